"""``python -m pkg.train --steps 3``: a module run as __main__ under torchrun's environment."""

import argparse
import json
import os
import sys

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
args = parser.parse_args()
dist.init_process_group("gloo", init_method="env://")
if dist.get_rank() == 0:
    with open("module_report.json", "w") as f:
        json.dump({"steps": args.steps, "argv0": os.path.basename(sys.argv[0]), "name": __name__,
                   "world": dist.get_world_size()}, f)
dist.barrier()  # every rank has joined before any leaves
dist.destroy_process_group()
