"""Workers that get stuck in a named function while the other ranks wait for them in a collective."""

import os
import time

import torch
import torch.distributed as dist


def load_batch(go: str):
    """Rank 1's slow data: waits for file ``go`` (forever, unless the test creates it)."""
    while not os.path.exists(go):
        time.sleep(0.1)


def one_rank_stuck(ctx, go: str = "/nonexistent"):
    """Rank 1 is stuck in ``load_batch``; rank 0 waits for it in ``all_reduce``."""
    ctx.heartbeat(epoch=0, step=0)
    print(f"rank {ctx.rank} at step 0", flush=True)
    if ctx.rank == 1:
        load_batch(go)
    ctx.heartbeat(epoch=0, step=0, waiting=True)
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return float(t)


def one_rank_stuck_quietly(ctx, go: str = "/nonexistent"):
    """The same hang in a worker that never calls ``ctx.heartbeat`` (most code people bring)."""
    if ctx.rank == 1:
        load_batch(go)
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return float(t)


def every_rank_stuck(ctx, go: str = "/nonexistent"):
    """A few quick steps, then every rank waits in ``load_batch`` (a data loader on a dead file
    system): none lags, no collective times out. Creating ``go`` lets them go on and finish."""
    for step in range(5):
        ctx.heartbeat(epoch=0, step=step)
        time.sleep(0.02)
    load_batch(go)
    ctx.heartbeat(epoch=0, step=5)
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return float(t)
