"""What a run's checkpoint costs to write and to read back: sharded (DCP) and plain (``.pt``).

    python bench/checkpoint_io.py [--width 2048] [--repeats 5]
    python bench/checkpoint_io.py --against /path/to/other/checkout   # side by side, interleaved

One process, CPU, no process group (DCP writes a single shard): a model of 4 ``width x width``
linear blocks with AdamW state (``width=2048``: 16.8M parameters, ~200 MB a checkpoint). Timed,
median of ``--repeats`` after one warm-up (wall time, or with ``--cpu`` the process's CPU time, which
a busy machine disturbs less; torch on one thread): ``sharded save`` (``sharded_checkpoint.save``: the
shard, ``.metadata``, ``extra.pt``, the swap into place), ``sharded load``
(``sharded_checkpoint.load``, resharded into a fresh model) and ``plain load``
(``checkpoint.load_checkpoint`` of a ``.pt`` in the run folder, as a resume reads it).

``--against`` runs this same script with another checkout's ``nbddp`` first on the import path,
alternating the two, and prints both medians and the ratio (this checkout / the other).
"""

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def measure(width: int, repeats: int, cpu: bool = False) -> dict:
    import torch
    from torch import nn

    from nbddp.contract import checkpoint
    from nbddp.rank import sharded_checkpoint

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    clock = time.process_time if cpu else time.perf_counter
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    fresh = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    checked = "run_dir" in inspect.signature(checkpoint.load_checkpoint).parameters
    times = {"sharded save": [], "sharded load": [], "plain load": []}
    base = Path(tempfile.mkdtemp(prefix="nbddp-ckbench-"))
    try:
        run = base / "run"
        (run / "checkpoints").mkdir(parents=True)
        plain = run / "checkpoints" / "last.pt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)
        for i in range(repeats + 1):
            t0 = clock()
            sharded_checkpoint.save(run, "last", {"model": model, "optimizer": optimizer, "step": i}, True)
            t1 = clock()
            sharded_checkpoint.load(run, "last", {"model": fresh, "optimizer": fresh_optimizer})
            t2 = clock()
            checkpoint.load_checkpoint(plain, **({"run_dir": run} if checked else {}))
            t3 = clock()
            if i:  # the first round warms the page cache and torch's lazy imports
                for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[key].append(seconds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="with --against: alternations of the two checkouts")
    parser.add_argument("--against", help="another checkout of nbddp to compare with, side by side")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU time of the process (user + system) instead of wall time: steadier on a busy machine")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one measurement, as JSON
    args = parser.parse_args()
    if args.json or not args.against:
        result = measure(args.width, args.repeats, args.cpu)
        if args.json:
            print(json.dumps(result))
        else:
            for key, seconds in result.items():
                print(f"{key:<13} {seconds * 1000:8.1f} ms")
        return
    runs = {"this": [], "other": []}
    for _ in range(args.rounds):
        for which, root in (("other", args.against), ("this", str(ROOT))):
            env = {**os.environ, "PYTHONPATH": root}
            out = subprocess.run([sys.executable, __file__, "--json", "--width", str(args.width), "--repeats",
                                  str(args.repeats)] + (["--cpu"] if args.cpu else []),
                                 env=env, capture_output=True, text=True, check=True, cwd=root)
            runs[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'':<13} {'other':>9} {'this':>9}  ratio (this / other), median of {args.rounds} rounds")
    for key in runs["this"][0]:
        other = statistics.median(r[key] for r in runs["other"])
        this = statistics.median(r[key] for r in runs["this"])
        print(f"{key:<13} {other * 1000:7.1f}ms {this * 1000:7.1f}ms  {this / other:.3f}")


if __name__ == "__main__":
    main()
