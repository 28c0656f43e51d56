"""FLOPs of a training step, counted once, and what a rank's throughput is worth: TFLOP/s, MFU, data wait.

nbddp counts FLOPs as ``torch.utils.flop_counter.FlopCounterMode`` does: a multiply-add is **2**
FLOPs (papers that quote ResNet-50 at "4.1 GFLOPs" count multiply-adds, MACs: half nbddp's
number), and only the matrix products and convolutions are counted (normalisations, activations,
pooling and the loss are a few per cent of a convolutional network's work, and no peak is
quoted for them). The backward counts what autograd computes: the gradients of the activations
and of the trainable weights, not those of frozen layers' weights nor of the input images.

The count runs on the ``meta`` device: shapes only, no memory, no arithmetic. There the
normalisations (batch, layer, group, instance, RMS norm), which count nothing, are stood in for by
one shape-only operation: torch computes their ``meta`` statistics in Python, op by op, which was
most of the count's time (ResNet34 at 224 px, as a rank counts it: 0.08 s of one CPU core, once per
run, instead of 0.2 s; ``bench/flop_count.py``). ``MFU`` (model FLOPs utilisation) is the achieved
TFLOP/s over the device's dense peak at the precision in use (:mod:`nbddp.contract.throughput`);
off a GPU, or on a GPU the table does not know, there is none.

Worker side: it reads the rank's device (``torch.cuda``).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..contract.throughput import PRECISIONS, peak_tflops


def device_name(device: torch.device) -> Optional[str]:
    """``device``'s CUDA name (``"NVIDIA H100 80GB HBM3"``), None off the GPU: what the MFU's peak is looked up by.

    Looked up at each call through this module, so a rank hook can name a CPU rank's device as a
    GPU (``tests/workers/device_name.py``).
    """
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def device_sms(device: torch.device) -> Optional[int]:
    """``device``'s count of streaming multiprocessors, None off the GPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def precision_of(amp_dtype: Optional[torch.dtype]) -> str:
    """The precision a step computes in, for its peak: the autocast dtype, else tf32 or fp32.

    Without autocast, fp32 convolutions go through the tensor cores as TF32 while
    ``torch.backends.cudnn.allow_tf32`` holds (PyTorch's default) and matmuls while
    ``torch.backends.cuda.matmul.allow_tf32`` does (not the default); the built-in worker's
    models are convolutional, so cuDNN's flag decides.
    """
    if amp_dtype is not None:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype, "fp32")
    return "tf32" if torch.backends.cudnn.allow_tf32 else "fp32"


class _ShapeOnly(torch.autograd.Function):
    """A normalisation on ``meta``: the input's shape out; back, a gradient for the input and for
    each affine parameter that needs one (so autograd computes upstream what the real one makes it)."""

    @staticmethod
    def forward(ctx, x, *params):
        ctx.params = [(p.shape, p.dtype) for p in params]
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad
        return (grad if needs[0] else None,
                *(grad.new_empty(shape, dtype=dtype) if need else None
                  for (shape, dtype), need in zip(ctx.params, needs[1:])))


#: The normalisations stood in for on ``meta``, each with its signature: none has a FLOP formula in
#: ``FlopCounterMode`` and each gives its input's shape, so the count is the same, in a third to four
#: fifths of the time (``bench/flop_count.py``).
_NORMS = {f: inspect.signature(f) for f in (F.batch_norm, F.instance_norm, F.layer_norm, F.group_norm, F.rms_norm)}


class _NormsShapeOnly(TorchFunctionMode):
    """Calls of the functions of :data:`_NORMS` (the modules' forwards call them) go to :class:`_ShapeOnly`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        signature = _NORMS.get(func)
        if signature is None:
            return func(*args, **(kwargs or {}))
        bound = signature.bind(*args, **(kwargs or {})).arguments
        params = [bound.get(name) for name in ("weight", "bias")]
        return _ShapeOnly.apply(bound["input"], *(p for p in params if isinstance(p, torch.Tensor)))


def _meta_call(model: torch.nn.Module, args: tuple, kwargs: dict, backward: bool):
    """One forward (and backward) of ``model`` with every parameter, buffer and input as a meta tensor,
    its normalisations stood in for (:class:`_NormsShapeOnly`)."""
    from torch.func import functional_call

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad and t.is_floating_point())

    state = {name: meta(p) for name, p in model.named_parameters()}
    state.update({name: torch.empty_like(b, device="meta") for name, b in model.named_buffers()})
    moved = [meta(a).requires_grad_(False) if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: meta(v).requires_grad_(False) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with _NormsShapeOnly():
        out = functional_call(model, state, tuple(moved), kw)
        if backward:
            _backward(out, [p for p in state.values() if p.requires_grad])


def _device_call(model: torch.nn.Module, args: tuple, kwargs: dict, backward: bool):
    """The same on the model's own device: its parameters read, never changed (no ``.grad``, no running statistics)."""
    from torch.func import functional_call

    state = {name: p.detach().requires_grad_(p.requires_grad) for name, p in model.named_parameters()}
    state.update({name: b.clone() for name, b in model.named_buffers()})
    out = functional_call(model, state, args, kwargs)
    if backward:
        _backward(out, [p for p in state.values() if p.requires_grad])


def _backward(out: Any, params: Sequence[torch.Tensor]) -> None:
    """Gradients of a scalar made of ``out``'s floating tensors (a sum: no counted FLOPs of its own)."""
    tensors = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
    if not tensors or not params:
        return
    loss = sum(t.float().sum() for t in tensors)
    torch.autograd.grad(loss, list(params), allow_unused=True)


def _tensors(out: Any):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _tensors(v)


def count_flops(model: torch.nn.Module, example: Union[torch.Tensor, Sequence[Any]], *, backward: bool = True,
                kwargs: Optional[dict] = None) -> int:
    """FLOPs of one training step of ``model`` on the batch ``example``: forward and backward (a multiply-add is 2).

    Counted on the ``meta`` device (shapes only: no memory, no arithmetic, the model untouched),
    with ``torch.utils.flop_counter.FlopCounterMode``: matrix products and convolutions, the
    gradients of the activations and of the parameters that require them. Where a layer cannot
    run on ``meta``, the count runs on the model's device instead, with the parameters read and
    never changed (give a small batch then: the count of a convolutional network or a
    transformer grows with the batch in proportion). Divide by the batch's size for the FLOPs
    per sample of :meth:`nbddp.rank.runtime.Context.throughput`.

    Args:
        model: the model as it trains (frozen layers frozen, the bare module or a DDP/compiled wrapper's).
        example: a batch as the model takes it: a tensor, or a tuple of positional arguments.
        backward: count the backward too (the default); False: the forward alone.
        kwargs: keyword arguments of the model's forward.

    Returns:
        The FLOPs, an integer.

    Example:
        >>> x = torch.randn(8, 3, 224, 224)
        >>> flops_per_sample = nbddp.count_flops(model, x) / len(x)   # ResNet34: ~21.7e9
    """
    from torch.utils.flop_counter import FlopCounterMode

    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # torch.compile's wrapper: what it compiled
        model = model._orig_mod
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # DDP's: the module it wraps
        model = model.module
    args = (example,) if isinstance(example, torch.Tensor) else tuple(example)
    kwargs = dict(kwargs or {})
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            _meta_call(model, args, kwargs, backward)
    except (NotImplementedError, RuntimeError):  # an operator without a meta kernel: on the real device
        counter = FlopCounterMode(display=False)
        with counter:
            _device_call(model, args, kwargs, backward)
    return int(counter.get_total_flops())


def throughput(samples: float, seconds: float, device: torch.device, flops_per_sample: Optional[float] = None,
               precision: Optional[str] = None, data_wait_s: Optional[float] = None) -> Dict[str, float]:
    """``samples_per_s``, and ``tflops``, ``mfu``, ``data_wait`` where they are known (see :meth:`nbddp.rank.runtime.Context.throughput`).

    Raises:
        ValueError: ``precision`` is not one the peaks are given for.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: one of {', '.join(map(repr, PRECISIONS))}, or None (no MFU)")
    if seconds <= 0:
        return {}
    out: Dict[str, float] = {"samples_per_s": samples / seconds}
    if flops_per_sample:
        tflops = samples * flops_per_sample / seconds / 1e12
        out["tflops"] = tflops
        peak = peak_tflops(device_name(device), precision, device_sms(device))
        if peak:
            out["mfu"] = tflops / peak
    if data_wait_s is not None:
        out["data_wait"] = min(1.0, max(0.0, data_wait_s / seconds))
    return out


__all__ = ["count_flops", "device_name", "device_sms", "precision_of", "throughput"]
