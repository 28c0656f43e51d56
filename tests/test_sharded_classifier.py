"""The built-in classifier with TrainConfig(strategy="fsdp"): it trains, evaluates exactly, exports one
plain state dict, and a run stopped in the middle of an epoch resumes to the weights of an uninterrupted
one; a checkpoint of 2 sharded ranks continues on 1. Real 2-process CPU runs (gloo)."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision

from nbddp import spawn_train
from nbddp.contract.checkpoint import load_checkpoint
from nbddp.kernel.inference import load_model, predict
from conftest import fault_env, make_tree, small_cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_classifier")
    cfg = small_cfg(make_tree(root / "data"), root / "runs", strategy="fsdp", sync_bn=True, checkpoint_every_s=0, epochs=1,
                    val_fraction=0.25)  # 9 validation images: shards of 5 and 4, 2 batches and 1
    straight = spawn_train(cfg.replace(name="straight"), echo=False)
    cut = spawn_train(cfg.replace(name="cut"), echo=False, env=fault_env("step0.1:0:stop"))
    resumed = spawn_train(cfg.replace(name="cut", resume=True), echo=False)
    resumed.last = load_checkpoint(resumed.run_dir / "checkpoints" / "last.pt")  # before the next launch goes on
    # On 1 process, and under DDP: the checkpoint keeps the whole model, its optimizer state by name.
    on_one = spawn_train(cfg.replace(name="cut", resume=True, nprocs=1, epochs=2, strategy="ddp"), echo=False)
    # And back: that DDP checkpoint (its optimizer's groups say fused=True) continues sharded on two.
    back = spawn_train(cfg.replace(name="cut", resume=True, epochs=3), echo=False)
    # Out of memory on rank 1 at step 2: restarted from the mid-epoch checkpoint with half the batch and
    # twice the accumulation (FSDP's gradients then stay unsharded until a group's last batch).
    oom = spawn_train(cfg.replace(name="oom", checkpoint_every_s=0.001, oom="halve"), echo=False,
                      env=fault_env("step0.2:1:oom"), restart_backoff_s=0)
    return cfg, straight, cut, resumed, on_one, oom, back


def test_a_sharded_run_learns_and_exports_one_plain_state_dict(runs):
    cfg, straight, *_ = runs
    value = straight.value
    assert [m["epoch"] for m in straight.metrics] == [0]
    assert all(m["val_images"] == 9 for m in straight.metrics), "every val image counted once (shards 5 and 4)"
    assert value["final_accuracy"] == straight.metrics[value["best_epoch"]]["val_accuracy"]
    sd = torch.load(straight.run_dir / "export" / "model.pth", weights_only=True)
    assert all(type(v) is torch.Tensor for v in sd.values())  # no DTensor: no torch.distributed to read it
    torchvision.models.get_model(cfg.model, num_classes=3).load_state_dict(sd, strict=True)
    model, classes = load_model(straight.run_dir)
    recorded = json.loads((straight.run_dir / "val_predictions.json").read_text())
    preds = predict(model, [r["path"] for r in recorded])
    assert [classes.index(p.label) for p in preds] == [r["pred"] for r in recorded]


def test_stopped_mid_epoch_and_resumed_ends_with_the_uninterrupted_weights(runs):
    cfg, straight, cut, resumed = runs[:4]
    assert cut.value["stopped"]
    a = load_checkpoint(straight.run_dir / "checkpoints" / "last.pt")
    b = resumed.last
    assert b["epoch"] == 0 and b.get("step") is None
    worst = max((a["model"][k].float() - b["model"][k].float()).abs().max().item() for k in a["model"])
    assert worst <= 1e-5, worst
    assert [m["val_accuracy"] for m in a["history"]] == [m["val_accuracy"] for m in b["history"]]


def test_a_checkpoint_of_two_sharded_ranks_continues_on_one_under_ddp(runs):
    on_one = runs[4]
    assert [m["epoch"] for m in on_one.metrics] == [0, 1] and on_one.world_size == 1
    log = (on_one.run_dir / "logs" / "rank0.log").read_text()
    assert "resumed from" in log and "at epoch 1" in log


def test_a_ddp_checkpoint_continues_sharded_on_two(runs):
    """The DDP run stepped with torch's fused kernel; FSDP's sharded parameters have none, so the
    resumed optimizer steps as this run does, whatever the checkpoint's groups say."""
    back = runs[6]
    assert [m["epoch"] for m in back.metrics] == [0, 1, 2] and back.world_size == 2
    assert "at epoch 2" in (back.run_dir / "logs" / "rank0.log").read_text()


def test_out_of_memory_restarts_a_sharded_run_with_half_the_batch(runs):
    oom = runs[5]
    (restart,) = oom.restarts
    assert "OutOfMemoryError" in restart.cause and restart.changes == {"batch_size": [4, 2], "grad_accum_steps": [1, 2]}
    assert "resuming from epoch 1 step 5" in (oom.run_dir / "logs" / "rank0.log").read_text()
    assert oom.weights_path is not None and all(m["train_loss"] == m["train_loss"] for m in oom.metrics)


def test_optimizer_state_converts_between_names_and_indices():
    from nbddp.tasks.classification.worker import optimizer_state_as

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0].bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    by_index = opt.state_dict()
    by_name = optimizer_state_as(by_index, model, by_name=True)
    assert list(by_name["state"]) == ["0.weight", "1.weight", "1.bias"]
    assert by_name["param_groups"][0]["params"] == ["0.weight", "1.weight", "1.bias"]
    back = optimizer_state_as(by_name, model, by_name=False)
    assert list(back["state"]) == [0, 1, 2] and back["param_groups"][0]["params"] == [0, 1, 2]
    assert optimizer_state_as(by_index, model, by_name=False) is by_index  # already so: unchanged
    opt.load_state_dict(back)
