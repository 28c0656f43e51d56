"""Workers that stop at a breakpoint (tests/test_debugger.py)."""

import torch
import torch.distributed as dist


def held(ctx, steps: int = 3):
    """Rank 1 stops after its first all_reduce; every rank ends with the same sum (the "weights")."""
    total = torch.zeros(1)
    for step in range(steps):
        local = torch.tensor([float(ctx.rank + step + 1)])
        dist.all_reduce(local)
        total += local
        if step == 0:
            secret = ctx.rank * 100 + 7
            ctx.breakpoint(rank=1)
            total += secret - secret  # the line rank 1 stops at
    return total.item()


def plain_breakpoint(rank: int):
    """mp.spawn convention: breakpoint() on rank 1 only (debug=True), then a collective on both."""
    import datetime
    import os

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
    value = torch.tensor([float(rank + 1)])
    if rank == 1:
        secret = 41
        breakpoint()
        value += secret - secret
    dist.all_reduce(value)
    dist.destroy_process_group()
    return value.item()
