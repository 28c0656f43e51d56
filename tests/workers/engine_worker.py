"""train_one_epoch on tiny tensors, with a fault on one rank only (tests/test_engine.py)."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nbddp.rank.engine import train_one_epoch
from nbddp.contract.errors import NonFiniteLossError, PeerError


class Batches:
    """8 batches of 4; batch ``bad_step`` raises on ``bad_rank``, batch ``nan_step`` holds a NaN on ``nan_rank``;
    counts what was read."""

    def __init__(self, rank, bad_rank=None, bad_step=None, nan_rank=None, nan_step=None):
        self.rank, self.bad_rank, self.bad_step, self.read = rank, bad_rank, bad_step, 0
        self.nan_rank, self.nan_step = nan_rank, nan_step

    def __len__(self):
        return 8

    def __iter__(self):
        g = torch.Generator().manual_seed(self.rank)
        for i in range(8):
            self.read += 1
            if self.rank == self.bad_rank and i == self.bad_step:
                raise OSError(f"cannot read batch {i}")
            x = torch.randn(4, 6, generator=g)
            if self.rank == self.nan_rank and i == self.nan_step:
                x[0, 0] = float("nan")
            yield x, torch.randint(0, 3, (4,), generator=g)


class StopAt:
    """A ctx stand-in whose stop request appears on one rank only, at one step."""

    def __init__(self, ctx, rank, step):
        self._ctx, self._rank, self._step = ctx, rank, step

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def should_stop(self):
        return self._ctx.rank == self._rank and (self._ctx.step or 0) >= self._step


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(6, 3)


def run(ctx, bad_rank=None, bad_step=None, stop_rank=None, stop_step=None, save_rank=None, save_step=None,
        nan_rank=None, nan_step=None):
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = Batches(ctx.rank, bad_rank, bad_step, nan_rank, nan_step)
    run_ctx = StopAt(ctx, stop_rank, stop_step) if stop_rank is not None else ctx
    steps = [0]
    out = {"rank": ctx.rank, "saves": []}
    # A checkpoint asked for by one rank at one step (as rank 0's clock does): every rank saves.
    due = lambda: ctx.rank == save_rank and ctx.step == save_step  # noqa: E731
    try:
        stats = train_one_epoch(ddp, opt, batches, ctx.device, 0, ctx=run_ctx,
                                on_step=lambda step, loss: steps.__setitem__(0, step + 1),
                                checkpoint=lambda done: out["saves"].append(done.steps), checkpoint_due=due)
        out.update(steps=stats.steps, stopped=stats.stopped, loss=stats.loss)
    except (OSError, PeerError, NonFiniteLossError) as exc:
        out.update(error=type(exc).__name__, message=str(exc), steps=steps[0])
    # Every rank must end with the same weights: the same optimizer steps were taken (a non-finite
    # loss's own update may have been applied: NaN on every rank alike).
    weights = [torch.zeros_like(model.weight) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(weights, model.weight.detach())
    out["same_weights"] = all(torch.allclose(w, weights[0], rtol=0, atol=0, equal_nan=True) for w in weights)
    out["read"] = batches.read
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, out)
    return gathered
