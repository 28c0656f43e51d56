"""What ``detach=True`` costs, side by side with a run the kernel owns; and how soon ``attach`` shows a run.

    python bench/detached.py [--repeats 3]

Per round, in one process and alternating: ``spawn_train(..., block=False)`` of a 2-rank CPU worker
that steps until it is stopped, owned by this process (warm forkserver) and then detached (a
supervisor of its own, which imports torch and starts its own forkserver); for each, the time until
``spawn_train`` returns and until rank 0's first progress, then the time from ``stop()`` to the
result. ``attach``: from ``nbddp.attach(run_dir)`` of the detached run to its first echoed line of
rank 0's output (the last lines it shows first) and to its first progress.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET = str(ROOT / "tests" / "workers" / "detached.py") + ":until_stopped"


def one(runs: Path, detach: bool) -> dict:
    import nbddp
    from nbddp.contract.protocol import read_progress

    t0 = time.perf_counter()
    h = nbddp.spawn_train(TARGET, nprocs=2, runs_dir=runs, block=False, echo=False, detach=detach)
    returned = time.perf_counter() - t0
    while read_progress(h.run_dir) is None:
        time.sleep(0.01)
    first = time.perf_counter() - t0
    view = {}
    if detach:
        seen = []
        t1 = time.perf_counter()
        f = nbddp.attach(h.run_dir, echo=False, on_event=lambda kind, _p: seen.append((kind, time.perf_counter())))
        while not any(k == "line" for k, _ in seen) or not any(k == "progress" for k, _ in seen):
            time.sleep(0.005)
        view = {"line": next(t for k, t in seen if k == "line") - t1,
                "progress": next(t for k, t in seen if k == "progress") - t1}
        f.stop(wait=False)
    t2 = time.perf_counter()
    h.stop()
    h.wait()
    return {"returned": returned, "first_progress": first, "stop": time.perf_counter() - t2, **view}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from nbddp.kernel.forkserver import prepare

    prepare()  # the owned runs fork from a warm server, as in a kernel that pre-warmed
    rows = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        one(Path(tmp), False)  # warm-up
        for _ in range(args.repeats):
            for detach in (False, True):
                rows[detach].append(one(Path(tmp), detach))
    for detach, got in rows.items():
        label = "detached" if detach else "owned   "
        print(label, "  ".join(f"{k} {statistics.median(r[k] for r in got):.2f} s" for k in got[0]))


if __name__ == "__main__":
    main()
