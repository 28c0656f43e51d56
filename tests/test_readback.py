"""The training step never waits for the device: no steady step reads a value of its own on the host.

On a GPU each such read stops the host from queueing the next step until the device has finished
this one. The engine reads a step's values (its loss, whether it is finite) at the next step,
through one helper (``nbddp.rank.readback.read``) that knows which step produced them; only the
epoch's end, a checkpoint, a stop or a read error read the step just done. tests/readwatch.py
follows every value a training forward produced to the host reads of it, independently of that
helper. The GPU settings are forced on the CPU: bf16 autocast, channels_last, a batch transform
prepared ahead.
"""

import pytest
import torch

from nbddp.contract.errors import NonFiniteLossError
from nbddp.rank import readback
from nbddp.rank.engine import train_one_epoch
from readwatch import ReadWatch

STEPS = 8


class Augment:
    """A transform that draws nothing from the rank's random state: prepared a step ahead (as on GPUs)."""

    prepare_ahead = True

    def __call__(self, x):
        return x.flip(3)


def _conv():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))


def _batches(n=STEPS, nan_at=None):
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][0][0, 0, 0, 0] = float("nan")
    return out


def _train(model, data, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return train_one_epoch(model, opt, data, torch.device("cpu"), 0, amp_dtype=torch.bfloat16, channels_last=True,
                           batch_transform=Augment(), **kw)


@pytest.mark.parametrize("accum_steps", [1, 3])
def test_no_steady_step_reads_a_value_of_its_own_step(accum_steps):
    losses = []
    with readback.recording() as helper, ReadWatch() as watch:
        stats = _train(_conv(), _batches(), accum_steps=accum_steps, on_step=lambda s, loss: losses.append((s, loss)))
    assert stats.steps == STEPS and watch.step == STEPS - 1
    last = STEPS - 1
    own = [r for r in watch.reads if r.own_step and r.step != last]
    assert not own, f"steady steps read values of their own step: {own}"
    # Each step's loss does reach the host: at the next step, then the last one at the epoch's end.
    late = sorted({(r.produced, r.step) for r in watch.reads if r.produced is not None})
    assert late == [(s, s + 1) for s in range(last)] + [(last, last)], late
    assert {r.where.split(":")[0] for r in watch.reads if r.produced is not None} == {"readback.py"}, \
        "every read of a step's value goes through the one helper"
    assert [(r.produced, r.step, r.why) for r in helper] == (
        [(s, s + 1, "next step") for s in range(last)] + [(last, last, "epoch end")])
    # on_step and the epoch's loss still see every step's own loss, in order.
    assert [s for s, _ in losses] == list(range(STEPS))
    assert stats.loss == pytest.approx(sum(v for _, v in losses) / STEPS)


def test_a_checkpoint_and_a_stop_read_the_step_they_follow(monkeypatch):
    saves = []
    with readback.recording() as helper:
        stats = _train(_conv(), _batches(), checkpoint=saves.append, checkpoint_due=lambda: len(saves) == 0)
    assert [s.steps for s in saves] == [1]
    assert [(r.produced, r.step, r.why) for r in helper][:2] == [(0, 0, "checkpoint"), (1, 2, "next step")]
    assert saves[0].loss == pytest.approx(helper[0].values[0]), "the checkpoint's totals hold the step it follows"
    assert stats.steps == STEPS and not stats.stopped


@pytest.mark.parametrize("bad_step", [2, STEPS - 1])
def test_a_non_finite_loss_is_named_with_the_step_that_produced_it(bad_step):
    seen = []
    with pytest.raises(NonFiniteLossError, match=rf"loss is nan on rank\(s\) \[0\] at epoch 0, step {bad_step}:"):
        _train(_conv(), _batches(nan_at=bad_step), on_step=lambda s, loss: seen.append(s))
    assert seen == list(range(bad_step)), "no step from the non-finite one on is reported"


def test_the_device_values_wait_for_nothing_on_the_host():
    """On the CPU the value itself is kept (nothing to copy); a copy is made only from another device."""
    t = torch.tensor([1.5])
    late = readback.Copies().start(3, t)
    assert late.step == 3 and late.event is None
    assert readback.read(late, 4, "next step") == [1.5]
    with pytest.raises(ValueError, match="step 3 read at step 2"):
        readback.read(late, 2, "next step")
