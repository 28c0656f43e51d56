"""Worker functions for the process-lifecycle tests: loader processes, phases to kill in, stop."""

import multiprocessing
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _descendants(pid: int) -> list:
    kids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                kids.setdefault(_ppid(int(entry)), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _builtin_loaders(ctx, data_path: str, num_workers: int):
    """nbddp's own PIL-pipeline loaders, as the built-in worker builds them."""
    from nbddp import TrainConfig
    from nbddp.tasks.classification import data as D
    from nbddp.tasks.classification.pipelines import make_loaders

    cfg = TrainConfig(data_path=data_path, image_size=16, batch_size=2, num_workers=num_workers,
                      nprocs=ctx.world_size, hflip=False)
    _, samples = D.scan_class_folders(data_path)
    train_s, val_s = D.split_samples(samples, cfg.val_fraction, cfg.seed)
    loaders = make_loaders(cfg, ctx, train_s, val_s)
    return loaders.sampler, loaders.train, loaders.val


class _Pid(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([os.getpid(), os.getppid()])


def loader_probe(ctx, data_path: str):
    """Which processes load the data: their parents, across epochs, and any forkserver."""
    sampler, train_loader, val_loader = _builtin_loaders(ctx, data_path, num_workers=2)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for _ in train_loader:
            pass
        workers = [w.pid for w in train_loader._iterator._workers]  # persistent: the same iterator
        # The training pass began the evaluation's near its end: its loader processes, started then.
        val_workers = [w.pid for w in val_loader.loader._iterator._workers]
        epochs.append({"workers": workers, "parents": [_ppid(p) for p in workers + val_workers],
                       "val_workers": val_workers})
    descendants = _descendants(os.getpid())  # a forkserver (and its children) would show here
    # A DataLoader of the user's own, with the rank's default start method (a class from this file).
    user = [b[0].tolist() for b in DataLoader(_Pid(), batch_size=1, num_workers=2)]
    return {"rank": os.getpid(), "start_method": multiprocessing.get_start_method(), "epochs": epochs,
            "user_workers": user,
            "descendants": descendants}


class _Slow(Dataset):
    """Items that take an hour: a loader worker busy inside one never checks on its parent."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        time.sleep(3600)
        return i


def phase_hold(ctx, data_path: str, phase: str):
    """Reach ``phase`` ("loading", "training" or "evaluation") with loader workers alive; stay there.

    The phase is announced through ``ctx.progress`` once reached, so a test can act on it. In
    "loading", a user's own DataLoader also has 2 workers busy inside an item.
    """
    sampler, train_loader, val_loader = _builtin_loaders(ctx, data_path, num_workers=2)
    if phase == "loading":
        busy = iter(DataLoader(_Slow(), batch_size=1, num_workers=2))  # the workers start on their items
    t = torch.ones(1)
    step = 0
    while True:
        loader = val_loader if phase == "evaluation" else train_loader
        for _batch in loader:
            step += 1
            if phase == "training":
                dist.all_reduce(t)
            ctx.progress(phase=phase, step=step)
            if phase == "loading":
                while True:  # workers alive, prefetching done: the rank waits on nothing
                    ctx.progress(phase=phase, step=step)
                    time.sleep(0.1)
            time.sleep(0.05)


def slow_stop(ctx, after_stop_s: float = 5.0):
    """Train until asked to stop, then keep working (with heartbeats) for ``after_stop_s`` and return."""
    from nbddp.rank.dist import any_rank

    step = 0
    t = torch.ones(1)
    while True:
        step += 1
        ctx.progress(epoch=0, step=step)
        dist.all_reduce(t)
        if any_rank(ctx.should_stop()):
            break
        time.sleep(0.05)
    print(f"rank {ctx.rank} stopping at step {step}", flush=True)
    end = time.time() + after_stop_s
    while time.time() < end:  # the final evaluation, the export, NCCL teardown...
        ctx.heartbeat(epoch=0, step=step)
        time.sleep(0.1)
    dist.barrier()
    return {"steps": step, "worked_after_stop_s": after_stop_s}


def main_thread_exits(ctx):
    """Rank 0's main thread ends while its other threads live on: a zombie leader with live
    threads, as a rank killed inside the CUDA driver looks. Its busy loader workers must go."""
    import ctypes
    import platform

    busy = iter(DataLoader(_Slow(), batch_size=1, num_workers=2))  # noqa: F841 - workers start on their items
    if ctx.rank == 0:
        print(f"workers {' '.join(str(w.pid) for w in busy._workers)}", flush=True)
        exit_thread = {"x86_64": 60, "aarch64": 93}[platform.machine()]  # SYS_exit: this thread only
        ctypes.CDLL(None).syscall(exit_thread, 0)
    while True:
        ctx.heartbeat(epoch=0, step=0)
        time.sleep(0.2)
