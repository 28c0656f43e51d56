"""Every signal in every phase: nothing of a launch outlives its launching process.

    python bench/orphans.py [--phases start-up,loading,training,evaluation] [--signals SIGTERM,SIGKILL,SIGHUP]

tests/test_orphans.py ends one launcher in each phase, each signal at least once; this ends one
launcher per signal in each phase (12 fresh launchers, side by side per phase: about a minute on 2
cores) and lists what each left behind. Exits 1 if any launch left a process (a zombie counts).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from launchers_end import PHASES, SIGNALS, end_launchers  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--signals", default=",".join(SIGNALS))
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="nbddp-orphans-") as tmp:
        for phase in a.phases.split(","):
            left = end_launchers(Path(tmp) / phase, phase, a.signals.split(","))
            for sig, procs in left.items():
                results[f"{phase} {sig}"] = procs
                print(f"{phase:>10} {sig:<7} " + (f"LEFT {procs}" if procs else "nothing left"), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    bad = [k for k, v in results.items() if v]
    print(f"\n{len(results) - len(bad)} of {len(results)} launches left nothing" + (f"; left: {bad}" if bad else ""))
    return results


if __name__ == "__main__":
    sys.exit(1 if any(main().values()) else 0)
