"""Run folders are never trained over, and ``resume=True`` continues the right one.

Launches under a launcher run ``python -m nbddp train`` for real (a one-rank torchrun environment
set by hand, and torchrun itself for its restarts); the runs that ``resume=True`` chooses from
are real run folders with real checkpoint, config and launch-record files.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from nbddp import ConfigError, TrainConfig
from nbddp.contract.checkpoint import atomic_save, load_checkpoint
from nbddp.tasks.classification import data_record
from nbddp.tasks.classification.data import scan_class_folders
from nbddp.tasks.classification.planning import find_resume_dir, preflight
from conftest import ROOT, free_port, launcher_env

PY = sys.executable


def one_rank(**extra):
    """The environment torchrun gives its only worker: this process is rank 0 of 1."""
    return launcher_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(free_port()), **extra)


def train_flags(tree, run_dir, epochs):
    return ["-m", "nbddp", "train", f"--data-path={tree}", "--model=resnet18", "--image-size=32", f"--epochs={epochs}",
            "--batch-size=4", "--gpus=", f"--run-dir={run_dir}"]


def run(args, env, timeout=240):
    return subprocess.run([PY, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_run_folder_with_checkpoints_is_not_trained_over(tree, tmp_path):
    run_dir = tmp_path / "exp"
    first = run(train_flags(tree, run_dir, 1), one_rank())
    assert first.returncode == 0, first.stdout + first.stderr
    last = run_dir / "checkpoints" / "last.pt"
    before = (last.read_bytes(), (run_dir / "metrics.jsonl").read_text())

    # The same command again: refused, nothing in the folder changed.
    again = run(train_flags(tree, run_dir, 1), one_rank())
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"{run_dir} already holds checkpoints" in again.stderr and "--resume true" in again.stderr
    assert "Traceback" not in again.stderr
    assert (last.read_bytes(), (run_dir / "metrics.jsonl").read_text()) == before

    # The flag the message names continues it (a launcher restart does too: test_cluster.py).
    resumed = run(train_flags(tree, run_dir, 2) + ["--resume=true"], one_rank())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert f"resumed from {last} at epoch 1" in (run_dir / "logs" / "rank0.log").read_text()


def test_torchrun_restarting_after_the_refusal_does_not_take_over_the_run(tree, tmp_path):
    run_dir = tmp_path / "exp"
    # An earlier run's checkpoint (refused before it is read, so any checkpoint file will do).
    atomic_save({"model": {}, "epoch": 0}, run_dir / "checkpoints" / "last.pt")
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    time.sleep(1.1)  # the launcher below starts after the checkpoint, on a whole-second clock too
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1",
           *train_flags(tree, run_dir, 2)]
    out = run(cmd, launcher_env())
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert text.count("already holds checkpoints") == 2, text  # the first attempt and the restart
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before


# ------------------------------------------------------------------ resume=True picks the run
def fake_run(runs_dir, folder, name, started=None, classes=("a", "b", "c"), model="resnet18", **config):
    """A run folder as spawn_train leaves it: config (``config``'s fields), launch record, last checkpoint."""
    run_dir = runs_dir / folder
    cfg = TrainConfig(model=model, name=name, runs_dir=str(runs_dir), **config)
    cfg.save(run_dir / "config.json")
    atomic_save({"model": {}, "epoch": 0, "config": cfg.to_dict(), "classes": list(classes)},
                run_dir / "checkpoints" / "last.pt")
    if started is not None:
        (run_dir / ".nbddp").mkdir()
        (run_dir / ".nbddp" / "launch.json").write_text(json.dumps({"started": started}))
    return run_dir


def test_resume_true_matches_the_exact_name_and_orders_by_recorded_start(tmp_path):
    runs = tmp_path / "runs"
    older = fake_run(runs, "20250101-120000-digits", "digits", started=1000.0)
    newest = fake_run(runs, "20250101-120000-digits-2", "digits", started=1000.5)  # same second: "-2"
    other = fake_run(runs, "20250101-130000-my-digits", "my-digits", started=5000.0)
    fake_run(runs, "20250101-140000-digits-2", "digits-2", started=6000.0)  # a run named digits-2
    # Folder times say nothing about which run started last (copies, exports, a later write).
    for i, folder in enumerate([newest, other, older]):
        os.utime(folder, (2e9 + i, 2e9 + i))
    cfg = TrainConfig(name="digits", model="resnet18", runs_dir=str(runs), resume=True)
    assert find_resume_dir(cfg) == newest.resolve()
    assert find_resume_dir(cfg.replace(name="my-digits")) == other.resolve()
    assert find_resume_dir(cfg.replace(name="digits-2")).name == "20250101-140000-digits-2"
    with pytest.raises(ConfigError, match="no run named 'digit' with a checkpoint"):
        find_resume_dir(cfg.replace(name="digit"))


def test_resume_true_without_launch_records_uses_config_time_then_folder_stamp(tmp_path):
    runs = tmp_path / "runs"
    a = fake_run(runs, "digits-77", "digits")  # a torchrun/srun run folder: no launch record
    b = fake_run(runs, "20250101-120000-digits", "digits")
    os.utime(a / "config.json", (3000.0, 3000.0))
    os.utime(b / "config.json", (2000.0, 2000.0))
    cfg = TrainConfig(name="digits", model="resnet18", runs_dir=str(runs), resume=True)
    assert find_resume_dir(cfg) == a.resolve()
    (a / "config.json").unlink()  # no config: the run counts by its folder's time stamp, never as another name
    (b / "config.json").unlink()
    assert find_resume_dir(cfg) == b.resolve()


def test_resume_refused_when_the_data_or_model_differ(tree, tmp_path):
    runs = tmp_path / "runs"
    cfg = TrainConfig(data_path=str(tree), model="resnet18", image_size=32, batch_size=4, name="d",
                      runs_dir=str(runs), resume=True)
    fake_run(runs, "20250101-120000-d", "d", started=1.0, classes=("a", "b", "c", "d"))
    with pytest.raises(ConfigError, match=r"(?s)cannot resume .*20250101-120000-d.*4 classes.*3 in .*missing.*'d'"):
        preflight(cfg)
    fake_run(runs, "20250101-120001-d", "d", started=2.0, classes=("a", "b", "x"))
    with pytest.raises(ConfigError, match=r"(?s)cannot resume .*missing.*'x'.*new.*'c'"):
        preflight(cfg)
    fake_run(runs, "20250101-120002-d", "d", started=3.0, model="resnet34")
    with pytest.raises(ConfigError, match=r"cannot resume .*trained 'resnet34'.*the config says 'resnet18'"):
        preflight(cfg)
    same = fake_run(runs, "20250101-120003-d", "d", started=4.0, data_path=str(tree), image_size=32, batch_size=4)
    # A run with no data record is refused as changed data; one that recorded these images resumes.
    with pytest.raises(ConfigError, match=r"cannot resume .*20250101-120003-d.*data record .*is missing"):
        preflight(cfg)
    classes, samples = scan_class_folders(tree)
    data_record.write(same, data_record.describe(str(tree), classes, samples, cfg.val_fraction, cfg.seed))
    assert preflight(cfg) == same.resolve()
    assert load_checkpoint(same / "checkpoints" / "last.pt")["classes"] == ["a", "b", "c"]
