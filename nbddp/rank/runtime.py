"""The per-rank entry point: everything a worker process does around the user's function.

Order matters and each step has a reason:
1. parent-death signal first, so a worker never outlives a kernel that died (OOM killer);
2. leave the kernel's process group: Jupyter's Interrupt signals the whole group, and the kernel
   side turns it into a staged shutdown instead, whose SIGINT raises ``KeyboardInterrupt`` here
   (:mod:`nbddp.rank.interrupt`) whatever disposition the rank inherited;
   then the user's per-rank start-up hook, if ``NBDDP_RANK_HOOK`` names one (:func:`nbddp.rank.process.run_rank_hook`);
3. stdout/stderr redirected at file-descriptor level, so C++ (gloo/NCCL) messages land in the
   rank's log too;
4. process group from a store the launcher made private to its user (no fixed port, no port race);
5. any exception is written as an error record (type, traceback, epoch, step) before exiting,
   so the notebook can name the root-cause rank.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from . import calls, debugger
from . import reaper
from .logs import redirect_output
from ..contract import cells, rundir, statedir, targets
from .heartbeat import HeartbeatThread
from . import process
from ..contract.errors import ConfigError, shown_traceback
from ..contract.protocol import (ErrorRecord, Heartbeat, HeartbeatWriter, LaunchSpec, Progress, ProgressWriter,
                       MAX_RESTARTS_ENV, RESTART_ENV, note_checkpoint, read_stop_request,
                       write_result)
from .rank_errors import is_retryable, is_secondary


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """``warnings`` output as one line, ``Category: message (file:line)``.

    Python's default adds the source line below, which reaches the notebook as an orphaned
    line of someone else's code (``  return func(*args, **kwargs)``) once the head has scrolled
    by or was filtered; one line per warning is whole wherever it is shown.
    """
    text = " ".join(str(message).split())
    return f"{category.__name__}: {text} ({os.path.basename(filename)}:{lineno})\n"


def _note_checkpoint(ctx: "Context", path: Path, state: Any) -> None:
    """A checkpoint ``ctx`` wrote is whole: loadable from now on, and (rank 0) where a restart continues from."""
    ctx._loadable.add(Path(path))  # whole on disk: every rank is past the save's agreement
    if ctx.is_main:  # where a restart continues from (nbddp.kernel.restarts)
        epoch, step = (state.get(k) if isinstance(state, dict) else None for k in ("epoch", "step"))
        note_checkpoint(ctx.run_dir, path, epoch if isinstance(epoch, int) else ctx.epoch,
                        step if isinstance(step, int) else ctx.step)


def _look_for_stop(ctx: "Context") -> None:
    """Read the stop request now; a rank that found one says so in its heartbeat (the launcher lets it finish)."""
    ctx._stop_checked = time.time()
    ctx._stop_reason = read_stop_request(ctx.run_dir)
    if ctx._stop_reason is not None and ctx._beat is not None:
        ctx._beat.beat()


def _last_step(fields: dict) -> bool:
    """A progress record of an epoch's last step: ``step`` equal to ``steps`` (or ``total``, as a worker may name it)."""
    return fields.get("step") is not None and fields.get("step") == (fields.get("steps") or fields.get("total"))


def _before_first_save(ctx: "Context") -> None:
    """The first save of a start of the ranks waits until every rank has reached it.

    A resumed run's checkpoints are loadable from the start, and rank 0's next save replaces them
    under the same name: a rank that has still to load what it resumes from would load the new one
    and start a step later. Before anything is written, so outside the held Interrupt, and on the
    CPU group, which fails at once when a peer has left (an Interrupt that reached it mid-step).
    """
    if ctx._saved:
        return
    from .dist import cpu_group, is_dist

    if is_dist():
        dist.barrier(group=cpu_group())
    ctx._saved = True


# ctx.log's TensorBoard scalars and a checkpoint's write are module functions beside Context (as
# the first-save barrier above), so that the class holds what a worker calls.

#: Keys that place a record, not values to chart.
_AXIS_KEYS = ("step", "epoch", "time")


def _log_to_tensorboard(ctx: "Context", record: dict) -> None:
    """Every scalar of a ``ctx.log`` record as a TensorBoard scalar (rank 0 only).

    The step axis is the record's ``step``, else its ``epoch``, else the number of records
    logged so far. Non-numbers (text, lists) stay in ``metrics.jsonl`` only.
    """
    scalars = {k: v for k, v in record.items() if k not in _AXIS_KEYS
               and isinstance(v, (int, float)) and not isinstance(v, bool)}
    axis = record.get("step", record.get("epoch"))
    step = axis if isinstance(axis, int) and not isinstance(axis, bool) else ctx._logged
    ctx._logged += 1
    if not scalars:
        return
    writer = ctx.tensorboard
    for key, value in scalars.items():
        writer.add_scalar(key, value, step)


def _save_checkpoint(ctx: "Context", state: dict, name: str) -> Path:
    """Write ``state`` as checkpoint ``name`` (sharded, or whole by rank 0), every rank learning of a failure."""
    from ..contract.checkpoint import save_run_checkpoint, to_plain
    from .dist import agree_on_error, barrier
    from .sharded_checkpoint import save as save_sharded, split_state
    from .sharding import gather_dtensors, has_dtensors

    if isinstance(state, dict) and any(split_state(state)[:2]):
        path = save_sharded(ctx.run_dir, name, state, ctx.is_main)
        _note_checkpoint(ctx, path, state)
        return path
    if has_dtensors(state):  # one tensor at a time, kept on rank 0 only
        state = gather_dtensors(state, keep=ctx.is_main)
    path = rundir.checkpoint_path(ctx.run_dir, name)
    error = None
    if ctx.is_main:
        try:
            save_run_checkpoint(to_plain(state), path)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it below
            error = exc
    agree_on_error(error, f"saving checkpoint {path.name}")
    barrier()
    _note_checkpoint(ctx, path, state)
    return path


class Context:
    """What a worker function receives as its first argument.

    Attributes:
        rank: global rank of this process.
        local_rank: rank on this machine (index into the selected GPUs).
        world_size: number of processes.
        device: ``torch.device`` this rank computes on (``cuda:i`` or ``cpu``).
        backend: ``"nccl"`` or ``"gloo"``.
        run_dir: the run's folder (config, logs, metrics, checkpoints).
        is_main: True on rank 0, the rank that writes files.
        strategy: ``"ddp"`` or ``"fsdp"``: how :meth:`prepare` spreads the model over the ranks
            (``spawn_train(..., strategy=...)``; ``$NBDDP_STRATEGY`` under torchrun/srun).
    """

    def __init__(self, rank: int, local_rank: int, world_size: int, device: torch.device,
                 backend: str, run_dir: Path):
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.run_dir = Path(run_dir)
        self.is_main = rank == 0
        # The checkpoints this start of the ranks may load: those on disk now, before any rank can
        # have saved (no rank passes the process group's set-up before every rank has reached it),
        # and those its own saves completed on every rank. Rank 0 writes a checkpoint before the
        # others agree it is whole: a rank still starting must not take it for one to resume from.
        self._loadable = set(_checkpoints_on_disk(self.run_dir))
        self._saved = False  # a save of this start was made (_before_first_save)
        from .sharding import launch_strategy

        self.strategy = launch_strategy()
        self.epoch: Optional[int] = None
        self.step: Optional[int] = None
        self.phase = "train"
        self.waiting = False
        self._progress_time = time.time()
        self._stop_checked = 0.0
        self._stop_reason: Optional[str] = None
        self._progress_written = 0.0
        self._metrics_file = None
        self._progress_file: Optional[ProgressWriter] = None
        self._tensorboard = None
        self._logged = 0  # ctx.log calls so far: TensorBoard's step when a record names none
        self._throughput_since = time.perf_counter()  # ctx.throughput's clock: its last call, or the worker's start
        self._beat: Optional[HeartbeatThread] = None
        self._breakpoints = 0  # ctx.breakpoint calls so far: the same count on every rank
        # What writes checkpoints in the background (``checkpoint.BackgroundSaver``), if anything:
        # the heartbeat says when it writes, and a failure's shutdown then lets the write end.
        self.background_writer = None
        self._saving = False  # inside ctx.save_checkpoint
        # spawn_train(profile=..., trackers=...): this rank's profiler, rank 0's tracker thread.
        self._profiler = None
        self._trackers = None
        # The run's state folder, held open for the rank's life (spawn_train's ranks hold it already;
        # ranks under torchrun or srun make it, or refuse one that is not the user's alone).
        statedir.pin(self.run_dir, None)

    # -- progress and metrics ---------------------------------------------------------
    def heartbeat(self, epoch: Optional[int] = None, step: Optional[int] = None, waiting: bool = False,
                  phase: Optional[str] = None) -> None:
        """Record that this rank made progress (cheap; call it once per step).

        Args:
            epoch: current epoch.
            step: current step (of the phase).
            waiting: this rank is about to wait for the others in a collective. A rank that
                hangs before reaching the collective is then told apart from the ranks that
                wait for it at the same step.
            phase: ``"train"``, ``"eval"`` or ``"eval-end"``: evaluation comes after the
                epoch's training steps, so a rank hung in validation lags behind the others too.
        """
        if epoch is not None:
            self.epoch = epoch
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase
        self.waiting = waiting
        self._progress_time = time.time()
        if self._beat is not None:
            self._beat.progressed()

    def _heartbeat_record(self, state: str) -> Heartbeat:
        """This rank's heartbeat record now, in lifecycle ``state`` (the heartbeat thread's snapshot)."""
        return Heartbeat(rank=self.rank, pid=os.getpid(), state=state, epoch=self.epoch, step=self.step,
                         phase=self.phase, waiting=self.waiting, progress_time=self._progress_time,
                         beat_time=time.time(), stopping=self._stop_reason is not None,
                         writing=self._saving or bool(getattr(self.background_writer, "writing", False))
                         or bool(getattr(self._trackers, "finishing", False)))

    def log(self, **metrics: Any) -> None:
        """Record metrics: rank 0's go live to the notebook and to the run's ``metrics.jsonl``.

        Other ranks only update their heartbeat, so ``ctx.log`` can be called on every rank
        (log values reduced over ranks, e.g. with :func:`nbddp.rank.dist.reduce_value`).
        """
        self.heartbeat(metrics.get("epoch"), metrics.get("step"))
        if self._profiler is not None:
            self._profiler.reported(metrics.get("step"))
        if not self.is_main:
            return
        if self._metrics_file is None:
            # Never through a link, never into a file others may write: the kernel reads its records back.
            fd = rundir.open_own(rundir.metrics_path(self.run_dir), "ctx.log's records")
            self._metrics_file = os.fdopen(fd, "a", buffering=1)
        record = {"time": round(time.time(), 3)}
        record.update({k: json_value(v) for k, v in metrics.items()})
        self._metrics_file.write(json.dumps(record) + "\n")
        _log_to_tensorboard(self, record)
        if self._trackers is not None:
            self._trackers.log(record)

    def track(self, **values: Any) -> None:
        """Values for the run's trackers only (``spawn_train(trackers=...)``), not ``metrics.jsonl``.

        For values too frequent for the cell (a loss every step): ``ctx.track(train_loss_step=loss,
        step=global_step)``. Rank 0 only; a no-op without trackers.
        """
        if self._trackers is not None:
            self._trackers.log({"time": time.time(), **{k: json_value(v) for k, v in values.items()}})

    def throughput(self, samples: float, flops_per_sample: Optional[float] = None, *, seconds: Optional[float] = None,
                   precision: Optional[str] = None, data_wait_s: Optional[float] = None) -> dict:
        """This rank's throughput since the last call, as values for :meth:`log`; cheap (no device sync).

        Args:
            samples: the samples this rank trained since the last call (or in ``seconds``).
            flops_per_sample: FLOPs of one sample's forward and backward (:func:`nbddp.count_flops` of
                a batch, divided by its size); without it, no ``tflops`` nor ``mfu``.
            seconds: the time they took; default: since the last call (the first: since the worker began).
            precision: what the step computes in, ``"bf16"``, ``"fp16"`` (autocast), ``"tf32"`` or
                ``"fp32"``: the MFU's peak is that precision's; without it, no ``mfu``.
            data_wait_s: seconds of that time this rank waited for its batches.

        Returns:
            ``samples_per_s``, ``tflops`` (achieved by this rank), ``mfu`` (over this GPU's dense peak,
            only for a GPU in :data:`nbddp.contract.throughput.PEAKS`: never on a CPU, never a guess)
            and ``data_wait`` (a fraction of ``seconds``), each where it is known.

        Example:
            >>> flops = nbddp.count_flops(model, x[:8]) / 8      # once, before the loop
            >>> for epoch in range(epochs):
            ...     n, wait = train_epoch()                      # samples, seconds waiting for data
            ...     ctx.log(epoch=epoch, **ctx.throughput(n, flops, precision="bf16", data_wait_s=wait))
        """
        from .flops import throughput

        now = time.perf_counter()
        seconds = now - self._throughput_since if seconds is None else seconds
        self._throughput_since = now
        return throughput(samples, seconds, self.device, flops_per_sample, precision, data_wait_s)

    @property
    def tensorboard(self):
        """Rank 0's ``SummaryWriter`` into the run's ``tensorboard/`` folder (``None`` on other ranks).

        ``ctx.log`` writes every scalar through it already; use it for anything else
        (histograms, images, hyper-parameters). Events are flushed every 2 seconds.
        """
        if not self.is_main:
            return None
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(rundir.tensorboard_dir(self.run_dir)), flush_secs=2)
        return self._tensorboard

    # -- the model ---------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, *, blocks=None, mixed_precision=None, reshard_after_forward: bool = True,
                cpu_offload: bool = False, compile: bool = False, compile_backend: Optional[str] = None,
                **ddp_kwargs: Any) -> torch.nn.Module:
        """The model on this rank's device, wrapped as the launch's :attr:`strategy` says. Call it once.

        ``"ddp"``: ``DistributedDataParallel`` around it (the bare model when this is the only
        rank); ``ddp_kwargs`` go to DDP. ``"fsdp"``: FSDP2, ``fully_shard`` on each block, then on
        the root; the model itself comes back, its parameters now shards (``DTensor``). A model
        the worker sharded itself is left as it is. Build the optimizer after this call, from the
        returned model's parameters.

        Args:
            model: the bare model (on the CPU or the device).
            blocks: FSDP: the module classes (classes or class names) to shard one by one, e.g.
                ``["TransformerBlock"]``; default: the model's repeated children (ResNet stages,
                transformer layers).
            mixed_precision: FSDP: ``"bf16"`` (bf16 parameters and compute, fp32 gradient
                reduction and master weights), ``"fp16"``, or a ``MixedPrecisionPolicy``.
            reshard_after_forward: FSDP: free each block's gathered parameters after its
                forward (less memory, one more all-gather in backward).
            cpu_offload: FSDP: keep the shards, gradients and optimizer state on the CPU.
            compile: ``torch.compile`` the DDP wrapper, or each FSDP block.
            compile_backend: ``torch.compile``'s backend (default inductor).

        Raises:
            ConfigError: a second call on the same model, DDP around a sharded model, a block class
                the model lacks, FSDP options under ``"ddp"``.

        Example:
            >>> model = ctx.prepare(build_model(), mixed_precision="bf16")
            >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        """
        from .sharding import prepare

        return prepare(model, self.device, self.strategy, blocks=blocks, mixed_precision=mixed_precision,
                       reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload, compile=compile,
                       compile_backend=compile_backend, **ddp_kwargs)

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        """Collective: ``model``'s whole, plain state dict on rank 0's CPU (empty on other ranks when sharded).

        For an export of a sharded model: no ``DTensor``, no wrapper prefixes, and never more than
        one full copy, on rank 0's CPU. Call it on every rank.
        """
        from .sharding import full_state_dict

        return full_state_dict(model)

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, state: dict, name: str = rundir.LAST) -> Optional[Path]:
        """Save ``state`` as the run's checkpoint ``name``; call it on every rank (a collective).

        Two forms:

        * modules and optimizers among the values, as Lightning Fabric's ``save`` takes them:
          ``{"model": model, "optimizer": optimizer, "step": step}``. Written with
          ``torch.distributed.checkpoint`` to ``checkpoints/<name>.dcp/``: every rank writes its
          own shard, in parallel (a sharded model is never gathered), and a later load reshards
          to the world size it runs on. The other values are kept beside the shards.
        * tensors and plain values (numbers, strings, lists, dicts): e.g. ``{"model":
          model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}``. Rank 0
          writes it to ``checkpoints/<name>.pt`` (weights-only loadable, so loading never runs
          code). Sharded tensors (a sharded model's ``state_dict()``) are gathered and saved whole.

        Either way the checkpoint is atomic (a half-written one is never ``name``) and every rank
        waits until it is whole. If a write fails (a full disk), every rank raises: the one that
        failed its own error. It is private whatever the umask (files ``0600`` in ``0700``
        folders), and a Stop's or an Interrupt's ``KeyboardInterrupt`` waits until it is whole:
        it is raised right after the call (one that cut a peer's save off drops this one, and the
        previous checkpoint stays).

        Returns:
            The path written (on every rank).
        """
        from ..contract.checkpoint import uninterrupted

        name = _checkpoint_name(name)
        _before_first_save(self)
        self._saving = True  # the heartbeat says so: the staged stop lets the write end before SIGTERM
        try:
            with uninterrupted(lambda: read_stop_request(self.run_dir) is not None):
                return _save_checkpoint(self, state, name)
        finally:
            self._saving = False

    def load_checkpoint(self, into: Union[dict, str, None] = None, name: str = rundir.LAST) -> Optional[dict]:
        """The run's checkpoint ``name``, or ``None`` if there is none (a fresh run).

        With ``into`` (``{"model": model, "optimizer": optimizer}``), the checkpoint is loaded into
        those modules and optimizers in place (a collective: call it on every rank) and the rest of
        the saved state comes back (``{"step": ...}``). A checkpoint of modules and optimizers
        (``checkpoints/<name>.dcp``) is resharded to this run's world size and sharding: a run
        saved on 2 ranks continues on 1 or 3. Without ``into``, a ``.pt`` checkpoint comes back
        whole, on this rank's device. Files are read weights-only, and only if they and every
        folder from the run folder down are yours and writable by no one else (checked on the
        descriptors read): anything else raises ``NotPrivate`` naming it, unread.

        Example:
            >>> state = ctx.load_checkpoint({"model": model, "optimizer": optimizer})
            >>> start = 0 if state is None else state["step"] + 1
        """
        from ..contract.checkpoint import load_checkpoint
        from .sharded_checkpoint import checkpoint_kinds, dcp_path, load as load_sharded, load_plain_into

        if isinstance(into, str):  # ctx.load_checkpoint("best"), as before modules could be given
            into, name = None, into
        name = _checkpoint_name(name)
        found = [p for p in checkpoint_kinds(self.run_dir, name) if p in self._loadable]
        if not found:
            return None
        newest = max(found, key=lambda p: p.stat().st_mtime)
        if into is not None:
            if newest == dcp_path(self.run_dir, name):
                rest = load_sharded(self.run_dir, name, into)
            else:
                rest = load_plain_into(load_checkpoint(newest, run_dir=self.run_dir), into, newest)
            return to_device(rest, self.device)
        if newest == dcp_path(self.run_dir, name):
            from ..contract.errors import ConfigError

            raise ConfigError(f"checkpoint {newest} holds modules and optimizers (sharded, one file per rank); load it "
                              "into them: state = ctx.load_checkpoint({'model': model, 'optimizer': optimizer})")
        return to_device(load_checkpoint(newest, run_dir=self.run_dir), self.device)

    def progress(self, **fields: Any) -> None:
        """Report live progress (epoch, step, total, loss...), shown by the notebook's panel.

        Written at most 5 times a second, so calling it every step costs nothing; an epoch's last
        step always (``step`` equal to ``steps``, or ``total``), so that the panel ends on the truth.
        """
        self.heartbeat(fields.get("epoch"), fields.get("step"))
        if self._profiler is not None:
            self._profiler.reported(fields.get("step"))
        now = time.time()
        if self.is_main and (_last_step(fields) or now - self._progress_written >= 0.2):
            self._progress_written = now
            if self._progress_file is None:
                self._progress_file = ProgressWriter(self.run_dir)
            self._progress_file.write(Progress({k: json_value(v) for k, v in fields.items()}, now))

    def should_stop(self) -> bool:
        """True once the notebook asked this run to stop (Stop button, ``handle.stop()``, Interrupt).

        Cheap enough for every step: the request is looked for at most 5 times a second.
        Local to this rank: to leave a loop together, agree first, e.g.
        ``if nbddp.rank.dist.any_rank(ctx.should_stop()): break``.
        """
        if self._stop_reason is None and time.time() - self._stop_checked >= 0.2:
            _look_for_stop(self)
        return self._stop_reason is not None

    def stop_reason(self) -> Optional[str]:
        """Why the notebook asked this run to stop, or ``None`` if it has not (yet).

        ``"stop"`` (Stop button, ``handle.stop()``: the run's result is kept), ``"interrupt"``
        (Jupyter's Interrupt: the cell raises, so work whose only use is the result, such as a
        final evaluation or an export, can be skipped), ``"failure"`` (another rank failed) or
        ``"pruned"`` (a sweep's pruner ended this trial, ``nbddp.sweep``: its result is not used).
        Looks afresh until a request came (use :meth:`should_stop` in a loop); local to this rank.
        """
        if self._stop_reason is None:
            _look_for_stop(self)
        return self._stop_reason

    def breakpoint(self, rank: int = 0) -> None:
        """Stop rank ``rank`` in ``pdb`` at the next line, with the prompt in the notebook; call it on every rank.

        The other ranks wait here (polling a file, not in a collective) until the debugger
        continues (``c``) or quits (``q``), however long that takes: no collective timeout and no
        stall report fires meanwhile. ``c`` lets every rank go on as if nothing happened; ``q``,
        Interrupt or Stop end the run (the cell raises ``TrainingInterrupted``). Where no one can
        answer (nbmake, a script, CI) it is skipped with a warning line, unless the launch said
        ``debug="always"``. Under a launcher other than ``spawn_train`` it is skipped.

        Example:
            >>> ctx.breakpoint(rank=1)     # rank 1 stops here; ranks 0, 2, ... wait for its `c`
        """
        self._breakpoints += 1
        debugger.breakpoint_at(self, rank, self._breakpoints, sys._getframe(1))

    def start_observing(self, observe: Optional[dict]) -> None:
        """Start what ``spawn_train(profile=..., trackers=...)`` asked for (after the process group)."""
        if not observe:
            return
        if observe.get("profile") is not None:
            from .profiling import start_profiler

            self._profiler = start_profiler(self.run_dir, self.rank, observe["profile"], self.device,
                                            by_optimizer=bool(observe.get("by_optimizer")))
        if observe.get("trackers") is not None:
            from .trackers import start_trackers

            self._trackers = start_trackers(self.run_dir, self.rank, observe["trackers"])

    def stop_observing(self, ok: bool) -> None:
        """The profile's last window and record; the trackers' last values, artifacts and end."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.close()
        trackers, self._trackers = self._trackers, None
        if trackers is not None:
            trackers.finish(ok)

    def close(self) -> None:
        self.stop_observing(ok=False)
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self._progress_file is not None:
            self._progress_file.close()


def json_value(v: Any) -> Any:
    """A metric as a JSON value: tensors become numbers or lists, unknown objects floats or text."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.detach().cpu().tolist()
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def to_device(obj: Any, device: Union[str, torch.device]) -> Any:
    """Move every tensor in a nested structure (dicts, lists, tuples) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items()) if type(obj) is not dict else {
            k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def to_cpu(obj: Any) -> Any:
    """Move every tensor in a nested structure to the CPU (the ranks' return values)."""
    return to_device(obj, "cpu")


def _checkpoints_on_disk(run_dir: Path) -> list:
    """The checkpoint files and sharded folders in ``run_dir`` now (none for a fresh run)."""
    folder = rundir.checkpoint_path(run_dir, rundir.LAST).parent
    try:
        return [folder / entry for entry in os.listdir(folder)]
    except OSError:
        return []


def _checkpoint_name(name: str) -> str:
    """A checkpoint name is a plain file name stem: ``last``, ``best``, ``step-1000``."""
    from ..contract.rundir import name_problem

    if name_problem(name):
        raise ValueError(f"checkpoint name {name!r}: {name_problem(name)}")
    return name


#: What torch says when a group is initialised a second time, and what nbddp says instead.
_SECOND_INIT = "trying to initialize the default process group twice"
_SECOND_INIT_FIX = (
    "the worker called torch.distributed.init_process_group, but nbddp had made the process group before "
    "calling it (call='ctx'). Launch it with call='torchrun' (called as fn(*args), its group from the "
    "environment, env://) or call='mp.spawn' (called as fn(rank, *args)), or drop the call and use ctx.")


def _error_record(exc: BaseException, ctx: Context, during_init: bool = False) -> ErrorRecord:
    """``exc`` (being handled) as ``ctx``'s rank's error record, classified cause or consequence."""
    record = ErrorRecord.from_exception(exc, ctx.rank, traceback.format_exc(), is_secondary(exc, during_init),
                                        epoch=ctx.epoch, step=ctx.step, retryable=is_retryable(exc))
    process = getattr(exc, "nbddp_process", None)  # set by nbddp.rank.spawned on torch's exception
    if isinstance(process, dict):  # a launcher script's: the process it started that failed is the error
        record.type, record.message, record.traceback = process["type"], process["message"], process["traceback"]
        record.process = {k: process[k] for k in ("name", "log", "pid")}
    if isinstance(exc, ValueError) and _SECOND_INIT in str(exc):
        record.message = _SECOND_INIT_FIX
    return record


def _interrupt_on_stop(ctx: Context, beat: HeartbeatThread) -> None:
    """Stop code that never asks ``ctx.should_stop()`` (a script, an mp.spawn or torchrun function):
    a stop request raises ``KeyboardInterrupt`` in its main thread, between two statements (or
    out of a blocking system call), as Ctrl-C would; the launcher's SIGTERM and SIGKILL follow
    for code that catches it or waits in a collective."""
    asked: list = []

    def raise_stop(signum, frame):
        # Only now has the code acted on the request: the next heartbeat says so, and the launcher
        # lets the rank finish. One waiting in C++ (its own rendezvous, a collective) never gets
        # here: its heartbeat does not say "stopping", and SIGINT, then SIGTERM, follow.
        ctx._stop_reason = asked[0] if asked else "interrupt"
        raise KeyboardInterrupt(f"nbddp: the notebook asked this run to stop ({ctx._stop_reason})")

    def on_stop(reason: str) -> None:
        asked.append(reason)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    signal.signal(signal.SIGINT, raise_stop)
    beat.poll_stop, beat.on_stop = (lambda: read_stop_request(ctx.run_dir)), on_stop


def _call_user_code(ctx: Context, target: Union[str, Callable[..., Any]], args: tuple, kwargs: dict, call: str,
                    argv: tuple, payload: Optional[bytes]) -> Any:
    """Run the user's code as it was written: a script as ``__main__``, a function by its convention."""
    if call == calls.SPAWNS:  # a launcher script: the processes it spawns are watched, not refused
        from .spawned import watch_spawns

        spawns = watch_spawns(ctx.run_dir, target)
    else:  # the ranks are the processes: an mp.spawn inside would double them
        spawns = calls.refuse_nested_spawn()
    with spawns:
        return _call_as_written(ctx, target, args, kwargs, call, argv, payload)


def _call_as_written(ctx: Context, target: Union[str, Callable[..., Any]], args: tuple, kwargs: dict, call: str,
                     argv: tuple, payload: Optional[bytes]) -> Any:
    if isinstance(target, str) and calls.is_script(target):
        try:
            calls.run_script(target, argv)
        except SystemExit as exc:
            if calls.exit_code(exc) != 0:
                raise
        return None
    if payload is not None:
        targets.from_source_in_user_folders()  # what the cell's function imports, as on disk now
        fn = cells.load(payload)
    else:
        fn = targets.load_target(target) if isinstance(target, str) else target
    # A function gets a command line of its own, not the kernel's (spawn hands the parent's
    # ``ipykernel_launcher.py -f ...`` down): argparse inside it then reads no arguments.
    from_file = isinstance(target, str) and payload is None
    sys.argv = [target.rpartition(":")[0] if from_file else getattr(fn, "__name__", "worker")]
    return calls.call_function(fn, call, ctx, args, kwargs)


def _group_starter(spec: LaunchSpec, rank: int, device: torch.device) -> Callable[[], None]:
    """What joins nbddp's own process group for this rank (run inside run_rank's error handling)."""

    def init_process_group():
        from .dist import init_process_group as init_group

        if device.type == "cuda":
            torch.cuda.set_device(device)  # CUDA_VISIBLE_DEVICES holds exactly the chosen GPUs
        if spec.store_path:  # a file in a folder only this user can open (nbddp.kernel.rendezvous)
            store = dist.FileStore(spec.store_path, spec.world_size)
            store.set_timeout(datetime.timedelta(seconds=spec.timeout_s))
        else:
            store = dist.TCPStore(spec.store_host, spec.store_port, spec.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=spec.timeout_s))
        # debug=True: a breakpoint() on one rank holds the others in their next collective for as
        # long as the prompt is open; the kernel's stall detector (paused at the prompt) guards hangs.
        timeout = max(spec.timeout_s, debugger.GROUP_TIMEOUT_S) if debugger.breakpoints_on() else spec.timeout_s
        init_group(spec.backend, store, rank, spec.world_size, timeout, device)

    return init_process_group


def entry(local_rank: int, spec: LaunchSpec, rank: Optional[int] = None) -> None:
    """Run one rank: set up, call the target, report, tear down. Never returns normally.

    ``rank``: the global rank where it differs from ``local_rank`` (a SLURM job over several nodes).
    """
    process.become_rank_process(spec)
    rank = local_rank if rank is None else rank  # single-machine launch: global rank == local rank
    process.run_rank_hook(rank)
    run_dir = Path(spec.run_dir)
    redirect_output(rundir.rank_log(run_dir, rank))
    try:  # the state folder the kernel made for this launch, opened once: never .nbddp found by name again
        statedir.pin(run_dir, spec.state_id)
    except OSError as exc:
        print(f"nbddp: rank {rank} cannot start: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    warnings.formatwarning = one_line_warning  # rank 0's log is echoed into the cell line by line
    process.stacks_on_signal(run_dir, rank)
    reaper.TreeRecorder(run_dir, rank).start()

    # torchrun's environment, for every kind of target: code written for torchrun reads it,
    # and env:// in code that makes its own group meets the kernel's store (its "agent store").
    # A launcher script (one that spawns its own processes) gets what `python script.py` gets:
    # no rank variables, only MASTER_ADDR/MASTER_PORT (a free port) for code that reads them.
    own_group = calls.makes_own_group(spec.call, spec.target)
    if spec.call != calls.SPAWNS:
        os.environ.update(calls.torchrun_environment(
            rank, spec.world_size, spec.store_host, spec.master_port or spec.store_port, run_id=run_dir.name,
            agent_store=own_group and spec.call != calls.MP_SPAWN, restart=int(os.environ.get(RESTART_ENV) or 0),
            max_restarts=int(os.environ.get(MAX_RESTARTS_ENV) or 0)))
    torch.set_num_threads(spec.threads)
    # No CUDA call here: device set-up runs inside run_rank's error handling, so "invalid
    # device ordinal" or "no NVIDIA driver" reach the notebook as this rank's error.
    device = torch.device("cuda", local_rank) if spec.backend == "nccl" else torch.device("cpu")
    ctx = Context(rank, local_rank, spec.world_size, device, spec.backend, run_dir)
    init_process_group = (lambda: None) if own_group else _group_starter(spec, rank, device)
    code, _ = run_rank(ctx, init_process_group, spec.target, spec.args,
                       spec.kwargs, watch=spec.kernel, all_values=spec.all_values, call=spec.call, argv=spec.argv,
                       payload=spec.payload, observe=spec.observe)
    # Nothing the rank started outlives it: a child in a session of its own, without the run's
    # marker, with stdio on /dev/null, forked from a thread or without a parent-death signal.
    reaper.end_descendants()
    # os._exit skips interpreter teardown: atexit hooks and non-daemon threads (DataLoader,
    # gloo) can deadlock there after the process group is gone; everything is flushed already.
    os._exit(code)


def run_rank(ctx: Context, init_process_group, target: Union[str, Callable[..., Any]], args: tuple, kwargs: dict,
             watch: Optional[tuple] = None, all_values: bool = False, call: str = calls.CTX, argv: tuple = (),
             payload: Optional[bytes] = None, observe: Optional[dict] = None) -> tuple:
    """Run one rank's target around heartbeats and error records; shared by every launcher.

    ``target`` is a spec (``"pkg.mod:fn"``, ``"/path/file.py:fn"``), loaded once the process
    group is up so that a worker file's import error is this rank's error record, or the
    function itself.

    Returns:
        ``(exit_code, value)``: 0 and the target's return value, or 1 and ``None`` after the
        error record (type, traceback, epoch, step) was written and the traceback printed.
    """
    beat = HeartbeatThread(HeartbeatWriter(ctx.run_dir, ctx.rank), ctx._heartbeat_record, watch=watch)
    ctx._beat = beat
    debugger.attach(ctx)  # breakpoint() reports "debugging" through the heartbeat
    beat.beat()
    beat.start()
    code, value = 0, None
    if calls.makes_own_group(call, target if isinstance(target, str) else ""):
        _interrupt_on_stop(ctx, beat)
    try:
        init_process_group()
        beat.state = "running"
        ctx.start_observing(observe)
        ctx._throughput_since = time.perf_counter()
        value = _call_user_code(ctx, target, args, kwargs, call, argv, payload)
        if ctx.rank == 0 or all_values:
            write_result(ctx.run_dir, to_cpu(value), ctx.rank)
        beat.state = "finishing"
        if dist.is_initialized():
            dist.destroy_process_group()
        ctx.stop_observing(ok=True)  # after the group: no rank waits for rank 0's trackers
        beat.state = "done"
    except BaseException as exc:  # noqa: BLE001 - every failure must become a record
        code = 1
        during_init = beat.state == "starting"
        beat.state = "failed"
        record = _error_record(exc, ctx, during_init=during_init)
        note = ctx._profiler.on_error(exc) if ctx._profiler is not None else None
        if note:
            record.message = f"{record.message}\n{note}"
        record.write(ctx.run_dir)
        if record.secondary or record.root_rank not in (None, ctx.rank):
            # A consequence of another rank's failure: one line here, so the notebook's echo of
            # this rank does not read as the cause. The full traceback is in the error record.
            print(f"rank {ctx.rank} stopped because another rank failed: {record.type}: {record.first_line}",
                  file=sys.stderr)
        elif isinstance(exc, ConfigError):  # nbddp's refusal: the notebook's error says it, once
            # Rank 0's log is echoed into the cell: one line there; the others keep the traceback.
            print(shown_traceback(record.traceback) if ctx.rank else "nbddp refused what the code does (ConfigError): the "
                  "notebook's error says why", file=sys.stderr)
        elif record.process is not None:  # its traceback is in its own log, echoed above it: said once
            print(f"nbddp: {record.process['name']} failed; the others were ended (its output: "
                  f"logs/{record.process['log']})", file=sys.stderr)
        elif not isinstance(exc, SystemExit):  # sys.exit(2) (argparse): its own words are the last lines
            print(shown_traceback(record.traceback), file=sys.stderr)  # from the code it ran on, as torchrun
    finally:
        ctx.close()
        beat.beat()
        sys.stdout.flush()
        sys.stderr.flush()
    return code, value

