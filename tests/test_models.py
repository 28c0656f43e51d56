"""nbddp.tasks.classification.models: building, head detection, freezing, shape-aware weight loading (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torchvision
from torch import nn

from nbddp.contract.checkpoint import atomic_save, export_weights
from nbddp.contract.errors import ConfigError, WeightsError
from nbddp.tasks.classification.models import (
    build_model,
    check_weights_file,
    classification_model_names,
    freeze_except_head,
    head_names,
    load_pretrained,
)


# ---------------------------------------------------------------------------- build_model
def test_build_model_is_random_and_has_num_classes():
    model = build_model("resnet18", 7)
    assert model.fc.out_features == 7
    assert "resnet34" in classification_model_names()


@pytest.mark.parametrize("name", ["resnet343", "ResNet34", "resnt34"])
def test_build_model_unknown_name_suggests_close_matches(name):
    with pytest.raises(ConfigError, match="did you mean 'resnet34'"):
        build_model(name, 10)


def test_build_model_refuses_non_classifiers_and_downloads():
    with pytest.raises(ConfigError, match="not an image classifier"):
        build_model("fasterrcnn_resnet50_fpn", 3)
    with pytest.raises(ConfigError, match="never downloads"):
        build_model("resnet18", 10, weights="DEFAULT")
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("resnet18", 0)


# ---------------------------------------------------------------------------- head_names
@pytest.mark.parametrize(
    "name, expected",
    [
        ("resnet18", ["fc"]),
        ("mobilenet_v3_small", ["classifier"]),
        ("vgg11", ["classifier"]),
        ("vit_b_16", ["heads"]),
        ("swin_t", ["head"]),
        ("convnext_tiny", ["classifier"]),
    ],
)
def test_head_names(name, expected):
    # The meta device builds even vit_b_16 in milliseconds: only the structure matters here.
    with torch.device("meta"):
        model = build_model(name, 10)
    assert head_names(model) == expected


def test_head_names_without_head_raises():
    with pytest.raises(ConfigError, match="cannot find the classifier head of Sequential"):
        head_names(nn.Sequential(nn.Linear(4, 2)))


# ---------------------------------------------------------------------------- freezing
def test_freeze_except_head_then_sgd_step_changes_only_the_head():
    torch.manual_seed(0)
    model = build_model("resnet18", 4)
    trainable = freeze_except_head(model)
    assert trainable == ["fc.weight", "fc.bias"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Weight decay and momentum would move frozen weights if they reached the optimizer with a grad.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-3)
    loss = nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 3]))
    loss.backward()
    opt.step()

    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == ["fc.weight", "fc.bias"]


def test_freeze_refuses_ddp_and_load_pretrained_goes_through_it(tmp_path):
    source = build_model("resnet18", 3)
    atomic_save(source.state_dict(), tmp_path / "r18.pth")
    # A one-process gloo group over an in-memory store: DDP can be built without other ranks.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(build_model("resnet18", 3))
        with pytest.raises(ConfigError, match="before wrapping it in DDP"):
            freeze_except_head(ddp)
        report = load_pretrained(ddp, tmp_path / "r18.pth")
        assert len(report.loaded) == len(source.state_dict()) and not report.unexpected
        assert torch.equal(ddp.module.fc.weight, source.fc.weight)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- load_pretrained
def test_load_pretrained_skips_the_head_with_another_class_count(tmp_path):
    torch.manual_seed(0)
    source = build_model("resnet18", 5)
    atomic_save(source.state_dict(), tmp_path / "five.pth")
    target = build_model("resnet18", 10)
    fc_before = target.fc.weight.detach().clone()

    report = load_pretrained(target, tmp_path / "five.pth")

    all_keys = list(target.state_dict())
    assert report.loaded == [k for k in all_keys if not k.startswith("fc.")]
    assert report.skipped_shape == [("fc.weight", (5, 512), (10, 512)), ("fc.bias", (5,), (10,))]
    assert report.missing == [] and report.unexpected == []
    assert torch.equal(target.conv1.weight, source.conv1.weight)
    assert torch.equal(target.bn1.running_var, source.bn1.running_var)
    assert torch.equal(target.fc.weight, fc_before)
    summary = report.summary()
    assert "fc.weight: file (5, 512) vs model (10, 512)" in summary
    assert "fc.bias: file (5,) vs model (10,)" in summary
    assert str(tmp_path / "five.pth") in summary


def test_load_pretrained_from_ddp_state_dict_and_export_folder(tmp_path):
    source = build_model("resnet18", 3)
    ddp_sd = {f"module.{k}": v for k, v in source.state_dict().items()}
    target = build_model("resnet18", 3)
    report = load_pretrained(target, {"model": ddp_sd, "epoch": 2})
    assert len(report.loaded) == len(ddp_sd) and not report.skipped_shape
    assert torch.equal(target.fc.weight, source.fc.weight)

    export_weights(source.state_dict(), tmp_path / "run" / "export", ["a", "b", "c"])
    again = build_model("resnet18", 3)
    assert len(load_pretrained(again, tmp_path / "run").loaded) == len(ddp_sd)
    assert torch.equal(again.layer4[1].conv2.weight, source.layer4[1].conv2.weight)


def test_load_pretrained_from_unrelated_model_raises(tmp_path):
    atomic_save(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).state_dict(), tmp_path / "tiny.pth")
    model = build_model("resnet18", 10)
    before = model.conv1.weight.detach().clone()
    with pytest.raises(WeightsError, match="different architecture") as info:
        load_pretrained(model, tmp_path / "tiny.pth")
    message = str(info.value)
    assert str(tmp_path / "tiny.pth") in message and "conv1.weight" in message and "0.weight" in message
    assert torch.equal(model.conv1.weight, before)


def test_check_weights_file_partial_and_foreign_weights(tmp_path):
    atomic_save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "r18.pth")
    report = check_weights_file(tmp_path / "r18.pth", "resnet34", 3)
    assert report.loaded and report.missing  # resnet34 has blocks resnet18 lacks
    with pytest.raises(WeightsError, match="different architecture"):
        check_weights_file(tmp_path / "r18.pth", "mobilenet_v3_small", 3)


# ---------------------------------------------------------------------------- check_weights_file
def test_check_weights_file_missing_path_names_it(tmp_path):
    missing = tmp_path / "nowhere" / "model.pth"
    with pytest.raises(WeightsError, match="not found") as info:
        check_weights_file(missing, "resnet18", 10)
    assert str(missing) in str(info.value)


def test_check_weights_file_matches_like_load_pretrained(tmp_path):
    export_weights(build_model("resnet18", 5).state_dict(), tmp_path / "export", list("abcde"))
    report = check_weights_file(tmp_path / "export", "resnet18", 10)
    assert [k for k, _, _ in report.skipped_shape] == ["fc.weight", "fc.bias"]
    assert report.source.endswith("export")
    with pytest.raises(ConfigError, match="did you mean"):
        check_weights_file(tmp_path / "export", "resnet1B", 10)
