"""Synchronised batch norm that also trains on CPU tensors (gloo).

``torch.nn.SyncBatchNorm`` refuses CPU tensors in training mode, so a CPU run (CI, a laptop
notebook) could not use the same model as a GPU run. :class:`CPUSyncBatchNorm` computes the
same thing with plain tensor ops and two all-reduces per layer (one in forward, one in
backward), and :func:`convert_sync_batchnorm` picks the right implementation for the device.

Gradient semantics match PyTorch's CUDA ``SyncBatchNorm``: the input gradient uses the
statistics of the global batch, while ``weight``/``bias`` gradients stay local to each rank
because ``DistributedDataParallel`` averages parameter gradients afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ..contract.errors import ConfigError

__all__ = ["CPUSyncBatchNorm", "convert_sync_batchnorm"]


def _reduce_dims(input: Tensor) -> list[int]:
    """Every dimension except the channel dimension 1 of an ``(N, C, *)`` tensor."""
    return [0, *range(2, input.dim())]


def _per_channel(values: Tensor, input: Tensor) -> Tensor:
    """View a ``(C,)`` tensor so it broadcasts against ``input`` of shape ``(N, C, *)``."""
    return values.view(1, -1, *([1] * (input.dim() - 2)))


def _compute_dtype(input: Tensor) -> torch.dtype:
    # Half and bfloat16 inputs are normalised in float32, as PyTorch's batch norm kernels do.
    return torch.promote_types(input.dtype, torch.float32)


def _global_batch_stats(input: Tensor, group) -> tuple[Tensor, Tensor, float]:
    """Mean and biased variance per channel over the batches of every rank in ``group``.

    Sums, sums of squares and counts add up across ranks even when ranks hold different
    batch sizes (or none), so a single all-reduce of their concatenation is exact. float64
    keeps ``E[x^2] - E[x]^2`` from cancelling catastrophically.

    Returns:
        ``(mean, var, count)``: two float64 ``(C,)`` tensors and the global number of values
        per channel.

    Raises:
        ValueError: the global batch has at most one value per channel (on every rank alike,
            since every rank sees the same reduced count, so no rank is left waiting).
    """
    x = input.detach().to(torch.float64)
    dims = _reduce_dims(input)
    local_count = x.new_tensor([input.numel() // input.size(1)])
    stats = torch.cat([x.sum(dims), x.square().sum(dims), local_count])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

    channels = input.size(1)
    total_sum, total_sq, count = stats[:channels], stats[channels:-1], float(stats[-1])
    if count <= 1:
        raise ValueError(
            "Expected more than 1 value per channel when training across all ranks, "
            f"got {int(count)}: use a larger batch or put the model in eval mode."
        )
    mean = total_sum / count
    # Rounding can push a constant channel's variance slightly below zero.
    var = (total_sq / count - mean.square()).clamp_(min=0.0)
    return mean, var, count


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with precomputed global statistics; all-reduce input-gradient sums in backward.

    The statistics come in as constants: their dependence on the input is accounted for by
    the closed-form backward below, which needs the global ``sum(dy)`` and
    ``sum(dy * (x - mean))``.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, mean, invstd, count, group):
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.count = count
        ctx.group = group
        ctx.param_dtype = weight.dtype if weight is not None else input.dtype

        compute = _compute_dtype(input)
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        out = (input.to(compute) - _per_channel(mean.to(compute), input)) * _per_channel(
            scale.to(compute), input
        )
        if bias is not None:
            out = out + _per_channel(bias.to(compute), input)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        compute = _compute_dtype(input)
        dims = _reduce_dims(input)

        dy = grad_output.to(compute)
        xmu = input.to(compute) - _per_channel(mean.to(compute), input)
        sum_dy = dy.sum(dims, dtype=torch.float64)
        sum_dy_xmu = (dy * xmu).sum(dims, dtype=torch.float64)

        # Parameter gradients stay local: DDP averages them over ranks right after backward.
        grad_weight = (sum_dy_xmu * invstd).to(ctx.param_dtype) if needs_weight else None
        grad_bias = sum_dy.to(ctx.param_dtype) if needs_bias else None

        grad_input = None
        # needs_input_grad is the same on every rank (same model), so either every rank joins
        # this all-reduce or none does.
        if needs_input:
            grad_input = _input_grad(
                dy, xmu, weight, invstd, sum_dy, sum_dy_xmu, ctx.count, ctx.group
            ).to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _input_grad(dy, xmu, weight, invstd, sum_dy, sum_dy_xmu, count, group) -> Tensor:
    """``w * invstd * (dy - sum_dy/N - xmu * invstd^2 * sum_dy_xmu/N)`` with global sums.

    ``sum_dy`` and ``sum_dy_xmu`` are this rank's sums; one all-reduce makes them global, and
    ``count`` is the global number of values per channel ``N``.
    """
    channels = sum_dy.numel()
    sums = torch.cat([sum_dy, sum_dy_xmu])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    mean_dy = sums[:channels] / count
    mean_dy_xmu = sums[channels:] / count

    scale = invstd if weight is None else invstd * weight.to(torch.float64)
    compute = dy.dtype
    centred = dy - _per_channel(mean_dy.to(compute), dy)
    centred = centred - xmu * _per_channel((invstd.square() * mean_dy_xmu).to(compute), dy)
    return centred * _per_channel(scale.to(compute), dy)


class CPUSyncBatchNorm(_BatchNorm):
    """Batch norm over ``(N, C, *)`` inputs whose training statistics span every rank.

    In training mode with an initialised process group of more than one rank, each forward
    all-reduces per-channel sums once and normalises with the global mean and biased
    variance; running statistics receive the global mean and unbiased variance. Backward
    all-reduces once more for the input gradient, while ``weight``/``bias`` gradients stay
    local (DDP averages them), exactly like ``torch.nn.SyncBatchNorm`` on CUDA. In every
    other case (eval mode, no process group, a single rank) it is ordinary batch norm.

    Every rank of the group must call forward and backward the same number of times, as
    with any collective.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: running-statistics update factor; ``None`` for a cumulative average.
        affine: learn a per-channel ``weight`` and ``bias``.
        track_running_stats: keep running mean and variance for eval mode.
        process_group: group whose ranks share statistics; ``None`` for the default group.
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.

    Example:
        >>> bn = CPUSyncBatchNorm(64)  # drop-in for nn.BatchNorm2d(64) under DDP on CPU
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an (N, C, *) input of at least 2 dims, got {input.dim()}D")

    def forward(self, input: Tensor) -> Tensor:
        group = self._sync_group()
        if group is None:
            return super().forward(input)
        self._check_input_dim(input)
        factor = self._average_factor()
        mean, var, count = _global_batch_stats(input, group)
        if self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean, var, count, factor)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, mean, invstd, count, group
        )

    def _sync_group(self):
        """The process group to synchronise over, or ``None`` when plain batch norm applies."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _average_factor(self) -> float:
        """Count this batch and return the running-stats factor, as ``_BatchNorm.forward`` does."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, count: float, factor: float):
        # Running variance is the unbiased estimate, like nn.BatchNorm, using the global count.
        unbiased_var = var * (count / (count - 1))
        self.running_mean.mul_(1 - factor).add_(factor * mean.to(self.running_mean.dtype))
        self.running_var.mul_(1 - factor).add_(factor * unbiased_var.to(self.running_var.dtype))


def convert_sync_batchnorm(
    module: torch.nn.Module, device: torch.device | str, process_group=None
) -> torch.nn.Module:
    """Make every batch norm layer of ``module`` synchronise statistics across ranks.

    On CUDA this is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. On CPU that class
    raises in training mode, so a gloo run would have no SyncBN at all; instead every
    ``_BatchNorm`` (``BatchNorm1d/2d/3d`` and subclasses) becomes a :class:`CPUSyncBatchNorm`
    that computes the same statistics and gradients with plain tensor ops.

    Converted layers reuse the original parameter and buffer tensors (like PyTorch's
    converter), so the ``state_dict``, ``requires_grad`` flags and any optimizer already
    holding the parameters stay valid; train/eval mode is kept.

    Args:
        module: the model (or a single batch norm layer), before wrapping in DDP.
        device: where the model trains; only its type (``cuda`` or ``cpu``) matters.
        process_group: group whose ranks share statistics; ``None`` for the default group.

    Returns:
        The converted model: ``module`` itself, or a new layer when ``module`` is a batch norm.

    Raises:
        ConfigError: ``device`` is neither CUDA nor CPU.

    Example:
        >>> model = convert_sync_batchnorm(model, device)
        >>> model = DistributedDataParallel(model.to(device))
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    if kind != "cpu":
        raise ConfigError(
            f"sync batch norm supports CUDA and CPU devices, got {device!r}: "
            "train on 'cuda' or 'cpu', or turn sync batch norm off."
        )
    return _convert_on_cpu(module, process_group)


def _convert_on_cpu(module: torch.nn.Module, process_group) -> torch.nn.Module:
    """Recursively swap ``_BatchNorm`` layers for :class:`CPUSyncBatchNorm`."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        converted = _cpu_sync_from(module, process_group)
    for name, child in module.named_children():
        converted.add_module(name, _convert_on_cpu(child, process_group))
    return converted


def _cpu_sync_from(bn: _BatchNorm, process_group) -> CPUSyncBatchNorm:
    """A :class:`CPUSyncBatchNorm` sharing ``bn``'s parameters, buffers and settings."""
    if process_group is None:
        # A torch SyncBatchNorm being moved to CPU keeps the group it was given.
        process_group = getattr(bn, "process_group", None)
    sync = CPUSyncBatchNorm(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        process_group=process_group,
    )
    # Assigning the same objects (not copies) keeps requires_grad, dtype, device and identity.
    sync.weight = bn.weight
    sync.bias = bn.bias
    sync.running_mean = bn.running_mean
    sync.running_var = bn.running_var
    sync.num_batches_tracked = bn.num_batches_tracked
    sync.training = bn.training
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    return sync
