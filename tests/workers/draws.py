"""What a rank's random generators give before anything seeds them, and after a fixed seed.

``draws(ctx)`` returns both for ``spawn_train(..., all_values=True)``; run as a torchrun script
(``python -m torch.distributed.run ... draws.py OUT.json``, or ``spawn_train("draws.py",
argv=[OUT.json])``) it all-gathers them and rank 0 writes the list to ``OUT.json``.
"""

import json
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

SEED = 1234


def _loader_worker_seed() -> int:
    """The base seed of a DataLoader worker the rank starts now (torch draws it from the rank's generator)."""
    loader = torch.utils.data.DataLoader(_WorkerSeed(), batch_size=None, num_workers=1)
    return int(next(iter(loader)))


class _WorkerSeed(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.initial_seed()


def sample() -> dict:
    """One draw of each generator a rank has, and what torch says its seeds are."""
    out = {"torch": torch.rand(1).item(), "numpy": float(np.random.rand()), "python": random.random(),
           "torch_seed": torch.initial_seed(), "loader_worker_seed": _loader_worker_seed()}
    if torch.cuda.is_available():  # on a machine with GPUs: CUDA's generators too (created on first use)
        out["cuda"] = torch.rand(1, device="cuda").item()
        out["cuda_seed"] = torch.cuda.initial_seed()
    return out


def seeded() -> dict:
    """The same after the usual seeding, which must give the same numbers on every launch."""
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    random.seed(SEED)
    return sample()


def both() -> dict:
    return {"fresh": sample(), "seeded": seeded()}


def draws(ctx, seed_first=False):
    """Both, or (``seed_first``) only the seeded draws, seeded before CUDA starts: torch then
    queues the CUDA seed until CUDA's first use, after any seed queued at the rank's start."""
    return {"seeded": seeded()} if seed_first else both()


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, both())
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
