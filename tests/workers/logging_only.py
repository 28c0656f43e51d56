"""The README's ``my_worker.py``: a DDP model trained step by step that only calls ``ctx.log``.

It prints one line every ``print_every`` steps (so the cell's echo and the ``ctx.log`` line meet),
and once its steps are done waits for the file ``go`` (when given, up to ``go_wait_s``): a test looks at the cell while
the run still goes, then lets it end.
"""

import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def train(ctx, steps: int = 300, go: str = "", print_every: int = 100, go_wait_s: float = 120):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(10, 1).to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 10), torch.randn(32, 1)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log(step=step, loss=loss.item())
        if print_every and step % print_every == 0 and ctx.is_main:
            print(f"at step {step}", flush=True)
    deadline = time.time() + go_wait_s
    while go and not os.path.exists(go):
        if time.time() > deadline:
            raise TimeoutError(f"{go} was not made within {go_wait_s} s")
        time.sleep(0.05)
    return steps
