"""Host reads of the built-in worker, counted on the CPU: what would make a GPU's host wait.

    python bench/host_reads.py [--epochs 2] [--pipeline pil|tensor|decode] [--tree DIR] [--json out.json]

One rank of the built-in worker (ResNet18 on the digits at 32 px, batch 32: 36 training steps an
epoch, no loader processes, so every read happens in the watched process) runs under
``tests/readwatch.py``: every host read in the rank (``.item()``, ``.tolist()``, ``bool()``,
``float()``, ``.cpu()``, ``.numpy()``...) by method and by place in the code; of those, the reads of
a value a training step computed, split into reads of the step still running (on a GPU, the host
waits there for the device) and reads of an earlier step (the device is long past it). Per
training step: the reads between the first and the last training forward, divided by their
number. ``--tree DIR`` counts the nbddp of another checkout (its rank imports that one), to
compare before and after a change.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DIGITS = str(ROOT / "data" / "digits")


def worker(ctx, config: dict) -> dict:
    """In the rank: the built-in worker's ``train`` under a ReadWatch; the reads, summed up."""
    sys.path.insert(0, str(ROOT / "tests"))
    from readwatch import ReadWatch

    from nbddp import TrainConfig
    from nbddp.tasks.classification.worker import train

    with ReadWatch() as watch:
        train(ctx, TrainConfig.from_dict(config))
    steps = watch.step + 1
    first = next(i for i, r in enumerate(watch.reads) if r.step >= 0) if watch.reads else 0
    # Reads inside the training steps: from the first forward to the last (evaluation between epochs included).
    inside = [r for r in watch.reads[first:] if r.step < watch.step]
    return {"steps": steps,
            "all": dict(watch.counts()),
            "by_place": {f"{m} {w}": n
                         for (m, w), n in Counter((r.method, r.where) for r in watch.reads).most_common()},
            "step_values": dict(watch.counts(of_step_values=True)),
            "own_step": sum(r.own_step for r in watch.reads),
            "own_step_by_place": dict(Counter(f"{r.method} {r.where}" for r in watch.reads if r.own_step)),
            "per_step": len(inside) / max(steps - 1, 1),
            "own_step_per_steady_step": sum(r.own_step for r in inside) / max(steps - 1, 1)}


def measure(epochs: int, pipeline: str, runs: Path) -> dict:
    from nbddp import TrainConfig, spawn_train

    cfg = TrainConfig(data_path=DIGITS, model="resnet18", image_size=32, epochs=epochs, batch_size=32, lr=0.01,
                      nprocs=1, num_workers=0, data_pipeline=pipeline, check_images=False, runs_dir=str(runs),
                      name="host-reads")
    return spawn_train(f"{Path(__file__).resolve()}:worker", nprocs=1, runs_dir=runs, echo=False, name="host-reads",
                       kwargs={"config": cfg.to_dict()}).value


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--pipeline", default="tensor", help="data_pipeline of the built-in worker")
    ap.add_argument("--tree", default=None, help="count the nbddp of this checkout instead")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    runs = Path(tempfile.mkdtemp(prefix="nbddp-host-reads-"))
    if a.tree:
        code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import host_reads as h; "
                f"from pathlib import Path; print(json.dumps(h.measure({a.epochs}, {a.pipeline!r}, Path({str(runs)!r}))))")
        env = dict(os.environ, PYTHONPATH=str(Path(a.tree).resolve()))
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                             cwd=a.tree, timeout=1800)
        r = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        r = measure(a.epochs, a.pipeline, runs)
    print(f"{r['steps']} training steps ({a.epochs} epochs, {a.pipeline} pipeline, one rank)")
    print(f"host reads in the rank: {r['all']}")
    print(f"of values a step computed: {r['step_values']}; of the step still running: {r['own_step']}")
    print(f"per training step: {r['per_step']:.2f} reads, {r['own_step_per_steady_step']:.2f} of the step's own values")
    for place, n in list(r["by_place"].items())[:12]:
        print(f"  {n:5d}  {place}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
