"""An mp.spawn script as people write it (no nbddp): ``main(rank, world_size, ...)`` and its own setup().

``python multigpu.py`` calls ``mp.spawn(main, args=(world_size, 5, 32), nprocs=world_size)``;
``spawn_train("multigpu.py:main", 2, 3, 8, nprocs=2, call="mp.spawn")`` calls the same function.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

#: Tests write the port they found free here; users hard-code one, as the tutorial does.
PORT = os.environ.get("OWN_CODE_PORT", "12355")


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = PORT
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def main(rank: int, world_size: int, total_epochs: int, batch_size: int, out: str = "."):
    ddp_setup(rank, world_size)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(total_epochs):
        loss = model(torch.full((batch_size, 4), float(rank + 1), device=device)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"[GPU{rank}] Epoch {epoch} | Batchsize: {batch_size} | loss {loss.item():.4f}")
    if rank == 0:
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump({"world": dist.get_world_size(), "weight": model.module.weight.sum().item(),
                       "port": os.environ["MASTER_PORT"]}, f)
    dist.barrier()  # every rank is done with the group before any leaves it (gloo aborts otherwise)
    dist.destroy_process_group()
    return rank * 10


if __name__ == "__main__":
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(main, args=(world_size, 5, 32), nprocs=world_size)
