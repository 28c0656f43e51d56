"""Code that never asks ctx.should_stop(): a script, and an mp.spawn-style function."""

import os
import sys
import time

import torch.distributed as dist


def spin(rank, seconds=120):
    print(f"rank {rank} spinning", flush=True)
    deadline = time.time() + seconds
    while time.time() < deadline:
        time.sleep(0.05)  # a blocking call: the stop must reach it too
    return "finished"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    spin(dist.get_rank(), float(sys.argv[1]) if len(sys.argv) > 1 else 120)
    dist.destroy_process_group()
    os._exit(0)
