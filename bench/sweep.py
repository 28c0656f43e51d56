"""How busy a sweep keeps its slots: the busy fraction and the gap from a slot freeing to its next trial.

    python bench/sweep.py [--trials 12] [--parallel 2] [--seconds 2] [--json out.json]

A sweep of ``--trials`` trials of a small worker (one CPU process that logs a metric every 0.1 s
for ``--seconds``) on ``--parallel`` CPU slots, the warm server started before the clock starts.
The kernel's torch import and the warm
server's start (one launch) come before the clock, as in a kernel that has launched before. Each trial's time is its launch record's ``started`` to ``ended`` (launch to the last process's
end); the busy fraction is their sum over ``slots x`` the sweep's wall time, and each gap is a
trial's start minus the moment the slot it took was freed (the sweep's start for the first ones).
"""

import argparse
import heapq
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

WORKER = '''
import time

def train(ctx, lr=0.1, seconds=2.0):
    end, step, score = time.time() + seconds, 0, 0.0
    while time.time() < end and not ctx.should_stop():
        score += lr
        ctx.log(step=step, score=score)
        step += 1
        time.sleep(0.1)
    return {"score": score}
'''


def gaps(intervals, slots: int, start: float):
    """Each trial's wait from its slot freeing to its launch, for trials started in order."""
    free = [start] * slots
    out = []
    for began, ended in sorted(intervals):
        freed = heapq.heappop(free)
        out.append(max(0.0, began - freed))
        heapq.heappush(free, ended)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import optuna

    import nbddp
    from nbddp.contract import rundir
    from nbddp.kernel.forkserver import start_server

    work = Path(tempfile.mkdtemp(prefix="nbddp-bench-sweep-"))
    (work / "bench_worker.py").write_text(WORKER)
    import nbddp.kernel.launch  # noqa: F401 - torch, imported by a kernel's first launch, not the sweep's doing
    import nbddp.kernel.trials  # noqa: F401

    start_server()  # the warm server's cold start neither: one launch waits until it is warm
    nbddp.spawn_train(f"{work / 'bench_worker.py'}:train", kwargs={"seconds": 0.0}, nprocs=1, echo=False,
                      runs_dir=work / "warm")
    t0 = time.time()
    s = nbddp.sweep(f"{work / 'bench_worker.py'}:train", lambda t: {"lr": t.suggest_float("lr", 0.01, 1.0),
                                                                    "seconds": a.seconds},
                    n_trials=a.trials, metric="score", nprocs=1, parallel=a.parallel, name="bench",
                    runs_dir=work / "runs", echo=False, pruner=optuna.pruners.NopPruner())
    wall = time.time() - t0
    intervals = []
    for t in s.study.trials:
        rec = rundir.read_launch_record(t.user_attrs["run_dir"])
        intervals.append((rec["started"], rec["ended"]))
    busy = sum(e - b for b, e in intervals) / (a.parallel * wall)
    waits = gaps(intervals, a.parallel, t0)
    result = {"trials": a.trials, "parallel": a.parallel, "trial_seconds": a.seconds, "wall_s": round(wall, 2),
              "busy_fraction": round(busy, 3), "gap_median_s": round(statistics.median(waits), 3),
              "gap_max_s": round(max(waits), 3),
              "gaps_s": [round(w, 2) for w in waits], "states": sorted({t.state.name for t in s.study.trials})}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
