"""A ``fn(ctx)`` loop under FSDP that writes a checkpoint of modules and optimizers every step and
never checks ``ctx.should_stop()``: tests/test_interrupt.py interrupts it while it mostly writes."""

import time
from pathlib import Path

import torch
from torch import nn


class Wide(nn.Module):
    """Repeated blocks (FSDP shards each); wide enough that a checkpoint takes most of a step."""

    def __init__(self, width: int, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width)) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def save_every_step(ctx, marks: str, width: int = 1536, steps: int = 100_000):
    """Train, save every step, sleep 0.2 s; resumed, say which step the checkpoint it loaded was saved at."""
    torch.manual_seed(0)
    model = ctx.prepare(Wide(width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = ctx.load_checkpoint({"model": model, "optimizer": optimizer})
    if state is not None:
        return {"resumed_from": state["step"]}
    for step in range(steps):
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.save_checkpoint({"model": model, "optimizer": optimizer, "step": step})
        Path(marks, f"saved{ctx.rank}").write_text(str(step))
        time.sleep(0.2)
    return None


def peer_leaves_at_the_stop(ctx, marks: str):
    """One whole checkpoint, then, at the stop: rank 0 saves again while rank 1 leaves with its
    KeyboardInterrupt (as a rank does that took it outside its own save): rank 0's save is cut off."""
    model = ctx.prepare(Wide(64))
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.save_checkpoint({"model": model, "optimizer": optimizer, "step": 0})
    Path(marks, f"saved{ctx.rank}").write_text("0")
    while not ctx.should_stop():
        time.sleep(0.05)
    if ctx.rank == 1:
        raise KeyboardInterrupt("rank 1 leaves at the stop")
    ctx.save_checkpoint({"model": model, "optimizer": optimizer, "step": 1})
    Path(marks, "saved-after-the-stop").write_text("1")
