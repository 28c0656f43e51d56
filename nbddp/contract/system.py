"""Facts about processes and this machine, shared by the kernel side and the workers.

A pid alone can be reused by an unrelated process after ours exited; the pair (pid, start
time in clock ticks since boot) cannot. Launch records keep both.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Dict, Optional


def cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity: taskset, cgroups), not all the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def start_time(pid: int) -> Optional[int]:
    """The process's start time (field 22 of /proc/<pid>/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def state(pid: int) -> Optional[str]:
    """'R', 'S', 'D', 'Z' (zombie)... or None when the pid does not exist."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        return None
    return None


def is_same_process(pid: int, started: Optional[int]) -> bool:
    """True if ``pid`` still is the process that was recorded (alive, not a zombie)."""
    now = start_time(pid)
    return now is not None and (started is None or now == started) and state(pid) not in (None, "Z", "X")


def kill_group_or_process(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid``'s process group if ``pid`` leads one (a rank and its DataLoader
    workers), else to ``pid`` alone; a process that is gone or not ours is no error."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def parent_pids() -> Dict[int, int]:
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
    parents = parent_pids()
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
