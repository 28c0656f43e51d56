"""One training run of a decoder-only transformer under DDP or FSDP2: what each rank holds, and the step time.

A torchrun script, run unchanged by torchrun and by ``spawn_train("bench/shard_worker.py", argv=[...])``
(bench/shard.py runs both):

    torchrun --standalone --nproc-per-node=2 bench/shard_worker.py --strategy fsdp --size tiny --out r.json

The model is sharded by nbddp's own code (``nbddp.rank.sharding.shard``: each layer, then the root), as
``ctx.prepare`` does under ``strategy="fsdp"``; DDP is ``torch.nn.parallel.DistributedDataParallel``.
AdamW; ``--bf16``: FSDP's bf16 ``MixedPrecisionPolicy`` (bf16 parameters and compute, fp32 gradient
reduction and master weights), DDP's autocast to bf16. Rank 0 writes one JSON object to ``--out``:
every rank's elements and bytes of parameters, gradients and optimizer state (local shards), the
CUDA peak memory per rank, the median step time after ``--warmup`` steps, the parameter count.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: name -> (width, layers, heads, vocabulary, sequence, batch per rank)
SIZES = {
    "tiny": (256, 4, 4, 2048, 64, 4),       # ~3.7M parameters: CPU, 2 ranks
    "1b": (2048, 20, 16, 32000, 1024, 4),   # ~1.07B parameters: a GPU
}


class Layer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, vocab: int, sequence: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(sequence, width)
        self.layers = nn.ModuleList(Layer(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), default="fsdp")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    width, layers, heads, vocab, seq, batch = SIZES[a.size]
    torch.manual_seed(0)
    model = Transformer(width, layers, heads, vocab, seq)
    n_params = sum(p.numel() for p in model.parameters())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16 and a.strategy == "ddp")
    if a.strategy == "fsdp":
        from nbddp.rank.sharding import shard

        if not a.cpu_offload:
            model = model.to(device)
        model = shard(model, mixed_precision="bf16" if a.bf16 else None, cpu_offload=a.cpu_offload)
    else:
        model = nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda and not a.cpu_offload)
    times = _train(model, optimizer, autocast, a, device, vocab, seq, batch, rank)
    _report(a, model, optimizer, times, n_params, rank, world, device)
    dist.destroy_process_group()


def _train(model, optimizer, autocast, a, device, vocab, seq, batch, rank) -> list:
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(a.warmup + a.steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        t0 = time.perf_counter()
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: they are part of what a rank holds
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"loss {loss.item()} at step {step}")
    return times


def _report(a, model, optimizer, times, n_params, rank, world, device) -> None:
    from nbddp.rank.sharding import local_state_bytes

    mine = local_state_bytes(model, optimizer)
    if device.type == "cuda":
        mine["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        record = {"strategy": a.strategy, "size": a.size, "world": world, "bf16": a.bf16, "cpu_offload": a.cpu_offload,
                  "launcher": os.environ.get("NBDDP_RUN_DIR") and "spawn_train" or "torchrun",
                  "parameters": n_params, "step_s": statistics.median(times), "step_times": times, "ranks": every}
        Path(a.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
