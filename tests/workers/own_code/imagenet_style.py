"""An ImageNet-example-style trainer (no nbddp): argparse, and mp.spawn only behind a flag.

``python imagenet_style.py --multiprocessing-distributed`` spawns one process per GPU itself;
without the flag it is one process of a job torchrun started (``env://``).
"""

import argparse
import os

import torch.distributed as dist
import torch.multiprocessing as mp


def main_worker(gpu, ngpus_per_node, args):
    dist.init_process_group("gloo")  # env://, from torchrun's environment
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}, local rank {gpu}", flush=True)
    # As training would, a collective before leaving: rank 0 destroying its group while rank 1
    # still connects to it fails rank 1 ("Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--multiprocessing-distributed", action="store_true")
    args = parser.parse_args()
    ngpus_per_node = 2
    if args.multiprocessing_distributed:
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
    else:
        main_worker(int(os.environ.get("LOCAL_RANK", 0)), ngpus_per_node, args)


if __name__ == "__main__":
    main()
