"""Every process a rank starts ends with the run, however it hides: child subreapers.

A rank's own children can leave every trace nbddp otherwise follows: a new session
(``start_new_session=True``, ``setsid``), an empty environment (``env={}``: no run marker),
stdio on ``/dev/null`` (no rank log), a parent-death signal reset to 0, a fork from a thread,
a double fork that re-parents the daemon to init. What none of them can leave is the process
tree while an ancestor is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): an orphan
re-parents to the nearest subreaper above it instead of to init, so the subreaper's
descendants, read from ``/proc`` by parent pid, are everything it started.

Two subreapers, so that nothing escapes however the run ends:

* each rank is one (:func:`become_subreaper` at its start) and, at its end, ends and reaps all
  its descendants (:func:`end_descendants`) before it exits;
* each rank records its descendants in the run's state folder whenever they change
  (:class:`TreeRecorder`), and the kernel ends what is left of them once the rank has gone: a
  rank killed by a signal under ``start_method="spawn"`` leaves its orphans to init;
* the warm forkserver, which parents the ranks of ``start_method="forkserver"``, is one too
  (preloaded :mod:`nbddp.rank.forkserver_reaper`): what a rank killed by a signal left behind
  re-parents to it, and it ends and reaps all its descendants when it exits with the kernel.

A cgroup would find the same processes without a parent chain, but a notebook's user rarely
may create one (cgroup v2 delegation needs systemd or root); the subreaper is a prctl of an
unprivileged process, on every Linux since 3.4.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from ..contract.system import descendants, parent_pids

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux); True if it is one now."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _reap_own_children() -> None:
    """Collect every child of this process that has exited (orphans re-parented here included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants(grace_s: float = 0.5) -> int:
    """SIGTERM every descendant of this process, up to ``grace_s``, then SIGKILL; reap them all.
    ``grace_s=0`` sends SIGKILL at once.

    Meant for a subreaper at its end: an orphan of the tree re-parents here as its parent dies,
    and is reaped here, so no zombie is left either. The tree is read child by child
    (:func:`own_tree`), a walk of all /proc only where Linux cannot list children. Returns how
    many descendants there were.
    """
    def tree() -> set:
        found = own_tree()
        return set(descendants()) if found is None else set(found)

    first = left = tree()
    for sig in ((signal.SIGTERM, signal.SIGKILL) if grace_s > 0 else (signal.SIGKILL,)):
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while True:
            _reap_own_children()
            left = tree()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    _reap_own_children()
    return len(first)


def _children(pid: int) -> Optional[List[int]]:
    """Direct children of ``pid`` from ``/proc/<pid>/task/*/children`` (None where Linux lacks it)."""
    found: List[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            return None  # CONFIG_PROC_CHILDREN is off: no cheap way to list children
        except (OSError, ValueError):
            continue
    return found


def own_tree() -> Optional[Dict[int, int]]:
    """``{pid: start time}`` of this process's descendants, read child by child (not a walk of all
    /proc, so it is cheap enough to repeat every second); None where Linux cannot list children."""
    from ..contract.system import start_time

    found: Dict[int, int] = {}
    todo = [os.getpid()]
    while todo:
        kids = _children(todo.pop())
        if kids is None:
            return None
        for kid in kids:
            started = start_time(kid)
            if kid not in found and started is not None:
                found[kid] = started
                todo.append(kid)
    return found


class TreeRecorder(threading.Thread):
    """Writes this rank's descendants to its ``tree-rank<r>.json`` whenever they change (checked every
    ``interval`` s), through the run's state folder the rank holds open.

    A rank killed by a signal cannot end what it started; under spawn those re-parent to init.
    The kernel reads the record when the rank has gone and ends each process whose start time
    still matches (:func:`nbddp.kernel.procs.end_recorded_tree`).
    """

    def __init__(self, run_dir: Path, rank: int, interval: float = 1.0):
        super().__init__(name="nbddp-tree", daemon=True)
        self.run_dir, self.rank, self.interval, self._last = Path(run_dir), rank, interval, None

    def record(self) -> None:
        tree = own_tree()
        if tree is None or tree == self._last:
            return
        from ..contract import rundir, statedir

        statedir.write_json(self.run_dir, rundir.tree_record_path(self.run_dir, self.rank).name,
                            {str(p): st for p, st in tree.items()})
        self._last = tree

    def run(self) -> None:
        while True:
            try:
                self.record()
            except OSError:
                pass  # the run folder went away: nothing to record into
            time.sleep(self.interval)
