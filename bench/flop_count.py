"""The FLOP count a run starts with, as rank 0 pays it: in a fresh process, normalisations stood in for or not.

    python bench/flop_count.py [--repeats 5] [--models resnet34:224,shufflenet_v2_x0_5:32]

The built-in worker counts one image's forward and backward on the ``meta`` device before its first
step (:func:`nbddp.count_flops`). On ``meta`` the count stands in for every normalisation with one
shape-only operation; the "real norms" column is the count without them (torch's own ``meta``
batch norm, computed op by op in Python). Each row runs both in fresh processes that first import
what the forkserver imports (as a rank finds it), interleaved, and quotes the median CPU seconds
of the process's first count (what a launch pays) and whether the two counts are the same number.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import importlib, json, resource, sys, time
import torch
from nbddp.kernel.forkserver import PRELOAD
for module in PRELOAD:  # what a rank finds imported: it forks from the forkserver that imported these
    importlib.import_module(module)
from nbddp.rank import flops
from nbddp.tasks.classification.models import build_model
name, size, real = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "real"
if real:
    flops._NormsShapeOnly = torch.overrides.TorchFunctionMode
with torch.device("meta"):
    model = build_model(name, 10)
x = torch.empty(2, 3, size, size, device="meta")
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
c0, t0 = cpu(), time.perf_counter()
n = flops.count_flops(model, x)
print(json.dumps({"cpu_s": cpu() - c0, "wall_s": time.perf_counter() - t0, "flops": n}))
"""


def one(name: str, size: int, real: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(size), "real" if real else "stood-in"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default="resnet34:224,resnet18:32,shufflenet_v2_x0_5:32,mobilenet_v3_small:32,"
                                        "efficientnet_b0:224,convnext_tiny:224,vit_b_16:224")
    a = ap.parse_args(argv)
    rows = {}
    print("| model | px | CPU s, real norms | CPU s, stood in | ratio | same FLOPs |")
    print("|---|---|---|---|---|---|")
    for spec in a.models.split(","):
        name, size = spec.split(":")
        real, stood = [], []
        for _ in range(a.repeats):  # interleaved: drift on the machine hits both sides alike
            real.append(one(name, int(size), True))
            stood.append(one(name, int(size), False))
        r = statistics.median(x["cpu_s"] for x in real)
        s = statistics.median(x["cpu_s"] for x in stood)
        same = {x["flops"] for x in real} == {x["flops"] for x in stood}
        rows[spec] = {"real_cpu_s": r, "stood_in_cpu_s": s, "ratio": s / r, "same_flops": same,
                      "gflop_per_image": stood[0]["flops"] / 2 / 1e9}
        print(f"| {name} | {size} | {r:.3f} | {s:.3f} | {s / r:.2f} | {'yes' if same else 'NO'} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
