"""A fresh launcher's first launch, and SIGINT to its whole process group a moment in, as Jupyter sends it.

Shared by tests/test_cold_interrupt.py (two moments for each start method) and
bench/cold_interrupt.py (a finer grid of moments): each launch must end as an Interrupt does and
leave no process of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from conftest import ROOT, WORKERS, wait_for
from test_shared_server import launch_workers

FAULTY = f"{WORKERS / 'faulty.py'}"

COLD_LAUNCH = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even when the suite runs under nohup or in a background job (SIGINT ignored from the start)
import sys, time
sys.path.insert(0, {root!r})
import nbddp, nbddp.kernel.launch  # torch is imported: the interrupt falls on the launch itself
print("launching", flush=True)
try:
    nbddp.spawn_train({target!r}, {go!r}, nprocs=2, runs_dir={runs!r}, echo=False, grace_s=1, start_method={method!r})
except BaseException as exc:
    print("ended with", type(exc).__name__, exc, flush=True)
print("alive", flush=True)
time.sleep(120)  # the kernel lives on after the interrupted cell
"""


def interrupt_a_cold_launch(tmp_path: Path, delay: float, method: str) -> str:
    """A fresh launcher's first launch (start method ``method``) and SIGINT to its whole group
    ``delay`` s in, as Jupyter sends it; checks it ended as an Interrupt must and left no worker.
    Returns what the launcher printed."""
    marker = uuid.uuid4().hex
    code = COLD_LAUNCH.format(root=str(ROOT), target=f"{FAULTY}:barrier_then_wait_for_file",
                               go=str(tmp_path / "go"), runs=str(tmp_path / "runs"), method=method)
    env = {**os.environ, "NBDDP_TEST_MARKER": marker, "NBDDP_PREWARM": "0"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline().startswith("launching")
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("alive"):
                break
        out = "".join(lines)
        assert "alive" in out, out
        ended = next(line for line in lines if line.startswith("ended with"))
        runs = tmp_path / "runs"
        assert ended.startswith("ended with TrainingInterrupted") or (
            ended.startswith("ended with KeyboardInterrupt") and not runs.exists()), out
        assert wait_for(lambda: not launch_workers(marker, proc.pid), timeout=10), (
            f"workers of the launch remain: {launch_workers(marker, proc.pid)}; output: {out}")
        return out
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
