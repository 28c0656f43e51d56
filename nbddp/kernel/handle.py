"""``RunHandle``: watch a launched run from the kernel, stop it, and turn its end into a result.

The kernel never blocks the workers' fate on itself: it polls. Each poll reads rank 0's new
log lines, new metrics, progress and every process's exit code. On failure, stop or interrupt
it runs a staged shutdown — stop request, SIGTERM, grace, SIGKILL — and reaps every process,
so no worker (live or zombie) and no port outlives the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from ..contract.errors import NbddpError, RunAbandoned, TrainingInterrupted, WorkerError
from ..contract.conventions import MP_SPAWN, SPAWNS
from .report import RankEnd, build_worker_error, how_ranks_stopped
from .output import CellEcho, OutputTail
from .logline import LoggedValues
from ..contract import rundir, statedir
from ..contract.protocol import (LaunchSpec, clear_stop_request, has_result, read_checkpoint_note,
                                 read_error_records, read_progress, take_result, write_stop_request)
from .restarts import Restart, RestartPolicy
from .stacks import Stacks, collect as collect_stacks
from .shutdown import STOP_TIMEOUT_S, Shutdown, ranks_finishing
from .debugger import PromptRelay, open_prompt, serve_prompts, watch_breakpoints
from .stall import QuietWatch, check_progress
from .forkserver import server_death
from .ranks import RankGroup
from . import interrupt, refusals
from ..contract.system import start_time


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
        values: every rank's return value, in rank order (tensors on the CPU), when the run was
            launched with ``spawn_train(..., all_values=True)``.
        restarts: the restarts the run made on its way (``max_restarts``; :class:`nbddp.kernel.restarts.Restart`).
    """

    value: Any
    run_dir: Path
    metrics: List[dict]
    seconds: float
    world_size: int
    backend: str
    stopped: bool = False
    all_values: Optional[List[Any]] = field(default=None, repr=False)
    restarts: List[Restart] = field(default_factory=list)

    @property
    def values(self) -> List[Any]:
        """Every rank's return value, rank 0's first (``value`` is ``values[0]``).

        Collected only when asked for, since each rank pickles its value into the run folder:
        launch with ``spawn_train(..., all_values=True)``.
        """
        if self.all_values is None:
            raise AttributeError(
                "TrainResult.values: this run kept rank 0's return value only (result.value). Launch with "
                "spawn_train(..., all_values=True) to collect every rank's.")
        return self.all_values

    @property
    def best_accuracy(self) -> Optional[float]:
        """Best validation accuracy over the epochs (built-in worker), else ``None``."""
        return self.value.get("best_accuracy") if isinstance(self.value, dict) else None

    @property
    def weights_path(self) -> Optional[Path]:
        """Exported weights of the best epoch (built-in worker), else ``None``."""
        v = self.value.get("weights_path") if isinstance(self.value, dict) else None
        return Path(v) if v else None

    @property
    def profile(self):
        """Per rank, where the profiled steps' time went and who waits for whom
        (:class:`nbddp.kernel.profiles.ProfileSummary`), for a run launched with ``profile=``; else ``None``."""
        from .profiles import summarize

        return summarize(self.run_dir, self.world_size)

    @property
    def trackers(self) -> Dict[str, Dict[str, Any]]:
        """The tracker runs the run logged into (``trackers=``): ``{"mlflow": {"run_id": ..., "uri": ...}}``."""
        from ..contract.observe import read_tracker_ids

        return read_tracker_ids(self.run_dir)

    def __repr__(self) -> str:
        return (f"TrainResult(run_dir={str(self.run_dir)!r}, world_size={self.world_size}, "
                f"backend={self.backend!r}, seconds={self.seconds:.1f}, metrics=[{len(self.metrics)} records], "
                f"stopped={self.stopped}" + (f", restarts={len(self.restarts)}" if self.restarts else "") + ")")


@contextlib.contextmanager
def interrupts_held(notice: Optional[str] = None):
    """Turn SIGINT (Jupyter's Interrupt, Ctrl-C) into a flag for the body; the list says if one came.

    Only the main thread can set signal handlers (and only it gets KeyboardInterrupt); elsewhere
    the body runs as it is and the list stays empty. ``notice``: a line said at once when the first
    one comes (the body may take seconds: a cold start of the ranks), so the Interrupt is seen.
    """
    came: list = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return

    def hold(signum, frame):
        if notice is not None and not came:
            with contextlib.suppress(Exception):  # a write the handler cut into: the stop goes on unsaid
                print(notice, file=sys.stderr, flush=True)
        came.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


class _LineTail:
    """Reads the complete lines appended to a file since the last call (``metrics.jsonl``).

    Through one descriptor, taken once the file is a regular file of the user's with one name that
    no one else may write (:func:`nbddp.contract.rundir.read_own`): its records are the run's
    metrics and a sweep's objective, so a group member may neither write into it nor, once it is
    read, swap another file in its place.
    """

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""
        self._fd: Optional[int] = None

    def read(self) -> List[str]:
        if self._fd is None:
            self._fd = rundir.read_own(self.path)
            if self._fd is None:
                return []
        data = b""
        try:
            while True:
                chunk = os.pread(self._fd, 1 << 20, self.offset + len(data))
                if not chunk:
                    break
                data += chunk
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _newest_checkpoint(run_dir: Path) -> Optional[str]:
    """``checkpoints/<name>.pt`` most recently written in the run folder, or None."""
    paths = [rundir.checkpoints_dir(run_dir) / n for n in rundir.checkpoint_names(run_dir)]
    paths = [p for p in paths if p.exists()]  # a file, or the folder of a sharded checkpoint
    if not paths:
        return None
    newest = max(paths, key=lambda p: p.stat().st_mtime)
    return f"{newest.parent.name}/{newest.name}"


def _note_restarts(error: WorkerError, restarts: List[Restart], not_restarted: str) -> None:
    """Add the run's restarts, and why it was not restarted once more, to its final error."""
    error.restarts = list(restarts)
    lines = []
    if restarts:
        lines.append(f"The run was restarted {len(restarts)} time{'s' if len(restarts) > 1 else ''} before: "
                     + "; ".join(f"{r.number}. {r.cause}" for r in restarts))
    if not_restarted:
        lines.append(not_restarted[0].upper() + not_restarted[1:] + ".")
    if lines:  # under the headline and the rank's whereabouts, above the traceback
        text = str(error).split("\n")
        error.args = ("\n".join(text[:2] + ["  " + line for line in lines] + text[2:]),)



def _open_store_port(spec: LaunchSpec) -> Optional[int]:
    """The port of the TCP store every local user can reach where this launch's ranks meet: the
    kernel's (``env://``), or the one an mp.spawn function's rank 0 hosts; None for a private store."""
    return spec.store_port or (spec.master_port if spec.call in (MP_SPAWN, SPAWNS) else None)


def _success(spec: LaunchSpec, metrics: List[dict], seconds: float, stopped: bool,
             restarts: List[Restart]) -> Union[TrainResult, BaseException]:
    """Every rank exited 0 unasked: a success, with or without a value. Code that ends its
    process itself (``os._exit(0)`` after training, common in scripts) returned nothing."""
    run_dir = Path(spec.run_dir)
    try:
        values = [take_result(run_dir, r) if has_result(run_dir, r) else None
                  for r in range(spec.world_size if spec.all_values else 1)]
    except rundir.NotPrivate as exc:  # never unpickled: the exception says which file and why
        return exc
    return TrainResult(values[0], run_dir, metrics, seconds, spec.world_size, spec.backend, stopped=stopped,
                       all_values=values if spec.all_values else None, restarts=list(restarts))


def _stopped(spec: LaunchSpec, reason: Optional[str], ends: Dict[int, RankEnd],
             stacks: Optional[Stacks] = None, beats: Optional[dict] = None) -> TrainingInterrupted:
    """A stopped run whose ranks did not all return: the notice an Interrupt gives (how, where, logs)."""
    run_dir = Path(spec.run_dir)
    what = "interrupted" if reason == "interrupt" else "stopped"
    records = read_error_records(run_dir, spec.world_size)
    request = "the interrupt" if reason == "interrupt" else "the stop request"
    return interrupt.interrupted(spec.world_size, run_dir, how_ranks_stopped(ends, records, request), stacks,
                                 _newest_checkpoint(run_dir), what=what, beats=beats)


def _forward_output(self: "RunHandle", final: bool = False) -> None:
    """Rank 0's new lines, metrics and progress: echoed in the cell (``echo``) and sent to the listeners."""
    for kind, text in (self._log_tail.rest() if final else self._log_tail.read()):
        if self.echo:
            self._echo.show(kind, text)
        self._emit(kind, text)  # "line", or "update": the current line rewritten (\r)
    logged = self._logged if self.echo and self._thread is None else None  # a cell that waits for the run
    for line in self._metrics_tail.read():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        self.metrics.append(rec)
        if logged is not None and isinstance(rec, dict):
            logged.add(rec)
        self._emit("metrics", rec)
    if self.echo:  # a few writes a second, each holding what arrived (Jupyter's rate limits)
        if logged is not None:
            self._echo.status(logged.text)  # ctx.log's values in one line under rank 0's output
        self._echo.close() if final else self._echo.flush()
    progress = read_progress(self.run_dir)
    prog = progress.as_dict() if progress is not None else None
    if prog and prog != self.progress:
        self.progress = prog
        self._emit("progress", prog)



def _interrupted_after_end(outcome: Union[TrainResult, BaseException]) -> BaseException:
    """The Interrupt came once the run had ended: its result is kept, the cell still stops."""
    if not isinstance(outcome, TrainResult):
        return outcome
    return interrupt.interrupted(outcome.world_size, outcome.run_dir, "", None, _newest_checkpoint(outcome.run_dir),
                                 result=outcome, ended_first=True)


def _look_before_interrupt(self: "RunHandle") -> None:
    """An Interrupt came to a running run: keep whether every rank had already returned, and where each is."""
    beats = self._ranks.beats()
    self._ended_first = len(beats) == self.world_size and all(
        b.state in ("finishing", "done") and not b.stopping for b in beats.values())
    pids = interrupt.ranks_to_ask(self._ranks.answering, len(self._ranks.running()))
    self._interrupt_stacks = collect_stacks(self.run_dir, pids, timeout=1.0) if pids else None
    self._interrupt_beats = {r: b for r, b in beats.items() if r not in (self._interrupt_stacks or {})}
    if self._interrupt_stacks:
        for r, stack in self._interrupt_stacks.items():  # a rank still starting is said to be, not placed in nbddp
            stack.state = beats[r].state if r in beats else None


def _outcome_of(self: "RunHandle", error: Optional[BaseException], not_restarted: str) -> Union[TrainResult, BaseException]:
    """The outcome of a run whose ranks have all ended: its result, its error, or how it was stopped."""
    seconds = time.time() - self.started_at
    reason = self._shutdown.reason if self._shutdown else None
    if hasattr(self._ranks, "outcome"):  # a followed run: its owner's outcome (nbddp.kernel.follow)
        return self._ranks.outcome()
    all_ok = all(e.exitcode == 0 for e in self._ends.values())
    if error is not None or reason == "failure" or (not all_ok and reason is None):
        outcome: Union[TrainResult, BaseException] = error or _worker_error(self)
        if isinstance(outcome, WorkerError):
            _note_restarts(outcome, self.restarts, not_restarted)
        return refusals.said_once(outcome, self.run_dir, self.world_size)  # a rank's refusal, once
    if all_ok and reason != "interrupt" and (has_result(self.run_dir) or reason is None):
        return _success(self.spec, self.metrics, seconds, reason is not None, self.restarts)
    if reason == "interrupt":  # the cell raises (the user asked it to stop); what every rank returned is kept
        returned = all_ok and has_result(self.run_dir)
        result = _success(self.spec, self.metrics, seconds, True, self.restarts) if returned else None
        if isinstance(result, BaseException):
            return result
        how = how_ranks_stopped(self._ends, read_error_records(self.run_dir, self.world_size), "the interrupt")
        return interrupt.interrupted(self.world_size, self.run_dir, how, self._interrupt_stacks,
                                     _newest_checkpoint(self.run_dir), result=result, beats=self._interrupt_beats,
                                     ended_first=result is not None and (self._ended_first or not any(
                                         b.stopping for b in self._ranks.beats().values())))  # none saw the request
    return _stopped(self.spec, reason, self._ends, self._interrupt_stacks, self._interrupt_beats)


def _worker_error(self: "RunHandle") -> WorkerError:
    """The run's one error, from what its ranks left (and a SLURM job's own output)."""
    error = build_worker_error(self.run_dir, self._ends, self.world_size, server_died=server_death(self._ranks.server),
                               stacks=self._failure_stacks, log_starts=self._log_starts,
                               store_port=_open_store_port(self.spec))
    explain = getattr(self._ranks, "explain", None)  # a SLURM job's own output (nbddp.kernel.slurm_group)
    return explain(error) if explain is not None else error


def _resumes_from(run_dir: Path) -> Optional[str]:
    """The checkpoint a restart would continue from, as the ranks noted it (else the newest file)."""
    note = read_checkpoint_note(run_dir)
    return note.where() if note is not None else _newest_checkpoint(run_dir)


# A watch that failed, the ranks a stop need not wait for, and the restarts: module functions
# beside RunHandle (as _outcome_of above), so that the class holds its public face and the poll.
def _abandon(self: "RunHandle", exc: BaseException) -> None:
    """Watching failed (run folder gone, disk unreadable): end every worker, end the run.

    A background run must always end, or ``running`` stays True and ``wait()`` never
    returns. The workers are killed and reaped; the outcome names what went wrong.
    """
    with self._lock:
        if self._done.is_set():
            return
        self._ranks.abandon()
        self._outcome = RunAbandoned(
            f"nbddp could not watch the run in {self.run_dir} ({type(exc).__name__}: {exc}); "
            f"all {self.world_size} workers were stopped and reaped. Check that the run folder "
            "still exists and is writable, then launch again.", run_dir=self.run_dir)
        self._outcome.__cause__ = exc
        self._release()
        if self._owner is not None:
            self._owner.end(self._outcome)
        if not getattr(self._ranks, "owner_here", False):  # a kernel following its own run keeps it
            statedir.release(self.run_dir)
        self._done.set()
    self._emit("end", self._outcome)


def _not_in_code(self: "RunHandle") -> set:
    """The running ranks that have nothing of the user's to finish or save: still starting
    (importing, meeting the others: a heartbeat not past ``starting``, which becomes ``running``
    once nbddp made the process group), or found meeting the others when the stop came (code that
    makes its own group, in C++ there: it would ignore a ``KeyboardInterrupt`` until the rendezvous
    times out)."""
    running, stacks = set(self._ranks.running()), self._interrupt_stacks or {}
    meeting = {r for r in running if r in stacks and stacks[r].meeting}
    in_code = {r for r in running if r in stacks and stacks[r].code_frame is not None} - meeting
    for _ in range(3):  # a heartbeat being rewritten reads as missing for a moment: look again
        beats = self._ranks.beats()  # (one says "starting" up to a second after the code began)
        starting = {r for r in running if r not in beats or beats[r].state == "starting"} - in_code
        if all(r in beats for r in running):
            break
        time.sleep(0.02)
    return starting | meeting


def _restart_or_finish(self: "RunHandle") -> None:
    """Every rank has ended: restart the run if its failure is one a restart heals, else finish."""
    reason = self._shutdown.reason if self._shutdown else None
    if reason not in ("failure", None) or all(e.exitcode == 0 for e in self._ends.values()):
        self._finish()
        return
    error = _worker_error(self)
    restart, why = (self._policy.next_restart(error, self.restarts, _resumes_from(self.run_dir))
                    if self._policy is not None else (None, ""))
    if restart is None:
        self._finish(error, why)
        return
    self._ranks.close()
    self.restarts.append(restart)
    rundir.update_launch_record(self.run_dir, restarts=[r.as_dict() for r in self.restarts])
    if self.echo:
        self._echo.close()
        print(restart.line(self.max_restarts), file=sys.stderr, flush=True)
    self._emit("restart", restart)
    self._shutdown = None  # that launch's; a Stop or an Interrupt during the back-off makes a new one
    self._restart_at = time.time() + restart.backoff_s


def _relaunch(self: "RunHandle") -> None:
    """Start the restart that waited for its back-off; a restart that cannot start ends the run."""
    restart = self.restarts[-1]
    self._log_starts = rundir.log_sizes(self.run_dir, self.world_size)  # the restart's own lines
    try:
        ranks = self._ranks.next(restart.number, restart.changes)
    except Exception as exc:  # noqa: BLE001 - the run must reach an end state
        self._restart_at = None
        error = NbddpError(f"restart {restart.number} of the run in {self.run_dir} could not start "
                           f"({type(exc).__name__}: {exc}); after: {restart.cause}")
        error.__cause__ = exc
        self._finish(error)
        return
    self._ranks = ranks
    self._shutdown, self._stall_checked, self._failure_stacks = None, 0.0, None
    self._quiet = QuietWatch(self.stall_timeout_s or 0.0, ranks.started_at)
    self._relay = PromptRelay(self.run_dir, self.world_size)
    self._restart_at = None
    spec = ranks.spec
    rundir.update_launch_record(
        self.run_dir, pids=self.pids, start_times=[start_time(p) for p in self.pids], store_path=spec.store_path,
        port=spec.store_port, tmp_dir=ranks.tmp_dir, restarts=[r.as_dict() for r in self.restarts])


class RunHandle:
    """A running (or finished) launch. ``spawn_train(..., block=False)`` returns one.

    Example:
        >>> h = spawn_train("my_worker.py:train", nprocs=2, block=False)
        >>> h.running, h.metrics[-1:]       # the notebook stays usable meanwhile
        >>> h.stop()                        # same guarantees as an interrupt
        >>> result = h.wait()
    """

    def __init__(self, ranks: RankGroup, echo: bool, grace_s: float,
                 stall_timeout_s: Optional[float] = None, stop_timeout_s: float = STOP_TIMEOUT_S,
                 leases=None, log_starts: Optional[Dict[int, int]] = None, restarts: Optional[RestartPolicy] = None,
                 debug: str = "prompt", show_logs: bool = True, records_before: int = 0):
        # ranks: this start of the ranks, which owns their processes, meeting point, temp folder
        # and error files (nbddp.kernel.ranks.RankGroup); a restart replaces it with the next.
        # leases: the run's GPU leases (nbddp.contract.leases.Leases), held until the run ends.
        # log_starts: each rank's log size before this launch (a resumed run appends to its logs):
        # the echo and the error quote only this launch's lines;
        # restarts: max_restarts and the launches a restart starts from (nbddp.kernel.restarts);
        # debug: what a breakpoint in a rank does: "prompt" (asked in a cell), "skip" (no one can
        # answer: continued, with a line) or "stop" (debug="always": it waits for a prompt);
        # show_logs: an echoed run that the cell waits for shows rank 0's ctx.log values in one line
        # (False for a worker that prints its records itself: the built-in one's epoch lines);
        # records_before: the lines of metrics.jsonl before this launch (a resumed run's), not shown there.
        self._ranks, self.echo, self.grace_s = ranks, echo, grace_s
        spec = ranks.spec
        self._leases = leases
        self.stop_timeout_s = stop_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._stall_checked = 0.0
        self.run_dir = Path(spec.run_dir)
        self.world_size = spec.world_size
        self.started_at = time.time()
        self._policy = restarts
        self.restarts: List[Restart] = []  # made so far (a restart is a new launch in the same folder)
        self._restart_at: Optional[float] = None  # a restart waits for its back-off until then
        self._quiet = QuietWatch(stall_timeout_s or 0.0, ranks.started_at)
        self._failure_stacks: Optional[Stacks] = None  # where the live ranks were when a failure stopped them
        self._interrupt_stacks: Optional[Stacks] = None  # ... and when an Interrupt came
        self._interrupt_beats: Dict[int, Any] = {}  # the heartbeats of ranks not asked for their stack then
        self._ended_first = False  # every rank had returned before the Interrupt reached it
        self.metrics: List[dict] = []
        self.progress: dict = {}
        self._log_starts = dict(log_starts or {})
        self._log_tail = OutputTail(rundir.rank_log(self.run_dir, 0), start=self._log_starts.get(0, 0))
        # A launcher script's own lines stand bare, as in a terminal; its processes' lines carry their rank.
        self._echo = CellEcho("" if spec.call == SPAWNS else "[rank0] ", log=rundir.rank_log(self.run_dir, 0))
        self._metrics_tail = _LineTail(rundir.metrics_path(self.run_dir))
        self._logged = LoggedValues(skip=records_before) if show_logs else None
        self._listeners: List[Callable[[str, Any], None]] = []
        self._lock = threading.RLock()
        self._shutdown: Optional[Shutdown] = None
        self._outcome: Optional[Union[TrainResult, BaseException]] = None
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.debug_mode = debug
        self._relay = PromptRelay(self.run_dir, self.world_size)
        self._debug_told = ""  # the last "waiting at a breakpoint" line said
        self._owner = None  # the run's owner records, for its followers (nbddp.kernel.owners.Ownership)

    # -- public ----------------------------------------------------------------------
    @property
    def spec(self) -> LaunchSpec:
        """What the ranks of the current start were started with."""
        return self._ranks.spec

    @property
    def pids(self) -> List[int]:
        """The process id of each rank of the current start, in rank order."""
        return self._ranks.pids

    _ends = property(lambda self: self._ranks.ends, doc="How each rank of the current start ended.")
    _procs = property(lambda self: self._ranks.procs, doc="torch's processes of the current start.")

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def followed(self) -> bool:
        """True when another process owns the run (a detached run's supervisor, another kernel) and this
        handle follows it (``nbddp.attach``): its Stop is asked of the owner, an Interrupt ends only a wait."""
        return bool(getattr(self._ranks, "followed", False))

    def stacks(self, timeout: float = 3.0) -> Stacks:
        """Where every running rank is now: each one's Python stacks (all threads), read from the ranks.

        Printed, it names per rank the innermost frame of the training code and the collective
        it waits in: ``rank 1 is in `load_batch` (my_worker.py:42); rank 0 is in `train`
        (my_worker.py:30), waiting in `all_reduce```. The full dumps stay in ``logs/rank<r>.stacks.log``.
        Works on a background run while it trains; a rank that does not answer within
        ``timeout`` seconds is left out.
        """
        with self._lock:
            if self._restart_at is not None or self._done.is_set():
                return Stacks()
            pids = self._ranks.answering()
        return collect_stacks(self.run_dir, pids, timeout)

    def _stacks_before_stopping(self) -> None:
        """A failure or a hang is about to stop the run: keep where every live rank is, for the error."""
        pids = self._ranks.answering()
        self._failure_stacks = collect_stacks(self.run_dir, pids, timeout=2.0) if pids else Stacks()

    @property
    def at_breakpoint(self) -> Optional[str]:
        """``"rank 1 is waiting at a breakpoint (my_worker.py:42); ..."`` while a rank waits at a prompt, else None."""
        return None if self._done.is_set() else self._relay.first_waiting_line()

    def debug(self, rank: Optional[int] = None) -> None:
        """Open the prompt of a rank waiting at a breakpoint in this cell (a background run's).

        Shows what pdb printed and asks for each command (``(Pdb) [rank 1]``) until the debugger
        continues (``c``: the run goes on, in the background again) or the run ends (``q`` or
        Interrupt end it, and this cell raises ``TrainingInterrupted``).

        Args:
            rank: the rank whose prompt to open; None: any rank at a prompt.
        """
        open_prompt(self, rank, interrupts_held)

    @property
    def max_restarts(self) -> int:
        """How many restarts the run may make (``spawn_train(max_restarts=)``); ``restarts`` lists those made."""
        return self._policy.max_restarts if self._policy is not None else 0

    def subscribe(self, callback: Callable[[str, Any], None]) -> None:
        """Call ``callback(kind, payload)`` for ``"line"``, ``"update"`` (rank 0 rewrote its current line
        with ``\r``: a progress bar), ``"metrics"``, ``"progress"``, ``"restart"`` (a
        :class:`nbddp.kernel.restarts.Restart`, before its back-off), ``"notice"`` (a line: no rank has made
        progress for long, and where each one is; see :mod:`nbddp.kernel.stall`), ``"breakpoint"`` (a background
        run's rank waits at a pdb prompt: the line saying where; ``""`` once the debugger let it go on) and ``"end"``."""
        self._listeners.append(callback)

    def stop(self, wait: bool = True, timeout: Optional[float] = None, reason: str = "stop") -> None:
        """Ask every worker to stop, and let the ones that keep working finish.

        Workers leave at their next step and may still evaluate, save and export: as long as
        their heartbeats go on (every second, even inside a collective) they are left alone, up
        to ``stop_timeout_s``. A worker whose heartbeat stops for ``grace_s + 2`` seconds, one
        still running after ``stop_timeout_s``, and a run in which no worker has asked
        ``ctx.should_stop()`` within ``grace_s`` get SIGTERM, then SIGKILL ``grace_s`` later.

        Args:
            wait: block until the run has ended.
            timeout: the longest to wait, in seconds.
            reason: what ``ctx.stop_reason()`` says in the ranks: ``"stop"``, ``"pruned"``
                (``nbddp.sweep``'s pruner; the run ends as a stopped run) or ``"interrupt"`` (as
                Jupyter's Interrupt: the outcome is ``TrainingInterrupted``).
        """
        if reason not in ("stop", "pruned", "interrupt"):
            raise ValueError(f"reason={reason!r}: use 'stop', 'pruned' or 'interrupt'")
        told = False
        with self._lock:
            if self._shutdown is None and not self._done.is_set() and reason != "pruned":
                # As an Interrupt: where each rank is, before the request moves it, and the rest of
                # rank 0's output (a KeyboardInterrupt's traceback among it) in its log, not the cell.
                _look_before_interrupt(self)
                told = reason == "stop" or self.echo  # a sweep stopping its trials has its own line
                if self.echo:
                    self._echo.close()
                    self.echo = False
            self._begin_shutdown(reason)
        if told:
            by = "Interrupt" if reason == "interrupt" else "Stop"
            print(interrupt.stopping_line(self.spec, self.run_dir, self.grace_s, by=by), file=sys.stderr, flush=True)
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
    def start_background(self) -> None:
        """Watch the run from a daemon thread (``spawn_train(block=False)``): the cell returns at once."""

        def loop():
            while not self._done.is_set():
                try:
                    self.poll()
                except Exception as exc:  # noqa: BLE001 - the run must reach an end state
                    _abandon(self, exc)
                    return
                time.sleep(0.1)

        self._thread = threading.Thread(target=loop, name="nbddp-monitor", daemon=True)
        self._thread.start()

    def _release(self) -> None:
        """Give back what the run held for its lifetime: its meeting point and its GPU leases."""
        self._ranks.close_store()
        if self._leases is not None:
            with contextlib.suppress(Exception):
                self._leases.release()
            self._leases = None

    def _wait_done(self, timeout: Optional[float]) -> None:
        # Jupyter's Interrupt (SIGINT) only sets a flag here, checked between polls: raised as
        # KeyboardInterrupt it could land inside a finaliser (a __del__ run by the garbage
        # collector in the middle of a poll), where Python drops it, and the run would go on.
        deadline = None if timeout is None else time.time() + timeout
        with interrupts_held() as came:
            while not self._done.is_set() and not came:
                if self._thread is not None:
                    self._done.wait(0.1)
                else:
                    try:
                        self.poll()
                    except Exception as exc:  # noqa: BLE001 - never return with workers left running
                        _abandon(self, exc)
                        return
                    if self.debug_mode in ("prompt", "stop") and not self._done.is_set() and self._relay.waiting():
                        serve_prompts(self, interrupted=came)  # a rank at a breakpoint: its prompt in this cell
                    time.sleep(0.05)
                if deadline is not None and time.time() > deadline:
                    break
        if came and self.followed:  # a followed run is its owner's: it goes on
            raise interrupt.StoppedWaiting(f"stopped waiting; the run in {self.run_dir} goes on (handle.stop() ends it)")
        if came:
            self.end_interrupted()  # an Interrupt while waiting on a background run stops it too

    def end_interrupted(self) -> None:
        """Jupyter's Interrupt (or Ctrl-C) arrived in the kernel: stop everything, then raise.

        The same staged stop as :meth:`stop`: workers that saw the request and keep beating may
        finish (the built-in worker its step and a checkpoint, then it exits); a second
        Interrupt ends them at once.
        """
        with self._lock:
            if self._thread is None:
                self.poll()  # a run that ended meanwhile ends as it did
            if self._done.is_set():
                raise _interrupted_after_end(self._outcome)
            _look_before_interrupt(self)  # where each rank is, before the request moves it
            self._begin_shutdown("interrupt")
            if self.echo:
                self._echo.close()  # what rank 0 printed before comes first; the rest stays in its log
                self.echo = False
        print(interrupt.stopping_line(self.spec, self.run_dir, self.grace_s), file=sys.stderr, flush=True)
        with interrupts_held() as again:
            while not self._done.is_set():
                if again:  # a second interrupt: no more grace
                    self.end_now()
                    break
                if self._thread is None:
                    self.poll()
                time.sleep(0.05)
        raise _interrupted_after_end(self._outcome) if isinstance(self._outcome, TrainResult) else self._outcome

    def end_now(self) -> None:
        """No more grace (a second Interrupt): SIGKILL every rank now, reap them, end the run."""
        with self._lock:
            if self._done.is_set():
                return
            if self._shutdown is not None:
                self._shutdown.kill_now(time.time())
            else:
                self._ranks.signal(signal.SIGKILL)
            self._ranks.reap()
            if not self._done.is_set():
                self._finish()

    def _emit(self, kind: str, payload: Any) -> None:
        for cb in list(self._listeners):
            try:
                cb(kind, payload)
            except Exception as exc:  # noqa: BLE001 - a broken display must not break training
                print(f"nbddp: listener failed: {exc!r}", file=sys.stderr)

    def _notice(self, line: str) -> None:
        """A line of nbddp's own under the cell's output (echoed runs) and a ``"notice"`` event."""
        if self.echo:
            self._echo.close()
            print(line, file=sys.stderr, flush=True)
        self._emit("notice", line)

    def poll(self) -> None:
        """One monitoring step: forward output, read metrics, check processes, shut down."""
        with self._lock:
            if self._done.is_set():
                return
            self._read_streams()
            now = time.time()
            asked = self._owner.asked(now) if self._owner is not None else None
            if asked == "kill":  # asked by a follower (nbddp.kernel.owners), as a second Interrupt here
                self.end_now()
                return
            if asked is not None:
                self._begin_shutdown(asked)
            if self._restart_at is None and self._shutdown is None:
                watch_breakpoints(self)
            if self._restart_at is not None:  # between two launches: no process runs
                if self._shutdown is not None:  # a Stop or an Interrupt is never retried
                    self._finish()
                elif now >= self._restart_at:
                    _relaunch(self)
                return
            self._ranks.see_exits(now, by_launcher=self._shutdown is not None)
            if self._ranks.failed() and self._shutdown is None:
                self._stacks_before_stopping()
                self._begin_shutdown("failure")
            if self._shutdown is None and self.stall_timeout_s and now - self._stall_checked >= 1.0:
                self._stall_checked = now
                check_progress(self, now)
            if self._shutdown is not None:
                self._shutdown.advance(now)
            if self._ranks.all_ended:
                self._ranks.reap()
                _restart_or_finish(self)

    _read_streams = _forward_output  # rank 0's lines, the metrics and the progress, to the cell and listeners

    # -- staged shutdown ----------------------------------------------------------------
    def _begin_shutdown(self, reason: str) -> None:
        if self._shutdown is not None or self._done.is_set():
            return
        if hasattr(self._ranks, "ask_stop"):  # a followed run: its owner stops it (nbddp.kernel.follow)
            self._ranks.ask_stop(reason)
            return
        write_stop_request(self.run_dir, reason)  # before any signal: ranks that obey may finish
        if self._owner is not None:
            self._owner.stopping(reason)  # for nbddp.runs()
        self._shutdown = Shutdown(reason, time.time(), self.grace_s, self.stop_timeout_s, kill=self._ranks.signal,
                                  finishing=self._finishing, writing=self._writing)
        if reason == "failure":
            return
        waiting = _not_in_code(self)
        if waiting and waiting >= set(self._ranks.running()):
            self._shutdown.end_starting(time.time())
        elif waiting and hasattr(self._ranks, "end_ranks"):
            self._ranks.end_ranks(waiting)  # the others may finish; these have nothing to

    def _finishing(self, now: float, since: float) -> bool:
        """True while the workers may still be finishing after the stop request (see :func:`ranks_finishing`)."""
        return ranks_finishing(now, since, self.grace_s, self._ranks.beats(), self._ranks.running())

    def _writing(self, now: float) -> bool:
        """True while a running rank writes a checkpoint in the background and its heartbeat is fresh."""
        running = set(self._ranks.running())
        return any(b.writing and r in running and now - (b.beat_time or 0.0) < self.grace_s + 2.0
                   for r, b in self._ranks.beats().items())

    def _finish(self, error: Optional[BaseException] = None, not_restarted: str = "") -> None:
        """End the run: its outcome (``error`` when already built), every resource given back.

        Args:
            not_restarted: why a run with ``max_restarts`` was not restarted after ``error``.
        """
        self._ranks.close()
        self._read_streams(final=True)
        self._metrics_tail.close()
        self._outcome = outcome = _outcome_of(self, error, not_restarted)
        self._restart_at = None
        self._release()  # the GPUs' leases given back
        if not getattr(self._ranks, "followed", False):  # the owner's records (a follower only reads them)
            clear_stop_request(self.run_dir)
            rundir.update_launch_record(self.run_dir, ended=time.time())
        if self._owner is not None:
            self._owner.end(outcome)  # kept for the run's followers, and the run off the user's live list
        if not getattr(self._ranks, "owner_here", False):  # a kernel following its own run keeps it
            statedir.release(self.run_dir, warn=True)  # the state folder held open since the launch
        self._done.set()
        self._emit("end", outcome)
