"""Follow a local run that another process owns: a detached run's supervisor, or another kernel.

:class:`FollowedGroup` stands where :class:`nbddp.kernel.ranks.RankGroup` and
:class:`nbddp.kernel.slurm_group.SlurmGroup` stand, with their methods, so that the one
:class:`~nbddp.kernel.handle.RunHandle` reads the run folder for it as for them (rank 0's output,
the ``ctx.log`` line, metrics, progress, events). Only what a starter owns differs: a followed
run's owner watches its ranks (staged stop, restarts, hangs, reaping, leases), so the group has no
failure of its own to act on, asks the owner to stop instead of signalling (:func:`owners.ask`),
and ends with the outcome the owner kept (:func:`owners.outcome`).

:func:`attach` follows a run from its folder; :func:`runs` lists the user's live runs on this server.
"""

from __future__ import annotations

import contextlib
import html
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from ..contract import statedir
from ..contract.errors import ConfigError, NbddpError, RunAbandoned
from ..contract.protocol import Heartbeat, LaunchSpec, read_heartbeats, read_progress
from ..contract import rundir
from ..contract.system import is_same_process
from . import owners
from .report import RankEnd

#: How many of rank 0's last lines :func:`attach` shows before the live output.
TAIL_LINES = 20
#: How long :meth:`FollowedGroup.reap` waits for the owner's outcome after a kill was asked.
REAP_WAIT_S = 30.0


def _spec(run_dir: Path, record: dict) -> LaunchSpec:
    """The little of the launch a follower needs (world size, backend, how ranks were called)."""
    world = record.get("world_size")
    return LaunchSpec(target=str(record.get("target") or ""), args=(), kwargs={},
                      world_size=world if isinstance(world, int) and world > 0 else 1,
                      backend=str(record.get("backend") or "gloo"), gpus=tuple(record.get("gpus") or ()),
                      store_host="", store_port=None, run_dir=str(run_dir), parent_pid=None, threads=1,
                      timeout_s=0.0, call=str(record.get("call") or "ctx"), all_values=bool(record.get("all_values")))


class FollowedGroup:
    """A run's ranks as seen by a follower, with :class:`~nbddp.kernel.ranks.RankGroup`'s methods.

    Attributes:
        owner: the owner record (pid, start time, detached or not, what runs).
    """

    followed = True

    def __init__(self, run_dir: Path, record: dict):
        self.owner = record
        self.spec = _spec(run_dir, record)
        self.run_dir, self.world_size = Path(run_dir), self.spec.world_size
        launch = rundir.read_launch_record(run_dir)
        self.pids: List[int] = [p for p in launch.get("pids") or [] if isinstance(p, int)]
        self.ends: Dict[int, RankEnd] = {}
        started = record.get("started")
        self.started_at = float(started) if isinstance(started, (int, float)) else time.time()
        self.procs = self.server = self.tmp_dir = self.store = self.not_before = None
        self.closed = False
        # The owner is this very process (a kernel following its own run): its state folder stays its own.
        self.owner_here = record.get("pid") == os.getpid() and not record.get("detached")
        self._outcome: Any = None
        self._has_outcome = False
        self.notify: Optional[Callable[[str], None]] = None  # the handle's notice line (set by follow())
        self._restarts = len(launch.get("restarts") or [])  # the owner's restarts seen so far
        self._asked_restarts = 0.0

    # -- the owner ---------------------------------------------------------------------------
    def _look(self) -> bool:
        """True once the run has ended: the owner kept its outcome, or ended (or is gone) without one."""
        if not self._has_outcome:
            try:
                self._has_outcome, self._outcome = owners.outcome(self.run_dir)
            except Exception as exc:  # noqa: BLE001 - a record not the user's, or one that cannot be read
                self._has_outcome, self._outcome = True, exc
        if self._has_outcome or not owners.owner_alive(self.owner):
            return True
        with contextlib.suppress(OSError):
            self.owner = owners.owner_record(self.run_dir) or self.owner  # "ended" once the owner is done
        return bool(self.owner.get("ended"))

    @property
    def ended(self) -> bool:
        """The run has ended (its outcome kept or not), or its owner is gone."""
        return self._look()

    def outcome(self) -> Any:
        """The run's result or error, as its owner saw it."""
        if self._has_outcome:
            return self._outcome
        who = "supervisor" if self.owner.get("detached") else "kernel"
        if self.owner.get("ended"):
            return NbddpError(f"the run in {self.run_dir} ended before it was followed, and its {who} kept no "
                              f"result for followers; what it wrote is in the run folder (metrics.jsonl, logs/)")
        return RunAbandoned(
            f"the {who} that owned the run in {self.run_dir} (pid {self.owner.get('pid')}) ended without saying how "
            f"the run ended (killed?); its ranks ended with it. Its logs are in {rundir.logs_dir(self.run_dir)}; "
            "resume=True continues from the last checkpoint.", run_dir=self.run_dir)

    def ask_stop(self, reason: str) -> None:
        """A Stop (or Interrupt) of a followed run: its owner carries it out, as its own."""
        owners.ask(self.run_dir, "interrupt" if reason == "interrupt" else "stop")

    # -- the processes (the owner's) ---------------------------------------------------------
    def running(self) -> List[int]:
        return [r for r in range(self.world_size) if r not in self.ends]

    def _see_restarts(self, now: float) -> None:
        """Say each restart the owner made (it keeps them in the launch record), once a second at most."""
        if now - self._asked_restarts < 1.0:
            return
        self._asked_restarts = now
        restarts = rundir.read_launch_record(self.run_dir).get("restarts") or []
        for restart in restarts[self._restarts:]:
            if self.notify is not None and isinstance(restart, dict):
                self.notify(f"nbddp: the run restarted ({restart.get('number')}): {restart.get('cause')}")
        self._restarts = max(self._restarts, len(restarts))

    def see_exits(self, now: float, by_launcher: bool) -> None:
        self._see_restarts(now)
        if self.running() and self._look():
            code = 0 if self._has_outcome else -signal.SIGKILL
            for rank in self.running():
                self.ends[rank] = RankEnd(rank, 0, code, now, by_launcher)

    @property
    def all_ended(self) -> bool:
        return len(self.ends) == self.world_size

    def failed(self) -> List[RankEnd]:
        return []  # a failure is the owner's to act on; its outcome says it

    def signal(self, sig: int) -> None:
        if sig == signal.SIGKILL and not self.closed:
            owners.ask(self.run_dir, "kill")

    def reap(self) -> None:
        deadline = time.time() + REAP_WAIT_S
        while self.running() and time.time() < deadline:
            self.see_exits(time.time(), by_launcher=True)
            time.sleep(0.1)

    def kill_started(self) -> None:
        pass

    def beats(self) -> Dict[int, Heartbeat]:
        return {r: b for r, b in read_heartbeats(self.run_dir, self.world_size).items()
                if (b.beat_time or 0.0) >= self.started_at}

    def answering(self) -> Dict[int, int]:
        """``{rank: pid}`` of the ranks that can answer for their stack (``handle.stacks()``): the owner's
        launch record names them, each checked to be that very process (pid and start time)."""
        launch = rundir.read_launch_record(self.run_dir)
        pids, starts, beats = launch.get("pids") or [], launch.get("start_times") or [], self.beats()
        return {r: pid for r, (pid, start) in enumerate(zip(pids, starts))
                if r in beats and r in self.running() and isinstance(pid, int) and is_same_process(pid, start)}

    def error_files(self) -> List[Optional[str]]:
        return []

    def close(self) -> None:
        self.closed = True

    def close_store(self) -> None:
        pass

    def abandon(self) -> None:
        self.closed = True  # the run is its owner's: following it failed, the run goes on


def _tail_start(path: Path, lines: int) -> int:
    """The offset of the last ``lines`` complete lines of ``path`` (0 if it is shorter)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            back = min(size, 64 * 1024)
            f.seek(size - back)
            data = f.read(back)
    except OSError:
        return 0
    cut = len(data)
    for _ in range(lines + 1):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            return size - back if back < size else 0
    return size - back + cut + 1


def _checked_folder(run_dir: Union[str, "os.PathLike[str]"]) -> Path:
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"attach({str(run_dir)!r}): no such run folder; give the folder spawn_train printed "
                          "(handle.run_dir), or one nbddp.runs() lists")
    return run.absolute()


def attach(run_dir: Union[str, "os.PathLike[str]"], block: bool = False, echo: bool = True,
           on_event: Optional[Callable[[str, Any], None]] = None, grace_s: float = 10.0) -> Any:
    """Follow a run again from its folder: one on this server (detached, or another kernel's), or a SLURM job.

    Shows rank 0's last lines, then its live output; the handle gives the ``ctx.log`` values and
    progress (``handle.progress``, ``on_event``), ``stop()`` and ``wait()``. Any number of kernels may
    follow one run, and a Stop from any of them ends it (its owner carries it out: staged, the
    worker may save and return). Calling it again in the same kernel brings back a view the
    browser lost. An Interrupt while a cell waits on a followed run ends the wait, not the run.

    Args:
        run_dir: the run's folder (``handle.run_dir``, a folder ``nbddp.runs()`` lists).
        block: wait here for the run's end and return its :class:`~nbddp.TrainResult` (or raise its error).
        echo: show rank 0's output in the cell.
        on_event: called with ``(kind, payload)`` as the run goes (as ``spawn_train``'s).
        grace_s: a SLURM run's: how long the ranks get between the steps of a Stop.

    Returns:
        A :class:`~nbddp.RunHandle` (``block=False``), else the run's :class:`~nbddp.TrainResult`.

    Raises:
        ConfigError: the folder holds no run that can be followed (none of yours, or one that ended
            with the kernel that started it).
        NotPrivate: the run's state folder or records are not provably yours.

    Example:
        >>> h = nbddp.attach("runs/20260101-120000-mnist")   # after a kernel restart
        >>> h.wait().value
    """
    run = _checked_folder(run_dir)
    if statedir.pinned(run) is None:
        # The run folder resolved once, a link at its name refused, its state folder pinned: every
        # record below (owner, stop requests, the kept result) is read from this run's own folder,
        # whatever is renamed meanwhile. A run this process owns is pinned already: kept as it is.
        try:
            statedir.follow(run)
        except FileNotFoundError:
            pass  # no state folder: not a run of this server's; SLURM's attach says what it is
    record = owners.owner_record(run)
    if record is None:  # not a local run's folder: a SLURM job's (nbddp.kernel.slurm_attach)
        from .slurm_attach import attach as attach_job

        return attach_job(run, block=block, echo=echo, on_event=on_event, grace_s=grace_s)
    group = FollowedGroup(run, record)
    if group.ended and not group._has_outcome:
        how = ("ended, and kept no result for followers" if group.owner.get("ended") else
               f"ended with the kernel that started it (pid {record.get('pid')}); launch with "
               "spawn_train(..., detach=True) for a run that outlives its kernel")
        raise ConfigError(f"attach({str(run_dir)!r}): the run {how}. Its logs are in {rundir.logs_dir(run)}.")
    return follow(group, block=block, echo=echo, on_event=on_event,
                  log_start=_tail_start(rundir.rank_log(run, 0), TAIL_LINES))


def follow(group: FollowedGroup, block: bool = False, echo: bool = True,
           on_event: Optional[Callable[[str, Any], None]] = None, log_start: int = 0,
           notice: bool = True) -> Any:
    """A :class:`~nbddp.RunHandle` that follows ``group``'s run (in the background unless ``block``)."""
    from .handle import RunHandle

    owners.follow_marker(group.run_dir)
    handle = RunHandle(group, echo=echo, grace_s=1.0, log_starts={0: log_start}, debug="follow")
    group.notify = handle._notice
    if on_event is not None:
        handle.subscribe(on_event)
    if notice:
        who = (f"its supervisor, pid {group.owner.get('pid')}" if group.owner.get("detached")
               else f"kernel pid {group.owner.get('pid')}")
        handle._notice(f"nbddp: following the run in {group.run_dir} ({who}); handle.stop() ends it")
    if block:
        return handle.wait()
    handle.start_background()
    return handle


# ---------------------------------------------------------------------------- nbddp.runs()
class RunInfo:
    """One of your live runs on this server, as :func:`runs` lists it; ``attach()`` follows it.

    Attributes:
        name: the run's name (its folder's without the time).
        run_dir: the run folder.
        state: ``"running"``, or ``"stopping"`` once a Stop was asked (its ranks may be saving).
        epoch: rank 0's last reported epoch (``ctx.progress``), else None.
        step: rank 0's last reported step, else None.
        gpus: the GPUs it runs on (``[]``: CPU processes).
        started: when it started (seconds since the epoch).
        detached: owned by a supervisor of its own, not a kernel.
        pid: its owner's process id.
    """

    def __init__(self, run_dir: Path, record: dict, progress: dict, stopping: bool):
        self.run_dir, self.record = run_dir, record
        self.name = str(record.get("name") or run_dir.name)
        self.detached = bool(record.get("detached"))
        self.pid = record.get("pid")
        self.gpus = list(record.get("gpus") or [])
        self.world_size = record.get("world_size")
        self.started = record.get("started")
        self.epoch, self.step = progress.get("epoch"), progress.get("step")
        self.total = progress.get("total")
        self.state = "stopping" if stopping else "running"

    def attach(self, **kwargs: Any) -> Any:
        """Follow the run (:func:`attach`)."""
        return attach(self.run_dir, **kwargs)

    def stop(self, wait: bool = True, timeout: Optional[float] = None) -> None:
        """Ask the run's owner to stop it (staged, as a Stop button), and wait for its end."""
        owners.ask(self.run_dir, "stop")
        if wait:
            attach(self.run_dir, echo=False).stop(wait=True, timeout=timeout)

    def where(self) -> str:
        if self.epoch is None and self.step is None:
            return ""
        text = f"epoch {self.epoch}" if self.epoch is not None else ""
        if self.step is not None:
            text += (", " if text else "") + f"step {self.step}" + (f"/{self.total}" if self.total else "")
        return text

    def row(self) -> List[str]:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.started)) if self.started else ""
        where = ", ".join(map(str, self.gpus)) if self.gpus else f"{self.world_size} CPU"
        return [self.name, str(self.run_dir), self.state + (" (detached)" if self.detached else ""), self.where(),
                where, when]

    def __repr__(self) -> str:
        return f"RunInfo(name={self.name!r}, run_dir={str(self.run_dir)!r}, state={self.state!r}, " \
               f"detached={self.detached}, pid={self.pid})"


class RunList(list):
    """:func:`runs`' answer: a list of :class:`RunInfo`, shown as a table in a notebook."""

    HEADER = ["name", "folder", "state", "where", "GPUs", "started"]

    def table(self) -> str:
        rows = [self.HEADER] + [r.row() for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.HEADER))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)

    def _repr_html_(self) -> str:
        if not self:
            return "<p>No live runs of yours on this server.</p>"
        cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r.row()) + "</tr>" for r in self)
        head = "".join(f"<th>{h}</th>" for h in self.HEADER)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>"


def runs() -> RunList:
    """Your live runs on this server: detached ones, and those other kernels of yours own.

    Listed from a folder of yours alone (``<cache home>/nbddp/live``) and read through each run's
    private state folder, never found by looking through a runs folder: another user's runs never
    appear, nor a run folder someone planted. A table in a notebook; in Python a list of
    :class:`RunInfo` (``.attach()``, ``.stop()``).
    """
    out = RunList()
    for entry in owners.registered():
        run = Path(str(entry.get("run_dir") or ""))
        try:
            with statedir.opened(run) as state:
                if list(state.identity) != list(entry.get("state") or ()):
                    continue  # not the state folder the owner listed: the run folder was swapped
            record = owners.owner_record(run)
        except (OSError, ValueError):
            continue
        if record is None or (record.get("pid"), record.get("start")) != (entry.get("pid"), entry.get("start")):
            continue
        progress = read_progress(run)
        stopping = bool(record.get("stopping")) or owners.asked_stop(run)
        out.append(RunInfo(run, record, progress.fields if progress is not None else {}, stopping))
    return out


__all__ = ["FollowedGroup", "attach", "follow", "runs", "RunInfo", "RunList"]
