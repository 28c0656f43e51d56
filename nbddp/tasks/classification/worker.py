"""The built-in worker: image classification with DDP, one linear story.

It rebuilds the multi-GPU ResNet flower classifier of the well-known ``train_multi_GPU``
scripts without their bugs: booleans are real booleans, validation counts every image exactly
once (no sampler padding), and checkpoints hold plain values that load with
``weights_only=True``.

``train`` runs in every rank; its plan and ``preflight`` (:mod:`.planning`) run in the kernel before any process starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .pipelines import TaskData, load_data
from .startup import LaunchClock
from ...contract import rundir
from ...contract.checkpoint import BackgroundSaver, export_weights, load_checkpoint, save_run_checkpoint
from ...contract.config import TrainConfig
from ...rank.dist import (agree_on_error, any_rank, barrier, check_same, cpu_group, data_parallel, is_dist,
                          sync_buffers_from_main)
from ...rank.engine import (EpochStats, autocast_dtype, evaluate, grad_scaler, reset_gpu_memory_peaks, train_one_epoch,
                            warmup_cosine_lambda)
from ...contract.protocol import note_checkpoint
from ...contract.throughput import rates_text
from .models import build_model, freeze_except_head, load_pretrained
from ...rank import flops
from ...rank.sharding import (full_optimizer_state_dict, full_state_dict, load_full_optimizer_state_dict,
                              load_full_state_dict, shard)
from ...rank.sync_bn import convert_sync_batchnorm

# ------------------------------------------------------------------------------ worker side
def _rss_mb() -> float:
    """Resident memory of this process now (rank 0's), to see that it does not grow per epoch."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def _seed_epoch(seed: int, epoch: int, rank: int) -> None:
    # Augmentation randomness is a function of (seed, epoch, rank) alone, so a run resumed at
    # epoch k draws exactly what an uninterrupted run draws at epoch k.
    s = (seed * 1_000_003 + epoch * 1_009 + rank) % (2**31)
    torch.manual_seed(s)
    random.seed(s)


@dataclass
class _Trainer:
    """The model and what trains it."""

    model: torch.nn.Module  # the bare model: checkpoints, evaluation, export
    ddp: torch.nn.Module    # what trains: DDP around the model, or the model itself when it is the only rank
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any             # a GradScaler for fp16 autocast, else None
    amp_dtype: Optional[torch.dtype]
    channels_last: bool
    compiled: bool = False  # ddp is torch.compile'd (the first epoch of a launch reports compile_s)
    saver: BackgroundSaver = field(default_factory=BackgroundSaver)  # rank 0 writes checkpoints meanwhile
    flops_per_image: Optional[float] = None  # of one training step's forward and backward (_flops_per_image)


@dataclass
class _Progress:
    """Where the run stands: what a checkpoint keeps and a resumed run starts from.

    Early stopping needs nothing more: the epochs without improvement are the last finished
    epoch minus ``best_epoch``, both in the checkpoint.
    """

    start_epoch: int = 0
    best: float = -1.0
    best_epoch: int = -1
    history: list = field(default_factory=list)
    stopped: bool = False
    early_stopped: bool = False
    # A checkpoint written in the middle of start_epoch: the steps done (totals included), the
    # images each rank's loader gave them, and every rank's random state after them, in rank order.
    start: Optional[EpochStats] = None
    start_items: int = 0
    # Seconds the training path spent on checkpoints since the last epoch record (a fixed cost).
    checkpoint_s: float = 0.0
    rng: Optional[list] = None


def _build(cfg: TrainConfig, ctx, num_classes: int) -> _Trainer:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts)
    model = build_model(cfg.model, num_classes)
    if cfg.weights:
        report = load_pretrained(model, cfg.weights)
        if ctx.is_main:
            print(report.summary(), flush=True)
    if cfg.freeze_layers:
        # Before DDP: DDP registers gradient hooks only for parameters that require grad.
        trainable = freeze_except_head(model)
        if ctx.is_main:
            print(f"frozen: training only {', '.join(trainable)}", flush=True)
    elif cfg.sync_bn and ctx.world_size > 1:
        model = convert_sync_batchnorm(model, ctx.device)
    cuda = ctx.device.type == "cuda"
    # The input shape is fixed, so cuDNN may time its algorithms once and keep the fastest
    # (at the price of run-to-run bit-exactness on GPUs; the CPU path is unaffected).
    torch.backends.cudnn.benchmark = cuda
    channels_last = cfg.channels_last and cuda
    model = model.to(ctx.device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if cfg.strategy == "fsdp":
        # Each ResNet stage sharded, then the root; checkpoints, evaluation and the export use the
        # model itself. compile=True compiles each stage (the gathers stay outside the graphs).
        model = shard(model, compile=cfg.compile, compile_backend=_compile_backend(ctx) if cfg.compile else "inductor")
        ddp = model
    else:
        ddp = data_parallel(model, ctx.device)  # the bare model when this is the only rank
        if cfg.compile:
            ddp = _compile(ddp, ctx)
    lr = cfg.lr * ctx.world_size if cfg.scale_lr else cfg.lr
    optimizer = _optimizer(cfg, [p for p in model.parameters() if p.requires_grad], lr, ctx.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=warmup_cosine_lambda(cfg.epochs, cfg.lrf, cfg.warmup_epochs))
    amp_dtype = autocast_dtype(ctx.device) if cfg.amp else None
    scaler = grad_scaler(ctx.device, amp_dtype)  # fp16 only (GPUs before compute capability 8.0)
    # A checkpoint writer thread overlaps a GPU's step; next to CPU ranks it only slows them.
    return _Trainer(model, ddp, optimizer, scheduler, scaler, amp_dtype, channels_last, compiled=cfg.compile,
                    saver=BackgroundSaver(background=ctx.device.type != "cpu"),
                    flops_per_image=_flops_per_image(cfg, ctx, num_classes, channels_last))


def _flops_per_image(cfg: TrainConfig, ctx, num_classes: int, channels_last: bool) -> Optional[float]:
    """FLOPs of one image's forward and backward as the run trains it, counted once on the ``meta`` device.

    The model is built again there (shapes only: no memory, no arithmetic, whatever the strategy),
    frozen as the run freezes it, at the run's image size and memory format. None where the count
    fails (a layer without a meta kernel): the records then carry no ``tflops`` nor ``mfu``.

    Rank 0 alone counts: the records that carry the rates (``metrics.jsonl``, the cell, TensorBoard,
    the checkpoint's history, the run's value) are its own, and the count runs a whole forward and
    backward on ``meta`` (0.05-0.2 s of CPU) that the other ranks would repeat for nothing.
    """
    if not ctx.is_main:
        return None
    t0 = time.perf_counter()
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, num_classes)
        if cfg.freeze_layers:
            freeze_except_head(model)
        # Two images: BatchNorm in training refuses one value per channel (a 32 px ResNet's last stage).
        x = torch.empty(2, 3, cfg.image_size, cfg.image_size, device="meta")
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        count = flops.count_flops(model, x) / 2
    except Exception as exc:  # noqa: BLE001 - the numbers are a report: training goes on without them
        if ctx.is_main:
            print(f"note: the FLOPs of {cfg.model} could not be counted ({type(exc).__name__}: {exc}); "
                  "the epoch records carry no tflops nor mfu", flush=True)
        return None
    if ctx.is_main:
        print(f"{cfg.model} at {cfg.image_size} px: {count / 1e9:.2f} GFLOP per image, forward and backward "
              f"(counted in {time.perf_counter() - t0:.2f} s)", flush=True)
    return float(count)


def _optimizer(cfg: TrainConfig, params: list, lr: float, device: torch.device) -> torch.optim.Optimizer:
    fused = _fused(device, sharded=cfg.strategy == "fsdp")
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, **fused)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **fused)


def _fused(device: torch.device, sharded: bool) -> dict:
    """``fused=True`` where this torch has a fused optimizer step for ``device``: one kernel over
    all the parameters instead of a few per parameter (SGD with weight decay, ResNet18, one CPU
    thread: 14.0 ms -> 6.7 ms a step; results equal to float rounding). FSDP's sharded
    parameters (DTensors) keep torch's default."""
    if sharded:
        return {}
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without it: the default step
        return {}
    return {"fused": True} if device.type in _get_fused_kernels_supported_devices() else {}


def with_this_runs_step(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``state`` (an optimizer's, from a checkpoint) with each group's ``fused`` set to how this run's
    ``optimizer`` steps. torch takes ``fused`` from the file and places a step counter by it (on
    the device for a fused AdamW): a checkpoint of a default step resumed fused would fail on a
    GPU (step on the CPU), one of a fused DDP run resumed under FSDP would run the fused kernel on
    sharded tensors (which it has none for), one from before the fused step would resume slower."""
    if not state or "param_groups" not in state:  # a rank that receives it from rank 0
        return state
    kernels = [group.get("fused") for group in optimizer.param_groups]
    return {**state, "param_groups": [{**saved, "fused": kernel}
                                      for saved, kernel in zip(state["param_groups"], kernels)]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, stepping as this run steps (:func:`with_this_runs_step`)."""
    optimizer.load_state_dict(with_this_runs_step(state, optimizer))


#: The ``torch.compile`` backend of ``TrainConfig(compile=True)``: inductor unless this variable
#: names another (``eager`` traces with dynamo but runs the captured graphs as they are: the
#: compile path in seconds on a CPU, as nbddp's tests use it).
COMPILE_BACKEND_ENV = "NBDDP_COMPILE_BACKEND"


def _compile_backend(ctx) -> str:
    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    if ctx.is_main:
        print(f"torch.compile (backend {backend}): the first steps compile", flush=True)
    return backend


def _compile(ddp: torch.nn.Module, ctx) -> torch.nn.Module:
    """``torch.compile`` of the DDP wrapper, as PyTorch advises for DDP: dynamo's DDP optimiser
    then splits the graph at the gradient buckets, so their all-reduces still overlap the
    backward. The bare model (checkpoints, evaluation, export) stays as it is."""
    return torch.compile(ddp, backend=_compile_backend(ctx))


def _compile_seconds() -> Optional[float]:
    """Seconds this process has spent in torch.compile so far, by dynamo's own count (None if unknown)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a private helper: without it the record leaves compile_s out
        return None


def _resume(cfg: TrainConfig, ctx, t: _Trainer) -> _Progress:
    """Continue from the run's last checkpoint when resuming: weights, optimizer, schedule, history."""
    last = rundir.checkpoint_path(ctx.run_dir, rundir.LAST)
    if not (cfg.resume and last.exists()):
        return _Progress()
    ck = load_checkpoint(last, run_dir=ctx.run_dir)  # yours alone, checked on the descriptor read
    optimizer_state = optimizer_state_as(ck["optimizer"], t.model, by_name=cfg.strategy == "fsdp")
    if cfg.strategy == "fsdp":  # whole tensors, keyed by name: each rank keeps its shard (any world size)
        load_full_state_dict(t.model, ck["model"])
        load_full_optimizer_state_dict(t.model, t.optimizer, with_this_runs_step(optimizer_state, t.optimizer))
    else:
        t.model.load_state_dict(ck["model"])
        load_optimizer_state(t.optimizer, optimizer_state)
    t.scheduler.load_state_dict(ck["scheduler"])
    _rebuild_schedule(cfg, ctx, t, ck.get("config", {}).get("epochs"))
    if t.scaler is not None and ck.get("scaler"):
        t.scaler.load_state_dict(ck["scaler"])
    progress = _Progress(ck["epoch"] + 1, ck["best_accuracy"], ck["best_epoch"], list(ck.get("history", [])))
    if ck.get("step"):  # written in the middle of epoch ck["epoch"], after ck["step"] of its steps
        done = ck.get("epoch_stats") or {}
        progress.start_epoch = ck["epoch"]
        written_batch = ck.get("config", {}).get("batch_size", cfg.batch_size)
        # Batches of the checkpoint's size done; a run that splits its batch (oom="halve") has done
        # as many of its own smaller ones as make the same images: its accumulation groups line up.
        steps = ck["step"] * (written_batch // cfg.batch_size if written_batch % cfg.batch_size == 0 else 1)
        progress.start = EpochStats(done.get("loss", 0.0), steps, done.get("images", 0), done.get("seconds", 0.0),
                                    False, done.get("optimizer_steps", 0), data_wait_s=done.get("data_wait_s", 0.0))
        progress.start_items = ck["step"] * written_batch
        progress.rng = ck.get("rank_rng")
        if ctx.is_main:
            # 1-based, as the epoch lines ("epoch 2/3") and the progress count them: the next
            # step to run, the first one the progress shows.
            print(f"resumed from {last}: resuming from epoch {ck['epoch'] + 1} step {steps + 1}", flush=True)
    elif ctx.is_main:
        # The number of epochs done: the 0-based index of the next one.
        print(f"resumed from {last} at epoch {progress.start_epoch}", flush=True)
    return progress


def optimizer_state_as(state: dict, model: torch.nn.Module, by_name: bool) -> dict:
    """An optimizer's state dict keyed by parameter name (FSDP's whole state) or by index (``optimizer.state_dict()``).

    A checkpoint of either strategy then resumes under the other: the index of a parameter is its
    place among the model's trainable parameters, the order the optimizer was built in.
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    keys = list(state.get("state", {})) + [k for g in state.get("param_groups", []) for k in g.get("params", [])]
    if not keys or all(isinstance(k, str) == by_name for k in keys):
        return state
    convert = (lambda i: names[i]) if by_name else {n: i for i, n in enumerate(names)}.__getitem__
    return {"state": {convert(k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [convert(k) for k in g["params"]]} for g in state["param_groups"]]}


def _rebuild_schedule(cfg: TrainConfig, ctx, t: _Trainer, planned: Any) -> None:
    """A run resumed with another number of epochs follows the schedule of its new length from here on.

    The scheduler keeps the new config's schedule (its function is not in the checkpoint), but
    the optimizer's current rate comes from the old one: it is recomputed for the epoch the run
    continues at, and rank 0 says so in its log.
    """
    if not isinstance(planned, int) or planned == cfg.epochs:
        return
    epoch = t.scheduler.last_epoch
    for group, base, factor in zip(t.optimizer.param_groups, t.scheduler.base_lrs, t.scheduler.lr_lambdas):
        group["lr"] = base * factor(epoch)
    t.scheduler._last_lr = [g["lr"] for g in t.optimizer.param_groups]  # what get_last_lr() reports
    if ctx.is_main:
        print(f"epochs {planned} -> {cfg.epochs}: the learning-rate schedule was rebuilt for {cfg.epochs} epochs "
              f"(lr {t.optimizer.param_groups[0]['lr']:.6g} at epoch {epoch + 1}, ending at "
              f"{cfg.lrf:g} x the base rate)", flush=True)


def _writer(cfg: TrainConfig, ctx):
    """Rank 0's ``ctx.tensorboard``, with the run's hyper-parameters written into it; None on other ranks.

    ``ctx.log`` writes every scalar of an epoch's record there; the worker adds the step losses
    and the reference scripts' names (``loss``, ``accuracy``, ``learning_rate``), each tag once
    per step.
    """
    writer = ctx.tensorboard
    if writer is None:
        return None
    from torch.utils.tensorboard.summary import hparams

    hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.to_dict().items()}
    hp["world_size"] = ctx.world_size
    # Written into the run's own event file (add_hparams would make a second run folder).
    for summary in hparams(hp, {"accuracy": 0.0, "loss": 0.0}):
        writer.file_writer.add_summary(summary)
    return writer


def _whole_states(cfg: TrainConfig, ctx, t: _Trainer) -> Optional[tuple]:
    """Collective under FSDP: ``(model, optimizer)`` state dicts gathered whole on rank 0's CPU, one tensor
    at a time (the checkpoint then holds the whole model, so it resumes on any number of ranks); else None."""
    if cfg.strategy != "fsdp":
        return None
    if ctx.is_main:
        t.saver.wait()  # one gathered copy at a time
    return full_state_dict(t.model), full_optimizer_state_dict(t.model, t.optimizer)


def _checkpoint(t: _Trainer, progress: _Progress, epoch: int, cfg: TrainConfig, classes,
                whole: Optional[tuple] = None) -> dict:
    # Plain values only, so it loads with torch.load(weights_only=True).
    return {
        "model": whole[0] if whole else t.model.state_dict(),  # the bare model: no "module." prefix
        "optimizer": whole[1] if whole else t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "scaler": t.scaler.state_dict() if t.scaler is not None else None,
        "epoch": epoch,
        "best_accuracy": progress.best,
        "best_epoch": progress.best_epoch,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []},
        "config": cfg.to_dict(),
        "classes": list(classes),
        "history": progress.history,
    }


def train(ctx, cfg: TrainConfig, planned: Optional[dict] = None) -> dict:
    """Train, evaluate exactly, checkpoint, export. Returns a small summary (rank 0's is kept).

    ``planned``: when the kernel's plan began and ended its checks (:mod:`.planning`); rank 0 puts
    the launch's fixed costs into its first epoch record (:mod:`.startup`).
    """
    started = LaunchClock(planned) if ctx.is_main else None
    data = load_data(cfg, ctx, started)
    t = _build(cfg, ctx, data.num_classes)
    progress = _resume(cfg, ctx, t)
    if started is not None:
        started.mark("model_build")
    if ctx.is_main:
        rundir.cleanup_temp_files(rundir.checkpoints_dir(ctx.run_dir))  # a crash between temp write and rename
    check_same(len(data.loaders.train), "training steps per epoch")
    writer = _writer(cfg, ctx)
    ctx.background_writer = t.saver
    try:
        _train_epochs(cfg, ctx, data, t, progress, writer, started)
    except BaseException:
        with contextlib.suppress(BaseException):
            t.saver.wait()  # a failing run still finishes the checkpoint it was writing
        raise
    _wait_for_checkpoints(ctx, t)
    if writer is not None:
        writer.flush()  # ctx closes it when the rank ends
    barrier()  # best.pt is complete before any rank reads it
    return _final_pass(cfg, ctx, data, t, progress)


def _train_epochs(cfg: TrainConfig, ctx, data: TaskData, t: _Trainer, progress: _Progress, writer,
                  started: Optional[LaunchClock] = None) -> None:
    """Epochs from ``progress.start_epoch`` on: train, validate, log, save; a stop request ends them.

    Mid-epoch checkpoints come at most every ``checkpoint_every_s``: rank 0 keeps the time, and
    every rank learns its decision in the step's existing all-reduce.
    """
    steps_per_epoch = len(data.loaders.train)  # before a resumed epoch leaves out its first batches
    clock = _CheckpointClock(cfg.checkpoint_every_s) if ctx.is_main else None
    for epoch in range(progress.start_epoch, cfg.epochs):
        if _early_stop_due(cfg, progress, epoch):
            progress.early_stopped = True
            if ctx.is_main:
                _say_early_stop(cfg, progress, epoch)
            return
        data.loaders.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        _seed_epoch(cfg.seed, epoch, ctx.rank)
        reset_gpu_memory_peaks(ctx.device)  # the epoch's peaks: evaluate reports them
        start = _continue_epoch(cfg, ctx, data, progress) if epoch == progress.start_epoch else None
        lr = t.optimizer.param_groups[0]["lr"]

        def on_step(step, loss, _base=epoch * steps_per_epoch):
            if started is not None:
                started.mark("first_step")  # the launch's first step, its loss known
            if writer is not None:
                writer.add_scalar("train_loss_step", loss, _base + step)
                ctx.track(train_loss_step=loss, step=_base + step)  # to spawn_train(trackers=...), if any

        def checkpoint(done: EpochStats, _epoch=epoch) -> None:
            t_save = time.perf_counter()
            _save_mid_epoch(cfg, ctx, data, t, progress, _epoch, done)
            progress.checkpoint_s += time.perf_counter() - t_save
            if clock is not None:
                clock.reset()

        # The launch's first steps compile: its first epoch reports how long that took.
        compiled_before = _compile_seconds() if t.compiled and epoch == progress.start_epoch else None
        stats = train_one_epoch(t.ddp, t.optimizer, data.loaders.train, ctx.device, epoch, ctx=ctx, scaler=t.scaler,
                                amp_dtype=t.amp_dtype, channels_last=t.channels_last, on_step=on_step,
                                batch_transform=data.loaders.train_transform, accum_steps=cfg.grad_accum_steps,
                                label_smoothing=cfg.label_smoothing, start=start, checkpoint=checkpoint,
                                checkpoint_due=clock.due if clock is not None else None)
        compile_s = _compile_seconds() - compiled_before if compiled_before is not None else None
        if stats.stopped:
            progress.stopped = True
            if ctx.is_main:
                _say_stopped(epoch, stats.steps)
            return
        if epoch + 1 < cfg.epochs:  # the next epoch's first batches load while this one is evaluated and saved
            data.loaders.start_epoch(epoch + 1)
        _end_epoch(cfg, ctx, data, t, progress, writer, started, epoch, stats, lr, compile_s)
        if clock is not None:
            clock.reset()


def _end_epoch(cfg: TrainConfig, ctx, data: TaskData, t: _Trainer, progress: _Progress, writer,
               started: Optional[LaunchClock], epoch: int, stats: EpochStats, lr: float,
               compile_s: Optional[float]) -> None:
    """A trained epoch's end on every rank: validate, step the schedule, record the epoch, save it."""
    t_eval = time.perf_counter()
    sync_buffers_from_main(t.model)
    ev = evaluate(t.model, data.loaders.val, ctx.device, t.amp_dtype, t.channels_last,
                  batch_transform=data.loaders.val_transform, ctx=ctx)
    t.scheduler.step()
    # The epoch's fixed costs, in its record (bench/gpu.py prints them): the loader's first
    # batch, the evaluation, the previous epoch's checkpoint on the step's path.
    costs = {"first_batch_s": stats.first_batch_s, "eval_s": time.perf_counter() - t_eval,
             "checkpoint_s": progress.checkpoint_s, **(started.take() if started is not None else {})}
    # Per rank: the epoch's images over the ranks; the data wait is rank 0's own.
    rates = flops.throughput(stats.images / ctx.world_size, stats.seconds, ctx.device, t.flops_per_image,
                             flops.precision_of(t.amp_dtype), stats.data_wait_s)
    rates.pop("samples_per_s", None)  # images_per_s says it, over all ranks
    improved = _record_epoch(cfg, ctx, progress, writer, epoch, stats, ev, lr, compile_s, costs, rates)
    progress.checkpoint_s = 0.0
    t_save = time.perf_counter()
    _save_epoch(cfg, ctx, data, t, progress, epoch, improved)
    progress.checkpoint_s += time.perf_counter() - t_save


def _say_early_stop(cfg: TrainConfig, progress: _Progress, epoch: int) -> None:
    """Rank 0: why the run ends before ``cfg.epochs`` and which epoch the export keeps."""
    stale = epoch - 1 - progress.best_epoch
    print(f"early stop: val accuracy has not improved for {stale} epoch{'s' if stale != 1 else ''} "
          f"(early_stop_patience={cfg.early_stop_patience}; best {progress.best:.4f} at epoch "
          f"{progress.best_epoch + 1}); the export keeps epoch {progress.best_epoch + 1}", flush=True)


def _say_stopped(epoch: int, steps: int) -> None:
    """Rank 0: where a stop request left the run and what a resumed run continues from."""
    if steps:
        saved = f"the checkpoint holds it, a resumed run continues at step {steps + 1}"
    else:
        saved = f"the last checkpoint is epoch {epoch}" if epoch > 0 else "no epoch was completed"
    print(f"stop requested: leaving epoch {epoch + 1} at step {steps}; {saved}", flush=True)


class _CheckpointClock:
    """Rank 0's clock of mid-epoch checkpoints: due once ``every_s`` passed since the last checkpoint (0: never)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.reset()

    def reset(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.every_s > 0 and time.monotonic() - self.last >= self.every_s


def _continue_epoch(cfg: TrainConfig, ctx, data: TaskData, progress: _Progress) -> Optional[EpochStats]:
    """Resuming in the middle of this epoch: leave out the batches done, restore this rank's random state.

    Called after the epoch's shuffle and seeding, so the rest of the epoch draws what an
    uninterrupted run draws after the same steps. Returns the steps done (``None``: a whole epoch).
    """
    start = progress.start
    if start is None:
        return None
    data.loaders.sampler.skip(progress.start_items)  # the loaders drop the last partial batch
    states = progress.rng
    if states is not None and len(states) == ctx.world_size:
        _set_rng_state(states[ctx.rank], ctx.device)
    elif ctx.is_main:
        print(f"note: the checkpoint was written by {len(states or [])} processes and this run has {ctx.world_size}: "
              f"the rest of the epoch comes from other shards, so it is not what an uninterrupted run would see",
              flush=True)
    return start


def _rng_state(device: torch.device) -> dict:
    """This rank's random state: torch's CPU generator (augmentation, dropout), Python's, and its GPU's."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def _gather_rng_states(ctx) -> Optional[list]:
    """Collective: every rank's :func:`_rng_state`, in rank order, on rank 0 (``None`` elsewhere)."""
    mine = _rng_state(ctx.device)
    if not is_dist():
        return [mine]
    states = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(mine, states, dst=0, group=cpu_group())
    return states


def _save_mid_epoch(cfg: TrainConfig, ctx, data: TaskData, t: _Trainer, progress: _Progress, epoch: int,
                    done: EpochStats) -> None:
    """Collective: last.pt in the middle of ``epoch``, after ``done.steps`` steps, with every rank's random state.

    Every rank gives its random state to rank 0, which writes the checkpoint atomically; then
    the ranks agree that it was written (a full disk stops every rank, the previous last.pt
    intact). best.pt stays per epoch.
    """
    ctx.heartbeat(epoch=epoch, step=done.steps, waiting=True)
    states = _gather_rng_states(ctx)
    whole = _whole_states(cfg, ctx, t)
    save_error = None
    if ctx.is_main:
        try:
            t0 = time.perf_counter()
            ck = _checkpoint(t, progress, epoch, cfg, data.classes, whole)
            ck.update(step=done.steps, rank_rng=states,
                      epoch_stats={"loss": done.loss, "images": done.images, "seconds": done.seconds,
                                   "optimizer_steps": done.optimizer_steps, "data_wait_s": done.data_wait_s})
            path = rundir.checkpoint_path(ctx.run_dir, rundir.LAST)

            def written(seconds: float) -> None:
                note_checkpoint(ctx.run_dir, path, epoch, done.steps)  # where a restart continues from
                print(f"checkpoint of epoch {epoch + 1} step {done.steps} written to {path} "
                      f"({path.stat().st_size / 2**20:.1f} MB in {seconds:.2f} s, in the background)", flush=True)

            t.saver.save(ck, path, write=save_run_checkpoint, then=written)
            ctx.heartbeat(epoch=epoch, step=done.steps)  # says at once that a write is under way
            copy_s = time.perf_counter() - t0
            if copy_s > 1.0:
                print(f"checkpoint of epoch {epoch + 1} step {done.steps}: {copy_s:.2f} s on the step's path "
                      "(waiting for the previous write, copying the state)", flush=True)
        except OSError as exc:  # disk full, quota, permissions (the last write's): the previous checkpoint is intact
            save_error = exc
    agree_on_error(save_error, f"saving the checkpoint of epoch {epoch} at step {done.steps}")
    ctx.heartbeat(epoch=epoch, step=done.steps)


def _early_stop_due(cfg: TrainConfig, progress: _Progress, epoch: int) -> bool:
    """Whether ``early_stop_patience`` ends the run before ``epoch``: the epochs after the best one reach it.

    Every rank decides the same: the accuracies come from the same all-reduced totals. Asked
    before each epoch, a resumed run decides from its checkpoint what the uninterrupted run
    decided after that epoch.
    """
    patience = cfg.early_stop_patience
    return patience > 0 and progress.best_epoch >= 0 and (epoch - 1) - progress.best_epoch >= patience


def _record_epoch(cfg: TrainConfig, ctx, progress: _Progress, writer, epoch: int, stats, ev, lr: float,
                  compile_s: Optional[float] = None, costs: Optional[dict] = None, rates: Optional[dict] = None) -> bool:
    """The epoch's metrics into the history, ctx.log, the cell and TensorBoard; True if it is the best so far.

    ``ctx.log`` writes every scalar of the record to TensorBoard at step ``epoch``; the
    reference names ``loss``, ``accuracy`` and ``learning_rate`` are written beside them.
    """
    record = {"epoch": epoch, "train_loss": stats.loss, "val_loss": ev.loss, "val_accuracy": ev.accuracy,
              "val_images": ev.count, "lr": lr, "seconds": stats.seconds, "images_per_s": stats.images_per_s,
              "rss_mb": _rss_mb(), **(rates or {})}
    if compile_s is not None:
        record["compile_s"] = compile_s
    record.update({k: round(v, 4) for k, v in (costs or {}).items()})
    if ev.gpu_mem_alloc_gib is not None:  # GPU ranks: the epoch's peaks, the highest of any rank
        record["gpu_mem_alloc_gib"] = ev.gpu_mem_alloc_gib
        record["gpu_mem_reserved_gib"] = ev.gpu_mem_reserved_gib
    progress.history.append(record)
    ctx.log(**record)
    improved = ev.accuracy > progress.best
    if improved:
        progress.best, progress.best_epoch = ev.accuracy, epoch
    if ctx.is_main:
        extra = ""
        if ev.gpu_mem_alloc_gib is not None:
            extra += f"  gpu mem {ev.gpu_mem_alloc_gib:.1f} GiB (reserved {ev.gpu_mem_reserved_gib:.1f})"
        if compile_s is not None:
            extra += f"  compile {compile_s:.1f}s"
        if cfg.early_stop_patience and not improved:
            extra += f"  no better for {epoch - progress.best_epoch}/{cfg.early_stop_patience}"
        print(f"epoch {epoch + 1}/{cfg.epochs}  train_loss {stats.loss:.4f}  val_loss {ev.loss:.4f}  "
              f"val_acc {ev.accuracy:.4f}  lr {lr:.5f}  {stats.seconds:.1f}s  "
              f"{stats.images_per_s:.0f} img/s{rates_text(record)}{extra}{'  *best*' if improved else ''}", flush=True)
        for tag, value in (("loss", stats.loss), ("accuracy", ev.accuracy), ("learning_rate", lr)):
            writer.add_scalar(tag, value, epoch)
        writer.flush()
    return improved


def _save_epoch(cfg: TrainConfig, ctx, data: TaskData, t: _Trainer, progress: _Progress, epoch: int,
                improved: bool) -> None:
    """Rank 0 saves last.pt (and best.pt); every rank raises if that failed, the rest PeerError."""
    whole = _whole_states(cfg, ctx, t)
    save_error = None
    if ctx.is_main:
        try:
            ck = _checkpoint(t, progress, epoch, cfg, data.classes, whole)
            last, best = rundir.checkpoint_path(ctx.run_dir, rundir.LAST), rundir.checkpoint_path(ctx.run_dir, rundir.BEST)
            accuracy, classes = progress.best, list(data.classes)

            def write(snapshot: dict, path) -> None:  # in the background: last.pt, then best.pt
                save_run_checkpoint(snapshot, path)  # 0600 in a 0700 checkpoints/: resumed only if yours alone
                if improved:
                    save_run_checkpoint({"model": snapshot["model"], "epoch": epoch, "accuracy": accuracy,
                                 "classes": classes, "config": snapshot["config"]}, best)

            t.saver.save(ck, last, write=write, then=lambda _s: note_checkpoint(ctx.run_dir, last, epoch, None))
        except OSError as exc:  # disk full, quota, permissions (the last write's): the previous checkpoint is intact
            save_error = exc
    agree_on_error(save_error, f"saving the checkpoint of epoch {epoch}")


def _wait_for_checkpoints(ctx, t: _Trainer) -> None:
    """Collective: the checkpoint rank 0 writes in the background is on disk; every rank raises if it failed."""
    error = None
    if ctx.is_main:
        try:
            t.saver.wait()
        except OSError as exc:
            error = exc
    agree_on_error(error, "writing the last checkpoint")


def _final_pass(cfg: TrainConfig, ctx, data: TaskData, t: _Trainer, progress: _Progress) -> dict:
    """Evaluate the best weights (the exported model's own validation predictions) and export them."""
    summary = {"run_dir": str(ctx.run_dir), "classes": list(data.classes), "best_accuracy": progress.best,
               "best_epoch": progress.best_epoch, "metrics": progress.history, "stopped": progress.stopped,
               "early_stopped": progress.early_stopped, "early_stop_patience": cfg.early_stop_patience,
               "weights_path": None}
    if progress.best_epoch < 0 or (progress.stopped and _interrupted(ctx)):
        return summary
    best_path = rundir.checkpoint_path(ctx.run_dir, rundir.BEST)
    if cfg.strategy == "fsdp":  # rank 0 reads the file; each rank keeps its shard of it
        load_full_state_dict(t.model, load_checkpoint(best_path, run_dir=ctx.run_dir)["model"] if ctx.is_main else None)
        # The broadcast frees what it sent: the export reads the file again, one plain copy on rank 0.
        best_state = load_checkpoint(best_path, run_dir=ctx.run_dir)["model"] if ctx.is_main else None
    else:
        best_state = load_checkpoint(best_path, run_dir=ctx.run_dir)["model"]
        t.model.load_state_dict(best_state)
    final = evaluate(t.model, data.loaders.val, ctx.device, t.amp_dtype, t.channels_last, gather_predictions=True,
                     batch_transform=data.loaders.val_transform, ctx=ctx)
    if ctx.is_main:
        summary["weights_path"] = str(_export(cfg, ctx, data, best_state, progress.best_epoch, final))
    summary["final_accuracy"] = final.accuracy
    return summary


def _interrupted(ctx) -> bool:
    """Collective: the stop came from an Interrupt, whose cell raises, or a sweep's pruner, which uses no
    result: no final evaluation nor export then."""
    reason = ctx.stop_reason() if ctx.is_main else None
    if any_rank(reason in ("interrupt", "pruned")):
        if ctx.is_main:
            what = "pruned by the sweep" if reason == "pruned" else "interrupted"
            print(f"{what}: no final evaluation nor export; the checkpoints are kept", flush=True)
        return True
    return False


def _export(cfg: TrainConfig, ctx, data: TaskData, best_state, best_epoch: int, final) -> Path:
    """Rank 0: the export folder and val_predictions.json; returns the exported .pth."""
    meta = {"model": cfg.model, "num_classes": data.num_classes, "image_size": cfg.image_size,
            "epoch": best_epoch, "val_accuracy": final.accuracy}
    export_dir = rundir.export_dir(ctx.run_dir)
    paths = export_weights(best_state, export_dir, data.classes, extra=meta)
    preds = [{"path": os.path.abspath(data.val_samples[i][0]), "label": data.val_samples[i][1], "pred": p}
             for i, p in final.predictions]
    rundir.atomic_write_text(rundir.val_predictions_path(ctx.run_dir), json.dumps(preds))
    print(f"best val_acc {final.accuracy:.4f} (epoch {best_epoch + 1}); weights exported to {export_dir}", flush=True)
    if cfg.export_onnx:  # the plain model of these files, as nbddp.export_onnx(run_dir) would export it
        from .onnx_export import export_after_training

        print(export_after_training(cfg.model, data.classes, cfg.image_size, paths["safetensors"],
                                    [rec["path"] for rec in preds], threads=torch.get_num_threads()), flush=True)
    return paths["pth"]

