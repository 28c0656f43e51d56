"""A torchrun script as people write it (no nbddp): argparse, env:// group, LOCAL_RANK, snapshot.

Run it with ``torchrun --nproc_per_node=2 torchrun_train.py 4 2 --batch_size 8`` or, unchanged,
``spawn_train("torchrun_train.py", nprocs=2, argv=["4", "2", "--batch_size", "8"])``.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(total_epochs: int, save_every: int, batch_size: int, out: str) -> None:
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(total_epochs):
        x = torch.full((batch_size, 4), float(dist.get_rank() + 1), device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"[GPU{local_rank}] epoch {epoch} | batch size {batch_size} | loss {loss.item():.4f}", flush=True)
        if dist.get_rank() == 0 and epoch % save_every == 0:
            torch.save(model.module.state_dict(), os.path.join(out, "snapshot.pt"))
    if dist.get_rank() == 0:
        seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")}
        report = {"argv": sys.argv, "cwd": os.getcwd(), "env": seen, "world": dist.get_world_size(),
                  "name": __name__, "weight": model.module.weight.sum().item()}
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--out", default=".", help="where the snapshot and report go")
    args = parser.parse_args()
    main(args.total_epochs, args.save_every, args.batch_size, args.out)
