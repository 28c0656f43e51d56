"""One epoch of training, exact evaluation, and the cosine learning-rate schedule.

Worker side. Everything here works on CPU (gloo) and GPU (nccl) alike: collectives run on the
device the backend needs, never a hard-coded ``"cuda"``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .dist import cpu_group, get_rank, get_world_size, is_dist
from .errors import NonFiniteLossError, PeerError


def _flag_device(device: torch.device) -> torch.device:
    # The agreement tensor lives where the backend can reduce it: CUDA for nccl, CPU for gloo.
    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


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
        raise PeerError(f"rank {failed[0]} failed while {what}; every rank stopped", rank=failed[0])


def cosine_lambda(epochs: int, lrf: float) -> Callable[[int], float]:
    """LR factor going from 1 to ``lrf`` along half a cosine over ``epochs`` (reference schedule)."""
    return lambda e: ((1 + math.cos(e * math.pi / epochs)) / 2) * (1 - lrf) + lrf


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """bf16 where the GPU supports it (no scaler needed), else fp16 (needs a grad scaler)."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def freeze_bn_statistics(model: torch.nn.Module) -> None:
    """Put BatchNorm layers whose parameters are frozen in eval mode.

    ``requires_grad=False`` stops the affine parameters, not the running statistics, which
    ``train()`` would keep updating: frozen layers must keep exactly what was loaded.
    """
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            params = [p for p in (m.weight, m.bias) if p is not None]
            if params and not any(p.requires_grad for p in params):
                m.eval()


@dataclass
class EpochStats:
    loss: float  # mean over steps of the loss averaged over ranks
    steps: int
    images: int  # images seen by all ranks
    seconds: float
    stopped: bool  # every rank agreed to stop early (notebook's Stop)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


def train_one_epoch(model, optimizer, loader, device, epoch: int, ctx=None, scaler=None,
                    amp_dtype: Optional[torch.dtype] = None, channels_last: bool = False,
                    on_step: Optional[Callable[[int, float], None]] = None) -> EpochStats:
    """Train for one pass over ``loader``; every rank leaves at the same step.

    Each step has two tiny agreements besides DDP's own gradient all-reduce: before the
    forward (a stop request, an unreadable batch; on CPU, via gloo) and after it (the loss,
    reported as the mean over ranks, and a non-finite flag per rank). So a condition only one
    rank sees ends every rank at the same step instead of leaving the others waiting.
    """
    model.train()
    freeze_bn_statistics(model)
    world, rank = get_world_size(), get_rank()
    total_steps = len(loader)
    loss_sum, steps, images = 0.0, 0, 0
    t0 = time.perf_counter()
    stopped = False
    group = cpu_group()
    batches = iter(loader)
    for step in range(total_steps):
        if ctx is not None:
            ctx.heartbeat(epoch=epoch, step=step)
            ctx.fault_point(f"step{epoch}.{step}")
        # A batch that cannot be read (a corrupt image) is one rank's problem. The ranks agree
        # on it, and on a stop request, BEFORE the forward pass: DDP's forward already talks to
        # the other ranks, and a rank that skipped it would leave them waiting there.
        error: Optional[BaseException] = None
        try:
            x, y = next(batches)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agree
            error = exc
        if ctx is not None:
            ctx.heartbeat(epoch=epoch, step=step, waiting=True)  # from here on: collectives
        pre = torch.zeros(1 + world)  # CPU: no GPU synchronisation for these flags
        pre[0] = 1.0 if (ctx is not None and ctx.should_stop()) else 0.0
        pre[1 + rank] = 1.0 if error is not None else 0.0
        if is_dist():
            dist.all_reduce(pre, group=group)
        failed = [r for r in range(world) if pre[1 + r] > 0]
        if failed:
            if error is not None:
                raise error
            raise PeerError(f"rank {failed[0]} could not read its batch at epoch {epoch}, step {step}; "
                            "every rank stopped at this step", rank=failed[0])
        if pre[0] > 0:
            stopped = True
            break

        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with amp:
            loss = F.cross_entropy(model(x), y)
        if ctx is not None and ctx.fault_flag(f"nan{epoch}.{step}"):
            loss = loss * float("nan")  # test-only: a non-finite loss on this rank alone

        # After the forward, one all-reduce carries the loss (reported as the mean over ranks)
        # and one non-finite flag per rank, so a NaN on one rank stops all before backward.
        post = torch.zeros(1 + world, device=_flag_device(device))
        post[0] = loss.detach().float()
        post[1 + rank] = 0.0 if torch.isfinite(loss.detach()).all() else 1.0
        if is_dist():
            dist.all_reduce(post)
        bad = [r for r in range(world) if post[1 + r] > 0]
        if bad:
            raise NonFiniteLossError(
                f"loss is {loss.item() if rank in bad else 'non-finite'} on rank(s) {bad} at epoch {epoch}, "
                f"step {step}: lower the learning rate, check the data, or turn amp off", rank=bad[0])

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()  # DDP averages the gradients over ranks here
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        mean_loss = post[0].item() / world
        loss_sum += mean_loss
        steps += 1
        images += x.shape[0] * world
        if ctx is not None:
            elapsed = time.perf_counter() - t0
            ctx.progress(epoch=epoch, step=step + 1, steps=total_steps, loss=mean_loss,
                         images_per_s=images / elapsed if elapsed > 0 else 0.0)
        if on_step is not None:
            on_step(step, mean_loss)
    return EpochStats(loss_sum / max(steps, 1), steps, images, time.perf_counter() - t0, stopped)


@dataclass
class EvalResult:
    accuracy: float
    loss: float
    count: int  # images evaluated over all ranks: exactly the validation set
    predictions: Optional[list] = None  # (dataset index, predicted class), gathered on every rank


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype: Optional[torch.dtype] = None, channels_last: bool = False,
             gather_predictions: bool = False) -> EvalResult:
    """Exact distributed evaluation: each image counted once, whatever the set and world sizes.

    ``loader`` must use :class:`nbddp.data.ShardSampler` (no padding). Correct counts, summed
    losses and image counts are all-reduced, so the accuracy equals a single-process run.
    Pass the bare model (``ddp.module``): evaluation needs no gradient synchronisation.
    """
    model.eval()
    correct = torch.zeros((), dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    preds = []
    indices = list(iter(loader.sampler)) if gather_predictions else None
    error: Optional[BaseException] = None
    try:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
            with amp:
                out = model(x)
            loss_sum += F.cross_entropy(out.float(), y, reduction="sum").double().cpu()
            p = out.argmax(dim=1)
            correct += (p == y).sum().double().cpu()
            count += y.numel()
            if gather_predictions:
                preds.extend(p.cpu().tolist())
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agree
        error = exc
    # Totals and one error flag per rank in one all-reduce: an unreadable validation image
    # on one rank stops every rank here, instead of leaving them waiting in the next step.
    world, rank = get_world_size(), get_rank()
    totals = torch.zeros(3 + world, dtype=torch.float64)
    totals[0], totals[1], totals[2] = correct, loss_sum, float(count)
    totals[3 + rank] = 1.0 if error is not None else 0.0
    if is_dist():
        dist.all_reduce(totals, group=cpu_group())
    failed = [r for r in range(world) if totals[3 + r] > 0]
    if error is not None:
        raise error
    if failed:
        raise PeerError(f"rank {failed[0]} failed during evaluation; every rank stopped", rank=failed[0])
    n = int(totals[2].item())
    gathered = None
    if gather_predictions:
        mine = list(zip(indices, preds))
        if is_dist():
            parts = [None] * get_world_size()
            dist.all_gather_object(parts, mine)
            gathered = sorted(p for part in parts for p in part)
        else:
            gathered = sorted(mine)
    return EvalResult(accuracy=totals[0].item() / max(n, 1), loss=totals[1].item() / max(n, 1), count=n,
                      predictions=gathered)
