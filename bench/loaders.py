"""Data-loader start-up cost: a 1-epoch digits run with ``num_workers=4`` against ``num_workers=0``.

    python bench/loaders.py [--repeats 3] [--workers 4]

Both are measured in the same process, interleaved, after one warm-up launch (which starts the
forkserver), the median quoted. DataLoader workers fork from their rank, so starting them costs
milliseconds; before, each one started through a forkserver of its own and imported torch
(seconds per worker, every epoch). The goal on a 2-core CI machine: at most 1.5 s slower.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--data", default=str(ROOT / "data" / "digits"))
    args = ap.parse_args()

    from nbddp import TrainConfig, spawn_train

    runs = tempfile.mkdtemp(prefix="nbddp-bench-loaders-")
    cfg = TrainConfig(data_path=args.data, model="resnet18", image_size=32, epochs=1, batch_size=32, lr=0.01,
                      hflip=False, nprocs=args.nprocs, runs_dir=runs, name="loaders", check_images=False)
    spawn_train(cfg.replace(num_workers=0), echo=False)  # warm-up: forkserver start, page cache
    times = {0: [], args.workers: []}
    for _ in range(args.repeats):
        for w in (args.workers, 0):
            t0 = time.perf_counter()
            spawn_train(cfg.replace(num_workers=w), echo=False)
            times[w].append(time.perf_counter() - t0)
    med = {w: statistics.median(t) for w, t in times.items()}
    for w, t in times.items():
        print(f"num_workers={w}: median {med[w]:.2f} s  (runs: {', '.join(f'{x:.2f}' for x in t)})")
    diff = med[args.workers] - med[0]
    print(f"difference: {diff:+.2f} s with {args.workers} workers per rank x {args.nprocs} ranks "
          f"({'within' if diff <= 1.5 else 'over'} the 1.5 s goal)")


if __name__ == "__main__":
    main()
