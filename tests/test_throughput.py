"""TFLOP/s, MFU and the data wait: the FLOP count against published figures, the peak table as data, the records.

nbddp counts a multiply-add as 2 FLOPs (``torch.utils.flop_counter``); the published ResNet figures
(1.82 and 3.68 "GFLOPs", torchvision's model table and He et al. 2016) count multiply-adds.
"""

import math
import types

import pytest
import torch
import torchvision

import nbddp
from nbddp import spawn_train
from nbddp.contract import rundir
from nbddp.contract.throughput import PEAKS, PRECISIONS, find, peak_tflops, rates_text
from nbddp.rank import flops
from nbddp.rank.runtime import Context
from nbddp.tasks.classification.models import build_model
from conftest import WORKERS, make_tree, small_cfg

#: Forward multiply-adds of one 224 px image, as published (GMAC).
PUBLISHED_GMAC = {"resnet18": 1.82, "resnet34": 3.68}


def _meta_model(name):
    with torch.device("meta"):  # shapes only: the count allocates nothing
        return getattr(torchvision.models, name)()


@pytest.mark.parametrize("name", sorted(PUBLISHED_GMAC))
def test_resnet_flops_at_224_px_match_the_published_figures(name):
    model = _meta_model(name)
    x = torch.empty(1, 3, 224, 224, device="meta")
    forward = nbddp.count_flops(model, x, backward=False)
    assert forward / 2 / 1e9 == pytest.approx(PUBLISHED_GMAC[name], rel=0.05)  # 2 FLOPs per multiply-add
    # The backward computes the gradients of the activations and of the weights, each about the
    # forward's work, except the input image's: a step is a little under 3 forwards.
    step = nbddp.count_flops(model, x)
    assert 2.9 < step / forward < 3.0
    assert nbddp.count_flops(model, torch.empty(4, 3, 224, 224, device="meta")) == 4 * step  # per sample: / batch


def test_frozen_layers_and_channels_last_count_as_the_run_trains():
    from nbddp.tasks.classification.models import freeze_except_head

    model, x = _meta_model("resnet18"), torch.empty(1, 3, 64, 64, device="meta")
    whole = nbddp.count_flops(model, x)
    last = nbddp.count_flops(model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last))
    assert last == whole  # the memory format moves bytes, not FLOPs
    freeze_except_head(model)
    frozen = nbddp.count_flops(model, x)
    forward = nbddp.count_flops(model, x, backward=False)
    assert forward < frozen < 1.01 * forward  # nothing below the head needs a gradient


class _Norms(torch.nn.Module):
    """Each normalisation the count stands in for, called as modules and as functions (keywords too)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.group, self.instance = torch.nn.GroupNorm(2, 8), torch.nn.InstanceNorm2d(8, affine=True)
        self.rms, self.w = torch.nn.RMSNorm([8]), torch.nn.Parameter(torch.ones(8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        x = self.instance(self.group(self.conv(x)))
        x = torch.nn.functional.layer_norm(x.mean((2, 3)), (8,), weight=self.w)
        return self.head(self.rms(x))


def _trainable_only(model, *words):
    for name, p in model.named_parameters():
        p.requires_grad_(any(w in name for w in words))
    return model


@pytest.mark.parametrize("case", ["resnet18", "resnet18 frozen", "resnet18 norms alone trainable",
                                  "convnext_tiny frozen", "norms"])
def test_the_normalisations_stood_in_for_on_meta_count_what_the_real_ones_do(case, monkeypatch):
    """On ``meta`` the count runs each normalisation as one shape-only op (torch computes their
    ``meta`` statistics op by op in Python): the FLOPs, forward and backward, stay the real ones'.

    Trainable norms between frozen convolutions still make autograd compute the convolutions'
    input gradients; frozen ones make it compute nothing there, as the real ones do."""
    from nbddp.tasks.classification.models import freeze_except_head

    name = case.split()[0]
    model = _Norms().to("meta") if name == "norms" else _meta_model(name)
    if case.endswith(" frozen"):
        freeze_except_head(model)
    elif case.endswith("alone trainable"):
        _trainable_only(model, "bn", "downsample.1")
    x = torch.empty(2, 3, 32, 32, device="meta")
    if name == "resnet18":
        x, model = x.contiguous(memory_format=torch.channels_last), model.to(memory_format=torch.channels_last)
    stood_in = nbddp.count_flops(model, x), nbddp.count_flops(model, x, backward=False)
    monkeypatch.setattr(flops, "_NormsShapeOnly", torch.overrides.TorchFunctionMode)  # the real norms
    assert stood_in == (nbddp.count_flops(model, x), nbddp.count_flops(model, x, backward=False))
    assert stood_in[0] > stood_in[1] > 0


def test_the_count_leaves_a_real_model_as_it_was_even_where_it_runs_on_the_device(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 2))
    x = torch.randn(2, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    on_meta = nbddp.count_flops(model, x)

    def no_meta_kernel(*args):
        raise NotImplementedError("an operator without a meta kernel")

    monkeypatch.setattr(flops, "_meta_call", no_meta_kernel)
    assert nbddp.count_flops(model, x) == on_meta > 0  # counted on the CPU instead, the same
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "running statistics untouched"


def test_the_peak_table_is_data_every_row_whole_and_dense():
    assert {p.model for p in PEAKS} >= {"A100", "H100 SXM", "H100 PCIe", "H200", "L40S", "L4", "A10", "RTX 4090"}
    for peak in PEAKS:
        assert set(peak.tflops) == set(PRECISIONS), peak.model
        t = peak.tflops
        assert t["bf16"] == t["fp16"] >= t["tf32"] >= t["fp32"] > 0, peak.model
    # the datasheets' dense figures (the sparse ones are twice these)
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156


@pytest.mark.parametrize("name, model", [
    ("NVIDIA A100-SXM4-40GB", "A100"), ("NVIDIA A100-PCIE-40GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"), ("NVIDIA A10", "A10"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    # Names that look alike but are other chips, or a part of one: no peak rather than a wrong one.
    ("NVIDIA A10G", None), ("NVIDIA L40", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None),
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", None), ("Tesla V100-SXM2-16GB", None), ("", None), (None, None)])
def test_a_device_is_found_by_its_whole_name(name, model):
    found = find(name)
    assert (found.model if found else None) == model


def test_a_device_with_other_multiprocessors_than_its_row_has_no_peak():
    assert find("NVIDIA H100 80GB HBM3", sms=132).model == "H100 SXM"
    assert find("NVIDIA H100 80GB HBM3", sms=16) is None  # a MIG slice that kept the whole name
    with pytest.raises(ValueError, match="precision='int8'"):
        peak_tflops("NVIDIA H100 80GB HBM3", "int8")


def test_throughput_has_no_mfu_on_the_cpu_and_one_with_a_known_device_name(monkeypatch):
    cpu = torch.device("cpu")
    r = flops.throughput(1000, 2.0, cpu, flops_per_sample=20e9, precision="bf16", data_wait_s=0.5)
    assert r == {"samples_per_s": 500.0, "tflops": pytest.approx(10.0), "data_wait": 0.25}
    monkeypatch.setattr(flops, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    r = flops.throughput(1000, 2.0, cpu, flops_per_sample=20e9, precision="bf16")
    assert r["mfu"] == pytest.approx(10.0 / 989.4)
    assert "mfu" not in flops.throughput(1000, 2.0, cpu, flops_per_sample=20e9)  # no precision: no guess
    with pytest.raises(ValueError, match="precision='float32'"):
        flops.throughput(1, 1.0, cpu, 1.0, precision="float32")


def test_context_throughput_times_from_its_last_call():
    ctx = types.SimpleNamespace(device=torch.device("cpu"), _throughput_since=0.0)
    r = Context.throughput(ctx, 100, 1e9, seconds=0.5, data_wait_s=0.1)
    assert r == {"samples_per_s": 200.0, "tflops": pytest.approx(0.2), "data_wait": pytest.approx(0.2)}
    since = ctx._throughput_since
    r = Context.throughput(ctx, 100)  # no seconds: since the call before
    assert ctx._throughput_since > since and r["samples_per_s"] > 0 and set(r) == {"samples_per_s"}


def test_rates_read_as_one_line():
    assert rates_text({"tflops": 21.34, "mfu": 0.0216, "data_wait": 0.04}) == "  21.3 TFLOP/s (MFU 2.16%)  data wait 4%"
    assert rates_text({"tflops": 0.000443, "mfu": 4.48e-7, "data_wait": 0.5}) == \
        "  0.000443 TFLOP/s (MFU 4.48e-05%)  data wait 50%"
    assert rates_text({"images_per_s": 3.0}) == ""


@pytest.fixture(scope="module")
def faked_h100_run(tmp_path_factory):
    """One epoch of the built-in worker on one CPU rank whose device the MFU takes for an H100 SXM."""
    root = tmp_path_factory.mktemp("throughput")
    cfg = small_cfg(make_tree(root / "data"), root / "runs", nprocs=1, epochs=1)
    return cfg, spawn_train(cfg, echo=False, env={"NBDDP_RANK_HOOK": f"{WORKERS / 'device_name.py'}:install"})


def test_the_builtin_workers_records_carry_tflops_mfu_and_data_wait(faked_h100_run):
    cfg, result = faked_h100_run
    (record,) = result.metrics
    assert {"tflops", "mfu", "data_wait"} <= set(record)
    with torch.device("meta"):
        model = build_model(cfg.model, 3)
    per_image = nbddp.count_flops(model, torch.empty(2, 3, cfg.image_size, cfg.image_size, device="meta")) / 2
    assert record["tflops"] == pytest.approx(record["images_per_s"] * per_image / 1e12)  # one rank: the run's images
    peak = peak_tflops("NVIDIA H100 80GB HBM3", "tf32" if torch.backends.cudnn.allow_tf32 else "fp32")
    assert record["mfu"] == pytest.approx(record["tflops"] / peak)  # no amp on a CPU rank: fp32 tensors
    assert 0 < record["data_wait"] < 1 and math.isfinite(record["data_wait"])
    log = rundir.rank_log(result.run_dir, 0).read_text()
    assert "GFLOP per image, forward and backward" in log
    assert "TFLOP/s (MFU " in log and "data wait " in log  # the epoch line, as `python -m nbddp train` shows it


class _SlowLoader:
    """Batches that each take ``wait_s`` to come (a loader the step waits for)."""

    def __init__(self, batches, wait_s):
        self.batches, self.wait_s = batches, wait_s

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        import time

        for b in self.batches:
            time.sleep(self.wait_s)
            yield b


def test_the_engine_counts_the_time_it_waits_for_batches_and_a_resumed_epoch_keeps_its_share():
    from nbddp.rank.engine import EpochStats, train_one_epoch

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(2, 3, 2, 2), torch.tensor([0, 1])) for _ in range(4)]
    stats = train_one_epoch(model, opt, _SlowLoader(batches, 0.05), torch.device("cpu"), 0)
    assert stats.data_wait_s >= 4 * 0.05 and stats.data_wait_s <= stats.seconds  # every batch's wait, the first's too
    assert stats.data_wait == pytest.approx(stats.data_wait_s / stats.seconds)
    start = EpochStats(loss=1.0, steps=2, images=4, seconds=10.0, stopped=False, data_wait_s=7.0)
    resumed = train_one_epoch(model, opt, _SlowLoader(batches[:2], 0.0), torch.device("cpu"), 0, start=start)
    assert resumed.data_wait_s >= 7.0 and resumed.seconds >= 10.0  # the part done before the resume counts
