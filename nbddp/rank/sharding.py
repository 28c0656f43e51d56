"""FSDP2 in a rank: ``ctx.prepare(model)`` shards a model block by block, then its root.

DDP keeps the whole model, its gradients and its optimizer state on every rank (16 bytes per
parameter with AdamW). FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps a 1/world shard of
each on every rank and gathers a block's parameters just before the block runs, so a model that
fits no single device trains on several. This module is what :meth:`nbddp.Context.prepare` does:

1. refuse what cannot work (a model prepared twice, DDP around a sharded model, a block class the
   model lacks), with the fix in the message;
2. under ``"ddp"``: move the model to the rank's device and wrap it in DDP (a lone rank keeps
   the bare model: nothing to average);
3. under ``"fsdp"``: move it, ``torch.compile`` each block if asked (a block is compiled as a whole
   and the gathers stay outside the graph), ``fully_shard`` each block, then the root (whose
   parameters are gathered once per step and so are not resharded after forward, as torchtitan
   does). A model the worker sharded itself is left as it is.

Consolidation (:func:`full_state_dict`) gathers one tensor at a time onto rank 0's CPU, so a
sharded model is never held whole anywhere but there. This module never imports the kernel side.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..contract.config import STRATEGIES, STRATEGY_ENV, check_strategy
from .dist import is_sharded, refuse_ddp_of_sharded  # noqa: F401 - part of this module's story
from ..contract.errors import ConfigError

#: Containers without a forward of their own: sharding one would never gather its parameters.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
#: The mark ``prepare`` leaves on a model it prepared (what it was prepared for).
_PREPARED = "_nbddp_prepared"
#: What ``mixed_precision`` accepts by name.
PRECISIONS = ("bf16", "fp16")


def launch_strategy() -> str:
    """The strategy of this rank's launch: ``$NBDDP_STRATEGY`` (``spawn_train(strategy=...)``), else ``ddp``."""
    value = os.environ.get(STRATEGY_ENV) or "ddp"
    return check_strategy(value, f"${STRATEGY_ENV}")


def has_dtensors(obj: Any) -> bool:
    """True when a nested structure (dicts, lists, tuples) holds a sharded tensor (``DTensor``)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, dict):
        return any(has_dtensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_dtensors(v) for v in obj)
    return False


def _mp_policy(mixed_precision: Any):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if mixed_precision not in dtypes:
        raise ConfigError(f"mixed_precision={mixed_precision!r}: use 'bf16' (bf16 parameters and compute, fp32 "
                          "gradient reduction and master weights), 'fp16', a torch.distributed.fsdp."
                          "MixedPrecisionPolicy, or None (fp32)")
    # Compute in low precision; reduce gradients and keep the sharded master weights in fp32.
    return MixedPrecisionPolicy(param_dtype=dtypes[mixed_precision], reduce_dtype=torch.float32)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def default_blocks(model: nn.Module) -> List[nn.Module]:
    """The model's repeated blocks: the modules of a class that repeats at the shallowest depth.

    Only modules with children and parameters count (ResNet stages, transformer layers, not a
    pair of embeddings); ``ModuleList``/``ModuleDict`` are looked through (they have no forward).
    Empty when nothing repeats: the root alone is then sharded.
    """
    level = [c for c in model.children()]
    while level:
        candidates = [m for m in level if not isinstance(m, _CONTAINERS) and _has_params(m)
                      and any(True for _ in m.children())]
        repeated = {cls for cls, n in Counter(type(m) for m in candidates).items() if n >= 2}
        if repeated:
            return [m for m in candidates if type(m) in repeated]
        level = [c for m in level for c in m.children()]
    return []


def _class_names(model: nn.Module) -> List[str]:
    return sorted({type(m).__name__ for m in model.modules() if m is not model and _has_params(m)})


def named_blocks(model: nn.Module, blocks: Iterable[Union[str, type]]) -> List[nn.Module]:
    """The modules of the classes ``blocks`` names (class objects or class names), outermost first.

    A module inside another chosen module is not chosen again: the outer block shards it.

    Raises:
        ConfigError: a named class is not in the model; the message lists the classes it holds.
    """
    wanted = list(blocks)
    for b in wanted:
        if not isinstance(b, (str, type)):
            raise ConfigError(f"blocks={wanted!r}: name module classes, as classes or their names "
                              "(e.g. blocks=['TransformerBlock'])")
    missing = [b for b in wanted if not any(_is_a(m, b) for m in model.modules())]
    if missing:
        names = ", ".join(getattr(b, "__name__", b) for b in missing)
        raise ConfigError(f"blocks: {names} {'is' if len(missing) == 1 else 'are'} not a module class of this "
                          f"{type(model).__name__}; its classes with parameters are: {', '.join(_class_names(model))}. "
                          "Name one of those, or leave blocks out to shard the model's repeated children.")
    chosen: List[nn.Module] = []
    inside: set = set()
    for m in model.modules():
        if m is model or id(m) in inside or not any(_is_a(m, b) for b in wanted):
            continue
        chosen.append(m)
        inside.update(id(x) for x in m.modules())
    return chosen


def _is_a(module: nn.Module, block: Union[str, type]) -> bool:
    """``module`` is of the class ``block`` (a class, or its name)."""
    return type(module) is block if isinstance(block, type) else type(module).__name__ == block


def _compile_block(block: nn.Module, backend: str) -> None:
    # nn.Module.compile compiles in place: the block keeps its name, so state dict keys and
    # checkpoints are those of the plain model.
    block.compile(backend=backend)


def _room_for_recompiles(blocks: int) -> None:
    """Blocks of one class share their ``forward``'s code, and dynamo keeps at most
    ``recompile_limit`` (8) graphs per code: blocks of other shapes (ResNet's stages), each in
    training and evaluation, at two batch sizes, would exceed it and silently run uncompiled."""
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * blocks)


def shard(model: nn.Module, *, blocks: Optional[Sequence[Union[str, type]]] = None, mixed_precision: Any = None,
          reshard_after_forward: bool = True, cpu_offload: bool = False, compile: bool = False,
          compile_backend: str = "inductor") -> nn.Module:
    """``fully_shard`` on each block of ``model`` (default :func:`default_blocks`), then on the root.

    Returns the model itself (``fully_shard`` changes it in place: its class becomes an
    ``FSDPModule``, its parameters ``DTensor`` shards).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    chosen = named_blocks(model, blocks) if blocks is not None else default_blocks(model)
    options = {"offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    policy = _mp_policy(mixed_precision)
    if policy is not None:
        options["mp_policy"] = policy
    if compile:
        _room_for_recompiles(len(chosen))
    for block in chosen:
        if compile:
            _compile_block(block, compile_backend)
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    # The root's own parameters (stem, head) are gathered once per step and needed again at
    # the start of backward: keeping them gathered saves an all-gather per step.
    fully_shard(model, reshard_after_forward=False if chosen else reshard_after_forward, **options)
    return model


def prepare(model: nn.Module, device: torch.device, strategy: Optional[str] = None, *,
            blocks: Optional[Sequence[Union[str, type]]] = None, mixed_precision: Any = None,
            reshard_after_forward: bool = True, cpu_offload: bool = False, compile: bool = False,
            compile_backend: Optional[str] = None, **ddp_kwargs: Any) -> nn.Module:
    """What :meth:`nbddp.Context.prepare` does: ``model`` on ``device``, wrapped as ``strategy`` says.

    See :meth:`nbddp.Context.prepare` for the arguments.
    """
    strategy = check_strategy(launch_strategy() if strategy is None else strategy)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"ctx.prepare takes a torch.nn.Module, got {type(model).__name__}")
    done = getattr(model, _PREPARED, None)
    from torch.nn.parallel import DistributedDataParallel

    if done is not None or isinstance(model, DistributedDataParallel):
        raise ConfigError(
            f"ctx.prepare was called twice on this model (it is already prepared for {done or 'ddp'!r}); call it once, "
            "on the bare model, and keep what it returns: model = ctx.prepare(model)")
    fsdp_only = {"blocks": blocks, "mixed_precision": mixed_precision, "cpu_offload": cpu_offload or None}
    if strategy == "ddp":
        given = [k for k, v in fsdp_only.items() if v is not None] + ([] if reshard_after_forward else
                                                                        ["reshard_after_forward"])
        if given:
            raise ConfigError(f"ctx.prepare({', '.join(given)}=...) shards the model, but this launch's strategy is "
                              "'ddp'; launch with strategy='fsdp' (spawn_train(..., strategy='fsdp')), or drop them")
        refuse_ddp_of_sharded(model)
        from .dist import data_parallel

        model = model.to(device)
        wrapped = data_parallel(model, device, **ddp_kwargs)
        if compile:
            wrapped = torch.compile(wrapped, backend=compile_backend or "inductor")
        setattr(model, _PREPARED, "ddp")
        return wrapped
    if ddp_kwargs:
        raise ConfigError(f"ctx.prepare({', '.join(ddp_kwargs)}=...): DistributedDataParallel options, but this "
                          "launch's strategy is 'fsdp'; drop them")
    if not _has_params(model):  # torch would shard it, then fail its checkpoint: "model state_dict is empty"
        raise ConfigError(f"ctx.prepare: strategy 'fsdp' shards a model's parameters, and this {type(model).__name__} "
                          "has none: there is nothing to shard or to checkpoint. Pass the model that holds the "
                          "weights, or launch with strategy='ddp'")
    if cpu_offload and device.type != "cuda":
        raise ConfigError("ctx.prepare(cpu_offload=True) keeps the shards and optimizer state in host memory while a "
                          "GPU computes; this rank computes on the CPU, where everything is in host memory already. "
                          "Drop cpu_offload, or launch on GPUs (spawn_train(..., gpus=[0, 1]))")
    if not cpu_offload:
        model = model.to(device)
    if is_sharded(model):  # the worker applied fully_shard itself: its sharding stands
        setattr(model, _PREPARED, "fsdp")
        return model
    shard(model, blocks=blocks, mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
          cpu_offload=cpu_offload, compile=compile, compile_backend=compile_backend or "inductor")
    setattr(model, _PREPARED, "fsdp")
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose state dict keys are the plain model's: DDP's ``.module``, compile's ``_orig_mod``."""
    while True:
        inner = getattr(model, "module", None) if hasattr(model, "no_sync") else None
        inner = inner if isinstance(inner, nn.Module) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


# ---------------------------------------------------------------------------- whole state dicts
def full_state_dict(model: nn.Module) -> dict:
    """Collective: the model's whole state dict on rank 0's CPU (an empty dict on other ranks).

    Plain tensors (no ``DTensor``, no ``module.`` prefix), one full copy only, on rank 0's CPU:
    ``get_model_state_dict`` with ``full_state_dict`` and ``cpu_offload`` gathers one tensor at a
    time. Call it on every rank. A model that is not sharded gives its state dict on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = unwrap(model)
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state: Optional[dict]) -> None:
    """Collective: load a whole state dict into a (sharded) model; only rank 0 needs to hold it.

    Other ranks may pass ``None``: rank 0's tensors are broadcast and each rank keeps its shard.
    The broadcast frees the storage of the tensors it sent: ``state`` is used up.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = unwrap(model)
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from_rank0 = dist.is_initialized() and dist.get_world_size() > 1
    set_model_state_dict(model, state or {}, options=StateDictOptions(full_state_dict=True,
                                                                      broadcast_from_rank0=from_rank0))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: the optimizer's whole state, keyed by parameter name, on rank 0's CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(unwrap(model), optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Optional[dict]) -> None:
    """Collective: load :func:`full_optimizer_state_dict`'s output; only rank 0 needs to hold it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from_rank0 = dist.is_initialized() and dist.get_world_size() > 1
    set_optimizer_state_dict(unwrap(model), optimizer, state or {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0))


def gather_dtensors(obj: Any, keep: bool) -> Any:
    """Collective: every ``DTensor`` of a nested structure gathered whole (kept on the CPU where ``keep``).

    Every rank walks the same structure in the same order, so the all-gathers pair up; the
    whole tensors are kept on one rank only (``keep``), one at a time.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        whole = obj.full_tensor()
        return whole.detach().cpu() if keep else None
    if isinstance(obj, dict):
        return {k: gather_dtensors(v, keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(gather_dtensors(v, keep) for v in obj)
    return obj


def local_state_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """This rank's own elements and bytes of parameters, gradients and optimizer state.

    A sharded tensor counts its local shard only: what this rank holds in memory.
    """
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    out = {}
    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [local(v) for s in (optimizer.state.values() if optimizer is not None else ())
              for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    for name, tensors in (("params", params), ("grads", grads), ("optimizer", states)):
        out[f"{name}_elements"] = sum(t.numel() for t in tensors)
        out[f"{name}_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    out["total_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"]
    return out


__all__ = ["STRATEGIES", "prepare", "shard", "default_blocks", "named_blocks", "is_sharded", "full_state_dict",
           "load_full_state_dict", "full_optimizer_state_dict", "load_full_optimizer_state_dict", "local_state_bytes",
           "launch_strategy", "unwrap"]
