"""The reference: a minimal plain-DDP training script, launched by torchrun.

    torchrun --standalone --nproc-per-node=2 bench/plain_ddp.py --model small_cnn --data synthetic --steps 60

Same model, data and batch as the nbddp side of each benchmark. Writes one JSON line of
timings to --out (rank 0): script start, end of the first optimizer step, and images/s over the
steps after --warmup.
"""

import argparse
import json
import os
import resource
import time

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import bench_models  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--data", default="synthetic", help="synthetic or a class-folder path")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = bench_models.build(a.model, num_classes=10)
    if distributed:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = bench_models.batches(a.data, a.image_size, a.batch_size, rank, world, a.steps)
    t_first = t_warm = None
    for step, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            t_first = time.time()
        if step == a.warmup - 1:
            t_warm = time.time()
    t_end = time.time()
    measured = (a.steps - a.warmup) * a.batch_size * world
    if rank == 0 and a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"start": T_START, "first_step": t_first, "images_per_s": measured / (t_end - t_warm),
                                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                "world": world, "threads": torch.get_num_threads()}) + "\n")
    if distributed:
        dist.barrier()  # every rank is done with the group before any leaves it (gloo may abort otherwise)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
