"""Checkpoints in the middle of an epoch: a Stop, an Interrupt or a periodic checkpoint loses no step."""

import json

import pytest
import torch

from nbddp import ConfigError, TrainConfig, WorkerError, spawn_train
from nbddp.contract import rundir
from nbddp import cli
from nbddp.contract.checkpoint import load_checkpoint
from nbddp.contract.cluster import cli_flags
from conftest import fault_env
from test_classification import small_cfg


def test_checkpoint_every_s_is_validated_in_the_kernel_the_cli_and_config_json(tmp_path, capsys):
    assert TrainConfig().checkpoint_every_s == 600.0
    assert TrainConfig(checkpoint_every_s=0).checkpoint_every_s == 0
    for bad in (-1, float("nan"), float("inf"), "60", True):
        with pytest.raises(ConfigError, match=r"TrainConfig\.checkpoint_every_s=.*seconds >= 0"):
            TrainConfig(checkpoint_every_s=bad)
    cfg = TrainConfig(checkpoint_every_s=0.5)
    assert TrainConfig.load(cfg.save(tmp_path / "config.json")) == cfg
    assert "--checkpoint-every-s=0.5" in cli_flags(cfg)

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**TrainConfig().to_dict(), "checkpoint_every_s": -5}))
    with pytest.raises(ConfigError, match=r"(?s)bad\.json.*TrainConfig\.checkpoint_every_s=-5"):
        TrainConfig.load(path)

    parser = cli.argparse.ArgumentParser()
    cli._add_config_flags(parser)
    ns = parser.parse_args(["--checkpoint-every-s", "30", "--gpus", ""])
    ns.config = None
    assert cli.build_config(ns).checkpoint_every_s == 30.0
    assert cli.main(["train", "--checkpoint-every-s", "-2", "--gpus", ""]) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.checkpoint_every_s=-2" in err and "Traceback" not in err


def _weights(run_dir):
    return load_checkpoint(rundir.checkpoint_path(run_dir, rundir.LAST))


def _log(run_dir) -> str:
    return rundir.rank_log(run_dir, 0).read_text()


@pytest.mark.parametrize("pipeline, workers", [("pil", 0), ("tensor", 0), ("pil", 2), ("decode", 2)])
def test_stop_and_kill_in_the_middle_of_epochs_lose_no_step(tree, runs_dir, pipeline, workers):
    # 30 training images, 2 ranks, batch 4: 3 steps per epoch. The uninterrupted reference,
    # then one run that is stopped in its first epoch, resumed with a checkpoint after every
    # step and killed in its second epoch, and resumed again: the same weights at the end.
    # MobileNetV3 has dropout: training draws from each rank's random generator with either
    # pipeline, so the resumed steps must draw what the uninterrupted ones drew.
    cfg = small_cfg(tree, runs_dir, data_pipeline=pipeline, num_workers=workers, model="mobilenet_v3_small")
    straight = spawn_train(cfg.replace(name="straight"), echo=False)

    # A Stop seen at step 1 of epoch 0 (0-based): every rank leaves after it, last.pt holds 2 steps.
    stopped = spawn_train(cfg.replace(name="cut", checkpoint_every_s=0), echo=False, env=fault_env("step0.1:0:stop"))
    run_dir = stopped.run_dir
    assert stopped.value["stopped"] and stopped.value["metrics"] == []
    ck = _weights(run_dir)
    assert (ck["epoch"], ck["step"], len(ck["rank_rng"])) == (0, 2, 2)
    assert not rundir.checkpoint_path(run_dir, rundir.BEST).exists(), "best.pt is written per epoch only"
    log = _log(run_dir)
    assert "checkpoint of epoch 1 step 2 written to" in log
    assert "stop requested: leaving epoch 1 at step 2; the checkpoint holds it, a resumed run continues at step 3" in log

    # Resumed with a checkpoint after every step; rank 1 killed at the top of step 2 of epoch 1.
    with pytest.raises(WorkerError) as info:
        spawn_train(cfg.replace(name="cut", resume=True, checkpoint_every_s=0.001), echo=False,
                    env=fault_env("step1.2:1:sigkill"))
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    log = _log(run_dir)
    assert "resuming from epoch 1 step 3" in log  # 1-based: the next step to run
    ck = _weights(run_dir)
    assert (ck["epoch"], ck["step"]) == (1, 2), "the periodic checkpoint after the last step done"
    assert [m["epoch"] for m in ck["history"]] == [0]

    resumed = spawn_train(cfg.replace(name="cut", resume=True), echo=False)
    assert "resuming from epoch 2 step 3" in _log(run_dir)
    a, b = _weights(straight.run_dir), _weights(resumed.run_dir)
    assert b["epoch"] == 1 and b.get("step") is None
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for x, y in zip(a["history"], b["history"]):
        assert x["val_accuracy"] == y["val_accuracy"] and x["val_loss"] == pytest.approx(y["val_loss"], rel=1e-5)
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-5), "the epoch's loss counts every step"

    if (pipeline, workers) == ("pil", 2):
        # The same kill, healed by a restart (max_restarts): the same weights, one restart on record.
        healed = spawn_train(cfg.replace(name="healed", checkpoint_every_s=0.001, max_restarts=1), echo=False,
                             env=fault_env("step1.2:1:sigkill"), restart_backoff_s=0)
        (restart,) = healed.restarts
        assert restart.rank == 1 and "SIGKILL" in restart.cause
        assert restart.resumed_from == "checkpoints/last.pt (epoch 1, step 2)"
        assert "resuming from epoch 2 step 3" in _log(healed.run_dir)
        c = _weights(healed.run_dir)
        for k in a["model"]:
            assert torch.equal(a["model"][k], c["model"][k]), k
