"""``spawn_train(..., profile=...)`` in a rank: torch.profiler on a schedule the worker's steps drive.

The worker writes no profiler code. The schedule (``torch.profiler.schedule``: wait, warmup,
active, repeat) advances on each new ``step`` the worker reports through ``ctx.log(step=...)`` or
``ctx.progress(step=...)``; for the built-in worker, on each optimizer step (a global optimizer
hook), so gradient accumulation's micro-batches do not count. Outside a window no profiler
exists: nbddp counts the wait steps itself and starts ``torch.profiler`` (warmup, then active
steps) when a window begins, and stops it once the window is saved.

Each window becomes a Chrome trace (``profile/rank<r>.pt.trace.json.gz``: Perfetto, TensorBoard's
profiler view) and adds to the rank's :class:`~nbddp.contract.observe.ProfileRecord`: where the
profiled steps' time went (communication, data loading, computation, idle) and the operators
that took most of it. The kernel puts every rank's record side by side (:mod:`nbddp.kernel.profiles`).
``profile/`` is the user's alone (0700) and every file goes through the folder held open
(:func:`~nbddp.contract.observe.open_profile_folder`): a link a group member puts at its name, or
in it, never takes a trace into a file of the user's elsewhere.

With ``memory=True`` (GPUs) the CUDA allocator's history is recorded from the start; an
out-of-memory error keeps its snapshot in the run folder and the error says how to open it.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..contract import rundir
from ..contract.observe import ProfileOptions, ProfileRecord, open_profile_folder

#: Names of the operators and kernels of a collective (gloo's and NCCL's, c10d's, DDP's).
COMM_WORDS = ("nccl", "gloo:", "c10d::", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
              "reducescatter", "broadcast", "barrier", "alltoall", "all_to_all", "record_param_comms")
#: Where a rank waits for its data loader.
DATA_WORDS = ("dataloader",)
MEMORY_VIZ = "https://pytorch.org/memory_viz"
#: Operators listed per rank.
TOP_OPS = 8


def category(name: str) -> str:
    """``"comm"``, ``"data"`` or ``"compute"``: what an operator or kernel named ``name`` spends time on."""
    low = name.lower()
    if any(w in low for w in COMM_WORDS):
        return "comm"
    if any(w in low for w in DATA_WORDS):
        return "data"
    return "compute"


class RankProfiler:
    """One rank's profiler, driven by the steps the worker reports (or its optimizer steps).

    Args:
        run_dir: the run folder (traces go to its ``profile/``).
        rank: this rank.
        options: the checked ``spawn_train(profile=...)``.
        device: the rank's device (a CUDA device adds GPU activity and, with ``memory``, the allocator history).
        by_optimizer: advance on optimizer steps (the built-in worker) instead of reported steps.
    """

    def __init__(self, run_dir: os.PathLike, rank: int, options: ProfileOptions, device: torch.device,
                 by_optimizer: bool = False):
        self.run_dir, self.rank, self.options, self.device = run_dir, rank, options, device
        self.by_optimizer = by_optimizer
        self.record = ProfileRecord(rank=rank, device=device.type)
        self._prof = None
        self._hook = None
        self._last_step: Any = None
        self._advanced = 0
        self._windows = 0
        self._ops: Dict[str, List[float]] = {}
        self._total = (options.wait + options.warmup + options.active) * options.repeat
        self._memory = options.memory and device.type == "cuda"
        self._folder = None  # profile/, held open from the first file written (open_profile_folder)

    def _in_folder(self, path: os.PathLike) -> str:
        """Where torch writes ``path`` (a file of ``profile/``): through the folder held open, never its name."""
        if self._folder is None:
            self._folder = open_profile_folder(self.run_dir)
        return f"/proc/self/fd/{self._folder.fd}/{os.path.basename(path)}"

    def start(self) -> None:
        """Start recording the allocator (``memory``); the profiler starts when its first window does."""
        if self._memory:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        # Kineto logs each window's start and stop (and, without a GPU, a failed device count) to
        # stderr, which rank 0 echoes into the cell; read when the profiler first starts.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        if self.options.wait == 0:
            self._open_window()
        if self.by_optimizer:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._hook = register_optimizer_step_post_hook(lambda opt, args, kwargs: self._advance())

    def reported(self, step: Any) -> None:
        """The worker reported ``step`` (``ctx.log`` / ``ctx.progress``): a new value advances the schedule."""
        if self.by_optimizer or step is None or step == self._last_step:
            return
        self._last_step = step
        self._advance()

    def _open_window(self) -> None:
        """A ``torch.profiler`` for one window (warmup, then active steps), started now.

        The wait steps are counted here rather than by torch's schedule: a step outside a
        window then costs a counter, not a ``prof.step()`` (about 35 us each on a CPU).
        """
        from torch.profiler import ProfilerActivity, profile, schedule

        o = self.options
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities, record_shapes=o.record_shapes, with_stack=o.with_stack,
                             schedule=schedule(wait=0, warmup=o.warmup, active=o.active, repeat=1),
                             on_trace_ready=self._ready)
        self._prof.start()

    def _advance(self) -> None:
        if self._advanced >= self._total:
            return
        self._advanced += 1
        o = self.options
        cycle = o.wait + o.warmup + o.active
        if self._prof is not None:
            self._prof.step()
            if self._advanced % cycle == 0:  # the window's last active step ended: its trace is saved
                self._stop_profiler()
        if self._prof is None and self._advanced < self._total and self._advanced % cycle == o.wait:
            self._open_window()
        if self._advanced >= self._total and self._hook is not None:  # every window saved: nothing left
            self._hook.remove()
            self._hook = None

    def _stop_profiler(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()  # a window cut short by the run's end is saved as far as it got

    def _ready(self, prof) -> None:
        """A window ended: its Chrome trace, and its time added to the record."""
        path = rundir.profile_trace_path(self.run_dir, self.rank, self._windows)
        self._windows += 1
        prof.export_chrome_trace(self._in_folder(path))
        self.record.traces.append(str(path.relative_to(self.run_dir)))
        parts = time_parts(prof.events())
        for key in ("steps", "wall_ms", "compute_ms", "comm_ms", "data_ms", "idle_ms"):
            setattr(self.record, key, getattr(self.record, key) + parts[key])
        self.record.device = parts["device"]
        for name, self_ms, calls in top_operators(prof, self.device.type == "cuda"):
            total = self._ops.setdefault(name, [0.0, 0])
            total[0] += self_ms
            total[1] += calls

    def on_error(self, exc: BaseException) -> Optional[str]:
        """For an out-of-memory error with ``memory``: the allocator's snapshot kept, and how to open it."""
        if not self._memory or not isinstance(exc, torch.cuda.OutOfMemoryError):
            return None
        path = rundir.memory_snapshot_path(self.run_dir, self.rank)
        try:
            torch.cuda.memory._dump_snapshot(self._in_folder(path))
        except Exception as dump_error:  # noqa: BLE001 - the OOM is the error to report
            return f"(the CUDA memory snapshot could not be written: {dump_error})"
        self.record.memory_snapshot = str(path.relative_to(self.run_dir))
        return (f"The CUDA allocator's history up to this error is in {path}: open {MEMORY_VIZ} and drop the "
                "file on the page to see every allocation, its size and the code that made it.")

    def close(self) -> None:
        """Stop (saving a window the run's end cut short) and write the record; never raises."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        try:
            self._stop_profiler()
        except Exception as exc:  # noqa: BLE001 - the run's own outcome matters more than its profile
            print(f"profiler: stopping failed: {exc}", flush=True)
        if self._memory:
            torch.cuda.memory._record_memory_history(enabled=None)
        ops = sorted(self._ops.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]
        self.record.top_ops = [{"name": n, "self_ms": round(ms, 3), "calls": int(c)} for n, (ms, c) in ops]
        for key in ("wall_ms", "compute_ms", "comm_ms", "data_ms", "idle_ms"):
            setattr(self.record, key, round(getattr(self.record, key), 3))
        try:
            self._in_folder(rundir.profile_summary_path(self.run_dir, self.rank))
            self.record.write(self._folder)
        except OSError as exc:  # NotPrivate too: another user kept replacing profile/
            print(f"profiler: the summary could not be written: {exc}", flush=True)
        finally:
            folder, self._folder = self._folder, None
            if folder is not None:
                folder.close()


def top_operators(prof, cuda: bool) -> List[Tuple[str, float, int]]:
    """``(name, self time ms, calls)`` of the window's operators, most time first (``key_averages``)."""
    out = []
    for avg in prof.key_averages():
        if avg.key.startswith("ProfilerStep"):
            continue
        us = avg.self_device_time_total if cuda and avg.self_device_time_total else avg.self_cpu_time_total
        out.append((avg.key, us / 1000.0, avg.count))
    return sorted(out, key=lambda t: -t[1])[:TOP_OPS * 2]


def time_parts(events) -> Dict[str, Any]:
    """Where the profiled steps' wall time went, from the window's events (any thread, any stream).

    A sweep over every event's start and end: inside a ``ProfilerStep`` span, a moment counts as
    communication if a collective is in flight, else data loading, else computation if any other
    operator runs, else idle. On a GPU the device's kernels decide (what the GPU does); on a CPU
    the operators do.
    """
    steps = [e for e in events if e.name.startswith("ProfilerStep")]  # "ProfilerStep*" in events(), "#<n>" in traces
    step_ids = {id(e) for e in steps}
    on_gpu = any(_is_device(e) for e in events)
    edges = []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if end <= start:
            continue
        if id(e) in step_ids:
            kind = "step"
        else:
            kind = category(e.name)
            if on_gpu and kind != "data" and not _is_device(e):
                continue  # the host's operators only launch the GPU's work
        edges += [(start, 1, kind), (end, -1, kind)]
    edges.sort(key=lambda t: (t[0], t[1]))
    counts = {"step": 0, "comm": 0, "data": 0, "compute": 0}
    spent = {"comm": 0.0, "data": 0.0, "compute": 0.0, "idle": 0.0}
    last = None
    for t, delta, kind in edges:
        if last is not None and counts["step"] > 0 and t > last:
            part = next((k for k in ("comm", "data", "compute") if counts[k] > 0), "idle")
            spent[part] += t - last
        counts[kind] += delta
        last = t
    wall = sum(spent.values())
    return {"steps": len(steps), "wall_ms": wall / 1000.0, "compute_ms": spent["compute"] / 1000.0,
            "comm_ms": spent["comm"] / 1000.0, "data_ms": spent["data"] / 1000.0, "idle_ms": spent["idle"] / 1000.0,
            "device": "cuda" if on_gpu else "cpu"}


def _is_device(event) -> bool:
    return getattr(getattr(event, "device_type", None), "name", "CPU") != "CPU"


def start_profiler(run_dir: os.PathLike, rank: int, options: Optional[ProfileOptions], device: torch.device,
                   by_optimizer: bool) -> Optional[RankProfiler]:
    """The rank's profiler, started, or ``None`` when this rank does not profile."""
    if options is None or not options.profiles(rank):
        return None
    profiler = RankProfiler(run_dir, rank, options, device, by_optimizer)
    profiler.start()
    return profiler


__all__ = ["RankProfiler", "start_profiler", "time_parts", "top_operators", "category", "MEMORY_VIZ"]
