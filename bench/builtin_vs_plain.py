"""The built-in worker against plain DDP under torchrun, side by side: the ratio the README quotes.

    python bench/builtin_vs_plain.py [--rounds 3] [--epochs 3] [--variant name=field:value ...]
                                     [--tree name=DIR ...]

ResNet18 on the digits at 32 px, batch 32 per rank, 2 CPU ranks x 1 thread, the same folder for
both. Each round runs plain DDP (``bench/plain_ddp.py`` under torchrun, images/s over the steps
after its warm-up) and then the built-in worker (its best epoch after the first, which warms up;
evaluation excluded), so a busy machine slows both alike; the rounds are printed one by one with
the spread of the ratio. ``--variant`` adds built-in runs with one config field changed (say
``nockpt=checkpoint_every_s:0``), and ``--tree`` built-in runs of another checkout of nbddp (say
``main=../main``, an unpacked ``git archive``), to find what a cost comes from.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from throughput import DIGITS, HERE, plain

STEPS_PER_EPOCH = 1438 // (2 * 32)


def builtin(tmp: Path, epochs: int, **changes) -> float:
    from nbddp import TrainConfig, spawn_train

    cfg = TrainConfig(data_path=DIGITS, model="resnet18", image_size=32, epochs=epochs, batch_size=32, lr=0.01,
                      nprocs=2, crop_scale=0.5, hflip=False, check_images=False, runs_dir=str(tmp / "runs"),
                      name="bench", **changes)
    r = spawn_train(cfg, echo=False)
    return max(m["images_per_s"] for m in r.metrics[1:])  # the first epoch warms up


def builtin_in(tree: str, tmp: Path, epochs: int) -> float:
    """:func:`builtin` with the nbddp of ``tree``, in a fresh interpreter (its ranks import the same)."""
    # The tree first on the path once the bench is imported (throughput.py puts this checkout there): the
    # launching side must be the tree's nbddp too, or it talks to the tree's ranks in its own protocol.
    root = str(Path(tree).resolve())
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); from builtin_vs_plain import builtin; "
            f"sys.path.insert(0, {root!r}); from pathlib import Path; "
            f"print(json.dumps(builtin(Path({str(tmp)!r}), {epochs})))")
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                         timeout=1800, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], help="name=field:value, a built-in run with a change")
    ap.add_argument("--tree", action="append", default=[], help="name=DIR, a built-in run of the nbddp in DIR")
    a = ap.parse_args()
    variants = {"builtin": {}}
    for v in a.variant:
        name, _, change = v.partition("=")
        field, _, value = change.partition(":")
        variants[name] = {field: _value(value)}
    trees = dict(t.partition("=")[::2] for t in a.tree)
    tmp = Path(tempfile.mkdtemp())
    rows = {"plain": [], **{k: [] for k in variants}, **{k: [] for k in trees}}
    for i in range(a.rounds):
        p = plain(tmp, 2, 1, model="resnet18", data=DIGITS, batch_size=32, steps=STEPS_PER_EPOCH * (a.epochs - 1),
                  warmup=5)["images_per_s"]
        rows["plain"].append(p)
        line = [f"round {i + 1}: plain {p:.1f} img/s"]
        for name, changes in variants.items():
            b = builtin(tmp, a.epochs, **changes)
            rows[name].append(b)
            line.append(f"{name} {b:.1f} ({b / p:.3f})")
        for name, tree in trees.items():
            b = builtin_in(tree, tmp, a.epochs)
            rows[name].append(b)
            line.append(f"{name} {b:.1f} ({b / p:.3f})")
        print("; ".join(line), flush=True)
    print("\n| run | img/s (median) | ratio to plain DDP per round (median, min-max) |")
    print("|---|---|---|")
    for name in rows:
        ratios = [b / p for b, p in zip(rows[name], rows["plain"])]
        print(f"| {name} | {statistics.median(rows[name]):.1f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) |")


if __name__ == "__main__":
    main()
