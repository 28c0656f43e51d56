"""The training recipe: optimizer, gradient accumulation, warm-up, label smoothing, torch.compile,
early stopping. Settings (config, CLI, panel) first, then the engine, then launched runs."""

import math

import pytest

from nbddp import ConfigError, TrainConfig, cli
from nbddp.contract.cluster import cli_flags
from nbddp.rank.engine import cosine_lambda, warmup_cosine_lambda
from conftest import small_cfg

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
GPU_RECORDS = [
    {"epoch": 0, "train_loss": 1.0, "val_accuracy": 0.5, "gpu_mem_alloc_gib": 3.25, "gpu_mem_reserved_gib": 4.0},
    {"epoch": 1, "train_loss": 0.5, "val_accuracy": 0.75, "gpu_mem_alloc_gib": 3.5, "gpu_mem_reserved_gib": 4.0},
]


def test_panel_shows_the_epochs_gpu_memory_peaks(monkeypatch, tmp_path):
    import re
    import time
    from types import SimpleNamespace

    import nbddp.ui.panel as panel_mod
    from nbddp.kernel.handle import TrainResult
    from nbddp.ui import TrainingPanel

    assert panel_mod.gpu_memory_text(GPU_RECORDS[0]) == "GPU memory 3.2 GiB peak, 4.0 reserved"
    assert panel_mod.gpu_memory_text({"epoch": 0, "val_accuracy": 0.5}) is None  # a CPU run's record
    monkeypatch.setattr(panel_mod, "list_gpus", lambda: [])
    panel = TrainingPanel(TrainConfig(data_path="d", epochs=5, nprocs=1))
    panel.handle = SimpleNamespace(metrics=list(GPU_RECORDS), started_at=time.time(), progress={}, run_dir=tmp_path)
    panel._on_progress({"epoch": 2, "step": 3, "steps": 10, "loss": 0.25, "images_per_s": 100.0})
    label = panel.progress_label.value
    assert label.startswith("epoch 3/5 · step 3/10 · loss 0.2500")
    assert label.endswith("GPU memory 3.5 GiB peak, 4.0 reserved")
    panel._ended.clear()  # a run in progress: the epoch's status line
    panel.stop_button.disabled = False
    panel._on_metrics()
    status = panel.status.value
    assert "epoch 2/5 done · val accuracy 0.7500 · best 0.7500 (epoch 2) · GPU memory 3.5 GiB peak" in status
    result = TrainResult({"best_accuracy": 0.75, "best_epoch": 1, "early_stopped": True, "early_stop_patience": 3},
                         tmp_path, list(GPU_RECORDS), 12.0, 2, "nccl")
    panel._show_result(result)
    text = re.sub(r"<[^>]+>", "", panel.status.value)
    assert "stopped early: no better val accuracy for 3 epochs" in text
    assert "GPU memory 3.5 GiB peak, 4.0 reserved (epoch 2)" in text


def test_gpu_memory_peaks_read_and_reset_torch_cuda_counters_on_gpu_devices_only(monkeypatch):
    import torch

    from nbddp.rank import engine

    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append(device) or 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2**31)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    cuda1 = torch.device("cuda", 1)  # a device object only: nothing starts CUDA
    assert engine.gpu_memory_peaks(cuda1) == (1.5, 2.0)
    engine.reset_gpu_memory_peaks(cuda1)
    assert calls == [cuda1, ("reset", cuda1)], "the rank's own GPU is read and reset"
    calls.clear()
    assert engine.gpu_memory_peaks(torch.device("cpu")) is None
    engine.reset_gpu_memory_peaks(torch.device("cpu"))
    assert calls == [], "CPU ranks never touch torch.cuda"
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_gpu_peaks", ROOT / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench._peak_gib(GPU_RECORDS) == 3.5 and bench._peak_gib([{"epoch": 0}]) is None


# ------------------------------------------------------------------------------ launched runs
def test_accumulated_steps_on_two_ranks_equal_one_process_with_the_whole_batch(runs_dir):
    import sys

    import torch

    from nbddp import spawn_train
    from nbddp.rank.engine import train_one_epoch
    from conftest import WORKERS

    sys.path.insert(0, str(WORKERS))
    import accum_worker as w

    # 2 ranks x batch 3 x 2 batches per step, 2 full groups and a last group of 1 batch.
    r0, r1 = spawn_train(f"{WORKERS / 'accum_worker.py'}:run", nprocs=2, runs_dir=runs_dir, echo=False,
                         kwargs={"groups": 2, "last": 1}, all_values=True).values
    model = w.mlp()
    ref = train_one_epoch(model, w.sgd(model), w.whole_batches(2, 2, 1), torch.device("cpu"), 0)
    assert ref.steps == 3  # one process, batches of 12, 12 and 6: an optimizer step each
    for r in (r0, r1):
        assert (r["steps"], r["optimizer_steps"]) == (5, 3)
        assert r["all_reduces"] == 3, "DDP all-reduced the gradients on each group's last batch only"
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["weights"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    # A stop request seen by rank 1 at batch 2 (the first of the second group): both ranks
    # finish that group (batch 3) and leave with the same weights, two optimizer steps taken.
    assert r0["stop"] == r1["stop"]
    assert (r0["stop"]["steps"], r0["stop"]["optimizer_steps"], r0["stop"]["stopped"]) == (4, 2, True)


def test_resume_with_the_recipe_ends_as_an_uninterrupted_run(tree, runs_dir):
    import torch

    from nbddp import WorkerError, spawn_train
    from nbddp.contract.checkpoint import load_checkpoint
    from conftest import fault_env

    # 3 batches an epoch in groups of 2: a full group and a last, shorter one.
    cfg = small_cfg(tree, runs_dir, epochs=3, lr=0.002, optimizer="adamw", grad_accum_steps=2, warmup_epochs=1,
                    label_smoothing=0.1, early_stop_patience=5)
    straight = spawn_train(cfg.replace(name="straight"), echo=False)
    with pytest.raises(WorkerError) as info:
        spawn_train(cfg.replace(name="crashy"), echo=False, env=fault_env("epoch0:0:exit3"))
    resumed = spawn_train(cfg.replace(name="crashy", resume=True), echo=False)
    assert resumed.run_dir == info.value.run_dir
    a = load_checkpoint(straight.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(resumed.run_dir / "checkpoints" / "last.pt")
    assert b["epoch"] == 2 and [m["epoch"] for m in b["history"]] == [0, 1, 2]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a and all({"exp_avg", "exp_avg_sq"} <= set(s) for s in state_a.values()), "AdamW's moments"
    for i in state_a:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state_a[i][k], state_b[i][k]), (i, k)
    assert [m["val_accuracy"] for m in a["history"]] == [m["val_accuracy"] for m in b["history"]]
    lrs = [m["lr"] for m in b["history"]]
    assert lrs == [m["lr"] for m in a["history"]]
    base = 0.002 * 2  # scale_lr: times the 2 processes
    assert lrs[0] == pytest.approx(base / 2) and lrs[1] == pytest.approx(base) and lrs[2] < base  # warm-up, cosine
    assert not straight.value["early_stopped"] and straight.value["early_stop_patience"] == 5


def test_early_stop_ends_every_rank_together_and_a_resumed_run_decides_the_same(tree, runs_dir):
    import json

    from nbddp import WorkerError, spawn_train
    from conftest import fault_env, worker_children

    # Frozen layers and a vanishing learning rate: validation accuracy never gets better than epoch 1's.
    cfg = small_cfg(tree, runs_dir, epochs=5, lr=1e-9, freeze_layers=True, early_stop_patience=1)
    # The run dies right after epoch 2's checkpoint, before it decides; the resumed run decides.
    with pytest.raises(WorkerError):
        spawn_train(cfg, echo=False, env=fault_env("epoch1:0:exit3"))
    result = spawn_train(cfg.replace(resume=True), echo=False, all_values=True)
    for value in result.values:  # both ranks left the loop at the same epoch
        assert value["early_stopped"] and value["best_epoch"] == 0 and not value["stopped"]
        assert [m["epoch"] for m in value["metrics"]] == [0, 1]
    log = (result.run_dir / "logs" / "rank0.log").read_text()
    assert len(result.metrics) == 2 and "epoch 3/5" not in log, "the resumed launch trained no epoch"
    assert "early stop: val accuracy has not improved for 1 epoch (early_stop_patience=1; best" in log
    assert "the export keeps epoch 1" in log
    meta = json.loads((result.run_dir / "export" / "meta.json").read_text())
    assert meta["epoch"] == 0
    assert not worker_children()


def test_compile_trains_the_same_weights_and_reports_its_time(tree, runs_dir):
    import torch

    from nbddp import spawn_train
    from nbddp.contract.checkpoint import load_checkpoint

    cfg = small_cfg(tree, runs_dir, epochs=1, grad_accum_steps=2)
    plain = spawn_train(cfg.replace(name="plain"), echo=False)
    compiled = spawn_train(cfg.replace(name="compiled", compile=True), echo=False,
                           env={"NBDDP_COMPILE_BACKEND": "eager"})  # dynamo's path, not inductor's minutes of C++
    assert compiled.metrics[0]["compile_s"] > 0 and "compile_s" not in plain.metrics[0]
    assert "torch.compile (backend eager)" in (compiled.run_dir / "logs" / "rank0.log").read_text()
    a = load_checkpoint(plain.run_dir / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(compiled.run_dir / "checkpoints" / "last.pt")["model"]
    assert list(a) == list(b), "checkpoints hold the bare model's names (no _orig_mod., no module.)"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    assert compiled.weights_path.exists()


def test_gpu_memory_peaks_reach_the_records_the_log_and_tensorboard_once_per_tag_and_step(tree, runs_dir):
    from collections import Counter

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from nbddp import spawn_train
    from conftest import WORKERS

    hook = {"NBDDP_RANK_HOOK": f"{WORKERS / 'gpu_memory.py'}:install"}  # CPU ranks with GPU memory counters
    result = spawn_train(small_cfg(tree, runs_dir, label_smoothing=0.1), echo=False, env=hook)
    # Reset every epoch; rank 1's peaks (the higher ones) in every record.
    assert [(m["gpu_mem_alloc_gib"], m["gpu_mem_reserved_gib"]) for m in result.metrics] == [(2.0, 2.5), (4.0, 4.5)]
    log = (result.run_dir / "logs" / "rank0.log").read_text()
    assert "gpu mem 2.0 GiB (reserved 2.5)" in log and "gpu mem 4.0 GiB (reserved 4.5)" in log

    seen = Counter()
    for path in sorted((result.run_dir / "tensorboard").iterdir()):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                seen[(value.tag, event.step)] += 1
    tags = {tag for tag, _ in seen}
    assert {"loss", "accuracy", "learning_rate", "train_loss_step", "train_loss", "val_loss", "val_accuracy", "lr",
            "gpu_mem_alloc_gib", "gpu_mem_reserved_gib"} <= tags
    assert "_hparams_/experiment" in tags, "the run's hyper-parameters"
    assert {step for tag, step in seen if tag == "gpu_mem_alloc_gib"} == {0, 1}
    assert len({step for tag, step in seen if tag == "train_loss_step"}) == 6  # 3 batches x 2 epochs
    twice = {k: n for k, n in seen.items() if n > 1}
    assert not twice, f"tags written more than once at a step: {twice}"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_optimizer_steps_fused_and_a_resume_keeps_it(optimizer, monkeypatch):
    """The built-in worker's optimizer takes torch's fused step where the device has one (one
    kernel for all the parameters: ResNet18's SGD step with weight decay 14 -> 6.7 ms on a CPU);
    its updates are the default step's to float rounding, and a checkpoint saved by a default
    optimizer does not turn it back (torch's load_state_dict takes ``fused`` from the file)."""
    import torch

    from nbddp.tasks.classification import worker
    from nbddp.tasks.classification.worker import _optimizer, load_optimizer_state

    cfg = TrainConfig(data_path=".", optimizer=optimizer)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = _optimizer(cfg, params, 0.1, torch.device("cpu"))
    with monkeypatch.context() as m:
        m.setattr(worker, "_fused", lambda device, sharded: {})
        default = _optimizer(cfg, plain, 0.1, torch.device("cpu"))
    assert not any(g["fused"] for g in default.param_groups)
    assert all(g["fused"] for g in fused.param_groups)
    for _ in range(3):
        for p, q in zip(params, plain):
            p.grad = q.grad = torch.full_like(p, 0.5) + p.detach() * 0.1
        fused.step()
        default.step()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(params, plain))
    load_optimizer_state(fused, default.state_dict())
    assert all(g["fused"] for g in fused.param_groups), "a resumed run steps fused too"
    assert torch.equal(fused.state_dict()["state"][0][next(iter(default.state_dict()["state"][0]))],
                       default.state_dict()["state"][0][next(iter(default.state_dict()["state"][0]))])
    sharded = _optimizer(cfg.replace(strategy="fsdp"), [torch.nn.Parameter(torch.randn(2))], 0.1,
                         torch.device("cpu"))
    assert not any(g.get("fused") for g in sharded.param_groups), "FSDP's DTensor shards keep the default step"
