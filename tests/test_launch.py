"""spawn_train with real processes: gloo on loopback, 2 ranks."""

import json
import os
import signal
import threading
import time

import pytest

from nbddp import ConfigError, TrainingInterrupted, WorkerError, spawn_train
from conftest import EXAMPLES, WORKERS, survivors, wait_for, worker_children

FAULTY = str(WORKERS / "faulty.py")


def test_linear_regression_learns_w_on_two_ranks(runs_dir):
    result = spawn_train(f"{EXAMPLES}/linear_regression.py:train", nprocs=2, kwargs={"steps": 500},
                         runs_dir=runs_dir, echo=False)
    w0, w1 = result.value["w_per_rank"]
    assert w0 == w1, "DDP replicas must stay identical"
    assert [v for (v,) in result.value["w"]] == pytest.approx([2.0, 3.0], abs=1e-3)
    assert result.world_size == 2 and result.backend == "gloo"
    # the run folder keeps logs of both ranks and rank 0's metrics
    assert (result.run_dir / "logs" / "rank0.log").read_text().count("step") >= 5
    assert (result.run_dir / "logs" / "rank1.log").exists()
    steps = [json.loads(l)["step"] for l in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 0 and steps[-1] == 499
    assert [m["step"] for m in result.metrics] == steps
    assert not worker_children()


def test_context_environment_and_restored_env(runs_dir):
    before = dict(os.environ)
    result = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, echo=False)
    v = result.value
    assert (v["rank"], v["local_rank"], v["world_size"], v["backend"], v["is_main"]) == (0, 0, 2, "gloo", True)
    assert v["device"] == "cpu"
    assert v["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert v["env"]["MASTER_ADDR"] == "127.0.0.1" and v["env"]["MASTER_PORT"] not in ("12355", "29500")
    assert v["env"]["WORLD_SIZE"] == "2" and v["env"]["RANK"] == "0"
    assert not v["modules_ipython"], "workers must not import IPython/ipykernel"
    assert v["tensor"].tolist() == [0, 1, 2]
    assert dict(os.environ) == before, "every variable nbddp sets must be restored"


def test_exception_on_rank_1_names_rank_1_and_leaves_nothing(runs_dir):
    t0 = time.time()
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{FAULTY}:raise_on", nprocs=2, kwargs={"rank": 1, "at_step": 3},
                    runs_dir=runs_dir, echo=False)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert err.step == 3 and err.epoch == 0
    msg = str(err)
    assert "rank 1 raised ValueError: boom on rank 1 at step 3" in msg
    assert "Traceback" in msg and "rank1.log" in msg
    assert err.log_path.name == "rank1.log" and "boom" in err.log_path.read_text()
    assert time.time() - t0 < 30, "the other rank must be stopped at once, not after a timeout"
    launch = json.loads((err.run_dir / ".nbddp" / "launch.json").read_text())
    assert survivors(launch["pids"]) == {}
    assert not worker_children()


@pytest.mark.parametrize("fn, kwargs, expected", [
    ("exit_code", {}, "exited with code 3"),
    ("kill_self", {}, "killed by SIGKILL"),
    # os._exit(0) mid-run: rank 0 then fails in the barrier ("Connection reset by peer"), secondary.
    ("exit_code", {"code": 0}, "rank 1 left without finishing: its process ended with exit code 0 before"),
])
def test_rank_dying_without_exception_is_named(runs_dir, fn, kwargs, expected):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{FAULTY}:{fn}", nprocs=2, runs_dir=runs_dir, echo=False, kwargs=kwargs)
    assert info.value.rank == 1
    assert expected in str(info.value)
    assert not worker_children()


def test_a_notebook_function_holding_an_open_file_is_refused_before_any_process(runs_dir, tmp_path):
    with open(tmp_path / "data.csv", "w") as handle:
        ns = {"__name__": "__main__", "handle": handle}
        exec("def train(ctx):\n    return handle.name\n", ns)
        with pytest.raises(ConfigError) as info:
            spawn_train(ns["train"], nprocs=2, runs_dir=runs_dir)
    assert "`handle` (a global that train uses) is an open file" in str(info.value)
    assert "pass its path and open it inside the function" in str(info.value)
    assert not runs_dir.exists(), "nothing may be created before the target is accepted"
    assert not worker_children()


def test_unpicklable_argument_refused_before_any_process(runs_dir):
    with pytest.raises(ConfigError, match=r"kwargs\['lock'\].*cannot be sent"):
        spawn_train(f"{FAULTY}:info", nprocs=2, kwargs={"lock": threading.Lock()}, runs_dir=runs_dir)
    assert not runs_dir.exists()


def test_bad_targets_are_explained(tmp_path, runs_dir):
    with pytest.raises(ConfigError, match="does not exist"):
        spawn_train(str(tmp_path / "nope.py") + ":train", runs_dir=runs_dir)
    (tmp_path / "w.py").write_text("def other(ctx):\n    pass\n")
    with pytest.raises(ConfigError, match="defines no top-level 'train'; it defines: other"):
        spawn_train(str(tmp_path / "w.py") + ":train", runs_dir=runs_dir)
    with pytest.raises(ConfigError, match="not of the form"):
        spawn_train("train", runs_dir=runs_dir)
    with pytest.raises(ConfigError, match="cannot be imported"):
        spawn_train("no_such_module_xyz:train", runs_dir=runs_dir)
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="`lock` .* synchronises the kernel's threads only"):
        spawn_train(lambda ctx: lock.locked(), runs_dir=runs_dir)


def test_interrupt_while_blocked_in_collective_leaves_nothing_and_relaunch_works(runs_dir):
    """Rank 0 waits in a barrier (C++), rank 1 sleeps (Python); the kernel gets SIGINT."""
    pids = []

    def interrupt_when_running():
        def running():
            found = sorted(runs_dir.glob("*/.nbddp/launch.json"))
            if not found:
                return False
            run = found[-1].parent
            ready = [(run / f"rank{r}.json") for r in range(2)]
            try:  # heartbeats are rewritten in place: a read may catch one half-written
                states = [json.loads(p.read_text())["state"] if p.exists() else None for p in ready]
            except ValueError:
                return False
            if states == ["running", "running"]:
                pids.extend(json.loads(found[-1].read_text())["pids"])
                return True
            return False

        if wait_for(running, timeout=60):
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupt_when_running, daemon=True)
    t.start()
    t0 = time.time()
    with pytest.raises(TrainingInterrupted, match="interrupted"):
        spawn_train(f"{FAULTY}:barrier_and_sleep", nprocs=2, runs_dir=runs_dir, echo=False, grace_s=1.0)
    elapsed = time.time() - t0
    t.join()
    assert len(pids) == 2
    assert survivors(pids) == {}, "no live or zombie worker may remain"
    assert not worker_children()
    assert elapsed < 30
    # the port is free and the machinery works at once
    again = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, echo=False)
    assert again.value["world_size"] == 2


def test_twice_in_a_row_sees_edits_to_the_worker_file(tmp_path, runs_dir):
    worker = tmp_path / "my_worker.py"
    worker.write_text("def train(ctx):\n    return 'first'\n")
    assert spawn_train(f"{worker}:train", nprocs=2, runs_dir=runs_dir, echo=False).value == "first"
    worker.write_text("def train(ctx):\n    return 'second'\n")
    assert spawn_train(f"{worker}:train", nprocs=2, runs_dir=runs_dir, echo=False).value == "second"


def test_background_handle_stop_leaves_nothing(runs_dir):
    h = spawn_train(f"{FAULTY}:barrier_and_sleep", nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False, grace_s=1.0)
    assert h.running
    assert wait_for(lambda: all((h.run_dir / ".nbddp" / f"rank{r}.json").exists() for r in range(2)), 60)
    h.stop()
    assert not h.running
    assert survivors(h.pids) == {}
    with pytest.raises(TrainingInterrupted, match="stopped"):
        h.wait()


def test_unpicklable_return_value_is_reported(runs_dir):
    with pytest.raises(WorkerError, match="cannot be pickled"):
        spawn_train(f"{FAULTY}:unpicklable_result", nprocs=2, runs_dir=runs_dir, echo=False)
