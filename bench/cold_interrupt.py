"""Jupyter's Interrupt early in a fresh launcher's first launch, at a grid of moments: each ends as an Interrupt.

    python bench/cold_interrupt.py [--delays 0.3,0.6,1.0,1.5,2.0,3.0] [--methods forkserver,spawn]

tests/test_cold_interrupt.py sends SIGINT to the launcher's whole process group (as Jupyter does)
at two moments of a forkserver launch and one of a spawn launch; this tries every moment of the
grid for each start method (a fresh launcher each, one after another: about 6 s each on 2 cores).
A launch passes when it ended with ``TrainingInterrupted`` (or a plain ``KeyboardInterrupt`` before
its run folder was made), the launcher lived on, and no process of the launch was left; under
spawn, also when no starting rank printed a traceback. Exits 1 if any failed, naming it.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from cold_launches import interrupt_a_cold_launch  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", default="0.3,0.6,1.0,1.5,2.0,3.0")
    ap.add_argument("--methods", default="forkserver,spawn")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="nbddp-cold-interrupt-") as tmp:
        for method in a.methods.split(","):
            for delay in map(float, a.delays.split(",")):
                folder = Path(tmp) / f"{method}-{delay}"
                folder.mkdir()
                try:
                    out = interrupt_a_cold_launch(folder, delay, method)
                    if method == "spawn":
                        assert "Traceback" not in out and "KeyboardInterrupt\n" not in out, out
                    ended = next(line for line in out.splitlines() if line.startswith("ended with"))
                    results[f"{method} {delay}"] = {"ok": True, "ended": ended}
                except AssertionError as exc:
                    results[f"{method} {delay}"] = {"ok": False, "why": str(exc)[-2000:]}
                r = results[f"{method} {delay}"]
                print(f"{method:>10} {delay:4.1f} s  " + (r["ended"] if r["ok"] else "FAILED: " + r["why"][-300:]),
                      flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    bad = [k for k, v in results.items() if not v["ok"]]
    print(f"\n{len(results) - len(bad)} of {len(results)} interrupted launches ended as an Interrupt and left "
          "nothing" + (f"; failed: {bad}" if bad else ""))
    return results


if __name__ == "__main__":
    sys.exit(1 if any(not v["ok"] for v in main().values()) else 0)
