"""Process identity from /proc, so nbddp only ever signals the processes it started.

A pid alone can be reused by an unrelated process after ours exited; the pair (pid, start
time in clock ticks since boot) cannot. Launch records keep both, and ``cleanup`` checks both.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

from .runtime import STATE_DIR


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


def recorded_workers(run_dir: Union[str, Path]) -> Dict[int, Optional[int]]:
    """``{pid: start_time}`` of the workers a run folder's launch record names."""
    try:
        rec = json.loads((Path(run_dir) / STATE_DIR / "launch.json").read_text())
    except (OSError, ValueError):
        return {}
    starts = rec.get("start_times") or [None] * len(rec.get("pids", []))
    return dict(zip(rec.get("pids", []), starts))


def live_workers(run_dir: Union[str, Path]) -> List[int]:
    """The recorded workers of a run folder that are still running."""
    return [pid for pid, st in recorded_workers(run_dir).items() if is_same_process(pid, st)]


def cleanup(run_dir: Union[str, Path], grace_s: float = 3.0) -> List[int]:
    """End the workers an earlier launch of ``run_dir`` left running: SIGTERM, grace, SIGKILL.

    Only the pids recorded in the run's launch record, checked against their start time, are
    signalled: never processes matched by name.

    Returns:
        The pids that were running and were ended.

    Example:
        >>> nbddp.cleanup("runs/20250101-120000-digits")
        [41234, 41235]
    """
    pids = live_workers(run_dir)
    recorded = recorded_workers(run_dir)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if is_same_process(pid, recorded[pid]):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace_s
        while time.time() < deadline and any(is_same_process(p, recorded[p]) for p in pids):
            for p in pids:  # reap the ones that are our own children
                try:
                    os.waitpid(p, os.WNOHANG)
                except ChildProcessError:
                    pass
            time.sleep(0.05)
    return pids
