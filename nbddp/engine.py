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

from .dist import get_rank, get_world_size, is_dist
from .errors import NonFiniteLossError


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

    Each step does ONE small all-reduce carrying the loss (reported as the mean over ranks),
    a stop request and one non-finite flag per rank. So a NaN seen on one rank, or a Stop seen
    by one rank first, ends every rank at the same step, before anyone waits alone in DDP's
    gradient all-reduce.
    """
    model.train()
    freeze_bn_statistics(model)
    world, rank = get_world_size(), get_rank()
    total_steps = len(loader)
    loss_sum, steps, images = 0.0, 0, 0
    t0 = time.perf_counter()
    stopped = False
    for step, (x, y) in enumerate(loader):
        if ctx is not None:
            ctx.heartbeat(epoch=epoch, step=step)
            ctx.fault_point(f"step{epoch}.{step}")
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with amp:
            loss = F.cross_entropy(model(x), y)
        if ctx is not None and ctx.fault_flag(f"nan{epoch}.{step}"):
            loss = loss * float("nan")  # test-only: a non-finite loss on this rank alone

        flags = torch.zeros(2 + world, device=device if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu")
        flags[0] = loss.detach().float()
        flags[1] = 1.0 if (ctx is not None and ctx.should_stop()) else 0.0
        flags[2 + rank] = 0.0 if torch.isfinite(loss.detach()).all() else 1.0
        if is_dist():
            dist.all_reduce(flags)
        bad = [r for r in range(world) if flags[2 + r] > 0]
        if bad:
            raise NonFiniteLossError(
                f"loss is {loss.item() if rank in bad else 'non-finite'} on rank(s) {bad} at epoch {epoch}, "
                f"step {step}: lower the learning rate, check the data, or turn amp off", rank=bad[0])
        if flags[1] > 0:
            stopped = True
            break

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()  # DDP averages the gradients over ranks here
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        mean_loss = flags[0].item() / world
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
    totals = torch.stack([correct, loss_sum, torch.tensor(float(count), dtype=torch.float64)])
    if is_dist():
        dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        totals = totals.to(dev)
        dist.all_reduce(totals)
        totals = totals.cpu()
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
