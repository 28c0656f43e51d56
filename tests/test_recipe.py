"""The training recipe: optimizer, gradient accumulation, warm-up, label smoothing, torch.compile,
early stopping. Settings (config, CLI, panel) first, then the engine, then launched runs."""

import math

import pytest

from nbddp import ConfigError, TrainConfig, cli
from nbddp.cluster import cli_flags
from nbddp.engine import cosine_lambda, warmup_cosine_lambda

RECIPE = dict(optimizer="adamw", grad_accum_steps=3, warmup_epochs=2, label_smoothing=0.1, compile=True,
              early_stop_patience=4)


# ------------------------------------------------------------------------------ settings
def test_recipe_fields_default_off_round_trip_and_become_flags(tmp_path):
    d = TrainConfig()
    assert (d.optimizer, d.grad_accum_steps, d.warmup_epochs, d.label_smoothing, d.compile,
            d.early_stop_patience) == ("sgd", 1, 0, 0.0, False, 0)
    cfg = TrainConfig(data_path="d", epochs=5, **RECIPE)
    assert TrainConfig.load(cfg.save(tmp_path / "config.json")) == cfg
    flags = cli_flags(cfg)
    for flag in ("--optimizer=adamw", "--grad-accum-steps=3", "--warmup-epochs=2", "--label-smoothing=0.1",
                 "--compile", "--early-stop-patience=4"):
        assert flag in flags
    parser = cli.argparse.ArgumentParser()
    parser.add_argument("--config")
    cli._add_config_flags(parser)
    assert cli.build_config(parser.parse_args(flags + ["--gpus", ""])) == cfg.replace(gpus=())
    # flags override a config file's recipe
    ns = parser.parse_args(["--config", str(tmp_path / "config.json"), "--optimizer", "sgd", "--no-compile",
                            "--gpus", ""])
    assert (cli.build_config(ns).optimizer, cli.build_config(ns).compile) == ("sgd", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--optimizer", "adam"])  # argparse names the choices


@pytest.mark.parametrize("field, value, match", [
    ("optimizer", "adam", r"TrainConfig.optimizer='adam': must be one of \('sgd', 'adamw'\)"),
    ("grad_accum_steps", 0, r"TrainConfig.grad_accum_steps=0: must be an integer >= 1 \(1: an optimizer step"),
    ("grad_accum_steps", 2.0, r"grad_accum_steps=2.0: must be an integer"),
    ("warmup_epochs", -1, r"TrainConfig.warmup_epochs=-1: must be an integer >= 0"),
    ("warmup_epochs", 5, r"warmup_epochs=5: is not less than epochs=5: the warm-up would take the whole run"),
    ("label_smoothing", 1.0, r"TrainConfig.label_smoothing=1.0: must be a number in \[0, 1\)"),
    ("label_smoothing", -0.1, r"label_smoothing=-0.1: must be a number in \[0, 1\)"),
    ("compile", "True", r"TrainConfig.compile='True': must be True or False"),
    ("early_stop_patience", -2, r"TrainConfig.early_stop_patience=-2: must be an integer >= 0 \(0: off"),
    ("early_stop_patience", True, r"early_stop_patience=True: must be an integer"),
])
def test_recipe_fields_are_validated_in_the_kernel(field, value, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(epochs=5, **{field: value})


def test_cli_refuses_a_bad_recipe_value_naming_the_field(capsys):
    assert cli.main(["train", "--grad-accum-steps", "0", "--gpus", ""]) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.grad_accum_steps=0" in err and "must be an integer >= 1" in err


def test_panel_advanced_section_is_collapsed_and_feeds_the_config(monkeypatch):
    import nbddp.ui.panel as panel_mod
    from nbddp.ui import TrainingPanel

    monkeypatch.setattr(panel_mod, "list_gpus", lambda: [])
    panel = TrainingPanel(TrainConfig(data_path="d", epochs=5, nprocs=1, early_stop_patience=2))
    assert panel.advanced.selected_index is None and panel.advanced.titles[0] == "Advanced"
    assert panel.early_stop_input.value == 2 and panel.optimizer_input.value == "sgd"
    assert panel.config == panel._base  # the widgets start from the config
    panel.optimizer_input.value = "adamw"
    panel.grad_accum_input.value = 3
    panel.warmup_input.value = 2
    panel.label_smoothing_input.value = 0.1
    panel.compile_toggle.value = True
    panel.early_stop_input.value = 4
    assert panel.config == panel._base.replace(**RECIPE)
    panel.warmup_input.value = 5  # as many as the epochs: refused, naming the field
    with pytest.raises(ConfigError, match="warmup_epochs=5"):
        panel.config
    panel._set_busy(True)  # a run in progress locks the advanced settings with the others
    assert panel.optimizer_input.disabled and panel.compile_toggle.disabled and panel.grad_accum_input.disabled


# ------------------------------------------------------------------------------ schedule
def test_warmup_climbs_linearly_then_runs_the_whole_cosine():
    f = warmup_cosine_lambda(10, 0.1, 3)
    assert [f(e) for e in range(3)] == [0.25, 0.5, 0.75]
    cos = cosine_lambda(7, 0.1)
    assert [f(e) for e in range(3, 10)] == [cos(e) for e in range(7)]
    assert f(3) == 1.0 and f(10) == pytest.approx(0.1)  # the cosine still ends at lrf
    plain, same = cosine_lambda(10, 0.1), warmup_cosine_lambda(10, 0.1, 0)
    assert all(plain(e) == same(e) for e in range(11)), "no warm-up is the reference schedule, bit for bit"
    assert all(math.isfinite(warmup_cosine_lambda(2, 0.0, 1)(e)) for e in range(3))


# ------------------------------------------------------------------------------ GPU memory in view
GPU_RECORDS = [{"epoch": 0, "train_loss": 1.0, "val_accuracy": 0.5, "gpu_mem_alloc_gib": 3.25, "gpu_mem_reserved_gib": 4.0},
               {"epoch": 1, "train_loss": 0.5, "val_accuracy": 0.75, "gpu_mem_alloc_gib": 3.5, "gpu_mem_reserved_gib": 4.0}]


def test_panel_shows_the_epochs_gpu_memory_peaks(monkeypatch, tmp_path):
    import re
    import time
    from types import SimpleNamespace

    import nbddp.ui.panel as panel_mod
    from nbddp.handle import TrainResult
    from nbddp.ui import TrainingPanel

    assert panel_mod.gpu_memory_text(GPU_RECORDS[0]) == "GPU memory 3.2 GiB peak, 4.0 reserved"
    assert panel_mod.gpu_memory_text({"epoch": 0, "val_accuracy": 0.5}) is None  # a CPU run's record
    monkeypatch.setattr(panel_mod, "list_gpus", lambda: [])
    panel = TrainingPanel(TrainConfig(data_path="d", epochs=5, nprocs=1))
    panel.handle = SimpleNamespace(metrics=list(GPU_RECORDS), started_at=time.time(), progress={}, run_dir=tmp_path)
    panel._on_progress({"epoch": 2, "step": 3, "steps": 10, "loss": 0.25, "images_per_s": 100.0})
    label = panel.progress_label.value
    assert label.startswith("epoch 3/5 · step 3/10 · loss 0.2500") and label.endswith("GPU memory 3.5 GiB peak, 4.0 reserved")
    panel._ended.clear()  # a run in progress: the epoch's status line
    panel.stop_button.disabled = False
    panel._on_metrics()
    assert "epoch 2/5 done · val accuracy 0.7500 · best 0.7500 (epoch 2) · GPU memory 3.5 GiB peak" in panel.status.value
    result = TrainResult({"best_accuracy": 0.75, "best_epoch": 1, "early_stopped": True, "early_stop_patience": 3},
                         tmp_path, list(GPU_RECORDS), 12.0, 2, "nccl")
    panel._show_result(result)
    text = re.sub(r"<[^>]+>", "", panel.status.value)
    assert "stopped early: no better val accuracy for 3 epochs" in text
    assert "GPU memory 3.5 GiB peak, 4.0 reserved (epoch 2)" in text
