"""An ImageNet-example-style trainer (no nbddp): argparse, and mp.spawn only behind a flag.

``python imagenet_style.py --multiprocessing-distributed --dist-url tcp://... --world-size 1 --rank 0``
spawns one process per GPU itself, each joining with its computed rank, as pytorch/examples'
``imagenet/main.py`` does; without the flag it is one process of a job torchrun started (``env://``).
"""

import argparse
import os

import torch.distributed as dist
import torch.multiprocessing as mp


def main_worker(gpu, ngpus_per_node, args):
    if args.dist_url == "env://" and args.rank == -1:
        args.rank = int(os.environ["RANK"])
    if args.multiprocessing_distributed:
        args.rank = args.rank * ngpus_per_node + gpu  # the global rank among all processes
    dist.init_process_group("gloo", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}, local rank {gpu}", flush=True)
    # As training would, a collective before leaving: rank 0 destroying its group while rank 1
    # still connects to it fails rank 1 ("Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--multiprocessing-distributed", action="store_true")
    parser.add_argument("--dist-url", default="env://")
    parser.add_argument("--world-size", type=int, default=-1)
    parser.add_argument("--rank", type=int, default=-1)
    args = parser.parse_args()
    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ["WORLD_SIZE"])
    ngpus_per_node = 2
    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
    else:
        main_worker(int(os.environ.get("LOCAL_RANK", 0)), ngpus_per_node, args)


if __name__ == "__main__":
    main()
