"""Data loaders in a rank: their start-up cost, and the gap between two epochs.

    python bench/loaders.py [--part startup|gaps|all] [--repeats 3] [--workers 4]

**startup**: a 1-epoch digits run with ``num_workers=4`` against ``num_workers=0``, both measured in
the same process, interleaved, after one warm-up launch (which starts the forkserver), the median
quoted. DataLoader workers fork from their rank, so starting them costs milliseconds; before,
each one started through a forkserver of its own and imported torch (seconds per worker, every
epoch). The goal on a 2-core CI machine: at most 1.5 s slower.

**gaps**: the built-in worker, ``--epochs`` epochs of a flowers-like folder (JPEGs of 320x240,
made once in a temp folder) on 2 CPU ranks, each pipeline with ``--gap-workers`` loader processes
per rank. The gap of an epoch boundary is the time from the end of one epoch's last step to the
start of the next one's first step (its batch in hand), evaluation excluded; it is rebuilt from
the epoch records (``time``, ``seconds``, ``eval_s``, ``first_batch_s``), so the same bench
measures any version of the worker. The goal: a gap of at most one step's time. A CPU rank writes
its end-of-epoch checkpoint in the gap (a writer thread slowed its steps: docs/benchmarks.md), so
the gap without it, the loaders' share, is printed beside. Beside it, each evaluation's time and
its wait for batches: the seconds its ``next()`` calls on the validation loader took, summed over
the pass (a rank hook, :func:`eval_wait_hook`, times them on rank 0; the decode pipeline's decoding
on the device is not part of it).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def startup(args) -> None:
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


def boundary_gaps(metrics: list) -> list:
    """Seconds from the end of each epoch's last step to the first step of the next, evaluation excluded.

    An epoch record is logged right after the evaluation, which took ``eval_s``: the epoch's
    evaluation ended at ``time``; the next epoch's training ended ``eval_s`` before its own
    record, began ``seconds`` before that, and had its first batch ``first_batch_s`` later. So
    the gap is what lies between the end of one evaluation and the next epoch's first step.
    """
    gaps = []
    for a, b in zip(metrics, metrics[1:]):
        first_step_b = b["time"] - b["eval_s"] - b["seconds"] + b["first_batch_s"]
        gaps.append(first_step_b - a["time"])
    return gaps


EVAL_WAIT_ENV = "NBDDP_BENCH_EVAL_WAIT"


def eval_wait_hook(rank: int) -> None:
    """Rank hook (``NBDDP_RANK_HOOK``): rank 0 appends each epoch evaluation's wait for its batches to ``$NBDDP_BENCH_EVAL_WAIT``.

    The wait is the time spent in the validation loader's ``next()``, from the pass's ``iter()`` to
    its end; the final pass (``gather_predictions``) is left out.
    """
    from nbddp.tasks.classification import worker as W

    if rank != 0:
        return
    path, evaluate = os.environ[EVAL_WAIT_ENV], W.evaluate

    class Timed:
        def __init__(self, loader):
            self.loader, self.waited = loader, 0.0

        def __iter__(self):
            t0 = time.perf_counter()
            batches = iter(self.loader)
            self.waited += time.perf_counter() - t0
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    self.waited += time.perf_counter() - t0
                    return
                self.waited += time.perf_counter() - t0
                yield batch

        def __len__(self):
            return len(self.loader)

        def __getattr__(self, name):
            return getattr(self.__dict__["loader"], name)

    def timed_evaluate(model, loader, *a, **kw):
        if kw.get("gather_predictions"):
            return evaluate(model, loader, *a, **kw)
        timed = Timed(loader)
        result = evaluate(model, timed, *a, **kw)
        with open(path, "a") as f:
            f.write(f"{timed.waited}\n")
        return result

    W.evaluate = timed_evaluate


def gaps(args) -> list:
    from gpu import _flowers_like
    from nbddp import TrainConfig, spawn_train

    tmp = Path(tempfile.mkdtemp(prefix="nbddp-bench-gaps-"))
    data = _flowers_like(tmp / "flowers", args.images)
    cfg = TrainConfig(data_path=str(data), model="resnet18", image_size=args.image_size, epochs=args.epochs,
                      batch_size=args.batch, lr=0.01, nprocs=args.nprocs, runs_dir=str(tmp / "runs"), name="gaps",
                      check_images=False, num_workers=args.gap_workers)
    spawn_train(cfg.replace(epochs=1, data_pipeline="tensor"), echo=False)  # warm-up: forkserver, page cache
    rows = []
    for pipeline in args.pipelines.split(","):
        waits = tmp / f"eval-wait-{pipeline}"
        env = {"NBDDP_RANK_HOOK": f"{Path(__file__).resolve()}:eval_wait_hook", EVAL_WAIT_ENV: str(waits)}
        r = spawn_train(cfg.replace(data_pipeline=pipeline), echo=False, env=env)
        m = r.metrics
        eval_wait = [float(x) for x in waits.read_text().split()]
        # An epoch's steps: its images over the global batch; its time after the first batch, per step.
        steps = [round(e["images_per_s"] * e["seconds"] / (args.batch * args.nprocs)) for e in m[1:]]
        step_s = statistics.median((e["seconds"] - e["first_batch_s"]) / max(n, 1) for e, n in zip(m[1:], steps))
        g = boundary_gaps(m)
        # The same without the end-of-epoch checkpoint a CPU rank writes on the step's path (a GPU
        # rank's writer thread overlaps the next epoch): the loaders' share of the gap.
        g_loaders = [x - e["checkpoint_s"] for x, e in zip(g, m[1:])]
        rows.append(dict(pipeline=pipeline, step_ms=step_s * 1e3, gap_ms=statistics.median(g) * 1e3,
                         gaps_ms=[round(x * 1e3) for x in g], no_checkpoint_ms=statistics.median(g_loaders) * 1e3,
                         first_batch_ms=statistics.median(e["first_batch_s"] for e in m[1:]) * 1e3,
                         checkpoint_ms=statistics.median(e["checkpoint_s"] for e in m[1:]) * 1e3,
                         eval_ms=statistics.median(e["eval_s"] for e in m[1:]) * 1e3,
                         eval_wait_ms=statistics.median(eval_wait[1:]) * 1e3,
                         eval_waits_ms=[round(x * 1e3) for x in eval_wait]))
        print(f"{pipeline}: {rows[-1]}", flush=True)
    print(f"\nepoch boundaries: {args.nprocs} CPU ranks, resnet18 at {args.image_size} px, batch {args.batch}, "
          f"{args.gap_workers} loader processes per rank, {args.epochs} epochs; ms, median over the boundaries")
    print("| pipeline | step | gap (eval excluded) | gap / step | of which first batch | checkpoint "
          "| gap without it / step | eval | of which waiting for batches |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pipeline']} | {r['step_ms']:.0f} | {r['gap_ms']:.0f} | {r['gap_ms'] / r['step_ms']:.2f} "
              f"| {r['first_batch_ms']:.0f} | {r['checkpoint_ms']:.0f} | {r['no_checkpoint_ms'] / r['step_ms']:.2f} "
              f"| {r['eval_ms']:.0f} | {r['eval_wait_ms']:.0f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["startup", "gaps", "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--data", default=str(ROOT / "data" / "digits"))
    ap.add_argument("--pipelines", default="pil,decode,tensor")
    ap.add_argument("--gap-workers", type=int, default=2)
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args()
    if args.part in ("startup", "all"):
        startup(args)
    if args.part in ("gaps", "all"):
        gaps(args)


if __name__ == "__main__":
    main()
