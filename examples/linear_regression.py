"""Data-parallel linear regression, the classic first DDP program (after the OneFlow DDP guide).

The model is ``y = x @ w`` with ``w`` starting at zero. The four samples are split between
the ranks (rank 0 holds the first two with 2 ranks); each rank computes a sum-reduced squared
error on its own samples, and DDP averages the gradients, so every rank takes the same step
and all end with ``w ≈ [[2], [3]]``.

Run it from a notebook or a script:

    from nbddp import spawn_train
    result = spawn_train("examples/linear_regression.py:train", nprocs=2)
    result.value["w"]      # [[2.0], [3.0]] (approximately)
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

X = [[1.0, 2.0], [2.0, 3.0], [4.0, 6.0], [3.0, 1.0]]
Y = [[8.0], [13.0], [26.0], [9.0]]


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 1))

    def forward(self, x):
        return x @ self.w


def train(ctx, steps: int = 500, lr: float = 0.01):
    if len(X) % ctx.world_size:
        raise ValueError(f"4 samples cannot be split evenly over {ctx.world_size} ranks; use 1, 2 or 4")
    share = len(X) // ctx.world_size
    x = torch.tensor(X[ctx.rank * share:(ctx.rank + 1) * share], device=ctx.device)
    y = torch.tensor(Y[ctx.rank * share:(ctx.rank + 1) * share], device=ctx.device)

    model = DDP(Linear().to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        loss = ((model(x) - y) ** 2).sum()  # sum-reduced on each rank; DDP averages the grads
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            ctx.log(step=step, loss=loss.item())
            if ctx.is_main:
                print(f"step {step:4d}  loss {loss.item():.6f}  w {model.module.w.detach().flatten().tolist()}")

    # Every rank's w, gathered to show they are identical (DDP keeps replicas in sync).
    w = model.module.w.detach()
    all_w = [torch.empty_like(w) for _ in range(ctx.world_size)]
    dist.all_gather(all_w, w)
    return {"w": w.cpu().tolist(), "w_per_rank": [t.cpu().tolist() for t in all_w]}
