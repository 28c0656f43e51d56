"""The same first step with plain torch.multiprocessing.spawn and with Accelerate's launcher."""

import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bench_models


def _step(rank, world, out):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = DDP(bench_models.build("small_cnn"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = next(bench_models.batches("synthetic", 32, 32, rank, world, 1))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(time.time()))
    dist.barrier()  # every rank is done with the group before any leaves it (gloo may abort otherwise)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run() -> float:
    out = tempfile.mktemp()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    t0 = time.time()
    torch.multiprocessing.spawn(_step, args=(2, out), nprocs=2)
    return float(open(out).read()) - t0


def _accel_inner(out):
    # notebook_launcher sets RANK/WORLD_SIZE and forks; the function runs in each child
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _step(rank, world, out)


def run_accelerate(notebook_launcher) -> float:
    out = tempfile.mktemp()
    t0 = time.time()
    notebook_launcher(_accel_inner, args=(out,), num_processes=2, use_port=str(_free_port()))
    return float(open(out).read()) - t0
