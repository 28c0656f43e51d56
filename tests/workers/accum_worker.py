"""Gradient accumulation through nbddp.rank.engine.train_one_epoch under DDP (tests/test_recipe.py).

A small MLP (no BatchNorm, so a batch's gradient is the mean of its samples' gradients) on
fixed data: rank r's batches of group g are its share of the group's samples.
"""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from nbddp.rank.dist import data_parallel
from nbddp.rank.engine import train_one_epoch

B, K, FEATURES, CLASSES = 3, 2, 5, 4  # batch per rank, batches per optimizer step


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)


def samples(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def group_sizes(groups, last):
    return [K] * groups + ([last] if last else [])


def rank_batches(rank, world, groups, last):
    """Rank ``rank``'s batches: in each group, its contiguous share of the group's samples, in batches of B."""
    x, y = samples(world * B * (groups * K + last))
    out, start = [], 0
    for size in group_sizes(groups, last):
        mine = start + rank * size * B
        out += [(x[mine + i * B:mine + (i + 1) * B], y[mine + i * B:mine + (i + 1) * B]) for i in range(size)]
        start += world * size * B
    return out


def whole_batches(world, groups, last):
    """One batch per group, holding every rank's samples of it: what one process steps on."""
    x, y = samples(world * B * (groups * K + last))
    out, start = [], 0
    for size in group_sizes(groups, last):
        n = world * size * B
        out.append((x[start:start + n], y[start:start + n]))
        start += n
    return out


class StopFrom:
    """A ctx stand-in whose stop request appears on rank 1 only, from batch ``step`` on."""

    def __init__(self, ctx, step):
        self._ctx, self._step = ctx, step

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def should_stop(self):
        return self._ctx.rank == 1 and (self._ctx.step or 0) >= self._step


def run(ctx, groups=2, last=1, stop_at=2):
    model = mlp()
    ddp = data_parallel(model, ctx.device)
    reduced = []  # one entry per bucket DDP all-reduces

    def counting_hook(state, bucket):
        reduced.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    opt = sgd(model)
    batches = rank_batches(ctx.rank, ctx.world_size, groups, last)
    stats = train_one_epoch(ddp, opt, batches, ctx.device, 0, ctx=ctx, accum_steps=K)
    out = {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "steps": stats.steps,
           "optimizer_steps": stats.optimizer_steps, "all_reduces": len(reduced), "loss": stats.loss}

    # A stop request in the middle of a group: every rank finishes the group, then leaves.
    model = mlp()
    ddp = data_parallel(model, ctx.device)
    stats = train_one_epoch(ddp, sgd(model), rank_batches(ctx.rank, ctx.world_size, 3, 0), ctx.device, 0,
                            ctx=StopFrom(ctx, stop_at), accum_steps=K)
    out["stop"] = {"steps": stats.steps, "optimizer_steps": stats.optimizer_steps, "stopped": stats.stopped,
                   "weight_sum": float(sum(p.detach().double().sum() for p in model.parameters()))}
    return out
