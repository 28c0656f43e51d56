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
import time
from typing import Dict, Optional

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux); True if it is one now."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _parents() -> Dict[int, int]:
    """``{pid: parent pid}`` of every process /proc shows (zombies included)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                found[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def descendants(pid: Optional[int] = None) -> Dict[int, int]:
    """``{pid: parent pid}`` of every descendant of ``pid`` (default: this process), zombies included."""
    root = os.getpid() if pid is None else pid
    parents = _parents()
    children: Dict[int, list] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child != root:
                found[child] = parents[child]
                todo.append(child)
    return found


def _reap_own_children() -> None:
    """Collect every child of this process that has exited (orphans re-parented here included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants(grace_s: float = 0.5, keep: Optional[set] = None) -> int:
    """SIGTERM every descendant of this process, up to ``grace_s``, then SIGKILL; reap them all.

    Meant for a subreaper at its end: an orphan of the tree re-parents here as its parent dies,
    and is reaped here, so no zombie is left either. ``keep``: pids (and their descendants) to
    leave alone. Returns how many descendants there were.
    """
    keep = keep or set()

    def targets() -> Dict[int, int]:
        found = descendants()
        spared = set(keep)
        for pid in keep:
            spared.update(descendants(pid))
        return {p: pp for p, pp in found.items() if p not in spared}

    first = targets()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while True:
            _reap_own_children()
            if not targets() or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not targets():
            break
    return len(first)
