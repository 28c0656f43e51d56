"""Worker functions used by the launch tests to create failures on purpose."""

import os
import time

import torch
import torch.distributed as dist


def raise_on(ctx, rank: int = 1, at_step: int = 3, steps: int = 50):
    """All ranks all-reduce every step; ``rank`` raises at ``at_step``."""
    t = torch.ones(1)
    for step in range(steps):
        ctx.heartbeat(epoch=0, step=step)
        if ctx.rank == rank and step == at_step:
            raise ValueError(f"boom on rank {ctx.rank} at step {step}")
        dist.all_reduce(t)
        time.sleep(0.05)
    return "unreachable"


def barrier_and_sleep(ctx, seconds: float = 600):
    """Rank 0 waits in a barrier (blocked in C++) while rank 1 sleeps in Python."""
    print(f"rank {ctx.rank} ready", flush=True)
    ctx.heartbeat(epoch=0, step=0)
    if ctx.rank == 0:
        dist.barrier()
    else:
        time.sleep(seconds)
    return "done"


def exit_code(ctx, code: int = 3, rank: int = 1):
    if ctx.rank == rank:
        os._exit(code)
    dist.barrier()
    return "unreachable"


def kill_self(ctx, rank: int = 1):
    import signal

    if ctx.rank == rank:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def hang_in_python(ctx, rank: int = 1):
    for step in range(1000):
        ctx.heartbeat(epoch=0, step=step)
        if ctx.rank == rank and step == 2:
            while True:
                time.sleep(1)
        dist.barrier()


def info(ctx):
    """Everything the context says, plus the environment a worker sees."""
    return {
        "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
        "device": str(ctx.device), "backend": ctx.backend, "run_dir": str(ctx.run_dir),
        "is_main": ctx.is_main, "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")},
        "modules_ipython": any(m.startswith(("IPython", "ipykernel", "ipywidgets")) for m in __import__("sys").modules),
        "tensor": torch.arange(3),
    }


def unpicklable_result(ctx):
    return lambda: None


def uneven_batches(ctx):
    """Rank 1 has one batch more than rank 0: caught before the first step."""
    from nbddp.rank.dist import check_same

    batches = 3 + ctx.rank
    check_same(batches, "batches per epoch")
    for _ in range(batches):
        dist.all_reduce(torch.ones(1))


def sigterm_target(ctx, steps: int = 400):
    """Steps forever-ish, reporting progress, so a test can SIGTERM one rank from outside."""
    t = torch.ones(1)
    for step in range(steps):
        ctx.heartbeat(epoch=0, step=step)
        dist.all_reduce(t)
        time.sleep(0.05)


def env_var(ctx, name: str):
    return os.environ.get(name)


def barrier_then_wait_for_file(ctx, path: str):
    """Every rank joins the group, then waits until the test creates ``path``."""
    dist.barrier()
    ctx.heartbeat(epoch=0, step=1)
    while not os.path.exists(path):
        time.sleep(0.1)
    dist.barrier()
    return "done"


def mark_rank(rank: int):
    """A rank start-up hook (NBDDP_RANK_HOOK): leaves its rank and the environment it saw."""
    os.environ["HOOKED"] = f"{rank} {os.environ.get('RANK')}"
