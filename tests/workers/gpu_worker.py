"""Workers for tests/test_gpu.py: NCCL collectives and SyncBatchNorm on real GPUs."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nbddp.rank.dist import any_rank, barrier, check_same, cpu_group, reduce_value, sync_buffers_from_main


def collectives(ctx):
    """Every helper nbddp offers workers, on NCCL: the answers must be the same on every rank."""
    assert ctx.device.type == "cuda" and torch.cuda.current_device() == ctx.device.index
    t = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(t)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, ctx.rank)
    box = [f"from rank {ctx.rank}"]
    dist.broadcast_object_list(box, src=0)
    barrier()
    check_same(7, "a constant")
    mean = reduce_value(torch.tensor(float(ctx.rank), device=ctx.device))
    stop = any_rank(ctx.rank == ctx.world_size - 1)
    flags = torch.tensor([float(ctx.rank)])
    dist.all_reduce(flags, group=cpu_group())  # nbddp's own gloo group beside nccl
    return {"sum": t.cpu().tolist(), "gathered": gathered, "broadcast": box[0], "mean": mean.item(),
            "any": stop, "cpu_sum": flags.item(), "device": str(ctx.device), "backend": dist.get_backend()}


def bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


def global_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 6, 6, generator=g) * 2 + 1, torch.randint(0, 4, (8,), generator=g)


def sgd_step(model, x, y, scale=1.0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(model(x), y) * scale
    loss.backward()
    opt.step()


def sync_bn_step(ctx):
    """One SGD step with SyncBatchNorm on this rank's share of the global batch."""
    from nbddp.rank.sync_bn import convert_sync_batchnorm

    torch.backends.cudnn.allow_tf32 = False
    model = convert_sync_batchnorm(bn_model(), ctx.device).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index])
    x, y = global_batch()
    share = len(x) // ctx.world_size
    part = slice(ctx.rank * share, (ctx.rank + 1) * share)
    sgd_step(ddp, x[part].to(ctx.device), y[part].to(ctx.device))
    sync_buffers_from_main(model)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
