"""Process identity from /proc, so nbddp only ever signals the processes it started.

A pid alone can be reused by an unrelated process after ours exited; the pair (pid, start
time in clock ticks since boot) cannot. Launch records keep both, and ``cleanup`` checks both.

What the ranks start themselves (a ``subprocess.Popen`` in a worker, a data server) is found
the same way: every rank leads its own process group, and every process it starts inherits
the run's marker in its environment, even one that left the group for a session of its own
(``start_new_session=True``). :func:`end_leftovers` ends both once the ranks are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple, Union

from ..contract import rundir, statedir
from ..contract.system import is_same_process, start_time


#: Environment variable that marks a worker of a run: its value is the run folder.
MARKER_ENV = "NBDDP_RUN_DIR"


#: A run folder as a launch found it: (device, inode), whatever it is named or linked to later.
FolderId = Tuple[int, int]


def folder_id(run_dir: Union[str, Path]) -> Optional[FolderId]:
    """The run folder a launch uses, as (device, inode): the parent of the state folder the launch
    holds open (:mod:`nbddp.contract.statedir`), which a rename of the run folder, or a link put in
    place of its name, does not change; else the folder its name leads to now."""
    state = statedir.pinned(run_dir)
    try:
        st = os.stat("..", dir_fd=state.fd) if state is not None and state.fd is not None else os.stat(run_dir)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _is_folder(path: Union[str, Path], folder: FolderId) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == folder


def carries_marker(pid: int, run_dir: Union[str, Path], folder: Optional[FolderId] = None) -> bool:
    """True if process ``pid`` is marked as a worker of ``run_dir``.

    A spawned worker starts with ``NBDDP_RUN_DIR=<run_dir>`` in its environment (as
    /proc/<pid>/environ shows it). A worker forked from the warm server shows the server's
    environment there instead, so its other mark counts too: its output (fd 1) goes to
    ``<run_dir>/logs/rank<r>.log``, which no unrelated process has as its stdout.

    Args:
        folder: the run folder as its launch found it (:func:`folder_id`): a mark counts only if
            the folder it names is that very folder. Names are not compared: anyone who may write
            the runs folder may rename the run folder and put a link to another run's in its place,
            whose processes would then carry the name.

    Raises:
        PermissionError: ``pid`` belongs to another user, whose /proc entries are closed to us.
    """
    target = os.path.realpath(run_dir) if folder is None else None
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
            same = _is_folder(value, folder) if folder is not None else os.path.realpath(value) == target
            if same:
                return True
    try:
        out = Path(os.readlink(f"/proc/{pid}/fd/1"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    if folder is not None:  # the log's folder wherever it is now (a rename keeps the process's fd)
        return rundir.is_rank_log(out, out.parent.parent) and _is_folder(out.parent.parent, folder)
    return rundir.is_rank_log(out, target)


def _parent(pid: int) -> Optional[int]:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def marked_processes(run_dir: Union[str, Path], spare: Iterable[int] = (),
                     folder: Optional[FolderId] = None) -> Dict[int, Optional[int]]:
    """``{pid: start_time}`` of this user's live processes that carry ``run_dir``'s marker.

    Never the calling process, the pids in ``spare``, nor a direct child of either that
    ``spare`` does not name: a kernel's multiprocessing helpers (resource tracker, forkserver)
    may have been started while a launch's marker was in its environment, and they stay for
    the next launch. What a rank started is the rank's descendant, never a kernel's child.
    """
    spared = {os.getpid(), *spare}
    uid = os.getuid()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spared:
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid or _parent(pid) in spared:
                continue
            if carries_marker(pid, run_dir, folder):
                started = start_time(pid)
                if started is not None and is_same_process(pid, started):
                    found[pid] = started
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return found


def end_leftovers(run_dir: Union[str, Path], groups: Iterable[int] = (), spare: Iterable[int] = (),
                  grace_s: float = 1.0, folder: Optional[FolderId] = None) -> List[int]:
    """End what a run's ranks left behind once they are gone: SIGTERM, up to ``grace_s``, SIGKILL.

    That is every member of the ranks' process groups (``groups``: the ranks' pids, each rank
    leads its own group; see :func:`orphaned_group`) and every process
    of this user that carries the run's marker (see :func:`marked_processes`; ``folder``: the run
    folder as the launch found it, see :func:`carries_marker`).

    Returns:
        The marked pids that were found and ended (group members are ended without a list).
    """
    groups = [g for g in groups if orphaned_group(g)]
    marked = marked_processes(run_dir, spare, folder)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid, started in marked.items():
            if is_same_process(pid, started):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        if sig == signal.SIGKILL:
            break
        deadline = time.time() + grace_s
        while time.time() < deadline and (_any_member(groups) or any(
                is_same_process(p, st) for p, st in marked.items())):
            time.sleep(0.02)
        if not _any_member(groups) and not any(is_same_process(p, st) for p, st in marked.items()):
            break
    return list(marked)


def boot_ticks() -> int:
    """Now, in the unit of /proc's process start times (clock ticks since boot), rounded down
    as Linux rounds a start time: no process started from now on has an earlier start time."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK") // 1_000_000_000


def launch_ticks() -> int:
    """The start-time tick that divides "before this call" from "after it": every process started
    before the call has an earlier start time, none started after it has an earlier one.

    A start time is a whole tick (1/CLK_TCK s, 10 ms), so the tick now running may already hold a
    process started just before the call (a kernel warm from earlier launches starts its ranks a few
    milliseconds after a ``subprocess.Popen`` of the notebook's): :func:`boot_ticks` alone would count
    that process as started at the launch. So the call waits for the next tick to begin (one tick at
    most) and returns it."""
    now = boot_ticks()
    while boot_ticks() <= now:
        time.sleep(0.001)
    return now + 1


def end_recorded_tree(run_dir: Union[str, Path], ranks: Iterable[int], grace_s: float = 1.0,
                      not_before: Optional[int] = None) -> List[int]:
    """End what the ranks recorded as their descendants (:class:`nbddp.rank.reaper.TreeRecorder`) and
    is still running, once the ranks are gone: a rank killed by a signal could not end them itself.

    The records are read through the run's state folder the kernel holds open (no one else can
    write there, and a folder renamed into ``.nbddp``'s place is never read), checked, and removed.
    Even so a recorded process is signalled only while it is provably one a rank started: this
    user's, with the recorded start time (a reused pid has another), and started no earlier than
    the launch (``not_before``, :func:`launch_ticks` before the ranks started): the user's Jupyter
    server, another run, anything older than the ranks is never a rank's descendant. Returns the
    pids ended.
    """
    recorded: Dict[int, int] = {}
    for rank in ranks:
        name = rundir.tree_record_path(run_dir, rank).name
        try:
            tree = json.loads(statedir.read(run_dir, name))
        except (OSError, ValueError):
            continue  # none written (no child ever), or not ours to trust
        finally:
            with contextlib.suppress(OSError):
                statedir.unlink(run_dir, name)
        if isinstance(tree, dict):
            recorded.update({int(p): st for p, st in tree.items()
                             if p.isdigit() and isinstance(st, int) and not isinstance(st, bool)})
    alive = {p: st for p, st in recorded.items()
             if (not_before is None or st >= not_before) and p != os.getpid() and is_same_process(p, st) and _own(p)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in alive.items():
            if is_same_process(pid, started):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(is_same_process(p, st) for p, st in alive.items()):
            time.sleep(0.02)
    return list(alive)


def _own(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def orphaned_group(group: int) -> bool:
    """True when the process that led group ``group`` is gone (exited and reaped).

    Linux never gives a pid to a new process while a process group of that id has members, so
    the group's remaining members are then the leader's own: signalling the group reaches no
    one else. While a process with that pid exists (the leader, or a new process once the group
    emptied and the pid was reused), nothing is sent.
    """
    return not os.path.exists(f"/proc/{group}")


def _any_member(groups: List[int]) -> bool:
    for group in groups:
        try:
            os.killpg(group, 0)
            return True
        except (ProcessLookupError, PermissionError):
            pass
    return False


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
    """End the workers an earlier launch of ``run_dir`` left running, and what they started.

    SIGTERM, grace, SIGKILL: first to the workers, then to what they started (see
    :func:`end_leftovers`), a child in a session of its own included.

    Only processes that are provably workers of this run are signalled: a pid of the run's
    launch record whose start time matches the recorded one AND that carries the run's marker
    (see :func:`carries_marker`); never the calling process, never processes matched by name.
    A process of another user is reported with a warning, not signalled.

    Returns:
        The pids that were running and were ended (workers first, then what they started).

    Example:
        >>> nbddp.cleanup("runs/20250101-120000-digits")
        [41234, 41235]
    """
    try:
        rundir.read_launch_record(run_dir, strict=True)
    except rundir.NotPrivate as exc:
        warnings.warn(f"nbddp.cleanup({str(run_dir)!r}) ends nothing and removes nothing: {exc}", stacklevel=2)
        return []
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
    # What the ranks started: their groups' members, and marked processes in sessions of their own.
    # The launching kernel (alive or not) and its own helpers are spared.
    parent = rundir.read_launch_record(run_dir).get("parent_pid")
    spare = [parent] if isinstance(parent, int) else []
    leftovers = end_leftovers(run_dir, groups=pids, spare=spare + list(recorded), grace_s=grace_s)
    remove_left_temp_folder(run_dir)
    return pids + [p for p in leftovers if p not in pids]


def remove_left_temp_folder(run_dir: Union[str, Path]) -> bool:
    """Remove the launch's private temp folder (the ranks' ``TMPDIR``, with its rendezvous
    ``FileStore``) that a kernel killed before the run's end left behind; True if removed.

    Only a folder the user's own launch record names and that a launch of this very run folder
    made (:func:`nbddp.contract.rundir.is_tmp_of`): a record copied from, or planted to name, another
    run's folder removes nothing.
    """
    path = rundir.read_launch_record(run_dir).get("tmp_dir")
    if not isinstance(path, str) or not path or not rundir.is_tmp_of(path, run_dir):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)
