"""FSDP2 from spawn_train: ctx.prepare under strategy="fsdp", checkpoints of modules and optimizers
that reshard to another world size, the old plain form with sharded tensors, and the errors.

Real 2-process CPU runs (gloo), launched once per module and shared by the assertions."""

from __future__ import annotations

import pytest
import torch

import nbddp
from nbddp.contract.errors import ConfigError

from conftest import WORKERS, wait_for

WORKER = f"{WORKERS / 'sharded.py'}:train"
STEPS, SAVE_AT = 6, 2


def _launch(runs_dir, nprocs, strategy, **kwargs):
    resume = kwargs.pop("resume_dir", None)
    kw = dict(steps=STEPS, **kwargs)
    if resume is not None:
        kw["resume"] = True
    return nbddp.spawn_train(WORKER, nprocs=nprocs, strategy=strategy, kwargs=kw, runs_dir=runs_dir, echo=False,
                             resume=resume, timeout_s=60)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Five small launches: DDP and FSDP on 2 ranks, FSDP on 1, and each FSDP run resumed on the other size."""
    runs_dir = tmp_path_factory.mktemp("sharded") / "runs"
    out = {"ddp2": _launch(runs_dir, 2, "ddp"),
           "fsdp2": _launch(runs_dir, 2, "fsdp", save_at=SAVE_AT, extras=True),
           "fsdp1": _launch(runs_dir, 1, "fsdp", save_at=SAVE_AT, compile=True)}
    out["fsdp2to1"] = _launch(runs_dir, 1, "fsdp", resume_dir=out["fsdp2"].run_dir)
    out["fsdp1to2"] = _launch(runs_dir, 2, "fsdp", resume_dir=out["fsdp1"].run_dir)
    return out


def _close(a: dict, b: dict, tol: float = 1e-4) -> float:
    assert sorted(a) == sorted(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, worst
    return worst


def test_fsdp_trains_to_the_weights_of_ddp(runs):
    ddp, fsdp = runs["ddp2"].value, runs["fsdp2"].value
    assert (ddp["strategy"], fsdp["strategy"]) == ("ddp", "fsdp")
    assert fsdp["param_types"] == ["DTensor"] and ddp["param_types"] == ["Parameter"]
    # ctx.full_state_dict: plain tensors, the plain model's keys, on rank 0's CPU.
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in fsdp["weights"].values())
    assert "layers.0.fc.weight" in fsdp["weights"]
    _close(ddp["weights"], fsdp["weights"])


def test_sharded_checkpoint_is_a_folder_of_shards_beside_plain_values(runs):
    folder = runs["fsdp2"].run_dir / "checkpoints" / "last.dcp"
    names = sorted(p.name for p in folder.iterdir())
    assert ".metadata" in names and "extra.pt" in names
    assert len([n for n in names if n.endswith(".distcp")]) == 2  # every rank wrote its own shard
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]  # nothing half-written left


@pytest.mark.parametrize("resumed,uninterrupted", [("fsdp2to1", "fsdp2"), ("fsdp1to2", "fsdp1")])
def test_resume_on_another_world_size_ends_as_uninterrupted(runs, resumed, uninterrupted):
    assert runs[resumed].value["resumed"] == SAVE_AT
    _close(runs[resumed].value["weights"], runs[uninterrupted].value["weights"])


def test_a_failed_sharded_save_leaves_the_last_checkpoint_whole(runs):
    """Rank 0's last write fails after every shard was written: every rank raises, nothing half-written
    stays, and ``last`` is still the checkpoint of step SAVE_AT (the 2 -> 1 resume continues from it)."""
    failed = runs["fsdp2"].value["failed_save"]
    assert failed["message"].startswith("OSError") and "No space left" in failed["message"]
    assert failed["entries"] == ["last.dcp", "plain.pt"]


def test_frozen_layers_stay_frozen_when_sharded(runs):
    changed = runs["fsdp2"].value["frozen_changed"]
    assert changed["fc.weight"] and changed["fc.bias"]
    assert not any(v for k, v in changed.items() if not k.startswith("fc."))


def test_one_rank_and_two_ranks_train_alike(runs):
    """The one-rank run compiled each block (compile=True): the same weights."""
    assert runs["fsdp1"].value["compiled"] == [True, True, True]
    # Blocks share their forward's code: dynamo is given room for a graph per block and mode (a ResNet's
    # 4 stages of other shapes ran uncompiled once its limit of 8 was hit).
    assert runs["fsdp1"].value["recompile_limit"] >= 12
    assert runs["fsdp2"].value["compiled"] == [False, False, False]
    _close(runs["fsdp1"].value["weights"], runs["fsdp2"].value["weights"])


def test_sharded_state_dict_given_the_old_way_is_saved_whole(runs):
    plain, weights = runs["fsdp2"].value["plain"], runs["fsdp2"].value["weights"]
    assert {k: tuple(v.shape) for k, v in plain.items()} == {k: tuple(v.shape) for k, v in weights.items()}
    _close(plain, weights, tol=0.0)


def test_prepare_refuses_with_the_fix(runs):
    errors = runs["fsdp2"].value["errors"]
    assert "ConfigError" in errors["twice"] and "model = ctx.prepare(model)" in errors["twice"]
    assert "strategy='fsdp'" in errors["ddp_of_sharded"]
    assert "TransformerBlock" in errors["block"] and "Block" in errors["block"]
    assert "cpu_offload" in errors["offload"] and "gpus=" in errors["offload"]
    assert "mixed_precision" in errors["ddp_options"] and "strategy='fsdp'" in errors["ddp_options"]
    # A model without parameters: refused with the reason, not torch's "model state_dict is empty" at a save.
    assert errors["no_params"].startswith("ConfigError") and "has none" in errors["no_params"], errors["no_params"]
    assert errors["stateless_save"].startswith("ConfigError") and "'act'" in errors["stateless_save"], \
        errors["stateless_save"]


@pytest.mark.parametrize("how", ["truncated", "missing"])
def test_a_truncated_or_missing_shard_is_nbddps_error_naming_the_checkpoint(runs, how):
    broken = runs["fsdp2"].value["broken"]
    message = broken[how]
    assert message is not None and message.startswith("WeightsError"), message
    assert f"checkpoint {runs['fsdp2'].run_dir / 'checkpoints' / (how + '.dcp')}" in message, message
    assert "incomplete or corrupt" in message and "CheckpointException" not in message, message
    kept = broken[f"{how} kept"]  # nothing removed
    assert ".metadata" in kept and "extra.pt" in kept and len([n for n in kept if n.endswith(".distcp")]) == \
        (2 if how == "truncated" else 1), kept


def test_a_checkpoint_of_another_architecture_is_refused_by_name(runs):
    message = runs["fsdp1to2"].value["other_architecture"]
    assert message.startswith("ConfigError") and "another architecture" in message
    assert "of other shapes (" in message and "checkpoint [16, 8], model [12, 8]" in message


def test_a_wrong_strategy_is_refused_before_anything_starts(runs_dir):
    with pytest.raises(ConfigError, match="'ddp'.*'fsdp'"):
        nbddp.spawn_train(WORKER, nprocs=2, strategy="zero3", runs_dir=runs_dir)
    assert not runs_dir.exists()


# ---------------------------------------------------------------------------- no processes
def test_the_strategy_is_a_config_field_a_flag_a_panel_choice_and_in_cluster_commands(tmp_path):
    from nbddp import TrainConfig
    from nbddp.cli import main

    with pytest.raises(ConfigError, match=r"TrainConfig.strategy='zero3'.*'ddp'.*'fsdp'"):
        TrainConfig(strategy="zero3")
    cfg = TrainConfig(data_path=str(tmp_path), strategy="fsdp", gpus=(0, 1))
    assert "--strategy=fsdp" in cfg.torchrun_command() and "--strategy=fsdp" in cfg.sbatch_script()
    assert "--strategy" not in TrainConfig(data_path=str(tmp_path), gpus=(0, 1)).torchrun_command()  # the default
    with pytest.raises(SystemExit):
        main(["train", "--strategy", "zero3"])
    with pytest.raises(SystemExit):
        main(["run", "--strategy", "zero3", "w.py:f"])


def test_the_panel_offers_the_strategy_beside_syncbn(tmp_path):
    pytest.importorskip("ipywidgets")
    from nbddp import TrainConfig, TrainingPanel

    panel = TrainingPanel(TrainConfig(data_path=str(tmp_path), runs_dir=str(tmp_path / "runs")))
    assert list(panel.strategy_input.options) == ["ddp", "fsdp"] and panel.strategy_input.value == "ddp"
    panel.strategy_input.value = "fsdp"
    assert panel.config.strategy == "fsdp"
    names = [f for f in panel.inputs]
    assert names.index("strategy") == names.index("sync_bn") + 1


def test_a_config_and_a_strategy_argument_that_disagree_are_refused(tmp_path):
    from nbddp import TrainConfig

    with pytest.raises(ConfigError, match="cfg.replace\\(strategy='fsdp'\\)"):
        nbddp.spawn_train(TrainConfig(data_path=str(tmp_path)), strategy="fsdp")


def test_python_m_nbddp_run_takes_the_strategy(tmp_path, capsys, monkeypatch):
    from nbddp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", "--nprocs", "1", "--strategy", "fsdp", WORKER, "--kwargs", '{"steps": 1}']) == 0
    assert "'strategy': 'fsdp'" in capsys.readouterr().out


def test_a_save_that_a_peer_left_at_the_stop_is_dropped_cleanly(tmp_path):
    """At a stop, rank 1 leaves with its KeyboardInterrupt while rank 0 saves (the collective save cannot
    end): rank 0's save is dropped as a KeyboardInterrupt, not torch's CheckpointException; its
    temporary folder is removed and ``last`` stays the checkpoint before the stop."""
    marks = tmp_path / "marks"
    marks.mkdir()
    handle = nbddp.spawn_train(f"{WORKERS / 'saving.py'}:peer_leaves_at_the_stop", str(marks), nprocs=2,
                               strategy="fsdp", runs_dir=tmp_path / "runs", echo=False, block=False, timeout_s=60)
    assert wait_for(lambda: all((marks / f"saved{r}").exists() for r in (0, 1)), timeout=120)
    handle.stop(wait=False)
    with pytest.raises(nbddp.TrainingInterrupted, match="ranks 0-1: KeyboardInterrupt at the stop request"):
        handle.wait(timeout=120)  # both ranks ended by their KeyboardInterrupt: neither by a checkpoint error
    log = (handle.run_dir / "logs" / "rank0.log").read_text()
    assert "the checkpoint being written was dropped at the stop" in log, log[-3000:]
    assert "CheckpointException" not in log, log[-3000:]
    assert not (marks / "saved-after-the-stop").exists()
    assert sorted(p.name for p in (handle.run_dir / "checkpoints").iterdir()) == ["last.dcp"]  # no temporary folder
    from nbddp.contract.checkpoint import load_checkpoint

    # The checkpoint before the stop, whole.
    assert load_checkpoint(handle.run_dir / "checkpoints" / "last.dcp" / "extra.pt") == {"step": 0}
