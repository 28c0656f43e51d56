"""A small model with repeated blocks, trained under the launch's strategy (ctx.prepare), with
checkpoints of modules and optimizers: tests/test_sharding.py compares DDP and FSDP, and runs
resumed on another world size against uninterrupted ones."""

import torch
from torch import nn

GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Tiny(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, classes: int = 4):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(step: int, rank: int, world: int):
    """This rank's part of the step's global batch: the same images whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _errors(ctx, model) -> dict:
    """The messages of what ctx.prepare refuses, caught here so one launch checks them all."""
    from nbddp.rank.sharding import prepare, refuse_ddp_of_sharded

    out = {}
    for key, call in (("twice", lambda: ctx.prepare(model)),
                      ("ddp_of_sharded", lambda: refuse_ddp_of_sharded(model)),
                      ("block", lambda: prepare(Tiny(), ctx.device, "fsdp", blocks=["TransformerBlock"])),
                      ("offload", lambda: prepare(Tiny(), ctx.device, "fsdp", cpu_offload=True)),
                      ("ddp_options", lambda: prepare(Tiny(), ctx.device, "ddp", mixed_precision="bf16")),
                      ("no_params", lambda: prepare(nn.Sequential(nn.ReLU()), ctx.device, "fsdp")),
                      ("stateless_save", lambda: ctx.save_checkpoint({"model": model, "act": nn.ReLU()}, "x"))):
        try:
            call()
            out[key] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def _load_other_architecture(ctx) -> str:
    other = ctx.prepare(Tiny(width=12))
    try:
        ctx.load_checkpoint({"model": other})
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def _frozen(ctx) -> dict:
    """A ResNet with only its head trainable, sharded: one step changes the head and nothing else."""
    from nbddp.tasks.classification.models import build_model, freeze_except_head
    from nbddp.rank.sharding import full_state_dict, shard

    torch.manual_seed(0)
    model = build_model("resnet18", 3)
    freeze_except_head(model)
    shard(model)
    before = full_state_dict(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    opt.step()
    after = full_state_dict(model)
    return {k: not torch.equal(before[k], after[k]) for k in before if "running" not in k
            and "num_batches" not in k} if ctx.is_main else {}


def _failed_save(ctx, model, optimizer) -> dict:
    """A save whose last write fails on rank 0 (a full disk): every rank raises, ``last`` stays whole."""
    import nbddp.contract.checkpoint as C

    def full_disk(obj, path, **kwargs):
        raise OSError(28, "No space left on device")

    real, message = C.atomic_save, None
    if ctx.is_main:
        C.atomic_save = full_disk
    try:
        ctx.save_checkpoint({"model": model, "optimizer": optimizer, "step": 99})
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        message = f"{type(exc).__name__}: {exc}"
    finally:
        C.atomic_save = real
    folder = ctx.run_dir / "checkpoints"
    return {"message": message, "entries": sorted(p.name for p in folder.iterdir())}


def _broken_checkpoints(ctx, model, optimizer) -> dict:
    """A checkpoint with a shard cut short, then one with a shard missing: what loading each says, what is kept."""
    import os

    import torch.distributed as dist

    out = {}
    for how in ("truncated", "missing"):
        ctx.save_checkpoint({"model": model, "optimizer": optimizer, "step": 0}, name=how)
        folder = ctx.run_dir / "checkpoints" / f"{how}.dcp"
        shard = sorted(folder.glob("*.distcp"))[-1]
        if ctx.is_main:
            if how == "truncated":
                os.truncate(shard, shard.stat().st_size // 2)
            else:
                shard.unlink()
        dist.barrier()
        try:
            ctx.load_checkpoint({"model": model, "optimizer": optimizer}, name=how)
            out[how] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            out[how] = f"{type(exc).__name__}: {exc}"
        out[f"{how} kept"] = sorted(p.name for p in folder.iterdir())
    return out


def train(ctx, steps: int = 6, save_at: int = -1, resume: bool = False, extras: bool = False,
          mixed_precision=None, compile=False, cpu_offload=False):
    torch.manual_seed(0)
    options = {"mixed_precision": mixed_precision} if mixed_precision else {}
    if cpu_offload:
        options["cpu_offload"] = True
    if compile:  # each block compiled (dynamo's eager backend: the compile path, in seconds on a CPU)
        options.update(compile=True, compile_backend="eager")
    model = ctx.prepare(Tiny(), **options)
    seen = []  # the dtype a block computes in (bf16 under mixed_precision="bf16")
    first = model.module if hasattr(model, "no_sync") else model
    first.layers[0].fc.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    start, resumed = 0, None
    if resume:
        state = ctx.load_checkpoint({"model": model, "optimizer": optimizer})
        start, resumed = state["step"] + 1, state["step"]
    for step in range(start, steps):
        x, y = (t.to(ctx.device) for t in batch(step, ctx.rank, ctx.world_size))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == save_at:
            ctx.save_checkpoint({"model": model, "optimizer": optimizer, "step": step, "note": "tiny"})
    result = {"weights": ctx.full_state_dict(model), "resumed": resumed, "strategy": ctx.strategy,
              "compute_dtype": seen[-1] if seen else None,
              "compiled": [getattr(m, "_compiled_call_impl", None) is not None for m in first.layers],
              "recompile_limit": torch._dynamo.config.recompile_limit,
              "master_dtype": sorted({str(p.dtype) for p in model.parameters()}),
              "param_devices": sorted({p.device.type for p in model.parameters()}),
              "param_types": sorted({type(p).__name__ for p in model.parameters()})}
    if resume:
        result["other_architecture"] = _load_other_architecture(ctx)
    if extras:
        # The old form with a sharded model's state dict: saved whole, not rank 0's shard.
        ctx.save_checkpoint({"model": model.state_dict(), "step": steps}, name="plain")
        result["plain"] = ctx.load_checkpoint("plain")["model"] if ctx.is_main else None
        result["errors"] = _errors(ctx, model)
        result["failed_save"] = _failed_save(ctx, model, optimizer)
        result["frozen_changed"] = _frozen(ctx)
        result["broken"] = _broken_checkpoints(ctx, model, optimizer)
    return result if ctx.is_main else None
