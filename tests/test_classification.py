"""The built-in classification worker, with real processes (gloo, 2 ranks unless said)."""

import json
from pathlib import Path

import pytest
import torch

from nbddp import ConfigError, DataError, TrainConfig, WorkerError, spawn_train
from nbddp.contract.checkpoint import load_checkpoint, load_state_dict_file
from nbddp.rank.engine import evaluate
from nbddp.kernel.inference import load_model, predict
from nbddp.tasks.classification.models import build_model
from conftest import WORKERS, fault_env, make_tree, small_cfg, worker_children

def test_a_run_leaves_its_metrics_export_checkpoint_and_tensorboard(small_run):
    """What a run leaves, on the small tree. That ResNet34 really learns the digits (the Quickstart
    run, minutes on 2 CPU cores) is checked by bench/digits.py, with these same checks."""
    from nbddp.tasks.classification.data import scan_class_folders, split_samples

    cfg, result = small_run
    n_val = len(split_samples(scan_class_folders(cfg.data_path)[1], 0.2, 0)[1])
    assert [m["epoch"] for m in result.metrics] == list(range(2))
    assert set(result.metrics[0]) >= {"epoch", "train_loss", "val_loss", "val_accuracy", "lr", "seconds"}
    # TFLOP/s and the data wait in every record; no MFU on a CPU (tests/test_throughput.py: with a GPU's name)
    assert all({"tflops", "data_wait"} <= set(m) and "mfu" not in m for m in result.metrics)
    assert all(m["val_images"] == n_val for m in result.metrics), "every val image counted exactly once"
    # each epoch's distributed evaluation scores exactly the weights rank 0 saved
    assert result.metrics[result.value["best_epoch"]]["val_accuracy"] == result.value["final_accuracy"]

    # Export: plain torchvision state_dict, strict load, safetensors twin, class names.
    export = result.run_dir / "export"
    sd = torch.load(export / "model.pth", weights_only=True)
    assert not any(k.startswith("module.") for k in sd)
    build_model(cfg.model, 3).load_state_dict(sd, strict=True)
    st = load_state_dict_file(export / "model.safetensors")
    assert all(torch.equal(sd[k], st[k]) for k in sd)
    assert json.loads((export / "class_indices.json").read_text()) == {"0": "a", "1": "b", "2": "c"}

    # Reloaded in this process (the "kernel"), it predicts what the workers' last evaluation did.
    model, classes = load_model(result.run_dir)
    recorded = json.loads((result.run_dir / "val_predictions.json").read_text())
    preds = predict(model, [r["path"] for r in recorded])
    assert [classes.index(p.label) for p in preds] == [r["pred"] for r in recorded]
    acc = sum(r["pred"] == r["label"] for r in recorded) / len(recorded)
    assert acc == pytest.approx(result.value["final_accuracy"])

    # Checkpoints hold plain values only; TensorBoard has the epoch curves and hparams.
    ck = load_checkpoint(result.run_dir / "checkpoints" / "last.pt")
    assert ck["epoch"] == 1 and ck["config"]["model"] == cfg.model
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(result.run_dir / "tensorboard"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"loss", "accuracy", "learning_rate", "train_loss_step", "tflops", "data_wait"} <= tags
    assert len(ea.Scalars("accuracy")) == 2
    assert not worker_children()


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_evaluation_is_exact_on_odd_sizes(tmp_path, runs_dir, world):
    root = make_tree(tmp_path / "odd", classes=("a", "b", "c"), per_class=[13][0])  # 39 images
    (root / "a" / "000.png").unlink()  # 38 -> shards of unequal size for 3 ranks; 2 ranks: 19 each
    (root / "b" / "000.png").unlink()  # 37 images: odd for both world sizes
    dist_r = spawn_train(f"{WORKERS / 'eval_worker.py'}:exact_eval", str(root), nprocs=world,
                         runs_dir=runs_dir, echo=False).value
    import sys

    sys.path.insert(0, str(WORKERS))
    import eval_worker

    n, loader = eval_worker.val_loader(root, 0, 1)
    single = evaluate(eval_worker.seeded_model(n), loader, torch.device("cpu"), gather_predictions=True)
    assert dist_r["count"] == single.count == 37
    assert dist_r["predictions"] == single.predictions
    assert dist_r["accuracy"] == single.accuracy
    assert dist_r["loss"] == pytest.approx(single.loss, rel=1e-6)


def test_freeze_layers_trains_only_the_head(tree, runs_dir):
    with pytest.raises(ConfigError, match="sync_bn.*freeze_layers"):
        small_cfg(tree, runs_dir, sync_bn=True, freeze_layers=True)
    cfg = small_cfg(tree, runs_dir, freeze_layers=True, epochs=1)
    result = spawn_train(cfg, echo=False)
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.model, 3).state_dict()
    trained = load_checkpoint(result.run_dir / "checkpoints" / "last.pt")["model"]
    changed = sorted(k for k in initial if not torch.equal(initial[k], trained[k]))
    assert changed == ["fc.bias", "fc.weight"], changed  # BatchNorm statistics stay frozen too


def test_sync_bn_run_on_cpu(tree, runs_dir):
    result = spawn_train(small_cfg(tree, runs_dir, sync_bn=True, epochs=1), echo=False)
    assert result.value["best_epoch"] == 0


def test_weights_from_another_run_fine_tune_a_different_class_count(tmp_path, runs_dir, small_run):
    _, first = small_run  # 3 classes
    four = make_tree(tmp_path / "four", classes=("w", "x", "y", "z"), per_class=10, seed=1)
    cfg = small_cfg(four, runs_dir, epochs=1, weights=str(first.run_dir))
    second = spawn_train(cfg, echo=False)
    log = (second.run_dir / "logs" / "rank0.log").read_text()
    features = build_model(cfg.model, 4).fc.in_features  # what the head reads: 512 for a ResNet18
    assert f"fc.weight: file (3, {features}) vs model (4, {features})" in log
    assert "fc.bias: file (3,) vs model (4,)" in log


@pytest.mark.parametrize("pipeline, workers", [("pil", 0), ("tensor", 0), ("pil", 2)])
def test_resume_after_a_crash_ends_with_the_same_weights(tree, runs_dir, pipeline, workers):
    # With workers: persistent ones, whose own seeds are drawn once per launch, not per epoch.
    cfg = small_cfg(tree, runs_dir, epochs=3, data_pipeline=pipeline, num_workers=workers)
    straight = spawn_train(cfg.replace(name="straight"), echo=False)
    with pytest.raises(WorkerError) as info:
        spawn_train(cfg.replace(name="crashy"), echo=False, env=fault_env("epoch0:0:exit3"))
    crashed_dir = info.value.run_dir
    assert load_checkpoint(crashed_dir / "checkpoints" / "last.pt")["epoch"] == 0
    resumed = spawn_train(cfg.replace(name="crashy", resume=True), echo=False)
    assert resumed.run_dir == crashed_dir
    a = load_checkpoint(straight.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(resumed.run_dir / "checkpoints" / "last.pt")
    assert b["epoch"] == 2 and [m["epoch"] for m in b["history"]] == [0, 1, 2]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert [m["val_accuracy"] for m in a["history"]] == [m["val_accuracy"] for m in b["history"]]


@pytest.mark.parametrize("case, error, match", [
    ("missing", DataError, "does not exist"),
    ("no_classes", DataError, "no class folders"),
    ("empty_class", DataError, "empty"),
    ("num_classes", ConfigError, "num_classes=5 but .* has 3 class"),
    ("corrupt", DataError, "bad.png"),
    ("batch", DataError, "batch_size"),
])
def test_bad_input_is_refused_before_any_process(tmp_path, tree, runs_dir, case, error, match):
    kw = {}
    if case == "missing":
        kw["data_path"] = str(tmp_path / "nope")
    elif case == "no_classes":
        (tmp_path / "flat").mkdir()
        (tmp_path / "flat" / "x.png").write_bytes((tree / "a" / "000.png").read_bytes())
        kw["data_path"] = str(tmp_path / "flat")
    elif case == "empty_class":
        (tree / "d").mkdir()
    elif case == "num_classes":
        kw["num_classes"] = 5
    elif case == "corrupt":
        (tree / "b" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    elif case == "batch":
        kw["batch_size"] = 64
    with pytest.raises(error, match=match):
        spawn_train(small_cfg(tree, runs_dir, **kw), echo=False)
    assert not worker_children()
    assert not list(Path(runs_dir).glob("*/logs")), "no run may start"


def test_config_round_trips_and_names_bad_fields(tmp_path):
    cfg = TrainConfig(data_path="d", gpus=[0, 1], epochs=3, resume=False)
    path = cfg.save(tmp_path / "config.json")
    assert TrainConfig.load(path) == cfg
    with pytest.raises(ConfigError, match="TrainConfig.sync_bn='False'"):
        TrainConfig(sync_bn="False")
    with pytest.raises(ConfigError, match="TrainConfig.lr=-1"):
        TrainConfig(lr=-1)
    with pytest.raises(ConfigError, match="TrainConfig.gpus=.*twice"):
        TrainConfig(gpus=[1, 1])
    with pytest.raises(ConfigError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"epochz": 3})


def test_nan_on_one_rank_stops_every_rank_at_the_same_step(tree, runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(small_cfg(tree, runs_dir), echo=False, env=fault_env("nan0.1:1:on"))
    err = info.value
    assert err.rank == 1 and err.exc_type == "NonFiniteLossError"
    assert (err.epoch, err.step) == (0, 1)
    assert "rank(s) [1] at epoch 0, step 1" in str(err)
    # both ranks left at the same step, through their own error, not killed while waiting
    for r in (0, 1):
        rec = json.loads((err.run_dir / ".nbddp" / f"error.rank{r}.json").read_text())
        assert (rec["type"], rec["step"]) == ("NonFiniteLossError", 1)
    assert not worker_children()


def test_stop_from_the_notebook_ends_training_cleanly(tree, runs_dir):
    from conftest import survivors, wait_for

    cfg = small_cfg(tree, runs_dir, epochs=50, batch_size=2)
    h = spawn_train(cfg, block=False, echo=False)
    assert wait_for(lambda: h.metrics, timeout=120), "no epoch finished"
    h.stop()
    result = h.wait()
    assert result.stopped and result.value["stopped"]
    done = [m["epoch"] for m in result.value["metrics"]]
    assert 1 <= len(done) < 50
    # the last completed epoch is checkpointed (with the steps after it, if the stop came in the
    # middle of the next one) and the best weights were exported
    ck = load_checkpoint(result.run_dir / "checkpoints" / "last.pt")
    assert (ck["epoch"], ck.get("step")) == (done[-1], None) or (ck["epoch"] == done[-1] + 1 and ck["step"] >= 1)
    assert (result.run_dir / "export" / "model.safetensors").exists()
    assert survivors(h.pids) == {}


def test_ranks_evaluate_rank_0s_batchnorm_statistics(runs_dir):
    v = spawn_train(f"{WORKERS / 'eval_worker.py'}:buffers_after_sync", nprocs=2, runs_dir=runs_dir, echo=False).value
    assert v["differed"], "the ranks' statistics differ before the sync (else the test proves nothing)"
    assert v["equal_after"]
