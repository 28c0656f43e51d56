"""Mixed precision: the dtype follows the GPU's real capability; fp16 steps go through a GradScaler.

No GPU is needed: the capability is stubbed for the choice, and the fp16 + scaler branch of the
training step runs under CPU autocast (float16 there since torch 2.x; skipped where not).
"""

import pytest
import torch

from nbddp.rank import engine
from nbddp.contract.errors import NonFiniteLossError

CUDA0 = torch.device("cuda", 0)  # a device object only: creating it does not start CUDA


@pytest.mark.parametrize("capability, expected", [
    ((7, 0), torch.float16),   # V100: bf16 only through emulation, several times slower
    ((7, 5), torch.float16),   # T4
    ((8, 0), torch.bfloat16),  # A100
    ((8, 6), torch.bfloat16),  # A10 / RTX 30xx
    ((9, 0), torch.bfloat16),  # H100
])
def test_bf16_only_from_compute_capability_8(monkeypatch, capability, expected):
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: seen.append(device) or capability)
    # What torch answers on a V100 with emulation: it must not decide the choice.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert engine.autocast_dtype(CUDA0) == expected
    assert seen and all(d in (CUDA0, 0) for d in seen), "the capability of the rank's own device is asked"


def test_no_autocast_off_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: pytest.fail("CPU ranks must not query CUDA"))
    assert engine.autocast_dtype(torch.device("cpu")) is None


def test_scaler_only_for_fp16_and_on_the_ranks_device_type():
    assert engine.grad_scaler(CUDA0, torch.bfloat16) is None
    assert engine.grad_scaler(CUDA0, None) is None
    scaler = engine.grad_scaler(torch.device("cpu"), torch.float16)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler._device == "cpu", "the scaler works on the device the rank trains on, not a fixed 'cuda'"


def _cpu_fp16_or_skip():
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.nn.Linear(2, 2)(torch.randn(1, 2))
        torch.amp.GradScaler("cpu")
    except (RuntimeError, AttributeError, TypeError) as exc:  # older torch: no CPU float16 autocast or scaler
        pytest.skip(f"this torch ({torch.__version__}) cannot run float16 autocast with a scaler on the CPU: {exc}")
    if out.dtype != torch.float16:
        pytest.skip(f"CPU autocast of this torch ({torch.__version__}) does not compute linear layers in float16")


def test_fp16_step_with_scaler_skips_an_overflowing_step_and_trains_the_others():
    _cpu_fp16_or_skip()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # A scale that small data does not overflow (the default 2^16 would on the first steps here).
    scaler = engine.grad_scaler(torch.device("cpu"), torch.float16, init_scale=2.0**10)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    # Step 2: large inputs. The logits and the loss stay finite (the loss is computed in fp32),
    # but the scaled weight gradient (about 2^10 * 1e4 per image) overflows float16.
    data[2] = (torch.full((4, 6), 1e4), torch.tensor([0, 1, 2, 0]))
    snapshots = []

    def on_step(step, loss):
        snapshots.append((model.weight.detach().clone(), scaler.get_scale(), loss))

    before = model.weight.detach().clone()
    stats = engine.train_one_epoch(model, opt, data, torch.device("cpu"), 0, scaler=scaler,
                                   amp_dtype=torch.float16, on_step=on_step)
    assert stats.steps == 4 and not stats.stopped
    weights = [before] + [w for w, _, _ in snapshots]
    scales = [2.0**10] + [s for _, s, _ in snapshots]
    assert all(torch.isfinite(torch.tensor(loss)) for _, _, loss in snapshots), "every loss was finite"
    assert torch.isfinite(model.weight).all()
    # Steps 0, 1, 3 changed the weights; step 2 was skipped and halved the scale.
    assert not torch.equal(weights[1], weights[0]) and not torch.equal(weights[2], weights[1])
    assert torch.equal(weights[3], weights[2]), "the step with an inf gradient must leave the weights unchanged"
    assert not torch.equal(weights[4], weights[3]), "training goes on after the skipped step"
    assert scales == [2.0**10, 2.0**10, 2.0**10, 2.0**9, 2.0**9], "halved once, on the skipped step"


def test_fp16_nonfinite_loss_still_stops_with_a_scaler():
    _cpu_fp16_or_skip()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = engine.grad_scaler(torch.device("cpu"), torch.float16)
    # Inputs beyond float16's range: the logits are inf in float16, so the loss itself is not finite.
    data = [(torch.full((4, 6), 1e6), torch.tensor([0, 1, 2, 0]))]
    with pytest.raises(NonFiniteLossError, match="turn amp off"):
        engine.train_one_epoch(model, opt, data, torch.device("cpu"), 0, scaler=scaler, amp_dtype=torch.float16)
