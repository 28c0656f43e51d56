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


def train(ctx, model="small_cnn", data="synthetic", image_size=32, batch_size=32, steps=60, warmup=5,
          report_progress=True):
    torch.manual_seed(0)
    net = DDP(bench_models.build(model, 10).to(ctx.device))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    t_first = t_warm = None
    for step, (x, y) in enumerate(bench_models.batches(data, image_size, batch_size, ctx.rank, ctx.world_size, steps)):
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
    return {"first_step": t_first, "images_per_s": (steps - warmup) * batch_size * ctx.world_size / (t_end - t_warm),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
