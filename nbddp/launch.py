"""``spawn_train``: start one process per GPU (or N CPU processes) from a notebook, safely.

The kernel never blocks the workers' fate on itself: it starts them, then polls. Each poll
reads rank 0's new log lines, new metrics and every process's exit code. On failure, stop or
interrupt it runs a staged shutdown — stop request, SIGTERM, grace, SIGKILL — and reaps every
process, so no worker (live or zombie) and no port outlives the run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch.distributed as dist
import torch.multiprocessing as mp

from .config import TrainConfig
from .errors import ConfigError, TrainingInterrupted, WorkerError
from .gpus import check_gpu_ids
from .procs import live_workers, start_time
from .report import RankEnd, build_worker_error, collect
from .runtime import STATE_DIR, LaunchSpec, entry, state_path
from .targets import resolve_target

BUILTIN_TARGET = "nbddp.tasks.classification:train"


@dataclass
class TrainResult:
    """What a finished run gives back to the notebook.

    Attributes:
        value: what rank 0's worker function returned (tensors moved to the CPU).
        run_dir: the run's folder: config, logs, metrics, checkpoints, exported weights.
        metrics: the records rank 0 logged with ``ctx.log`` (one per epoch for the built-in worker).
        seconds: wall time from launch to the last process's exit.
        world_size: number of processes.
        backend: ``"nccl"`` or ``"gloo"``.
        stopped: True when the run ended early because ``stop()`` was asked and the worker obeyed.
    """

    value: Any
    run_dir: Path
    metrics: List[dict]
    seconds: float
    world_size: int
    backend: str
    stopped: bool = False

    @property
    def weights_path(self) -> Optional[Path]:
        """Exported weights of the best epoch (built-in worker), else ``None``."""
        v = self.value.get("weights_path") if isinstance(self.value, dict) else None
        return Path(v) if v else None

    def __repr__(self) -> str:
        return (f"TrainResult(run_dir={str(self.run_dir)!r}, world_size={self.world_size}, "
                f"backend={self.backend!r}, seconds={self.seconds:.1f}, metrics=[{len(self.metrics)} records], "
                f"stopped={self.stopped})")


class _LineTail:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> List[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]


def _free_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore owned by the kernel on a free loopback port (port 0: the OS picks)."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


@contextlib.contextmanager
def _patched_env(values: Dict[str, Optional[str]]):
    """Set environment variables for the children to inherit; restore them afterwards."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _bare_main():
    """Spawned children re-import the parent's ``__main__`` (pytest, a script, ipykernel).

    Workers load their function from a file, so they need none of it: a bare ``__main__``
    during the start keeps IPython out of the workers and saves a second of start-up.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


# What the forkserver imports once, so that forked workers start with it in memory: torch,
# the distributed stack, DDP (whose constructor otherwise imports torch._dynamo, 1-2 s) and
# nbddp's worker side. Never torch.cuda initialisation: the server only imports.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                       "torchvision", "nbddp.runtime", "nbddp.tasks.classification"]
_forkserver_ready = False


def _prepare_forkserver() -> None:
    global _forkserver_ready
    if not _forkserver_ready:
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
        _forkserver_ready = True


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _new_run_dir(runs_dir: Union[str, Path], name: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(runs_dir).resolve() / f"{stamp}-{name}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def _check_picklable(args: tuple, kwargs: dict) -> None:
    for label, obj in [(f"args[{i}]", a) for i, a in enumerate(args)] + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]:
        try:
            pickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(
                f"{label} ({type(obj).__name__}) cannot be sent to the worker processes: {exc}. "
                "Pass plain values (numbers, strings, paths, lists, dicts, CPU tensors) and build "
                "models, loaders and open files inside the worker function."
            ) from exc


class RunHandle:
    """A running (or finished) launch. ``spawn_train(..., block=False)`` returns one.

    Example:
        >>> h = spawn_train("my_worker.py:train", nprocs=2, block=False)
        >>> h.running, h.metrics[-1:]       # the notebook stays usable meanwhile
        >>> h.stop()                        # same guarantees as an interrupt
        >>> result = h.wait()
    """

    def __init__(self, ctx, spec: LaunchSpec, store, echo: bool, grace_s: float,
                 stall_timeout_s: Optional[float] = None):
        self._ctx, self.spec, self._store, self.echo, self.grace_s = ctx, spec, store, echo, grace_s
        self.stall_timeout_s = stall_timeout_s
        self._stall_checked = 0.0
        self.run_dir = Path(spec.run_dir)
        self.world_size = spec.world_size
        self.started_at = time.time()
        self.pids = [p.pid for p in ctx.processes]
        self.metrics: List[dict] = []
        self.progress: dict = {}
        self._ends: Dict[int, RankEnd] = {}
        self._log_tail = _LineTail(self.run_dir / "logs" / "rank0.log")
        self._metrics_tail = _LineTail(self.run_dir / "metrics.jsonl")
        self._listeners: List[Callable[[str, Any], None]] = []
        self._lock = threading.RLock()
        self._shutdown: Optional[dict] = None  # {"reason", "stage", "since"}
        self._outcome: Optional[Union[TrainResult, BaseException]] = None
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- public ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def subscribe(self, callback: Callable[[str, Any], None]) -> None:
        """Call ``callback(kind, payload)`` for ``"line"``, ``"metrics"``, ``"progress"`` and ``"end"``."""
        self._listeners.append(callback)

    def stop(self, wait: bool = True, timeout: Optional[float] = None) -> None:
        """Ask every worker to stop; escalate to SIGTERM, then SIGKILL after ``grace_s`` each."""
        with self._lock:
            self._begin_shutdown("stop")
        if wait:
            self._wait_done(timeout)

    def wait(self, timeout: Optional[float] = None) -> TrainResult:
        """Block until the run ends; return its ``TrainResult`` or raise its error."""
        self._wait_done(timeout)
        if not self._done.is_set():
            raise TimeoutError(f"the run in {self.run_dir} is still going after {timeout} s")
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    @property
    def outcome(self) -> Optional[Union[TrainResult, BaseException]]:
        """The result or the exception once the run has ended, else ``None``."""
        return self._outcome

    # -- monitoring --------------------------------------------------------------------
    def _start_background(self) -> None:
        def loop():
            while not self._done.is_set():
                self.poll()
                time.sleep(0.1)

        self._thread = threading.Thread(target=loop, name="nbddp-monitor", daemon=True)
        self._thread.start()

    def _wait_done(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.time() + timeout
        if self._thread is not None:
            try:
                self._done.wait(timeout)
            except KeyboardInterrupt:
                self._interrupted()  # Interrupt while waiting on a background run stops it too
            return
        try:
            while not self._done.is_set():
                self.poll()
                if deadline is not None and time.time() > deadline:
                    return
                time.sleep(0.05)
        except KeyboardInterrupt:
            self._interrupted()

    def _interrupted(self) -> None:
        """Jupyter's Interrupt (or Ctrl-C) arrived in the kernel: stop everything, then raise."""
        with self._lock:
            self._begin_shutdown("interrupt")
        try:
            while not self._done.is_set():
                self.poll()
                time.sleep(0.05)
        except KeyboardInterrupt:
            # A second interrupt: no more grace.
            self._kill_all(signal.SIGKILL)
            self._reap_all()
            self._finish()
        raise self._outcome

    def _emit(self, kind: str, payload: Any) -> None:
        for cb in list(self._listeners):
            try:
                cb(kind, payload)
            except Exception as exc:  # noqa: BLE001 - a broken display must not break training
                print(f"nbddp: listener failed: {exc!r}", file=sys.stderr)

    def poll(self) -> None:
        """One monitoring step: forward output, read metrics, check processes, shut down."""
        with self._lock:
            if self._done.is_set():
                return
            self._read_streams()
            now = time.time()
            for rank, p in enumerate(self._ctx.processes):
                if rank not in self._ends and p.exitcode is not None:  # exitcode reaps the child
                    self._ends[rank] = RankEnd(rank, p.pid, p.exitcode, now, self._shutdown is not None)
            failed = [e for e in self._ends.values() if e.exitcode != 0 and not e.by_launcher]
            if failed and self._shutdown is None:
                self._begin_shutdown("failure")
            if self._shutdown is None and self.stall_timeout_s and now - self._stall_checked >= 1.0:
                self._stall_checked = now
                if self._find_stalled_rank(now) is not None:
                    self._begin_shutdown("failure")
            if self._shutdown is not None:
                self._advance_shutdown(now)
            if len(self._ends) == self.world_size:
                self._reap_all()
                self._finish()

    def _find_stalled_rank(self, now: float) -> Optional[int]:
        """A rank behind the others whose progress stopped ``stall_timeout_s`` ago (a hang).

        Only a rank that lags can be hung: the ones ahead of it are waiting for it in a
        collective. Ranks all at the same point (a long evaluation, a checkpoint) never trip it.
        """
        records, beats = collect(self.run_dir, self.world_size)
        if records or len(beats) < self.world_size or any(b.get("state") != "running" for b in beats.values()):
            return None

        def where(b: dict) -> tuple:
            return (b.get("epoch") if b.get("epoch") is not None else -1,
                    b.get("step") if b.get("step") is not None else -1, bool(b.get("waiting")))

        lead = max(where(b) for b in beats.values())
        for rank, b in sorted(beats.items()):
            if where(b) < lead and now - b.get("progress_time", now) > self.stall_timeout_s:
                return rank
        return None

    def _read_streams(self) -> None:
        for line in self._log_tail.read():
            if self.echo:
                print(f"[rank0] {line}", flush=True)
            self._emit("line", line)
        for line in self._metrics_tail.read():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            self.metrics.append(rec)
            self._emit("metrics", rec)
        try:
            prog = json.loads(state_path(self.run_dir, "progress.json").read_text())
        except (OSError, ValueError):
            prog = None
        if prog and prog != self.progress:
            self.progress = prog
            self._emit("progress", prog)

    # -- staged shutdown ----------------------------------------------------------------
    def _begin_shutdown(self, reason: str) -> None:
        if self._shutdown is not None or self._done.is_set():
            return
        # On failure the peers are most likely blocked in a collective: no point asking nicely.
        stage = "term" if reason == "failure" else "ask"
        self._shutdown = {"reason": reason, "stage": stage, "since": time.time()}
        try:
            state_path(self.run_dir, "stop").write_text(reason)
        except OSError:
            pass
        if stage == "term":
            self._kill_all(signal.SIGTERM)

    def _advance_shutdown(self, now: float) -> None:
        sd = self._shutdown
        if now - sd["since"] < self.grace_s:
            return
        if sd["stage"] == "ask":
            sd.update(stage="term", since=now)
            self._kill_all(signal.SIGTERM)
        elif sd["stage"] == "term":
            sd.update(stage="kill", since=now)
            self._kill_all(signal.SIGKILL)

    def _kill_all(self, sig: int) -> None:
        for rank, p in enumerate(self._ctx.processes):
            if rank in self._ends or p.exitcode is not None:
                continue
            try:
                # Each worker leads its own process group (DataLoader workers included).
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, sig)
                else:
                    os.kill(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _reap_all(self) -> None:
        now = time.time()
        for rank, p in enumerate(self._ctx.processes):
            p.join(timeout=5)
            if p.exitcode is None:  # cannot happen after SIGKILL, but never leave one behind
                p.kill()
                p.join()
            if rank not in self._ends:
                self._ends[rank] = RankEnd(rank, p.pid, p.exitcode, now, True)

    def _finish(self) -> None:
        self._read_streams()
        seconds = time.time() - self.started_at
        reason = self._shutdown["reason"] if self._shutdown else None
        result_path = state_path(self.run_dir, "result.pkl")
        all_ok = all(e.exitcode == 0 for e in self._ends.values())
        if reason == "failure" or (not all_ok and reason is None):
            outcome: Union[TrainResult, BaseException] = build_worker_error(self.run_dir, self._ends, self.world_size)
        elif all_ok and result_path.exists() and reason != "interrupt":
            with open(result_path, "rb") as f:
                value = pickle.load(f)
            outcome = TrainResult(value, self.run_dir, self.metrics, seconds, self.world_size,
                                  self.spec.backend, stopped=reason is not None)
        else:
            # An interrupted cell always ends in an exception, even when the workers obeyed the
            # stop request and returned: the user asked the cell to stop.
            what = "interrupted" if reason == "interrupt" else "stopped"
            outcome = TrainingInterrupted(
                f"training {what}: all {self.world_size} workers were stopped and reaped. "
                f"Logs and the last checkpoint are kept in {self.run_dir}", run_dir=self.run_dir)
        self._outcome = outcome
        for p in self._ctx.processes:
            with contextlib.suppress(Exception):
                p.close()
        self._store = None  # closes the kernel-owned store and frees its port
        with contextlib.suppress(OSError):
            state_path(self.run_dir, "stop").unlink()
        self._update_launch_record(ended=time.time())
        self._done.set()
        self._emit("end", outcome)

    def _update_launch_record(self, **fields) -> None:
        path = self.run_dir / STATE_DIR / "launch.json"
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            rec = {}
        rec.update(fields)
        path.write_text(json.dumps(rec, indent=1))


def spawn_train(
    target: Union[str, Callable[..., Any], TrainConfig],
    *args: Any,
    nprocs: Optional[int] = None,
    gpus: Optional[Sequence[int]] = None,
    kwargs: Optional[dict] = None,
    block: bool = True,
    name: Optional[str] = None,
    runs_dir: Union[str, Path] = "runs",
    timeout_s: Optional[float] = None,
    threads_per_proc: Optional[int] = None,
    grace_s: float = 3.0,
    stall_timeout_s: Optional[float] = None,
    echo: bool = True,
    on_event: Optional[Callable[[str, Any], None]] = None,
    start_method: str = "spawn",
    env: Optional[Dict[str, str]] = None,
    _fault: Optional[str] = None,
) -> Union[TrainResult, RunHandle]:
    """Run a DDP worker function in one process per GPU (nccl) or ``nprocs`` CPU processes (gloo).

    Args:
        target: a ``TrainConfig`` (runs the built-in classification worker), or a worker
            function: ``"path/to/file.py:fn"``, ``"package.module:fn"`` or a function defined
            at module level in a file. It is called as ``fn(ctx, *args, **kwargs)`` after the
            process group is set up; ``ctx`` is a :class:`nbddp.runtime.Context`.
        *args: positional arguments for the worker function (must be picklable).
        nprocs: number of CPU processes (gloo). Defaults to 1 when ``gpus`` is not given.
        gpus: GPU ids (as in ``nvidia-smi``); rank r runs on ``gpus[r]`` with nccl.
        kwargs: keyword arguments for the worker function (must be picklable).
        block: wait for the end and return a ``TrainResult``; ``False`` returns a
            ``RunHandle`` at once and keeps the notebook usable.
        name: suffix of the run folder ``runs_dir/<time>-<name>``.
        runs_dir: folder that holds the run folders.
        timeout_s: process-group timeout: a collective that waits longer fails (default 120 s
            on CPU, 600 s on GPU).
        threads_per_proc: intra-op threads per rank (default: cores divided among the ranks).
        grace_s: seconds each shutdown stage waits (stop request, then SIGTERM, then SIGKILL).
        stall_timeout_s: a rank that lags behind the others without progress for this long is
            declared hung and the run is stopped, naming it (default: ``timeout_s``). Progress
            is what the worker reports through ``ctx.heartbeat``/``ctx.log``/``ctx.progress``.
        echo: print rank 0's output live, prefixed with ``[rank0]``.
        on_event: called as ``on_event(kind, payload)`` for every ``"line"``, ``"metrics"``,
            ``"progress"`` and ``"end"`` event (see :meth:`RunHandle.subscribe`).
        start_method: ``"spawn"`` (default: every worker a fresh interpreter) or
            ``"forkserver"`` (warm: workers fork from a server process that has torch and DDP
            preloaded, so relaunches start in a fraction of the time; the server is a fresh
            process too, so the kernel may still use CUDA).
        env: extra environment variables for the workers.

    Returns:
        A ``TrainResult`` (``block=True``) or a ``RunHandle`` (``block=False``).

    Raises:
        ConfigError: bad arguments, found before any process starts.
        WorkerError: a worker failed; names the root-cause rank, its traceback and log.
        TrainingInterrupted: the cell was interrupted; every worker was stopped and reaped.

    Example:
        >>> result = spawn_train("my_worker.py:train", nprocs=2, kwargs={"steps": 500})
        >>> result.value, result.run_dir
    """
    kwargs = dict(kwargs or {})
    if start_method not in ("spawn", "forkserver"):
        raise ConfigError(f"start_method={start_method!r}: use 'spawn' or 'forkserver' (fork breaks once the "
                          "kernel has used CUDA, so it is not offered)")
    config: Optional[TrainConfig] = None
    run_dir: Optional[Path] = None
    if isinstance(target, TrainConfig):
        from .tasks.classification import preflight

        config = target
        if args or kwargs:
            raise ConfigError("with a TrainConfig, put every setting in the config (no args/kwargs)")
        if nprocs is not None or gpus is not None:
            raise ConfigError("with a TrainConfig, set nprocs/gpus in the config: cfg.replace(gpus=[0, 1])")
        run_dir = preflight(config)  # data, weights, batch vs world size; resume folder if any
        spec_target, args, nprocs, gpus = BUILTIN_TARGET, (config,), config.nprocs, list(config.gpus)
        name, runs_dir = name or config.name, config.runs_dir
        timeout_s = timeout_s or config.timeout_s
    else:
        spec_target = resolve_target(target)
    _check_picklable(args, kwargs)

    gpus = list(gpus or [])
    if gpus and nprocs not in (None, len(gpus)):
        raise ConfigError(f"nprocs={nprocs} but gpus={gpus}: one process per GPU; drop nprocs")
    if gpus:
        check_gpu_ids(gpus)
    world = len(gpus) if gpus else (nprocs or 1)
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"nprocs={nprocs!r}: must be an integer >= 1")
    backend = "nccl" if gpus else "gloo"
    timeout_s = float(timeout_s or (600.0 if gpus else 120.0))
    threads = threads_per_proc or max(1, _cores() // world)

    if run_dir is None:
        run_dir = _new_run_dir(runs_dir, name or _default_name(spec_target))
    elif live_workers(run_dir):
        raise ConfigError(
            f"{run_dir} still has running workers from an earlier launch (pids {live_workers(run_dir)}); "
            f"they may hold its GPUs and checkpoints. End them with nbddp.cleanup({str(run_dir)!r}) "
            "and launch again.")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / STATE_DIR).mkdir(exist_ok=True)
    for stale in ("stop", "result.pkl", "progress.json", *[f"error.rank{r}.json" for r in range(world)]):
        with contextlib.suppress(OSError):
            state_path(run_dir, stale).unlink()
    if config is not None:
        config.save(run_dir / "config.json")

    store = _free_store(timeout_s)
    child_env: Dict[str, Optional[str]] = {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
    }
    if gpus:
        child_env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)))
    elif "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        child_env["GLOO_SOCKET_IFNAME"] = "lo"  # CPU ranks talk over loopback, not the LAN
    child_env.update(env or {})
    warm = start_method == "forkserver"
    spec = LaunchSpec(spec_target, tuple(args), kwargs, world, backend, tuple(gpus), "127.0.0.1",
                      store.port, str(run_dir), None if warm else os.getpid(), threads, timeout_s, _fault,
                      env={k: v for k, v in child_env.items() if v is not None})
    if warm:
        _prepare_forkserver()
    with _patched_env(child_env), _bare_main():
        ctx = mp.start_processes(entry, args=(spec,), nprocs=world, join=False, start_method=start_method)
    handle = RunHandle(ctx, spec, store, echo=echo, grace_s=grace_s,
                       stall_timeout_s=timeout_s if stall_timeout_s is None else stall_timeout_s)
    if on_event is not None:
        handle.subscribe(on_event)
    handle._update_launch_record(target=spec_target, world_size=world, backend=backend, gpus=gpus,
                                 pids=handle.pids, start_times=[start_time(p) for p in handle.pids],
                                 parent_pid=os.getpid(), port=store.port,
                                 host=socket.gethostname(), started=handle.started_at)
    if not block:
        handle._start_background()
        return handle
    return handle.wait()


def _default_name(spec: str) -> str:
    qual = spec.rpartition(":")[2]
    stem = Path(spec.rpartition(":")[0]).stem if spec.rpartition(":")[0].endswith(".py") else ""
    return "-".join(x for x in (stem, qual) if x) or "run"
