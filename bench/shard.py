"""What sharding saves: per-rank state and step time of the same transformer under DDP and FSDP2, side by side.

    python bench/shard.py                  # CPU: 2 gloo ranks, a ~3.7M-parameter transformer, AdamW
    python bench/shard.py --gpu            # every visible GPU: a ~1.07B-parameter transformer, AdamW, bf16
    python bench/shard.py --gpu --json shard.json

Each variant is one launch of ``bench/shard_worker.py`` (a torchrun script) by ``spawn_train``,
the variants interleaved ``--repeats`` times, medians quoted:

- CPU: DDP vs FSDP on 2 ranks: elements and bytes of parameters, gradients and optimizer state
  that each rank holds (local shards), and the step time. Goal: FSDP's per-rank state <= 0.6x DDP's.
- GPU (``--gpu``): DDP vs FSDP (and FSDP with CPU offload) on the visible GPUs: peak memory per GPU
  (``torch.cuda.max_memory_allocated``) and bytes per parameter; then the FSDP step under
  ``spawn_train`` vs the same script under ``torchrun``. Goals: FSDP's peak <= 0.6x DDP's (with 2
  or more GPUs; on one GPU only the CPU offload can save), FSDP's step within 5% of torchrun's.

Exits 1 when a goal is missed, naming it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
WORKER = str(HERE / "shard_worker.py")


def launch(variant: dict, world: int, gpu: bool, runs_dir: str) -> dict:
    """One run of the worker through spawn_train; its rank 0's record."""
    from nbddp import spawn_train

    out = Path(tempfile.mkdtemp()) / "r.json"
    argv = _argv(variant, gpu, out)
    where = dict(gpus=list(range(world))) if gpu else dict(nprocs=world)
    spawn_train(WORKER, argv=argv, runs_dir=runs_dir, echo=False, name="shard", **where)
    return json.loads(out.read_text())


def launch_torchrun(variant: dict, world: int, gpu: bool) -> dict:
    out = Path(tempfile.mkdtemp()) / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                    WORKER, *_argv(variant, gpu, out)], check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _argv(variant: dict, gpu: bool, out: Path) -> list:
    argv = ["--strategy", variant["strategy"], "--size", "1b" if gpu else "tiny", "--out", str(out)]
    if gpu:
        argv.append("--bf16")
    if variant.get("offload"):
        argv.append("--cpu-offload")
    return argv


def _state(record: dict) -> dict:
    """The largest rank's holdings (what the busiest device must fit)."""
    keys = [k for k in record["ranks"][0] if k.endswith(("_bytes", "_elements"))]
    return {k: max(r[k] for r in record["ranks"]) for k in keys}


def table(results: dict, gpu: bool) -> str:
    base = _state(results["ddp"][0])
    lines = ["| variant | params (elements) | grads (elements) | optimizer (elements) | state per rank | vs DDP "
             "| step s | vs DDP |" + (" peak per GPU | bytes / param |" if gpu else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if gpu else "")]
    ddp_step = statistics.median(r["step_s"] for r in results["ddp"])
    for name, records in results.items():
        s = _state(records[0])
        step = statistics.median(r["step_s"] for r in records)
        row = (f"| {name} | {s['params_elements']:,} | {s['grads_elements']:,} | {s['optimizer_elements']:,} | "
               f"{s['total_bytes'] / 2**20:.1f} MiB | {s['total_bytes'] / base['total_bytes']:.2f}x | {step:.3f} | "
               f"{step / ddp_step:.2f}x |")
        if gpu:
            peak = statistics.median(max(r["cuda_peak_bytes"] for r in rec["ranks"]) for rec in records)
            row += f" {peak / 2**30:.2f} GiB | {peak / records[0]['parameters']:.1f} |"
        lines.append(row)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="the ~1B transformer on every visible GPU")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    world = 2
    if a.gpu:
        from nbddp.contract.gpus import list_gpus

        world = len(list_gpus())
        if world == 0:
            print("no GPU found")
            return 1
    variants = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"}}
    if a.gpu:
        variants["fsdp + CPU offload"] = {"strategy": "fsdp", "offload": True}
    results = {name: [] for name in variants}
    runs_dir = tempfile.mkdtemp(prefix="nbddp-shard-")
    for _ in range(a.repeats):  # interleaved: drift of the machine hits every variant alike
        for name, variant in variants.items():
            results[name].append(launch(variant, world, a.gpu, runs_dir))
    if a.gpu:
        results["fsdp under torchrun"] = [launch_torchrun(variants["fsdp"], world, True) for _ in range(a.repeats)]
    print(f"{results['ddp'][0]['parameters']:,} parameters, {world} {'GPU' if a.gpu else 'CPU'} rank(s), AdamW"
          f"{', bf16' if a.gpu else ', fp32'}; medians of {a.repeats}\n")
    print(table(results, a.gpu))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return _goals(results, a.gpu, world)


def _goals(results: dict, gpu: bool, world: int) -> int:
    missed = []
    ratio = _state(results["fsdp"][0])["total_bytes"] / _state(results["ddp"][0])["total_bytes"]
    print(f"\nper-rank state, FSDP / DDP: {ratio:.2f}x (goal <= 0.6x with 2 or more ranks)")
    if world >= 2 and ratio > 0.6:
        missed.append(f"per-rank state {ratio:.2f}x DDP's")
    if gpu:
        peak = {k: statistics.median(max(r["cuda_peak_bytes"] for r in rec["ranks"]) for rec in results[k])
                for k in ("ddp", "fsdp")}
        print(f"peak memory per GPU, FSDP / DDP: {peak['fsdp'] / peak['ddp']:.2f}x")
        if world >= 2 and peak["fsdp"] > 0.6 * peak["ddp"]:
            missed.append("FSDP's peak memory per GPU above 0.6x DDP's")
        ours = statistics.median(r["step_s"] for r in results["fsdp"])
        theirs = statistics.median(r["step_s"] for r in results["fsdp under torchrun"])
        print(f"FSDP step, spawn_train / torchrun: {ours / theirs:.3f}x (goal <= 1.05x)")
        if ours > 1.05 * theirs:
            missed.append(f"FSDP step {ours / theirs:.3f}x torchrun's")
    for m in missed:
        print(f"MISSED: {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
