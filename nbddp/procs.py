"""Process identity from /proc, so nbddp only ever signals the processes it started.

A pid alone can be reused by an unrelated process after ours exited; the pair (pid, start
time in clock ticks since boot) cannot. Launch records keep both, and ``cleanup`` checks both.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Union

from . import rundir
from .system import is_same_process


#: Environment variable that marks a worker of a run: its value is the run folder.
MARKER_ENV = "NBDDP_RUN_DIR"


def carries_marker(pid: int, run_dir: Union[str, Path]) -> bool:
    """True if process ``pid`` is marked as a worker of ``run_dir``.

    A spawned worker starts with ``NBDDP_RUN_DIR=<run_dir>`` in its environment (as
    /proc/<pid>/environ shows it). A worker forked from the warm server shows the server's
    environment there instead, so its other mark counts too: its output (fd 1) goes to
    ``<run_dir>/logs/rank<r>.log``, which no unrelated process has as its stdout.

    Raises:
        PermissionError: ``pid`` belongs to another user, whose /proc entries are closed to us.
    """
    target = os.path.realpath(run_dir)
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    prefix = MARKER_ENV.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            value = os.fsdecode(item[len(prefix):])
            if not os.path.isabs(value):  # relative to the worker's own working folder
                value = os.path.join(os.readlink(f"/proc/{pid}/cwd"), value)
            if os.path.realpath(value) == target:
                return True
    try:
        out = Path(os.readlink(f"/proc/{pid}/fd/1"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return rundir.is_rank_log(out, target)


def recorded_workers(run_dir: Union[str, Path]) -> Dict[int, Optional[int]]:
    """``{pid: start_time}`` of the workers a run folder's launch record names."""
    rec = rundir.read_launch_record(run_dir)
    pids = rec.get("pids") or []
    starts = rec.get("start_times") or [None] * len(pids)
    return {int(p): s for p, s in zip(pids, starts)}


def _owned(pid: int, started: Optional[int], run_dir: Union[str, Path]) -> bool:
    """Provably a live worker of ``run_dir``: same start time as recorded AND the run's marker.

    A pid alone, or a pid with its start time but no marker, is not proof: pids are reused,
    and a record may be old or hand-written. The calling process is never a worker of its own.

    Raises:
        PermissionError: the process belongs to another user.
    """
    if pid == os.getpid() or started is None or not is_same_process(pid, started):
        return False
    return carries_marker(pid, run_dir)


def live_workers(run_dir: Union[str, Path]) -> List[int]:
    """The recorded workers of a run folder that are still running and provably its own."""
    found = []
    for pid, started in recorded_workers(run_dir).items():
        try:
            if _owned(pid, started, run_dir):
                found.append(pid)
        except PermissionError:
            pass  # another user's process: not ours to wait for (cleanup reports it)
    return found


def _other_user(pid: int, run_dir: Union[str, Path]) -> str:
    return (f"pid {pid}, named in the launch record of {run_dir}, belongs to another user: nbddp "
            f"leaves it alone. If it is a stale worker of this run, ask its owner or an administrator "
            f"to end it (`sudo kill {pid}`).")


def cleanup(run_dir: Union[str, Path], grace_s: float = 3.0) -> List[int]:
    """End the workers an earlier launch of ``run_dir`` left running: SIGTERM, grace, SIGKILL.

    Only processes that are provably workers of this run are signalled: a pid of the run's
    launch record whose start time matches the recorded one AND that carries the run's marker
    (see :func:`carries_marker`); never the calling process, never processes matched by name.
    A process of another user is reported with a warning, not signalled.

    Returns:
        The pids that were running and were ended.

    Example:
        >>> nbddp.cleanup("runs/20250101-120000-digits")
        [41234, 41235]
    """
    recorded = recorded_workers(run_dir)
    pids = []
    for pid, started in recorded.items():
        try:
            if _owned(pid, started, run_dir):
                pids.append(pid)
        except PermissionError:
            warnings.warn(_other_user(pid, run_dir), stacklevel=2)
    unproven = [p for p, st in recorded.items() if st is None and p != os.getpid() and is_same_process(p, None)]
    if unproven:
        warnings.warn(
            f"the launch record of {run_dir} has no start times, so nbddp cannot prove that the "
            f"running pids {unproven} are its workers (pids are reused) and leaves them alone. "
            f"Check them with `ps -o pid,lstart,args -p {','.join(map(str, unproven))}`.", stacklevel=2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(pids):
            if is_same_process(pid, recorded[pid]):  # not reused since the check above
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    warnings.warn(_other_user(pid, run_dir), stacklevel=2)
                    pids.remove(pid)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(is_same_process(p, recorded[p]) for p in pids):
            for p in pids:  # reap the ones that are our own children
                try:
                    os.waitpid(p, os.WNOHANG)
                except ChildProcessError:
                    pass
            time.sleep(0.05)
    return pids
