"""Accuracy and speed of the two data pipelines on the same runs: ``pil`` against ``tensor``.

    python bench/pipelines.py [--seeds 0 1 2 3] [--epochs 5] [--gpus 0,1 | --nprocs 2]

The built-in worker on the digits (ResNet18 at 32 px, batch 32 per rank, lr 0.01,
``crop_scale=0.5``, no flips), each seed with both pipelines one after the other, so that a
pair shares the machine's state. Prints a markdown table: best validation accuracy and the
median images/s of the epochs after the first, per seed and pipeline (docs/benchmarks.md).
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--nprocs", type=int, default=2, help="CPU processes when --gpus is not given")
    ap.add_argument("--gpus", default="", help="GPU ids, e.g. 0,1")
    ap.add_argument("--data", default=str(ROOT / "data" / "digits"))
    a = ap.parse_args(argv)

    from nbddp import TrainConfig, spawn_train

    gpus = [int(g) for g in a.gpus.split(",") if g.strip()]
    cfg = TrainConfig(data_path=a.data, model="resnet18", image_size=32, epochs=a.epochs, batch_size=32, lr=0.01,
                      crop_scale=0.5, hflip=False, nprocs=a.nprocs, gpus=gpus,
                      runs_dir=tempfile.mkdtemp(prefix="nbddp-bench-pipelines-"), name="pipelines")
    rows = {}
    for seed in a.seeds:
        for pipeline in ("pil", "tensor"):
            r = spawn_train(cfg.replace(seed=seed, data_pipeline=pipeline), echo=False)
            steady = [m["images_per_s"] for m in r.metrics[1:]] or [m["images_per_s"] for m in r.metrics]
            rows[seed, pipeline] = (r.value["best_accuracy"], statistics.median(steady))
            print(f"seed {seed} {pipeline}: accuracy {rows[seed, pipeline][0]:.4f}, "
                  f"{rows[seed, pipeline][1]:.0f} img/s", flush=True)
    print("\n| seed | pil accuracy | tensor accuracy | pil img/s | tensor img/s | tensor / pil |")
    print("|---|---|---|---|---|---|")
    for seed in a.seeds:
        (pa, ps), (ta, ts) = rows[seed, "pil"], rows[seed, "tensor"]
        print(f"| {seed} | {pa:.4f} | {ta:.4f} | {ps:.0f} | {ts:.0f} | {ts / ps:.2f} |")
    mean = {p: statistics.mean(rows[s, p][0] for s in a.seeds) for p in ("pil", "tensor")}
    ratio = statistics.median(rows[s, "tensor"][1] / rows[s, "pil"][1] for s in a.seeds)
    print(f"| mean | {mean['pil']:.4f} | {mean['tensor']:.4f} | | | median {ratio:.2f} |")
    return {"rows": {f"{s}-{p}": v for (s, p), v in rows.items()}, "mean_accuracy": mean, "median_speed_ratio": ratio}


if __name__ == "__main__":
    main()
