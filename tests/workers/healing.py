"""Workers that fail on their first launches and heal on a restart (``max_restarts``).

Each rank reads which launch it belongs to from ``NBDDP_RESTART_COUNT`` and fails as the
arguments say on that launch only; every launch continues from ``ctx.load_checkpoint()``.
"""

import os
import signal
import time

import torch
import torch.distributed as dist

import nbddp


def _launch() -> int:
    return int(os.environ.get("NBDDP_RESTART_COUNT", "0"))


def counted(ctx, steps: int = 8, kill_at: int = 3, hang_at: int = 5):
    """Launch 0: rank 1 is SIGKILLed at step ``kill_at``. Launch 1: rank 0 hangs at step ``hang_at``."""
    state = ctx.load_checkpoint()
    w = torch.zeros(2) if state is None else state["w"]
    start = 0 if state is None else state["step"] + 1
    for step in range(start, steps):
        ctx.heartbeat(epoch=0, step=step)
        if _launch() == 0 and ctx.rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if _launch() == 1 and ctx.rank == 0 and step == hang_at:
            while True:  # stuck before the collective: the others wait for it in all_reduce
                time.sleep(0.5)
        ctx.heartbeat(epoch=0, step=step, waiting=True)  # the others wait here for a hung rank
        t = torch.ones(2)
        dist.all_reduce(t)
        w += t
        ctx.save_checkpoint({"w": w, "step": step})
    return {"starts": start, "w": w.tolist(), "launch": _launch()}


def flaky_then_wrong(ctx):
    """Launch 0 raises ``nbddp.Retryable`` (retried); launch 1 a ``TypeError`` (not retried)."""
    ctx.heartbeat(epoch=0, step=0)
    if _launch() == 0:
        raise nbddp.Retryable("the data server went away")
    if ctx.rank == 1:
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
    dist.barrier()
    return "unreachable"


def fails_then_waits(ctx, go: str):
    """Launch 0: rank 1 raises a retryable error at once; a restart waits for file ``go``."""
    if _launch() == 0 and ctx.rank == 1:
        raise nbddp.Retryable("flaky")
    while not os.path.exists(go):
        time.sleep(0.1)
    return "done"
