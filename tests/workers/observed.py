"""A small DDP worker with no profiler or tracker code: spawn_train(profile=..., trackers=...) adds them."""

import os
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import nbddp


def train(ctx, steps: int = 6, fail_once_at: int = -1, slow_rank: int = -1, checkpoint: bool = True):
    """``steps`` DDP steps, each logged; a checkpoint after each, so a restart or resume continues.

    ``fail_once_at``: rank 0 raises ``nbddp.Retryable`` at that step in the first launch (a restart
    heals it). ``slow_rank``: that rank works longer each step, so the others wait for it.
    ``checkpoint=False``: no checkpoint (whose write on rank 0 would make rank 0 the slow one).
    """
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randint(0, 2, (64,))), batch_size=8)
    state = ctx.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    if state is not None:
        model.module.load_state_dict(state["model"])
    restart = int(os.environ.get("NBDDP_RESTART_COUNT") or 0)
    batches = iter(data)
    for step in range(start, steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(data)
            x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ctx.rank == slow_rank:
            time.sleep(0.1)
        ctx.log(step=step, loss=loss.item(), lr=0.1)
        if checkpoint:
            ctx.save_checkpoint({"model": model.module.state_dict(), "step": step})
        if step == fail_once_at and restart == 0 and ctx.rank == 0:
            raise nbddp.Retryable("the data server went away")
    return {"start": start, "rank": ctx.rank}


def out_of_memory(ctx):
    """Allocate a little on the GPU each step, then far more than any GPU has."""
    kept = []
    for step in range(3):
        kept.append(torch.ones(1024, 1024, device=ctx.device))
        ctx.log(step=step, held_mib=4 * len(kept))
    kept.append(torch.empty(2**44, dtype=torch.uint8, device=ctx.device))  # 16 TiB
    return len(kept)
