"""Warm starts (forkserver with torch preloaded) keep every guarantee of spawn."""

import json
import os
import signal
import socket
import threading
import time

import pytest

from nbddp import TrainingInterrupted, WorkerError, spawn_train
from conftest import EXAMPLES, WORKERS, survivors, wait_for, worker_children

FAULTY = str(WORKERS / "faulty.py")
WARM = dict(start_method="forkserver", echo=False)  # the default, spelled out


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_warm_regression_and_fast_relaunch(runs_dir):
    first = spawn_train(f"{EXAMPLES}/linear_regression.py:train", nprocs=2, runs_dir=runs_dir, **WARM)
    assert [v for (v,) in first.value["w"]] == pytest.approx([2.0, 3.0], abs=1e-3)
    again = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, **WARM)
    assert again.value["env"]["MASTER_PORT"] != first.value.get("port")  # fresh port per launch
    assert again.value["env"]["GLOO_SOCKET_IFNAME"] == "lo"  # the child got this launch's env


def test_warm_workers_see_the_environment_of_each_launch(runs_dir, monkeypatch):
    spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, **WARM)  # the server is running now
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # nbddp's own value must still win
    monkeypatch.setenv("NBDDP_TEST_MARKER", "set-after-the-server-started")
    env = spawn_train(f"{FAULTY}:env_var", "NBDDP_TEST_MARKER", nprocs=2, runs_dir=runs_dir, **WARM).value
    assert env == "set-after-the-server-started"


def test_warm_exception_names_the_rank(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{FAULTY}:raise_on", nprocs=2, kwargs={"rank": 1, "at_step": 2}, runs_dir=runs_dir, **WARM)
    assert info.value.rank == 1 and info.value.step == 2
    launch = json.loads((info.value.run_dir / ".nbddp" / "launch.json").read_text())
    assert survivors(launch["pids"]) == {}


def test_warm_interrupt_in_a_collective(runs_dir):
    pids = []

    def interrupt():
        # The rank files can appear before the launcher has written its launch record.
        if wait_for(lambda: len(list(runs_dir.glob("*/.nbddp/rank*.json"))) == 2
                    and list(runs_dir.glob("*/.nbddp/launch.json")), 60):
            pids.extend(json.loads(next(runs_dir.glob("*/.nbddp/launch.json")).read_text())["pids"])
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(TrainingInterrupted):
        spawn_train(f"{FAULTY}:barrier_and_sleep", nprocs=2, runs_dir=runs_dir, grace_s=1.0, **WARM)
    assert pids and wait_for(lambda: survivors(pids) == {}, 10)


@pytest.mark.parametrize("start_method, cycles", [("forkserver", 12), ("spawn", 3)])
def test_soak_short(tmp_path, start_method, cycles):
    """Launch/teardown cycles: no hang, no leaked process or port, no temp file left."""
    runs = tmp_path / "runs"
    for i in range(cycles):
        t0 = time.time()
        r = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs, echo=False, start_method=start_method)
        assert time.time() - t0 < 60, f"cycle {i} took too long"
        launch = json.loads((r.run_dir / ".nbddp" / "launch.json").read_text())
        assert survivors(launch["pids"]) == {}
        assert port_is_free(launch["port"])
    assert not worker_children()
    assert not [p for p in runs.rglob("*") if ".tmp" in p.name]
