"""Stop keeps the result: workers that obey the stop and keep beating are let finish."""

import os
import signal

import pytest

from nbddp import TrainingInterrupted, TrainResult, spawn_train
from conftest import WORKERS, survivors, wait_for

SLOW_STOP = f"{WORKERS / 'lifecycle.py'}:slow_stop"


def started(h) -> bool:
    return bool(h.progress) and all((h.run_dir / ".nbddp" / f"rank{r}.json").exists() for r in range(2))


def test_workers_finishing_after_a_stop_return_their_result(runs_dir):
    # 5 s of work after the stop, five times grace_s: the result still comes back.
    h = spawn_train(SLOW_STOP, nprocs=2, runs_dir=runs_dir, block=False, echo=False, grace_s=1.0,
                    kwargs={"after_stop_s": 5.0})
    assert wait_for(lambda: started(h), 60)
    h.stop()
    result = h.wait()
    assert isinstance(result, TrainResult) and result.stopped
    assert result.value["worked_after_stop_s"] == 5.0 and result.value["steps"] >= 1
    assert survivors(h.pids) == {}


def test_an_interrupt_lets_workers_that_keep_beating_finish_too(runs_dir):
    # 3 s of work after the request (a step and its checkpoint), three times grace_s: no SIGTERM.
    h = spawn_train(SLOW_STOP, nprocs=2, runs_dir=runs_dir, block=False, echo=False, grace_s=1.0,
                    kwargs={"after_stop_s": 3.0})
    assert wait_for(lambda: started(h), 60)
    with pytest.raises(TrainingInterrupted, match="interrupted"):
        h.end_interrupted()
    assert [e.exitcode for e in sorted(h._ends.values(), key=lambda e: e.rank)] == [0, 0]
    assert survivors(h.pids) == {}


@pytest.mark.parametrize("how", ["heartbeat stops", "stop_timeout_s"])
def test_workers_that_do_not_finish_are_ended(runs_dir, how):
    h = spawn_train(SLOW_STOP, nprocs=2, runs_dir=runs_dir, block=False, echo=False, grace_s=1.0,
                    kwargs={"after_stop_s": 600.0}, stop_timeout_s=600.0 if how == "heartbeat stops" else 3.0)
    assert wait_for(lambda: started(h), 60)
    h.stop(wait=False)
    if how == "heartbeat stops":
        # Wait until the stop was seen (the run is finishing), then freeze rank 1, heartbeat and all.
        assert wait_for(lambda: "stopping at step" in (h.run_dir / "logs" / "rank0.log").read_text(), 30)
        os.kill(h.pids[1], signal.SIGSTOP)
    with pytest.raises(TrainingInterrupted, match="stopped"):
        h.wait(timeout=120)  # the workers alone would take 600 s: the launcher ended them
    assert survivors(h.pids) == {}


def test_an_interrupt_in_the_middle_of_an_epoch_checkpoints_it_before_any_sigterm(tmp_path, runs_dir):
    from nbddp import TrainConfig
    from nbddp.contract import rundir
    from nbddp.contract.checkpoint import load_checkpoint
    from conftest import make_tree

    # 192 training images, 2 ranks, batch 2: 48 steps per epoch, far more than the steps
    # between the interrupt and the moment the workers see it.
    tree = make_tree(tmp_path / "data", per_class=80)
    cfg = TrainConfig(data_path=str(tree), model="mobilenet_v3_small", image_size=32, epochs=3, batch_size=2,
                      nprocs=2, runs_dir=str(runs_dir), name="interrupted")
    h = spawn_train(cfg, block=False, echo=False, grace_s=1.0)
    assert wait_for(lambda: h.progress.get("epoch") == 1 and h.progress.get("step", 0) >= 2, 180)
    with pytest.raises(TrainingInterrupted, match="interrupted"):
        h.end_interrupted()  # what Jupyter's Interrupt does in a cell waiting on the run
    log = rundir.rank_log(h.run_dir, 0).read_text()
    ck = load_checkpoint(rundir.checkpoint_path(h.run_dir))
    assert ck["epoch"] == 1 and 2 <= ck["step"] < 48, "the steps done in epoch 1, in the middle of it"
    assert f"checkpoint of epoch 2 step {ck['step']} written to" in log
    assert f"stop requested: leaving epoch 2 at step {ck['step']}" in log
    assert "interrupted: no final evaluation nor export" in log and not rundir.export_dir(h.run_dir).exists()
    assert [e.exitcode for e in sorted(h._ends.values(), key=lambda e: e.rank)] == [0, 0], "no SIGTERM was needed"
    assert survivors(h.pids) == {}
