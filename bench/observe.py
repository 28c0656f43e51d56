"""What ``profile=`` and ``trackers=`` cost a training step, side by side with neither.

    python bench/observe.py [--rounds 8] [--block 40] [--trackers mlflow,wandb] [--json out.json]

One process, one CPU training step of a small CNN (batch 16, 32x32 images), and after each step
``ctx.log(step=..., loss=..., lr=...)`` on a rank-0 ``Context`` (metrics.jsonl and TensorBoard,
as in every run). The variants, run in turn in blocks of ``--block`` steps for ``--rounds``
rounds, each block of a variant right after a block without it (the ratio of their median step
times is the round's; the median over rounds is printed), so the machine's drift hits both alike:

- ``plain``: no profiler, no tracker;
- ``profiler waiting``: ``profile=`` outside its active window (the schedule's wait steps: every
  step reported advances ``torch.profiler``, which records nothing then);
- ``<tracker>``: rank 0's tracker thread (a local MLflow SQLite store; W&B offline) takes every
  record off the training thread; at the end of its block the thread sends what it still holds
  and the block's time includes that wait (so the ratio bounds the cost from above).

Printed: each variant's ratio to ``plain`` (the budget: <= 1.02 for the waiting profiler, <= 1.01
for a tracker).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_step():
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def step() -> float:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def make_context(folder: Path):
    import torch

    from nbddp.rank.runtime import Context

    return Context(0, 0, 1, torch.device("cpu"), "gloo", folder)


def wait_until_open(ctx, names, timeout_s: float = 120.0) -> None:
    """Let the tracker thread import its package and open its run before timing starts."""
    from nbddp.contract.observe import read_tracker_ids

    ctx.log(step=-1, loss=0.0)
    end = time.time() + timeout_s
    while time.time() < end and not all(n in read_tracker_ids(ctx.run_dir) for n in names):
        time.sleep(0.2)
    time.sleep(2.0)  # W&B finishes its start after writing the id


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=40, help="steps per block (profiler)")
    ap.add_argument("--tracker-block", type=int, default=200, help="steps per block (a tracker: several flushes)")
    ap.add_argument("--trackers", default="mlflow", help="comma-separated: mlflow, wandb (empty: none)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    from nbddp.contract.observe import check_trackers, profile_options, tracker_plan
    from nbddp.rank.profiling import RankProfiler
    from nbddp.rank.trackers import TrackerThread

    torch.set_num_threads(1)
    step = make_step()
    work = Path(tempfile.mkdtemp(prefix="nbddp-observe-bench-"))
    variants = {"plain": make_context(work / "plain")}
    waiting = make_context(work / "profiled")
    options = profile_options({"wait": 10**9, "warmup": 1, "active": 1}, 1, "gloo")
    waiting._profiler = RankProfiler(waiting.run_dir, 0, options, torch.device("cpu"))
    waiting._profiler.start()
    variants["profiler waiting"] = waiting
    for name in check_trackers([n for n in a.trackers.split(",") if n]):
        ctx = make_context(work / name)
        plan = tracker_plan((name,), "observe-bench", work, {"bench": "observe"}, environ={})
        ctx._trackers = TrackerThread(ctx.run_dir, plan).start()
        wait_until_open(ctx, (name,))
        variants[name] = ctx
    for _ in range(3 * a.block):  # warm: allocator, threads
        step()
    counter = [0]

    def block(ctx, steps: int, mean: bool = False) -> float:
        """Median (or mean) step time of ``steps`` steps, each followed by ``ctx.log`` as in a run."""
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step()
            ctx.log(step=counter[0], loss=loss, lr=0.01)
            times.append(time.perf_counter() - t0)
            counter[0] += 1
        return statistics.mean(times) if mean else statistics.median(times)

    result = {}
    plain = variants.pop("plain")
    for name, ctx in variants.items():
        ratios, base_ms, tracked_s = [], [], 0.0
        tracked = ctx._trackers is not None
        clock = time.pthread_getcpuclockid(ctx._trackers._thread.ident) if tracked else None
        cpu0 = time.clock_gettime(clock) if tracked else 0.0
        steps = a.tracker_block if tracked else a.block
        for _ in range(a.rounds):
            # A tracker's cost comes in bursts (a batch sent every few seconds): means, not medians.
            base = block(plain, steps, mean=tracked)
            t0 = time.perf_counter()
            mine = block(ctx, steps, mean=tracked)
            if tracked:  # what the thread still holds is sent inside this block's time
                ctx._trackers.flush()
                mine = (time.perf_counter() - t0) / steps
                tracked_s += mine * steps
            ratios.append(mine / base)
            base_ms.append(base * 1000)
        result[name] = {"plain_step_ms": statistics.median(base_ms), "ratio": statistics.median(ratios),
                        "rounds": len(ratios), "steps_per_block": steps}
        if tracked:  # the thread's own CPU time: what it could take from the training thread at most
            result[name]["thread_cpu_share"] = (time.clock_gettime(clock) - cpu0) / tracked_s
            print(f"{name:>18}: its thread used {100 * result[name]['thread_cpu_share']:.2f}% of the tracked "
                  "blocks' time in CPU")
        print(f"{name:>18}: x{result[name]['ratio']:.4f} of a plain step ({result[name]['plain_step_ms']:.2f} ms), "
              f"median of {len(ratios)} rounds of {steps} steps each")
    # What the waiting profiler adds to a step, alone: one reported step each call (no training).
    probe = RankProfiler(work / "probe", 0, options, torch.device("cpu"))
    probe.start()
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        probe.reported(i)
    added_us = (time.perf_counter() - t0) / n * 1e6
    probe.close()
    result["profiler waiting"]["added_us_per_step"] = added_us
    print(f"{'profiler waiting':>18}: adds {added_us:.1f} us per reported step, alone "
          f"({100 * added_us / 1000 / result['profiler waiting']['plain_step_ms']:.3f}% of the plain step)")
    for ctx in [plain, *variants.values()]:
        ctx.stop_observing(ok=True)
        ctx.close()
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
