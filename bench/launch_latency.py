"""Time from ``spawn_train(...)`` to the first line of the worker function, and to the end.

    python bench/launch_latency.py [--repeats 5] [--nprocs 2]

The first launch in a fresh process is "cold" (nothing imported or cached in the OS page
cache for this run's children); the following ones are "warm" relaunches from the same process.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

WORKER = '''
import time
def first_line(ctx):
    return time.time()
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nprocs", type=int, default=2)
    args = ap.parse_args()
    t_import = time.time()
    from nbddp import spawn_train

    import_s = time.time() - t_import
    tmp = Path(tempfile.mkdtemp())
    (tmp / "latency_worker.py").write_text(WORKER)
    rows = []
    for i in range(args.repeats):
        t0 = time.time()
        r = spawn_train(f"{tmp / 'latency_worker.py'}:first_line", nprocs=args.nprocs, runs_dir=tmp / "runs", echo=False)
        t1 = time.time()
        rows.append((r.value - t0, t1 - t0))
    print(f"import nbddp: {import_s:.2f} s   (nprocs={args.nprocs}, cores={os.cpu_count()})")
    print(f"{'launch':>8} | {'to first line (s)':>18} | {'to result (s)':>14}")
    for i, (first, total) in enumerate(rows):
        print(f"{'cold' if i == 0 else 'warm':>8} | {first:18.2f} | {total:14.2f}")
    if len(rows) > 1:
        print(f"{'median warm':>8} | {statistics.median(r[0] for r in rows[1:]):18.2f} | "
              f"{statistics.median(r[1] for r in rows[1:]):14.2f}")


if __name__ == "__main__":
    sys.exit(main())
