"""What a custom worker gets beyond a launch: TensorBoard from ctx.log, checkpoints and resume,
every rank's return value. Real processes, 2-3 gloo ranks."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nbddp import ConfigError, TrainConfig, spawn_train
from nbddp.contract import rundir
from conftest import WORKERS

RESUMABLE = str(WORKERS / "resumable.py")


def _scalars(run_dir):
    events = EventAccumulator(str(rundir.tensorboard_dir(run_dir)))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_checkpoint_resume_and_tensorboard_of_a_custom_worker(runs_dir):
    first = spawn_train(f"{RESUMABLE}:train", nprocs=2, kwargs={"stop_after": 2}, name="resumable",
                        runs_dir=runs_dir, echo=False)
    run_dir = first.run_dir
    assert first.value["start"] == 0 and first.value["w"].tolist() == [3.0, 3.0, 3.0]
    saved = torch.load(rundir.checkpoint_path(run_dir), weights_only=True)  # weights-only loadable
    assert saved["step"] == 2 and saved["tag"] == "step-2"

    # resume=True finds the newest run of that name with a checkpoint: the same folder
    second = spawn_train(f"{RESUMABLE}:train", nprocs=2, name="resumable", resume=True,
                         runs_dir=runs_dir, echo=False)
    assert second.run_dir == run_dir
    assert second.value["start"] == 3 and second.value["loaded_on"] == "cpu"
    assert second.value["w"].tolist() == [6.0, 6.0, 6.0]
    assert [m["step"] for m in second.metrics] == [0, 1, 2, 3, 4, 5]  # the run's whole history

    # every scalar of ctx.log, both launches, on the step axis; text stays out
    scalars = _scalars(run_dir)
    assert set(scalars) == {"loss", "w_sum"}
    assert [s for s, _ in scalars["loss"]] == [0, 1, 2, 3, 4, 5]
    assert [v for _, v in scalars["w_sum"]] == pytest.approx([3, 6, 9, 12, 15, 18])

    # an explicit folder works too, and a finished run simply has nothing left to do
    third = spawn_train(f"{RESUMABLE}:train", nprocs=1, resume=str(run_dir), runs_dir=runs_dir, echo=False)
    assert third.run_dir == run_dir and third.value["start"] == 6


def test_a_rank_that_starts_late_does_not_resume_from_the_checkpoint_rank_0_is_still_saving(runs_dir):
    """Rank 0 writes its first checkpoint before the others agree it is whole: a rank that only
    then looks for one to resume from must find none, as rank 0 did (else its steps, and so its
    collectives, no longer match rank 0's)."""
    result = spawn_train(f"{RESUMABLE}:train", nprocs=2, kwargs={"steps": 2, "late_rank": 1}, all_values=True,
                         runs_dir=runs_dir, echo=False)
    assert [v["start"] for v in result.values] == [0, 0]
    assert [v["w"].tolist() for v in result.values] == [[2.0, 2.0, 2.0]] * 2


def test_a_rank_that_resumes_late_does_not_load_the_checkpoint_rank_0_is_already_replacing(runs_dir):
    """On a resume, ``last.pt`` is on disk and loadable when the ranks start: rank 0 must not
    replace it with its next save while another rank has still to load it (that rank would start
    a step later, and its collectives no longer match rank 0's)."""
    first = spawn_train(f"{RESUMABLE}:train", nprocs=2, kwargs={"stop_after": 2}, name="late-resume",
                        runs_dir=runs_dir, echo=False)
    assert first.value["start"] == 0
    second = spawn_train(f"{RESUMABLE}:train", nprocs=2, kwargs={"late_rank": 1}, name="late-resume",
                         resume=True, all_values=True, runs_dir=runs_dir, echo=False)
    assert second.run_dir == first.run_dir
    assert [v["start"] for v in second.values] == [3, 3]
    assert [v["w"].tolist() for v in second.values] == [[6.0, 6.0, 6.0]] * 2


def test_every_ranks_value_and_epoch_axis(runs_dir):
    result = spawn_train(f"{RESUMABLE}:epochs_only", nprocs=3, all_values=True, runs_dir=runs_dir, echo=False)
    assert result.values == [0, 1, 2] and result.value == 0
    scalars = _scalars(result.run_dir)
    assert [s for s, _ in scalars["accuracy"]] == [0, 1, 2]
    assert [s for s, _ in scalars["throughput"]] == [3, 4]  # the record count when a record names no axis

    plain = spawn_train(f"{RESUMABLE}:train", nprocs=2, kwargs={"steps": 1}, runs_dir=runs_dir, echo=False)
    with pytest.raises(AttributeError, match="all_values=True"):
        plain.values
    assert plain.value["w"].device.type == "cpu"


def test_resume_is_checked_before_any_process_starts(runs_dir, tmp_path):
    with pytest.raises(ConfigError, match="no run named 'nothing-here' with a checkpoint"):
        spawn_train(f"{RESUMABLE}:train", nprocs=2, name="nothing-here", resume=True, runs_dir=runs_dir)
    with pytest.raises(ConfigError, match="no such run folder"):
        spawn_train(f"{RESUMABLE}:train", resume=str(tmp_path / "missing"), runs_dir=runs_dir)
    with pytest.raises(ConfigError, match="set resume in the config"):
        spawn_train(TrainConfig(data_path=str(tmp_path)), resume=True)
    assert not any(runs_dir.iterdir()) if runs_dir.exists() else True
