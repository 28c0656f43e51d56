"""An Interrupt early in a kernel's first launch, and a warm server that dies mid-run.

Jupyter's Interrupt (and Ctrl-C) sends SIGINT to the kernel's whole process group, the warm
server included. A server that took it while importing torch died, and the cell got an
``EOFError``; a server killed mid-run left every rank "exited with code 255 without a Python
exception". The server now starts with SIGINT blocked, and its death is named.
"""

import json
import os
import signal
import time

import pytest

from nbddp import WorkerError, spawn_train
from nbddp.kernel.forkserver import server_pid
from cold_launches import FAULTY, interrupt_a_cold_launch
from conftest import wait_for


@pytest.mark.parametrize("delay", [0.3, 2.0])
def test_an_interrupt_to_the_group_early_in_a_cold_launch_raises_training_interrupted(tmp_path, delay):
    """SIGINT to the launcher's whole group (as Jupyter sends it) ``delay`` s into its first launch,
    while the warm server starts and imports torch, and as it starts the ranks. ``bench/cold_interrupt.py``
    tries a finer grid of moments."""
    interrupt_a_cold_launch(tmp_path, delay, "forkserver")


@pytest.mark.parametrize("delay", [1.0])
def test_an_interrupt_while_spawned_ranks_start_reaches_none_of_them(tmp_path, delay):
    """Under ``start_method="spawn"`` a rank is in the kernel's process group until its first line
    moves it out, seconds later (it imports torch first): Jupyter's SIGINT to the group in that
    window must stop the launch, never raise in a starting rank and print its traceback."""
    out = interrupt_a_cold_launch(tmp_path, delay, "spawn")
    assert "Traceback" not in out and "KeyboardInterrupt\n" not in out, out


def test_a_server_killed_mid_run_is_named(runs_dir, tmp_path):
    handle = spawn_train(f"{FAULTY}:barrier_then_wait_for_file", str(tmp_path / "go"), nprocs=2,
                         runs_dir=runs_dir, echo=False, block=False, start_method="forkserver", grace_s=1)
    try:
        assert wait_for(lambda: all((handle.run_dir / "logs" / f"rank{r}.log").exists() for r in (0, 1)), 60)
        os.kill(server_pid(), signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"the launch server died \(signal 9\)"):
            handle.wait(timeout=60)
    finally:
        if handle.running:
            handle.stop()
    # The next launch starts a new server and runs.
    assert spawn_train(f"{FAULTY}:info", nprocs=1, runs_dir=runs_dir, echo=False).value is not None


def test_where_a_rank_was_says_only_what_it_reported(tmp_path):
    """A worker of one's own may report a step and no epoch: never "at epoch None"."""
    from nbddp.kernel.report import RankEnd, build_worker_error
    from nbddp.kernel.restarts import Restart

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / ".nbddp").mkdir()
    now = time.time()
    for r in (0, 1):
        (run / ".nbddp" / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "pid": 10 + r, "state": "running", "step": 7, "progress_time": now}))
    ends = {r: RankEnd(r, 10 + r, -signal.SIGKILL, now, False) for r in (0, 1)}
    text = str(build_worker_error(run, ends, 2, server_died="signal 9"))
    assert "the launch server died (signal 9)" in text and "after it reported step 7 ·" in text and "None" not in text
    assert "at step 7;" in Restart(1, "a cause", 0, None, 7).line(3)
