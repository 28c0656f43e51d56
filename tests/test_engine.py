"""The training step's one agreement per step (2 real gloo ranks): read errors, stop, losses.

Each step carries the loss, non-finite flags, the stop request and a read error of the *next*
batch in one all-reduce that overlaps the backward. These tests inject a condition on one rank
only and check that both ranks leave at the same step with the same weights.
"""

import pytest

from nbddp import spawn_train
from conftest import WORKERS

ENGINE = f"{WORKERS / 'engine_worker.py'}:run"


def run(runs_dir, **kw):
    return spawn_train(ENGINE, nprocs=2, runs_dir=runs_dir, echo=False, kwargs=kw).value


def test_clean_epoch_takes_every_step_on_every_rank(runs_dir):
    r0, r1 = run(runs_dir)
    assert r0["steps"] == r1["steps"] == 8 and not r0["stopped"]
    assert r0["loss"] == r1["loss"], "the reported loss is the mean over ranks, the same everywhere"
    assert r0["same_weights"] and r0["read"] == r1["read"] == 8


@pytest.mark.parametrize("bad_step", [0, 5])
def test_unreadable_batch_on_one_rank_stops_both_before_that_step(runs_dir, bad_step):
    r0, r1 = run(runs_dir, bad_rank=1, bad_step=bad_step)
    assert r1["error"] == "OSError" and f"cannot read batch {bad_step}" in r1["message"]
    assert r0["error"] == "PeerError"
    assert f"rank 1 could not read its batch at epoch 0, step {bad_step}" in r0["message"]
    # Steps before the bad batch were trained on both ranks, none after it.
    assert r0["steps"] == r1["steps"] == bad_step
    assert r0["same_weights"]


def test_non_finite_loss_on_one_rank_stops_both_naming_the_rank_and_its_step(runs_dir):
    # The loss reaches the host a step late: both ranks learn of it in step 4's agreement, and
    # leave before step 4's update, naming step 3.
    r0, r1 = run(runs_dir, nan_rank=1, nan_step=3)
    for r in (r0, r1):
        assert r["error"] == "NonFiniteLossError" and "on rank(s) [1] at epoch 0, step 3:" in r["message"], r
    assert "loss is nan on rank(s) [1]" in r1["message"] and "loss is non-finite on rank(s) [1]" in r0["message"]
    assert r0["steps"] == r1["steps"] == 3, "on_step saw steps 0-2 only"
    assert r0["same_weights"]


def test_stop_request_seen_by_one_rank_ends_both_at_the_same_step(runs_dir):
    # And a checkpoint asked for by rank 1 alone at step 1: both ranks save after it, and again
    # after the step they stop at.
    r0, r1 = run(runs_dir, stop_rank=0, stop_step=3, save_rank=1, save_step=1)
    assert r0["stopped"] and r1["stopped"]
    assert r0["steps"] == r1["steps"] == 4, "the step in flight is finished, then both leave"
    assert r0["same_weights"]
    assert r0["saves"] == r1["saves"] == [2, 4], "the next step to run, on every rank together"


def test_stop_before_the_first_step_trains_nothing(runs_dir):
    r0, r1 = run(runs_dir, stop_rank=1, stop_step=0)
    assert r0["stopped"] and r1["stopped"]
    assert r0["steps"] == r1["steps"] == 0


def test_single_process_and_empty_epochs_need_no_process_group():
    import torch

    from nbddp.rank.engine import train_one_epoch

    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    empty = train_one_epoch(model, opt, [], torch.device("cpu"), 0)
    assert (empty.steps, empty.images, empty.stopped) == (0, 0, False)
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    before = model.weight.detach().clone()
    stats = train_one_epoch(model, opt, data, torch.device("cpu"), 0)
    assert (stats.steps, stats.images) == (3, 12) and not torch.equal(before, model.weight)


def test_the_next_batch_is_prepared_before_the_step_waits_for_the_device():
    """The transform of batch n+1 (decoding, augmenting on the rank) runs before step n's
    agreement waits for the device and the optimizer steps, so it overlaps the device's work;
    one that fails stops the epoch as an unreadable batch does, before that batch's step."""
    import torch

    from nbddp.rank.engine import train_one_epoch

    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []
    opt.register_step_pre_hook(lambda *_: events.append("step"))

    class Transform:
        prepare_ahead = True  # draws nothing from the rank's random state (the decode pipeline's)

        def __call__(self, x):
            events.append("prepare")
            if float(x[0, 0]) == 99.0:
                raise RuntimeError("cannot decode batch 2")
            return x * 2

    transform = Transform()

    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    stats = train_one_epoch(model, opt, data, torch.device("cpu"), 0, batch_transform=transform)
    assert stats.steps == 3
    assert events == ["prepare", "prepare", "step", "prepare", "step", "step"]
    events.clear()
    data[2][0][0, 0] = 99.0
    with pytest.raises(RuntimeError, match="cannot decode batch 2"):
        train_one_epoch(model, opt, data, torch.device("cpu"), 0, batch_transform=transform)
    assert events == ["prepare", "prepare", "step", "prepare", "step"], "step 1 ends; batch 2's step never runs"
    # A transform that may draw from the rank's random state runs at its step, as before.
    events.clear()
    train_one_epoch(model, opt, data[:2], torch.device("cpu"), 0, batch_transform=lambda x: events.append("prepare") or x)
    assert events == ["prepare", "step", "prepare", "step"]


def test_ddp_buffer_option_is_accepted_without_deprecation_warnings():
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbddp.rank.dist import no_forward_buffer_sync

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model = DDP(torch.nn.BatchNorm1d(3), **no_forward_buffer_sync())
        model(torch.randn(4, 3))
        assert model.module.running_mean.abs().sum() > 0  # the rank's own statistics
    finally:
        dist.destroy_process_group()


def test_gradients_live_in_ddps_buckets_on_gpus_only():
    """On GPUs the bucket views save a gradient-sized buffer of GPU memory; on CPU ranks they slow
    the backward (ResNet18 on 2 gloo ranks: 131-143 ms against 125-132 ms), so they are off."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbddp.rank.dist import ddp_options

    assert ddp_options(torch.device("cuda", 0))["gradient_as_bucket_view"] is True
    assert ddp_options(torch.device("cpu"))["gradient_as_bucket_view"] is False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(3, 2), **ddp_options(torch.device("cpu")))  # torch takes them as they are
        model(torch.randn(4, 3)).sum().backward()
        assert model.module.weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_checkpoints_in_the_middle_of_an_epoch_and_a_resumed_epoch_continue_its_steps():
    import torch

    from nbddp.rank.engine import EpochStats, train_one_epoch

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(5)]
    saves = []
    train_one_epoch(model, opt, data, torch.device("cpu"), 0, checkpoint=saves.append, checkpoint_due=lambda: True)
    assert [s.steps for s in saves] == [1, 2, 3, 4], "none after the last step: the epoch's own save follows"
    assert saves[1].images == 8 and not saves[1].stopped

    steps = []
    start = EpochStats(loss=2.0, steps=3, images=12, seconds=1.5, stopped=False)
    stats = train_one_epoch(model, opt, data[3:], torch.device("cpu"), 0, start=start,
                            on_step=lambda step, loss: steps.append((step, loss)))
    assert [s for s, _ in steps] == [3, 4], "the numbering continues"
    assert (stats.steps, stats.images) == (5, 20) and stats.seconds >= 1.5
    assert stats.loss == pytest.approx((2.0 * 3 + sum(loss for _, loss in steps)) / 5)
