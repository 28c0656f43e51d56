"""CPUSyncBatchNorm and convert_sync_batchnorm, checked against plain batch norm.

Distributed tests run 2 real processes (spawn, gloo on a file store) and compare what each
rank ends with against one process that sees the whole batch. The two ranks are started once
for the module and run every distributed case in turn (each case builds its own seeded model
and data); each test asserts on its case's results. Worker functions live at module level
because spawn children import them by name; pytest puts this folder on ``sys.path`` and spawn
hands the parent's ``sys.path`` to the children.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from nbddp.contract.errors import ConfigError
from nbddp.rank.sync_bn import CPUSyncBatchNorm, convert_sync_batchnorm

WORLD = 2
PER_RANK = 4  # samples per rank; the single-process reference sees WORLD * PER_RANK
LR = 0.1
ATOL = 1e-6
RTOL = 1e-5
# Eval outputs go through several layers divided by sqrt(running_var): float32 rounding in the
# state grows to a few 1e-6 there (the float32 single-process reference is itself ~4e-6 away
# from a float64 run after 3 steps), so outputs get a proportionally wider float tolerance.
PROBE_ATOL = 2e-5
CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------
# Harness: run ``worker(rank, world_size, *args)`` in real processes, collect its results.
# --------------------------------------------------------------------------------------


def _bootstrap(rank: int, worker, out_dir: str, world_size: int, args: tuple) -> None:
    # One thread per child: two ranks on a 2-core runner must not oversubscribe it.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=world_size,
        # A rank that skips a collective fails the test in a minute instead of hanging it.
        timeout=timedelta(seconds=60),
    )
    try:
        torch.save(worker(rank, world_size, *args), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(worker, tmp_path, *args, world_size: int = WORLD) -> list:
    """Run ``worker`` on ``world_size`` spawned ranks; return each rank's result, by rank."""
    mp.start_processes(
        _bootstrap,
        args=(worker, str(tmp_path), world_size, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


# --------------------------------------------------------------------------------------
# Models and data shared by the ranks and the single-process reference.
# --------------------------------------------------------------------------------------


def make_plain_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 5),
    )


def make_bn_model(seed: int = 0, **bn_kwargs) -> nn.Module:
    """BatchNorm on the raw input (no input grad), after convs (4D) and after a linear (2D)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.BatchNorm2d(3, **bn_kwargs),
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6, **bn_kwargs),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1),
        nn.BatchNorm2d(6, **bn_kwargs),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 8),
        nn.BatchNorm1d(8, **bn_kwargs),
        nn.ReLU(),
        nn.Linear(8, 5),
    )
    # Non-trivial affine parameters so that a wrong weight/bias gradient shows.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def make_batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``WORLD * PER_RANK`` images; rank r trains on slice r.

    The second half is shifted and scaled so that per-rank statistics differ clearly from
    the global ones: without synchronisation the ranks must visibly diverge.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(WORLD * PER_RANK, 3, 8, 8, generator=gen)
    x[PER_RANK:] = 2.0 * x[PER_RANK:] + 1.0
    y = torch.randint(0, 5, (WORLD * PER_RANK,), generator=gen)
    return x, y


def rank_slice(rank: int) -> slice:
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


def sgd_steps(model: nn.Module, steps: int, rank: int | None = None) -> None:
    """Train ``steps`` SGD steps with mean cross-entropy; ``rank=None`` uses the whole batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    for step in range(steps):
        x, y = make_batch(step)
        if rank is not None:
            x, y = x[rank_slice(rank)], y[rank_slice(rank)]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def probe_eval(model: nn.Module) -> torch.Tensor:
    """Eval-mode output on a fixed batch: uses the running statistics."""
    model.eval()
    with torch.no_grad():
        return model(make_batch(step=99)[0])


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(builder, steps: int, **kwargs) -> tuple[dict, torch.Tensor]:
    """One process, plain layers, whole batch: what the distributed run must reproduce."""
    model = builder(**kwargs)
    sgd_steps(model, steps)
    return snapshot(model), probe_eval(model)


def ddp_run(builder, rank: int, steps: int, sync_bn: bool, **kwargs) -> dict:
    model = builder(**kwargs)
    if sync_bn:
        model = convert_sync_batchnorm(model, CPU)
    ddp = DistributedDataParallel(model)
    sgd_steps(ddp, steps, rank=rank)
    return {"state": snapshot(model), "probe": probe_eval(model)}


def _named(name: str):
    """An ``assert_close`` message that keeps torch's diagnostics and says what was compared."""
    return lambda message: f"{name}: {message}"


def assert_states_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], atol=ATOL, rtol=RTOL, msg=_named(key)
        )


def max_param_diff(actual: dict, expected: dict, model: nn.Module) -> float:
    names = [n for n, _ in model.named_parameters()]
    return max((actual[n] - expected[n]).abs().max().item() for n in names)


# --------------------------------------------------------------------------------------
# Workers (module level: spawn children import them from this file).
# --------------------------------------------------------------------------------------


def worker_plain_ddp(rank: int, world_size: int) -> dict:
    return ddp_run(make_plain_model, rank, steps=1, sync_bn=False)


def worker_bn_ddp(rank: int, world_size: int, steps: int, bn_kwargs: dict) -> dict:
    return {
        "sync": ddp_run(make_bn_model, rank, steps, sync_bn=True, **bn_kwargs),
        "local": ddp_run(make_bn_model, rank, steps, sync_bn=False, **bn_kwargs),
    }


def uneven_inputs(sizes: tuple[int, ...]):
    """A global (N, C, L) batch, a fixed upstream gradient, and the BN's affine parameters."""
    gen = torch.Generator().manual_seed(7)
    n = sum(sizes)
    x = torch.randn(n, 5, 6, generator=gen) * 3.0 + 2.0
    upstream = torch.randn(n, 5, 6, generator=gen)
    weight = torch.rand(5, generator=gen) + 0.5
    bias = torch.randn(5, generator=gen)
    return x, upstream, weight, bias


def bn_step(bn: nn.Module, x: torch.Tensor, upstream: torch.Tensor, weight, bias) -> dict:
    """Forward and backward ``sum(bn(x) * upstream)``; return output, grads and buffers."""
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    x = x.clone().requires_grad_(True)
    out = bn(x)
    (out * upstream).sum().backward()
    return {
        "out": out.detach(),
        "grad_input": x.grad,
        "grad_weight": bn.weight.grad,
        "grad_bias": bn.bias.grad,
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
        "num_batches_tracked": bn.num_batches_tracked.clone(),
    }


def worker_uneven(rank: int, world_size: int, sizes: tuple[int, ...]) -> dict:
    x, upstream, weight, bias = uneven_inputs(sizes)
    start = sum(sizes[:rank])
    part = slice(start, start + sizes[rank])
    return bn_step(CPUSyncBatchNorm(5), x[part], upstream[part], weight, bias)


MOMENTUM_NONE_AFFINE_FALSE = {"momentum": None, "affine": False}
UNEVEN = {"3+5": (3, 5), "empty+4": (0, 4)}
# Every two-rank case, by name: (worker, its arguments after rank and world size).
CASES = {
    "plain ddp": (worker_plain_ddp, ()),
    "bn ddp, 1 step": (worker_bn_ddp, (1, {})),
    "bn ddp, 3 steps, momentum=None, affine=False": (worker_bn_ddp, (3, MOMENTUM_NONE_AFFINE_FALSE)),
    **{f"uneven {name}": (worker_uneven, (sizes,)) for name, sizes in UNEVEN.items()},
}


def worker_cases(rank: int, world_size: int, cases: dict) -> dict:
    """Every case in turn on this rank, in one process group: ``{case: result}``."""
    return {name: worker(rank, world_size, *args) for name, (worker, args) in cases.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """``{case: [rank 0's result, rank 1's result]}`` for every case of ``CASES``, from one launch."""
    results = run_ranks(worker_cases, tmp_path_factory.mktemp("two_ranks"), CASES)
    return {name: [r[name] for r in results] for name in CASES}


# --------------------------------------------------------------------------------------
# Single process: without a process group it is ordinary batch norm.
# --------------------------------------------------------------------------------------


BN_CONFIGS = [
    {},
    {"momentum": None},
    {"affine": False},
    {"track_running_stats": False},
]


def _forward_backward(bn: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    out = bn(x)
    (out * upstream).sum().backward()
    result = {"out": out.detach(), "grad_input": x.grad}
    result.update({f"grad_{n}": p.grad for n, p in bn.named_parameters()})
    result.update({n: b.clone() for n, b in bn.named_buffers()})
    return result


@pytest.mark.parametrize("config", BN_CONFIGS, ids=lambda c: ",".join(c) or "default")
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_batchnorm2d_without_process_group(config, training):
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(4, **config)
    if plain.affine:
        with torch.no_grad():
            plain.weight.uniform_(0.5, 1.5)
            plain.bias.uniform_(-0.5, 0.5)
    if plain.track_running_stats:
        plain.running_mean.uniform_(-1, 1)
        plain.running_var.uniform_(0.5, 2)
    sync = convert_sync_batchnorm(copy.deepcopy(plain), CPU)
    assert isinstance(sync, CPUSyncBatchNorm)
    plain.train(training)
    sync.train(training)

    for step in range(3):  # several steps: the momentum=None average depends on the count
        x = torch.randn(5, 4, 6, 6) * 2 + 1
        upstream = torch.randn(5, 4, 6, 6)
        expected = _forward_backward(plain, x, upstream)
        actual = _forward_backward(sync, x, upstream)
        assert actual.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(
                actual[key], expected[key], msg=_named(f"step {step}: {key}")
            )


def test_single_rank_process_group_is_plain_batchnorm(tmp_path):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    plain = nn.BatchNorm2d(3)
    sync = convert_sync_batchnorm(copy.deepcopy(plain), CPU)
    x, upstream = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )
    try:
        expected = _forward_backward(plain, x, upstream)
        actual = _forward_backward(sync, x, upstream)
    finally:
        dist.destroy_process_group()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=_named(key))


def test_rejects_a_single_value_per_channel_like_batchnorm():
    with pytest.raises(ValueError):
        CPUSyncBatchNorm(3).train()(torch.randn(1, 3))
    with pytest.raises(ValueError):
        CPUSyncBatchNorm(3)(torch.randn(3))


# --------------------------------------------------------------------------------------
# Two ranks: gradient semantics of DDP, with and without synchronised batch norm.
# --------------------------------------------------------------------------------------


def test_ddp_without_batchnorm_equals_one_process_on_the_whole_batch(two_ranks):
    expected, expected_probe = reference(make_plain_model, steps=1)
    for rank, result in enumerate(two_ranks["plain ddp"]):
        assert_states_close(result["state"], expected)
        torch.testing.assert_close(result["probe"], expected_probe, atol=ATOL, rtol=RTOL)
    # The step really moved the weights: equality above is not trivially "nothing changed".
    assert max_param_diff(expected, snapshot(make_plain_model()), make_plain_model()) > 1e-3


def test_sync_bn_ddp_equals_one_process_and_local_bn_does_not(two_ranks):
    expected, expected_probe = reference(make_bn_model, steps=1)
    results = two_ranks["bn ddp, 1 step"]
    for rank, result in enumerate(results):
        # Parameters after the step, running_mean/var and num_batches_tracked.
        assert_states_close(result["sync"]["state"], expected)
        torch.testing.assert_close(
            result["sync"]["probe"], expected_probe, atol=PROBE_ATOL, rtol=RTOL
        )
        # Ordinary BatchNorm normalises each rank with its own statistics: parameters differ.
        diff = max_param_diff(result["local"]["state"], expected, make_bn_model())
        assert diff > 1000 * ATOL, f"rank {rank}: unsynchronised BN matched (diff {diff:.2e})"


def test_sync_bn_ddp_momentum_none_affine_false_over_three_steps(two_ranks):
    """Cumulative-average running stats and affine-free layers, over several steps."""
    steps, bn_kwargs = 3, MOMENTUM_NONE_AFFINE_FALSE
    expected, expected_probe = reference(make_bn_model, steps=steps, **bn_kwargs)
    for rank, result in enumerate(two_ranks["bn ddp, 3 steps, momentum=None, affine=False"]):
        assert_states_close(result["sync"]["state"], expected)
        assert int(result["sync"]["state"]["0.num_batches_tracked"]) == steps
        torch.testing.assert_close(
            result["sync"]["probe"], expected_probe, atol=PROBE_ATOL, rtol=RTOL
        )
        diff = max_param_diff(result["local"]["state"], expected, make_bn_model(**bn_kwargs))
        assert diff > 1000 * ATOL, f"rank {rank}: unsynchronised BN matched (diff {diff:.2e})"


@pytest.mark.parametrize("name", list(UNEVEN))
def test_uneven_batches_use_global_statistics_and_local_param_grads(two_ranks, name):
    """No DDP: the layer alone, with 3D input and a different batch size on each rank.

    With a summed loss, the whole-batch gradient of the input is the concatenation of the
    ranks' input gradients, and the whole-batch parameter gradient is the SUM of the ranks'
    local ones (DDP would divide that sum by the world size for a mean loss).
    """
    x, upstream, weight, bias = uneven_inputs(UNEVEN[name])
    expected = bn_step(nn.BatchNorm1d(5), x, upstream, weight, bias)
    results = two_ranks[f"uneven {name}"]

    for key in ("out", "grad_input"):
        actual = torch.cat([r[key] for r in results])
        torch.testing.assert_close(actual, expected[key], atol=ATOL, rtol=RTOL, msg=_named(key))
    for key in ("grad_weight", "grad_bias"):
        local_sum = sum(r[key] for r in results)
        torch.testing.assert_close(local_sum, expected[key], atol=ATOL, rtol=RTOL, msg=_named(key))
    for r in results:
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(r[key], expected[key], atol=ATOL, rtol=RTOL, msg=_named(key))


# --------------------------------------------------------------------------------------
# Conversion.
# --------------------------------------------------------------------------------------


def test_convert_resnet18_replaces_every_batchnorm_and_keeps_state():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    # Make flags and modes non-uniform so that losing them would show.
    model.layer1[0].bn1.weight.requires_grad_(False)
    model.bn1.bias.requires_grad_(False)
    model.layer2.eval()
    original = copy.deepcopy(model)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    state = snapshot(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}

    converted = convert_sync_batchnorm(model, CPU)

    bns = [m for m in converted.modules() if isinstance(m, _BatchNorm)]
    assert n_bn == 20 and len(bns) == n_bn
    assert all(type(m) is CPUSyncBatchNorm for m in bns)
    assert_states_close(snapshot(converted), state)
    for key, value in converted.state_dict().items():
        assert value.dtype == state[key].dtype, key
    assert {n: p.requires_grad for n, p in converted.named_parameters()} == flags
    assert {n: m.training for n, m in converted.named_modules()} == modes

    # Undistributed, the converted model computes exactly what the original does.
    x = torch.randn(2, 3, 32, 32)
    original.train()
    converted.train()
    torch.testing.assert_close(converted(x), original(x))
    assert_states_close(snapshot(converted), snapshot(original))  # running stats moved alike


def test_convert_keeps_settings_and_returns_new_root():
    bn = nn.BatchNorm3d(4, eps=1e-3, momentum=None, affine=False, track_running_stats=False)
    bn.eval()
    sync = convert_sync_batchnorm(bn, "cpu")
    assert isinstance(sync, CPUSyncBatchNorm) and sync is not bn
    assert (sync.num_features, sync.eps, sync.momentum) == (4, 1e-3, None)
    assert not sync.affine and not sync.track_running_stats and not sync.training
    assert sync.weight is None and sync.running_mean is None
    # Converting again leaves the already converted layers alone.
    model = nn.Sequential(nn.Linear(3, 4), sync)
    assert convert_sync_batchnorm(model, CPU)[1] is sync


def test_convert_on_cuda_uses_torch_sync_batchnorm():
    # Conversion alone needs no GPU: only the forward of torch's SyncBatchNorm does.
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), "cuda")
    assert type(model[1]) is nn.SyncBatchNorm


def test_convert_rejects_other_devices():
    with pytest.raises(ConfigError, match="CUDA and CPU"):
        convert_sync_batchnorm(nn.BatchNorm2d(4), torch.device("meta"))
