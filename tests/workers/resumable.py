"""A custom worker that checkpoints with ctx.save_checkpoint and continues with ctx.load_checkpoint."""

import time

import torch


def train(ctx, steps: int = 6, stop_after: int = -1, late_rank: int = -1):
    if ctx.rank == late_rank:  # this rank looks for a checkpoint after rank 0 wrote its first
        time.sleep(1.5)
    state = ctx.load_checkpoint()
    w = torch.zeros(3) if state is None else state["w"]
    start = 0 if state is None else state["step"] + 1
    loaded_on = None if state is None else str(state["w"].device)
    for step in range(start, steps):
        w += 1.0
        ctx.log(step=step, loss=1.0 / (step + 1), w_sum=float(w.sum()), note="text stays out of TensorBoard")
        ctx.save_checkpoint({"w": w, "step": step, "tag": f"step-{step}"})
        if step == stop_after:
            break
    return {"rank": ctx.rank, "start": start, "w": w, "loaded_on": loaded_on}


def epochs_only(ctx, epochs: int = 3):
    for epoch in range(epochs):
        ctx.log(epoch=epoch, accuracy=0.5 + 0.1 * epoch)
    for _ in range(2):
        ctx.log(throughput=100.0)  # no step, no epoch: TensorBoard counts the records
    return ctx.rank
