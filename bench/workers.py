"""nbddp-side worker functions of the benchmarks (same model, data and batch as plain_ddp.py)."""

import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import bench_models  # noqa: E402


def nbddp_batches(data: str, image_size: int, batch_size: int, rank: int, world: int, steps: int):
    """``(batches, batch_transform)`` through nbddp's own data paths.

    ``data`` is ``"<pipeline>:<class-folder path>"`` with pipeline ``pil`` (per-image PIL
    transforms), ``pil-cache`` (the same, decoded once) or ``tensor`` (decoded once into a uint8
    tensor, batches cropped/flipped/normalised at once); anything else goes to
    ``bench_models.batches`` (``synthetic``, or a path read with torchvision's ImageFolder).
    """
    pipeline, _, path = data.partition(":")
    if pipeline not in ("pil", "pil-cache", "tensor"):
        return bench_models.batches(data, image_size, batch_size, rank, world, steps), None
    from torch.utils.data import DataLoader, DistributedSampler

    from nbddp.tasks.classification import data as D
    from nbddp.tasks.classification import tensor_data as TD

    _, samples = D.scan_class_folders(path)
    if pipeline == "tensor":
        ds = TD.TensorCache(samples, image_size, torch.device("cpu"))
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
        loader = TD.TensorBatches(ds, sampler, batch_size, drop_last=True)
        transform = TD.BatchAugment(image_size, crop_scale=0.5, hflip=False)
    else:
        tf, _ = D.build_transforms(image_size, crop_scale=0.5, hflip=False)
        ds = D.ImageListDataset(samples, tf, cache=pipeline == "pil-cache")
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
        loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True)
        transform = None

    return bench_models.repeat_epochs(loader, sampler, steps), transform


def train(ctx, model="small_cnn", data="synthetic", image_size=32, batch_size=32, steps=60, warmup=5,
          report_progress=True):
    t_line = time.time()  # the worker's first line
    torch.manual_seed(0)
    net = DDP(bench_models.build(model, 10).to(ctx.device))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches, transform = nbddp_batches(data, image_size, batch_size, ctx.rank, ctx.world_size, steps)
    t_first = t_warm = None
    for step, (x, y) in enumerate(batches):
        if transform is not None:
            x = transform(x)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if report_progress:  # what the built-in worker does every step: live progress, heartbeat
            ctx.progress(epoch=0, step=step + 1, steps=steps, loss=loss.item())
        if step == 0:
            t_first = time.time()
        if step == warmup - 1:
            t_warm = time.time()
    t_end = time.time()
    return {"first_line": t_line, "first_step": t_first, "images_per_s": (steps - warmup) * batch_size * ctx.world_size / (t_end - t_warm),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
