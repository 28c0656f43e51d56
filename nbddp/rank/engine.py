"""One epoch of training (with gradient accumulation), exact evaluation, the learning-rate schedule, GPU memory peaks.

Worker side. Everything here works on CPU (gloo) and GPU (nccl) alike: collectives run on the
device the backend needs, never a hard-coded ``"cuda"``. A training step never waits for the
device: the values it computes there reach the host a step later (:mod:`.readback`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import readback
from .dist import cpu_group, get_rank, get_world_size, is_dist
from ..contract.errors import NonFiniteLossError, PeerError


def cosine_lambda(epochs: int, lrf: float) -> Callable[[int], float]:
    """LR factor going from 1 to ``lrf`` along half a cosine over ``epochs`` (reference schedule)."""
    return lambda e: ((1 + math.cos(e * math.pi / epochs)) / 2) * (1 - lrf) + lrf


def warmup_cosine_lambda(epochs: int, lrf: float, warmup_epochs: int = 0) -> Callable[[int], float]:
    """LR factor per epoch: a linear warm-up of ``warmup_epochs``, then :func:`cosine_lambda` over the rest.

    Warm-up epoch ``e`` trains at ``(e + 1) / (warmup_epochs + 1)`` of the base rate, so the rate
    climbs in equal steps and the first epoch after the warm-up starts the cosine at 1, which
    then ends at ``lrf`` as it does without a warm-up. ``warmup_epochs=0`` is
    :func:`cosine_lambda` itself (the same values, bit for bit).

    Args:
        epochs: the run's epochs, warm-up included.
        lrf: final factor of the cosine.
        warmup_epochs: epochs of warm-up, ``0 <= warmup_epochs < epochs``.
    """
    if warmup_epochs <= 0:
        return cosine_lambda(epochs, lrf)
    cosine = cosine_lambda(epochs - warmup_epochs, lrf)
    return lambda e: (e + 1) / (warmup_epochs + 1) if e < warmup_epochs else cosine(e - warmup_epochs)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for mixed precision on ``device``; ``None`` off the GPU.

    bf16 (no scaler needed) where the GPU computes it natively, compute capability 8.0 and
    later (A100, A10, H100, ...); fp16 with a grad scaler before (V100, T4).
    ``torch.cuda.is_bf16_supported()`` is not the test: it also says yes on V100/T4, where bf16
    runs through emulation at a fraction of fp16's speed.

    Args:
        device: the rank's device.

    Returns:
        ``torch.bfloat16``, ``torch.float16``, or ``None`` for a non-CUDA device.
    """
    if device.type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def grad_scaler(device: torch.device, amp_dtype: Optional[torch.dtype], **kwargs):
    """A ``GradScaler`` for fp16 autocast on ``device``'s type, else ``None``.

    fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.

    Args:
        device: the rank's device; the scaler works on its type (``"cuda"``, ``"cpu"``, ...).
        amp_dtype: the autocast dtype, as :func:`autocast_dtype` chose it.
        **kwargs: passed to ``GradScaler`` (``init_scale``, ``growth_interval``, ...).

    Returns:
        ``torch.amp.GradScaler`` (torch >= 2.3) or ``None`` when no scaling is needed.
    """
    if amp_dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device.type, **kwargs)


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


class NoContext:
    """The part of a run's :class:`nbddp.rank.runtime.Context` the loops use, doing nothing.

    Stands in when :func:`train_one_epoch` or :func:`evaluate` runs outside a launched run (a
    plain loop, a test): no heartbeat, no progress, never a stop request.
    """

    epoch: Optional[int] = None
    step: Optional[int] = None
    phase = "train"

    def heartbeat(self, epoch: Optional[int] = None, step: Optional[int] = None, waiting: bool = False,
                  phase: Optional[str] = None) -> None:
        pass

    def progress(self, **fields) -> None:
        pass

    def should_stop(self) -> bool:
        return False


def _context(ctx):
    return ctx if ctx is not None else NoContext()


@dataclass
class EpochStats:
    loss: float  # mean over steps of the loss averaged over ranks
    steps: int  # batches of the epoch done, those before a resume included: the next step's index
    images: int  # images seen by all ranks
    seconds: float
    stopped: bool  # every rank agreed to stop early (notebook's Stop)
    optimizer_steps: int = 0  # updates of the weights: ``steps`` without accumulation
    first_batch_s: float = 0.0  # from the epoch's start to its first batch (the loader's start, a fixed cost)
    data_wait_s: float = 0.0  # seconds this rank's host waited in the loader's next(), the first batch's included

    @property
    def data_wait(self) -> float:
        """The fraction of the epoch's time this rank waited for batches (:attr:`data_wait_s` over :attr:`seconds`)."""
        return min(1.0, self.data_wait_s / self.seconds) if self.seconds > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


def _next_batch(run: "_Epoch", batches):
    """The next batch, or the exception reading it raised (agreed on before anyone raises).

    The time the host spends here is the epoch's data wait (``EpochStats.data_wait_s``): the
    loader's ``next()``, as torchtitan and Composer time it; the transforms on the device are the step's.
    """
    t0 = time.perf_counter()
    try:
        return next(batches), None
    except Exception as exc:  # noqa: BLE001 - re-raised after the ranks agree
        return None, exc
    finally:
        run.data_wait_s += time.perf_counter() - t0


def _raise_read_error(error: Optional[BaseException], failed: list, epoch: int, step: int):
    if error is not None:
        raise error
    raise PeerError(f"rank {failed[0]} could not read its batch at epoch {epoch}, step {step}; "
                    "every rank stopped at this step", rank=failed[0])


class _Ready(tuple):
    """``(x, y)`` of a batch read ahead and already prepared (on the device, transformed)."""


def _prepare(batch, device, batch_transform, channels_last):
    if isinstance(batch, _Ready):
        return batch
    x, y = batch
    x = x.to(device, non_blocking=True)
    y = y.to(device, non_blocking=True)
    if batch_transform is not None:
        x = batch_transform(x)  # batched augmentation on the rank's device (data_pipeline="tensor")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def _autocast(device: torch.device, amp_dtype: Optional[torch.dtype]):
    return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()


@dataclass
class _Epoch:
    """What every step of one epoch uses: :func:`train_one_epoch`'s arguments and this rank's place."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    epoch: int
    ctx: Any
    scaler: Any
    amp_dtype: Optional[torch.dtype]
    channels_last: bool
    batch_transform: Optional[Callable[[torch.Tensor], torch.Tensor]]
    accum_steps: int = 1          # batches per optimizer step
    label_smoothing: float = 0.0  # of the training loss
    checkpoint_due: Optional[Callable[[], bool]] = None  # asked every step: save in the middle of the epoch?
    world: int = field(default_factory=get_world_size)
    rank: int = field(default_factory=get_rank)
    copies: readback.Copies = field(default_factory=readback.Copies)  # each step's loss, on its way to the host
    data_wait_s: float = 0.0  # seconds in the loader's next() so far (_next_batch)


@dataclass
class _Agreed:
    """What the ranks agreed on in one step: its own host facts, and the loss of an earlier step."""

    of_step: Optional[int]     # the step whose loss came with it; None: no loss came
    loss_sum: float            # that loss summed over ranks
    own_loss: Optional[float]  # this rank's own
    nonfinite: List[int]       # ranks whose loss of that step is NaN or infinite
    stop: bool                 # some rank was asked to stop
    save: bool                 # some rank (rank 0, by the clock) asked for a checkpoint after this step
    unreadable: List[int]      # ranks that could not read their next batch


class _StepAgreement:
    """A step's one all-reduce, on the host: ``[loss, stop, save, nonfinite[world], unreadable_next[world]]``.

    The stop request, the checkpoint due and the next batch's read error are this step's: host
    facts, known at once. The loss and its non-finite flags are those of ``values``, an earlier
    step's, read through :func:`readback.read`: the host never waits here for the step still
    running on the device. A gloo all-reduce (nbddp's CPU group beside nccl), started after the
    forward and waited for after the backward, so the backward is queued (and on CPU ranks, DDP's
    gradient all-reduce runs) meanwhile.
    """

    def __init__(self, run: _Epoch, step: int, values: Optional[readback.Late], why: str, stop: bool = False,
                 save: bool = False, read_error: Optional[BaseException] = None):
        self.world = run.world
        flags = torch.zeros(3 + 2 * run.world)
        self.of_step, self.own_loss = None, None
        if values is not None:
            (loss,) = readback.read(values, step, why)
            self.of_step, self.own_loss = values.step, loss
            flags[0] = loss
            flags[3 + run.rank] = 0.0 if math.isfinite(loss) else 1.0
        flags[1] = 1.0 if stop else 0.0
        flags[2] = 1.0 if save else 0.0
        flags[3 + run.world + run.rank] = 1.0 if read_error is not None else 0.0
        self.tensor = flags
        self.work = dist.all_reduce(flags, group=cpu_group(), async_op=True) if is_dist() else None

    def wait(self) -> _Agreed:
        if self.work is not None:
            self.work.wait()  # the other ranks' hosts, never a device
        values = self.tensor.tolist()
        world = self.world
        return _Agreed(self.of_step, values[0], self.own_loss, [r for r in range(world) if values[3 + r] > 0],
                       values[1] > 0, values[2] > 0, [r for r in range(world) if values[3 + world + r] > 0])


def _non_finite(run: _Epoch, agreed: _Agreed) -> NonFiniteLossError:
    """The error every rank raises for a non-finite loss, naming the ranks and the step that produced it."""
    bad = agreed.nonfinite
    run.ctx.heartbeat(epoch=run.epoch, step=agreed.of_step)  # the error's record names that step
    return NonFiniteLossError(
        f"loss is {agreed.own_loss if run.rank in bad else 'non-finite'} on rank(s) {bad} at epoch {run.epoch}, "
        f"step {agreed.of_step}: lower the learning rate, check the data, or turn amp off", rank=bad[0])


def _settle(run: _Epoch, late: readback.Late, why: str) -> _Agreed:
    """Collective: the ranks agree on the loss of the step just done (``why``: the epoch's end, a checkpoint,
    a stop, a read error), which waits for the device; raises if it is not finite on any rank."""
    agreed = _StepAgreement(run, late.step, late, why).wait()
    if agreed.nonfinite:
        raise _non_finite(run, agreed)
    return agreed


def _first_batch(run: _Epoch, batches, step: int, total_steps: int) -> tuple:
    """Read the first batch (of step ``step``) and agree on it: ``(batch, stop)``; raises if a rank could not read it.

    The first batch has no earlier step to carry its agreement: one up-front all-reduce of
    ``[stop, unreadable[world]]``.
    """
    ctx = run.ctx
    ctx.heartbeat(epoch=run.epoch, step=step, phase="train")
    batch, error = _next_batch(run, batches) if step < total_steps else (None, None)
    ctx.heartbeat(epoch=run.epoch, step=step, waiting=True)
    first = torch.zeros(1 + run.world)
    first[0] = 1.0 if ctx.should_stop() else 0.0
    first[1 + run.rank] = 1.0 if error is not None else 0.0
    if is_dist():
        dist.all_reduce(first, group=cpu_group())
    failed = [r for r in range(run.world) if first[1 + r] > 0]
    if failed:
        _raise_read_error(error, failed, run.epoch, step)
    return batch, bool(first[0] > 0)


def _forward(run: _Epoch, batch, step: int) -> tuple:
    """The step's forward on this rank: ``(loss, images in the batch)``."""
    run.ctx.heartbeat(epoch=run.epoch, step=step)
    x, y = _prepare(batch, run.device, run.batch_transform, run.channels_last)
    # From here on this rank may wait for the others (SyncBatchNorm and DDP's buffer
    # broadcast talk in the forward): a rank that hangs before this point lags behind.
    run.ctx.heartbeat(epoch=run.epoch, step=step, waiting=True)
    with _autocast(run.device, run.amp_dtype):
        loss = F.cross_entropy(run.model(x), y, label_smoothing=run.label_smoothing)
    return loss, x.shape[0]


def _read_ahead(run: _Epoch, batches, step: int) -> tuple:
    """The next step's batch, read now so that a read error travels in this step's agreement."""
    run.ctx.heartbeat(epoch=run.epoch, step=step)  # reading data: local work again
    batch, error = _next_batch(run, batches)
    if error is None and getattr(run.batch_transform, "prepare_ahead", run.batch_transform is None):
        # Prepared now, while the device runs this step's forward: the host's share of the
        # transform (decoding, augmenting on the rank) overlaps the device's work, and the next
        # step's input is ready when the device gets there. Only a transform that says so
        # (``prepare_ahead``: it draws nothing from the rank's random state, which a
        # checkpoint after this step must hold as the step left it). A transform that fails (a
        # file that does not decode) is a read error: it travels in this step's agreement.
        try:
            batch = _Ready(_prepare(batch, run.device, run.batch_transform, run.channels_last))
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks agree
            batch, error = None, exc
    run.ctx.heartbeat(epoch=run.epoch, step=step, waiting=True)
    return batch, error


@dataclass
class _Group:
    """Where a batch falls in its gradient-accumulation group, the batches that share one optimizer step.

    Groups are the batches ``[g*k, (g+1)*k)`` of the epoch; the last one is shorter when the
    epoch's batches do not divide by ``k``, and it steps too.
    """

    first: bool  # the group's first batch: the gradients are zeroed before its backward
    size: int    # batches in the group: each batch's loss is divided by it
    syncs: bool  # the group's last batch: its backward all-reduces the gradients, then the optimizer steps


def _group(step: int, total_steps: int, accum_steps: int) -> _Group:
    start = step - step % accum_steps
    end = min(start + accum_steps, total_steps)
    return _Group(step == start, end - start, step + 1 == end)


def _grad_sync(model: torch.nn.Module, syncs: bool):
    """DDP's ``no_sync()`` for a group's batches before its last: their gradients only add up locally.

    Covers the forward and the backward, as DDP requires. A bare model (one process) has no
    ``no_sync`` and nothing to synchronise; a compiled DDP model passes it through.
    """
    if syncs:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: gradients stay unsharded until the last batch
        return _fsdp_no_sync(model)
    no_sync = getattr(model, "no_sync", None)
    return contextlib.nullcontext() if no_sync is None else no_sync()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _backward(run: _Epoch, loss: torch.Tensor, group: _Group) -> None:
    if group.first:
        run.optimizer.zero_grad(set_to_none=True)
    if group.size > 1:
        loss = loss / group.size  # the group's gradient is the mean over its batches
    if run.scaler is not None:
        run.scaler.scale(loss).backward()  # DDP averages the gradients over ranks here (last batch of a group)
    else:
        loss.backward()


def _optimizer_step(run: _Epoch) -> None:
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()


def _train_step(run: _Epoch, step: int, batch, batches, group: _Group, before: Optional[readback.Late],
                count: Callable[[_Agreed], None]) -> tuple:
    """One step: forward, read ahead (``batches=None`` on the last step), agree, backward, update.

    The update (and DDP's gradient all-reduce) happens on the last batch of ``group`` only.
    ``before`` is the loss of the step before, not yet agreed on (``None`` after a step that
    settled its own): it travels in this step's agreement, and ``count`` gets it before this
    step's update, so that it sees the state that step left. Returns ``(agreed, images, next
    batch, its read error, this step's loss on its way to the host)``. Raises
    ``NonFiniteLossError`` on every rank, before this step's update, when the loss of the step
    before was not finite on any of them.
    """
    with _grad_sync(run.model, group.syncs):
        loss, images = _forward(run, batch, step)
        late = run.copies.start(step, loss.float())  # queued behind the forward, read at the next step
        batch, error = _read_ahead(run, batches, step) if batches is not None else (None, None)
        save = run.checkpoint_due is not None and run.checkpoint_due()
        agreement = _StepAgreement(run, step, before, "next step", run.ctx.should_stop(), save, error)
        _backward(run, loss, group)
    agreed = agreement.wait()
    if agreed.nonfinite:
        raise _non_finite(run, agreed)
    count(agreed)
    if group.syncs:
        _optimizer_step(run)
    return agreed, images, batch, error, late


def _start_epoch(model, optimizer, device, epoch, ctx, scaler, amp_dtype, channels_last, batch_transform,
                 accum_steps, label_smoothing, checkpoint_due) -> "_Epoch":
    """The model set to train (BatchNorm statistics frozen where asked) and the epoch's step state."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r}: batches per optimizer step, an integer >= 1")
    model.train()
    freeze_bn_statistics(model)
    return _Epoch(model, optimizer, device, epoch, ctx, scaler, amp_dtype, channels_last, batch_transform,
                  accum_steps=accum_steps, label_smoothing=label_smoothing, checkpoint_due=checkpoint_due)


def _progress(run: _Epoch, epoch: int, step: int, steps: int, shown: dict, images: int, t0: float) -> None:
    """The epoch's progress after step ``step``: ``shown`` holds the latest loss the host has."""
    elapsed = time.perf_counter() - t0
    run.ctx.progress(epoch=epoch, step=step, steps=steps, **shown, images_per_s=images / elapsed if elapsed > 0 else 0.0)


def train_one_epoch(model, optimizer, loader, device, epoch: int, ctx=None, scaler=None,
                    amp_dtype: Optional[torch.dtype] = None, channels_last: bool = False,
                    on_step: Optional[Callable[[int, float], None]] = None,
                    batch_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                    accum_steps: int = 1, label_smoothing: float = 0.0,
                    start: Optional[EpochStats] = None,
                    checkpoint: Optional[Callable[[EpochStats], None]] = None,
                    checkpoint_due: Optional[Callable[[], bool]] = None) -> EpochStats:
    """Train for one pass over ``loader``; every rank leaves at the same step.

    Every rank sees the same agreements, so every rank takes the same decisions. A stop or a
    checkpoint waits for the end of the accumulation group: the state saved, or left with, has
    applied every batch it counts.

    Conditions only one rank sees end every rank at the same step instead of leaving the
    others waiting in DDP's next all-reduce: a non-finite loss, a stop request from the
    notebook, a batch that cannot be read (a corrupt image). All of them travel in ONE small
    all-reduce per step, on the host, started right after the forward and waited for after the
    backward. To let a read error travel in it, each step reads the *next* batch before the
    agreement: ranks then stop before the forward that batch would feed, as they must, since
    DDP's forward (SyncBatchNorm, buffer broadcast) may talk to the other ranks.

    The step never waits for the device. Its loss is copied to the host as the forward queues it
    and travels in the *next* step's agreement (:mod:`nbddp.rank.readback`), so a non-finite loss
    stops every rank one step later: before the next step's update, named with the rank and the
    step that produced it (the update of that step itself may have been applied; no checkpoint
    holds it). The epoch's end, a checkpoint, a stop and a read error agree on the loss of the
    step just done first, one more all-reduce that waits for the device. ``on_step`` and the
    progress see each step's loss one step late (``on_step`` before the next update: with the
    weights that step left); the epoch's totals hold every step's.

    The tensor is ``[loss, stop, save, nonfinite[world], unreadable_next[world]]``; the loss is
    reported as the mean over ranks. ``ctx`` (heartbeats, progress, stop requests) may be
    ``None`` outside a launched run.

    Gradient accumulation (``accum_steps=k``): the optimizer steps once per group of ``k``
    batches, each batch's loss divided by the group's size, and the batches before a group's
    last run under DDP's ``no_sync()`` so that only the last one all-reduces the gradients.
    An epoch whose batches do not divide by ``k`` ends with a shorter group, which steps too
    (its gradient is the mean of the batches it has); ``k`` times ``len(loader)`` batches are
    never needed. The agreement still runs every batch: a non-finite loss stops every rank
    before any update of its group (on the group's last batch: before the next group's first),
    an unreadable batch at the batch it feeds, and a stop request at the end of the group it
    falls in, so a stopped epoch has completed all its optimizer steps. ``label_smoothing``
    goes to ``F.cross_entropy``.

    Checkpoints in the middle of the epoch: after a step at which the ranks agreed to stop, or
    at which ``checkpoint_due()`` said yes on some rank (the worker asks its clock on rank 0
    only), at the end of that step's accumulation group, every rank calls
    ``checkpoint(stats)`` together (it may use collectives), with the epoch's totals so far:
    ``stats.steps`` is the index of the next step to run. Not after the epoch's last step: the
    end-of-epoch checkpoint follows it.

    Args:
        start: the part of this epoch done before (a resumed epoch), ``None`` for a whole epoch.
            ``loader`` then yields the remaining batches only (``nbddp.tasks.classification.loading.SkipSampler``); step
            numbers, progress and the returned totals continue from ``start``.
    """
    run = _start_epoch(model, optimizer, device, epoch, _context(ctx), scaler, amp_dtype, channels_last,
                       batch_transform, accum_steps, label_smoothing, checkpoint_due)
    start = start or EpochStats(0.0, 0, 0, 0.0, False)
    run.data_wait_s = start.data_wait_s  # a resumed epoch's wait counts, as its time does
    first_step, total_steps = start.steps, start.steps + len(loader)
    t0 = (t_first := time.perf_counter()) - start.seconds  # the epoch's clock; a resumed one's time counts
    batches = iter(loader)
    batch, stop = _first_batch(run, batches, first_step, total_steps)
    first_batch_s = time.perf_counter() - t_first
    loss_sum, steps, images = start.loss * start.steps, start.steps, start.images
    updates, stop_asked, save_asked = start.optimizer_steps, False, False
    shown: dict = {}  # the latest step's loss known on the host, for the progress

    def totals(stopped: bool) -> EpochStats:
        return EpochStats(loss_sum / max(steps, 1), steps, images, time.perf_counter() - t0, stopped, updates,
                          first_batch_s, run.data_wait_s)

    def count(agreed: _Agreed) -> None:
        """The loss of the step the ranks just agreed on, into the totals and ``on_step``."""
        nonlocal loss_sum
        if agreed.of_step is None:
            return
        mean_loss = agreed.loss_sum / run.world
        loss_sum += mean_loss
        shown["loss"] = mean_loss
        if on_step is not None:
            on_step(agreed.of_step, mean_loss)

    if stop or first_step == total_steps:
        return totals(stop)
    pending = None  # the loss of the last step done, on its way to the host, not agreed on yet
    for step in range(first_step, total_steps):
        last = step + 1 == total_steps
        group = _group(step, total_steps, accum_steps)
        agreed, batch_images, batch, error, pending = _train_step(run, step, batch, None if last else batches, group,
                                                                  pending, count)
        updates += group.syncs
        steps, images = steps + 1, images + batch_images * run.world
        _progress(run, epoch, step + 1, total_steps, shown, images, t0)
        if agreed.unreadable:
            count(_settle(run, pending, "read error"))  # the steps done are reported before leaving
            run.ctx.heartbeat(epoch=epoch, step=step + 1)  # the step whose batch failed
            _raise_read_error(error, agreed.unreadable, epoch, step + 1)
        stop_asked = stop_asked or agreed.stop
        save_asked = save_asked or agreed.save
        if last or not group.syncs:
            continue
        save_now = checkpoint is not None and (stop_asked or save_asked)
        if stop_asked or save_now:
            count(_settle(run, pending, "stop" if stop_asked else "checkpoint"))  # totals whole, loss finite
            pending = None
        if save_now:
            checkpoint(totals(stop_asked))
            save_asked = False
        if stop_asked:
            return totals(True)
    if pending is not None:
        count(_settle(run, pending, "epoch end"))
        _progress(run, epoch, steps, total_steps, shown, images, t0)  # with the last step's loss, read only now
    return totals(False)


def reset_gpu_memory_peaks(device: torch.device) -> None:
    """Start a new peak-memory window on ``device`` (a GPU rank's epoch); nothing off the GPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gpu_memory_peaks(device: torch.device) -> Optional[Tuple[float, float]]:
    """``(allocated, reserved)`` peaks on ``device`` since the last reset, in GiB; ``None`` off the GPU.

    Allocated is what tensors held at most (``torch.cuda.max_memory_allocated``); reserved is
    what PyTorch's caching allocator held from the driver (``max_memory_reserved``), what
    ``nvidia-smi`` shows plus the CUDA context. Reading them does not synchronise the GPU.
    """
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30


@dataclass
class EvalResult:
    accuracy: float
    loss: float
    count: int  # images evaluated over all ranks: exactly the validation set
    predictions: Optional[list] = None  # (dataset index, predicted class), gathered on every rank
    # GPU memory peaks (GiB) since the ranks' last reset_gpu_memory_peaks, the highest of any rank;
    # None off the GPU. They ride on the evaluation's own all-reduce.
    gpu_mem_alloc_gib: Optional[float] = None
    gpu_mem_reserved_gib: Optional[float] = None


@dataclass
class _Shard:
    """One rank's share of an evaluation, before the ranks agree."""

    correct: torch.Tensor  # on the device: no host synchronisation per batch
    loss_sum: torch.Tensor
    count: int = 0
    predictions: list = field(default_factory=list)
    error: Optional[BaseException] = None  # raised once every rank knows of it
    memory: Optional[Tuple[float, float]] = None  # this rank's GPU memory peaks (gpu_memory_peaks)


def _batches_to_match(model, loader) -> Optional[int]:
    """Under FSDP, the most validation batches any rank has: every forward gathers parameters from
    every rank, so a rank with fewer batches runs extra forwards (uncounted). ``None`` otherwise."""
    if not is_dist() or not any(hasattr(m, "set_requires_gradient_sync") for m in model.modules()):
        return None
    counts = [None] * get_world_size()
    dist.all_gather_object(counts, len(loader), group=cpu_group())
    return max(counts)


def _evaluate_shard(model, loader, device, amp_dtype, channels_last, batch_transform, ctx, keep: bool) -> _Shard:
    """This rank's batches; an exception is kept, to be raised after the ranks agree."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    shard = _Shard(zero, zero.clone())
    most = _batches_to_match(model, loader)
    x = None
    try:
        for i, batch in enumerate(loader):
            ctx.heartbeat(step=i, phase="eval")
            x, y = _prepare(batch, device, batch_transform, channels_last)
            with _autocast(device, amp_dtype):
                out = model(x)
            shard.loss_sum += F.cross_entropy(out.float(), y, reduction="sum").double()
            p = out.argmax(dim=1)
            shard.correct += (p == y).sum()
            shard.count += y.numel()
            if keep:
                shard.predictions.append(p)
        for _ in range(len(loader), most or 0):  # FSDP: the others' gathers need this rank (see above)
            with _autocast(device, amp_dtype):
                model(x[:1])
    except Exception as exc:  # noqa: BLE001 - re-raised by evaluate, after the ranks agree
        shard.error = exc
    return shard


def _agree_on_shards(shard: _Shard) -> torch.Tensor:
    """``[correct, loss_sum, count, failed[world], alloc[world], reserved[world]]`` summed over ranks.

    One all-reduce. The error flags travel with the totals: an unreadable validation image on
    one rank stops every rank here, instead of leaving them waiting in the next step. So do the
    GPU memory peaks, each rank in its own slot (-1 off the GPU), so every rank learns the highest.
    """
    world, rank = get_world_size(), get_rank()
    totals = torch.zeros(3 + 3 * world, dtype=torch.float64)
    totals[0], totals[1], totals[2] = shard.correct.cpu(), shard.loss_sum.cpu(), float(shard.count)
    totals[3 + rank] = 1.0 if shard.error is not None else 0.0
    alloc, reserved = shard.memory if shard.memory is not None else (-1.0, -1.0)
    totals[3 + world + rank], totals[3 + 2 * world + rank] = alloc, reserved
    if is_dist():
        dist.all_reduce(totals, group=cpu_group())
    return totals


def _highest(values: torch.Tensor) -> Optional[float]:
    """The highest of the ranks' memory slots, or None when no rank is on a GPU."""
    top = values.max().item()
    return top if top >= 0 else None


def _gather_predictions(indices: list, predictions: list) -> list:
    """``(dataset index, predicted class)`` of every rank, sorted, on every rank."""
    mine = list(zip(indices, torch.cat(predictions).tolist() if predictions else []))
    if not is_dist():
        return sorted(mine)
    parts = [None] * get_world_size()
    dist.all_gather_object(parts, mine, group=cpu_group())
    return sorted(p for part in parts for p in part)


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype: Optional[torch.dtype] = None, channels_last: bool = False,
             gather_predictions: bool = False,
             batch_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, ctx=None) -> EvalResult:
    """Exact distributed evaluation: each image counted once, whatever the set and world sizes.

    ``loader`` must use :class:`nbddp.tasks.classification.loading.ShardSampler` (no padding). Correct counts, summed
    losses and image counts are all-reduced, so the accuracy equals a single-process run.
    Pass the bare model (``ddp.module``): evaluation needs no gradient synchronisation.
    Totals stay on the device until the end: no host synchronisation per batch. With ``ctx``,
    each batch is a heartbeat of phase ``"eval"``, so a rank hung in validation is named.
    On GPUs the result also carries the memory peaks since the ranks' last
    :func:`reset_gpu_memory_peaks`, the highest of any rank, at no extra collective.
    """
    ctx = _context(ctx)
    model.eval()
    indices = list(iter(loader.sampler)) if gather_predictions else None
    step = ctx.step  # the training step every rank left the epoch at
    shard = _evaluate_shard(model, loader, device, amp_dtype, channels_last, batch_transform, ctx, gather_predictions)
    shard.memory = gpu_memory_peaks(device)  # the peaks since the last reset: the epoch's, training included
    # Shards differ by a batch, so every rank waits at the same place: the end of evaluation.
    ctx.step = step
    ctx.heartbeat(phase="eval-end", waiting=True)
    totals = _agree_on_shards(shard)
    ctx.heartbeat(phase="eval-end")
    failed = [r for r in range(get_world_size()) if totals[3 + r] > 0]
    if shard.error is not None:
        raise shard.error
    if failed:
        raise PeerError(f"rank {failed[0]} failed during evaluation; every rank stopped", rank=failed[0])
    n = int(totals[2].item())
    gathered = _gather_predictions(indices, shard.predictions) if gather_predictions else None
    world = get_world_size()
    return EvalResult(accuracy=totals[0].item() / max(n, 1), loss=totals[1].item() / max(n, 1), count=n,
                      predictions=gathered, gpu_mem_alloc_gib=_highest(totals[3 + world:3 + 2 * world]),
                      gpu_mem_reserved_gib=_highest(totals[3 + 2 * world:]))

