"""A worker that checkpoints every step, stops when asked, and continues from its checkpoint when started again.

A fresh run holds at half-way until it is asked to stop (a test signals it there); a resumed one runs to the end.
"""

import os
import time


def train(ctx, steps: int = 40, wait: float = 0.05):
    state = ctx.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    deadline = time.time() + 240
    for step in range(start, steps):
        ctx.log(step=step)
        ctx.save_checkpoint({"step": step})
        if ctx.should_stop():
            return {"stopped_at": step}
        time.sleep(wait)
        while state is None and step == steps // 2 and not ctx.should_stop():
            if time.time() > deadline:
                raise TimeoutError("no stop request came within 240 s")
            time.sleep(0.05)
    return {"start": start, "restart_count": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
