"""Small, device-agnostic helpers for code that runs inside a worker.

They work the same with gloo on CPU tensors and nccl on GPU tensors, and degrade to no-ops
when no process group is initialised, so one worker file runs alone or distributed.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import sys
from typing import Iterator, Optional

import torch
import torch.distributed as dist


def is_dist() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    """True on global rank 0 (and when not distributed): the rank that writes files."""
    return get_rank() == 0


_CPU_GROUPS: dict = {}
_TIMEOUT: Optional[datetime.timedelta] = None  # the default group's, for nbddp's own groups


def init_process_group(backend: str, store, rank: int, world_size: int, timeout_s: float,
                       device: torch.device) -> None:
    """Initialise the default process group, bound to this rank's device on GPUs.

    On nccl the group is given ``device_id``: NCCL then sets up its communicator here, so a
    broken set-up (driver, ``/dev/shm``, P2P) fails at init with NCCL's own message instead of
    inside ``DDP()``, and collectives without a device (``barrier()``) know theirs instead of
    warning "using the device under current context". Releases that do not accept
    ``device_id`` get the same group without it. Call ``torch.cuda.set_device`` first.
    """
    global _TIMEOUT
    timeout = datetime.timedelta(seconds=timeout_s)
    extra = {}
    if device.type == "cuda" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        extra["device_id"] = device
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **extra)
    _TIMEOUT = timeout
    # Every rank is connected before any goes on: gloo's init can return on one rank while a
    # peer still completes its connections, and a worker that returns at once would then exit
    # under it ("Connection closed by peer"). One barrier, a few milliseconds, once per run.
    barrier()


def cpu_group():
    """A gloo group over all ranks for small CPU-side agreements (flags, counts).

    With gloo that is the default group. With nccl a separate gloo group lets ranks agree on
    plain Python facts (stop requested? batch unreadable?) without a GPU synchronisation.
    Collective on first use: every rank must call it at the same point. It waits as long as
    the default group (``timeout_s`` of the launch), not torch's 30-minute default.
    """
    if not is_dist() or dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo", timeout=_TIMEOUT)
    return _CPU_GROUPS[key]


def _collective_device() -> torch.device:
    # nccl only reduces CUDA tensors, gloo reduces CPU tensors: pick by backend, never hard-code.
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_value(value: torch.Tensor | float, average: bool = True) -> torch.Tensor:
    """Sum (or average) a tensor or number over all ranks; returns a new tensor.

    Example:
        >>> loss_mean = reduce_value(loss.detach())  # same value on every rank
    """
    t = torch.as_tensor(value)
    if not is_dist():
        return t.clone()
    dev = _collective_device()
    out = t.detach().to(dev, dtype=torch.float64 if not t.is_floating_point() else t.dtype, copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    if average:
        out /= get_world_size()
    return out.to(t.device)


def any_rank(flag: bool) -> bool:
    """All ranks agree: True on every rank if ``flag`` is True on at least one rank."""
    if not is_dist():
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return bool(t.item() > 0)


def barrier() -> None:
    """Wait for every rank; on nccl on this rank's own GPU (never a guess from the context)."""
    if is_dist():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def agree_on_error(error: Optional[BaseException], what: str) -> None:
    """Collective: if any rank has an ``error``, every rank raises (the failing one its own).

    For conditions only one rank sees (disk full while rank 0 saves), so that no rank walks on
    into the next collective and waits there until the timeout.
    """
    world = get_world_size()
    if world > 1:
        flags = torch.zeros(world)
        flags[get_rank()] = 1.0 if error is not None else 0.0
        dist.all_reduce(flags, group=cpu_group())
        failed = [r for r in range(world) if flags[r] > 0]
    else:
        failed = [0] if error is not None else []
    if error is not None:
        raise error
    if failed:
        from ..contract.errors import PeerError

        raise PeerError(f"rank {failed[0]} failed while {what}; every rank stopped", rank=failed[0])


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks (e.g. to build a cache once).

    Example:
        >>> with main_first():
        ...     dataset = build_or_load_cache(path)
    """
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()


def save_on_main(obj, path) -> None:
    """Save ``obj`` atomically from rank 0 only (see :func:`nbddp.contract.checkpoint.atomic_save`)."""
    if is_main():
        from ..contract.checkpoint import atomic_save

        atomic_save(obj, path)


def check_same(value, what: str) -> None:
    """Collective: raise on every rank if ``value`` differs between ranks.

    Use it before a loop whose length each rank computes for itself (its number of batches):
    ranks that disagree would otherwise leave one rank waiting in DDP's all-reduce until the
    timeout. For truly uneven inputs use DDP's ``join()`` context manager instead.

    Example:
        >>> check_same(len(loader), "batches per epoch")
    """
    if not is_dist():
        return
    values = [None] * get_world_size()
    dist.all_gather_object(values, value, group=cpu_group())
    if any(v != values[0] for v in values):
        from ..contract.errors import DataError

        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise DataError(f"ranks disagree on {what} ({per_rank}); each rank must do the same number of "
                        "collective steps: shard with DistributedSampler(drop_last=True), or wrap the loop "
                        "in DDP's join() for uneven inputs")


def data_parallel(model: torch.nn.Module, device: torch.device, **ddp_kwargs) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` when there are several ranks; the model itself alone.

    With one process there is nothing to average: DDP would copy every gradient into its
    buckets and all-reduce them with itself (on one H100, ResNet34: 0.92 of a plain step's
    speed and 1.9 GiB more memory; ``torch.compile`` of it 0.67 of a plain compiled step, its
    graph split at the buckets). Several ranks get DDP with :func:`ddp_options`; ``ddp_kwargs``
    add to them.
    """
    refuse_ddp_of_sharded(model)  # a sharded model's gradients are shards: DDP would average unlike pieces
    if get_world_size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    options = {**ddp_options(device), **ddp_kwargs}
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **options)


def ddp_options(device: torch.device) -> dict:
    """DDP's keyword arguments for ranks on ``device``: never the per-forward buffer broadcast
    (:func:`no_forward_buffer_sync`), and on GPUs ``gradient_as_bucket_view`` (the gradients live
    in DDP's buckets: no copy, no second gradient-sized buffer in GPU memory). Not on CPUs, where
    memory is plenty and the views slow the backward: ResNet18, 32 px, 2 gloo ranks, batch 32,
    six alternated runs: 131-143 ms a backward with them, 125-132 ms without (the best epoch
    329-345 img/s against 341-354)."""
    return {"gradient_as_bucket_view": device.type == "cuda", **no_forward_buffer_sync()}


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model`` (or a module inside it) was sharded with FSDP2's ``fully_shard``."""
    # Importing torch.distributed.fsdp takes a second: a model sharded with it has imported it
    # already, and a DDP launch must not pay for it.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def refuse_ddp_of_sharded(model: torch.nn.Module) -> None:
    """DDP around a model whose parameters are shards would average shards of different tensors."""
    if is_sharded(model):
        from ..contract.errors import ConfigError

        raise ConfigError(
            "the model is sharded (fully_shard was applied to it), and DistributedDataParallel around a sharded "
            "model would all-reduce shards as if they were whole parameters. Launch with strategy='fsdp' "
            "(ctx.prepare(model) then leaves your sharding as it is), or do not call fully_shard under DDP.")


def no_forward_buffer_sync() -> dict:
    """DDP keyword arguments that stop it broadcasting rank 0's buffers at every forward.

    That broadcast is a collective per step. Rank 0's BatchNorm statistics evolve the same
    without it, and they are what counts: call :func:`sync_buffers_from_main` before
    evaluating or saving. Training uses batch statistics, so gradients are unchanged. Buffers
    are still synced once when DDP is built. PyTorch 2.14 renamed the option
    (``forward_sync_buffers``); older releases know only ``broadcast_buffers``.
    """
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def sync_buffers_from_main(model: torch.nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank.

    Each rank's training forward updates the statistics with its own batch, so after an epoch
    the ranks' statistics differ slightly. Call this before evaluating, so every rank evaluates
    exactly the model rank 0 saves. One broadcast per dtype (a ResNet has ~100 buffers, and
    each collective has a fixed cost), not one per buffer.
    """
    if not is_dist():
        return
    by_dtype: dict = {}
    for buf in model.buffers():
        by_dtype.setdefault((buf.dtype, buf.device), []).append(buf)
    for bufs in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in bufs])
        dist.broadcast(flat, src=0)
        offset = 0
        for b in bufs:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()
