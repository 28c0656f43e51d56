"""A function written for torchrun's environment: ``fn(*args)``, its group from ``env://``."""

import os

import torch.distributed as dist


def train(total_epochs, tag="run"):
    dist.init_process_group("gloo")
    value = [None]
    if dist.get_rank() == 0:
        value = [f"{tag}:{total_epochs}:{dist.get_world_size()}:{os.environ['LOCAL_RANK']}"]
    dist.broadcast_object_list(value, src=0)
    dist.destroy_process_group()
    return value[0]
