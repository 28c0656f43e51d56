"""Checkpoints in the middle of an epoch: a Stop, an Interrupt or a periodic checkpoint loses no step."""

import json

import pytest

from nbddp import ConfigError, TrainConfig
from nbddp import cli
from nbddp.cluster import cli_flags


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
