"""Launch overhead of a function from a notebook cell against the same function in a file, warm.

    python bench/cells.py [--repeats 10]

One process (a kernel's stand-in: its ``__main__`` holds the cell function), the warm forkserver
started by a first launch of each, then the two targets launched alternately ``--repeats`` times
each, 2 CPU ranks, from the call to the returned result. Prints both medians, their difference
(goal: within 0.1 s) and the cell's extra work in the kernel (checking, pickling by value,
writing its source).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402 - a kernel that has been used has torch imported
import torch.nn as nn  # noqa: E402

from nbddp import spawn_train  # noqa: E402
from nbddp.contract.cells import ship  # noqa: E402

SOURCE = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc(x)


def train(ctx, steps=3):
    torch.manual_seed(ctx.rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return float(model.fc.weight.sum())
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    ns = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nbddp-bench-cells-"))
    (tmp / "worker.py").write_text(SOURCE)
    cell = {"__name__": "__main__", "torch": torch, "nn": nn}
    exec(compile(SOURCE, str(tmp / "cell.py"), "exec"), cell)
    targets = {"file": f"{tmp / 'worker.py'}:train", "cell": cell["train"]}
    times = {k: [] for k in targets}
    for k, target in targets.items():  # warm-up: starts the forkserver, loads torch there
        spawn_train(target, nprocs=2, runs_dir=tmp / "runs", echo=False)
    for _ in range(ns.repeats):
        for k, target in targets.items():
            t0 = time.perf_counter()
            spawn_train(target, nprocs=2, runs_dir=tmp / "runs", echo=False)
            times[k].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(20):
        ship(cell["train"])
    ship_s = (time.perf_counter() - t0) / 20
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"file target, warm: median {med['file']:.3f} s over {ns.repeats}")
    print(f"cell function, warm: median {med['cell']:.3f} s over {ns.repeats}")
    print(f"cell - file: {med['cell'] - med['file']:+.3f} s (goal: within 0.1 s); ship() alone {ship_s * 1000:.1f} ms")


if __name__ == "__main__":
    main()
