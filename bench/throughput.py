"""Steady-state throughput and memory, nbddp against a plain-DDP reference run by torchrun.

    python bench/throughput.py [--repeats 3]

Each comparison runs both sides in this one run, interleaved, and quotes the median:
1. overhead: the built-in worker (live progress, logging, TensorBoard, per-step agreement,
   checkpoints each epoch; evaluation excluded) vs plain_ddp.py under torchrun, same model
   (resnet18), data (the digits at 32 px through PIL transforms), batch (32 per rank) and 2 CPU
   ranks; the same with the built-in worker's tensor data pipeline;
2. CPU scaling: 2 ranks x 1 thread vs 1 process x 2 threads vs 1 process x 1 thread, for the
   small CNN (the goal) and resnet18 (11 M parameters: bound by gloo's all-reduce);
3. data: nbddp's data paths (PIL, PIL decoded once, tensor pipeline) vs synthetic tensors in
   memory, small CNN, via spawn_train;
4. memory: peak resident memory per rank, and rank 0's resident memory at each epoch end.
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
DIGITS = str(ROOT / "data" / "digits")
sys.path.insert(0, str(ROOT))


def plain(tmp: Path, nproc: int, threads: int, **kw) -> dict:
    out = tmp / "plain.jsonl"
    out.unlink(missing_ok=True)
    args = [str(HERE / "plain_ddp.py"), "--threads", str(threads), "--out", str(out)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, PYTHONPATH=str(HERE), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(threads))
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + args
           if nproc > 1 else [sys.executable] + args)
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=900)
    return json.loads(out.read_text().splitlines()[-1])


def builtin(tmp: Path, epochs: int = 3, pipeline: str = "pil") -> dict:
    from nbddp import TrainConfig, spawn_train

    cfg = TrainConfig(data_path=DIGITS, model="resnet18", image_size=32, epochs=epochs, batch_size=32, lr=0.01,
                      nprocs=2, crop_scale=0.5, hflip=False, check_images=False, runs_dir=str(tmp / "runs"),
                      name="bench", data_pipeline=pipeline)
    r = spawn_train(cfg, echo=False)
    later = [m["images_per_s"] for m in r.metrics[1:]]  # epoch 1 includes warm-up
    return {"images_per_s": statistics.median(later), "rss_mb": [round(m["rss_mb"]) for m in r.metrics]}


def nbddp_loop(tmp: Path, data: str, steps: int, model: str = "small_cnn") -> dict:
    from nbddp import spawn_train

    r = spawn_train(f"{HERE}/workers.py:train", nprocs=2, runs_dir=tmp / "runs", echo=False,
                    kwargs=dict(model=model, data=data, steps=steps, warmup=5))
    return r.value


def med(xs):
    return statistics.median(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    steps_per_epoch = 1438 // (2 * 32)
    data_modes = {"synthetic": "synthetic", "pil": f"pil:{DIGITS}", "pil-cache": f"pil-cache:{DIGITS}",
                  "tensor": f"tensor:{DIGITS}"}
    rows = {k: [] for k in ("builtin", "builtin_tensor", "plain_resnet", "nbddp_resnet", "p1t1", "p1t2", "p2t1",
                            "r1t1", "r1t2", "r2t1", "rss_plain", *[f"nb_{m}" for m in data_modes])}
    rss_builtin = []
    for _ in range(a.repeats):
        b = builtin(tmp)
        rows["builtin"].append(b["images_per_s"])
        rss_builtin.append(b["rss_mb"])
        rows["builtin_tensor"].append(builtin(tmp, pipeline="tensor")["images_per_s"])
        p = plain(tmp, 2, 1, model="resnet18", data=DIGITS, batch_size=32, steps=steps_per_epoch * 2, warmup=5)
        rows["plain_resnet"].append(p["images_per_s"])
        rows["rss_plain"].append(p["peak_rss_mb"])
        rows["nbddp_resnet"].append(nbddp_loop(tmp, DIGITS, steps_per_epoch * 2, model="resnet18")["images_per_s"])
        rows["p1t1"].append(plain(tmp, 1, 1, steps=80)["images_per_s"])
        rows["p1t2"].append(plain(tmp, 1, 2, steps=80)["images_per_s"])
        rows["p2t1"].append(plain(tmp, 2, 1, steps=80)["images_per_s"])
        rows["r1t1"].append(plain(tmp, 1, 1, model="resnet18", steps=30)["images_per_s"])
        rows["r1t2"].append(plain(tmp, 1, 2, model="resnet18", steps=30)["images_per_s"])
        rows["r2t1"].append(plain(tmp, 2, 1, model="resnet18", steps=30)["images_per_s"])
        for m, data in data_modes.items():
            rows[f"nb_{m}"].append(nbddp_loop(tmp, data, 80)["images_per_s"])

    m = {k: med(v) for k, v in rows.items()}
    print(f"\nmedian of {a.repeats}, 2 CPU ranks unless said (cores: {os.cpu_count()})\n")
    print("| comparison | nbddp | reference | ratio | goal |")
    print("|---|---|---|---|---|")

    def row(text, ours, ref, goal="-"):
        print(f"| {text} | {ours:.0f} | {ref:.0f} | {ours / ref:.3f} | {goal} |")

    row("built-in worker vs plain DDP under torchrun (resnet18, digits 32 px, batch 32), img/s",
        m["builtin"], m["plain_resnet"], ">= 0.98")
    row("same plain loop via spawn_train vs torchrun, img/s", m["nbddp_resnet"], m["plain_resnet"], ">= 0.98")
    row("built-in worker, data_pipeline='tensor', vs plain DDP (PIL) under torchrun, img/s",
        m["builtin_tensor"], m["plain_resnet"])
    row("2 ranks x 1 thread vs ideal (2 x 1 process x 1 thread), small CNN", m["p2t1"], 2 * m["p1t1"], ">= 0.85")
    row("2 ranks x 1 thread vs 1 process x 2 threads, small CNN", m["p2t1"], m["p1t2"], ">= 1.1")
    row("2 ranks x 1 thread vs ideal, resnet18 (44.7 MB of gradients per step)", m["r2t1"], 2 * m["r1t1"])
    row("2 ranks x 1 thread vs 1 process x 2 threads, resnet18", m["r2t1"], m["r1t2"])
    for mode, goal in (("pil", ">= 0.9"), ("pil-cache", ">= 0.9"), ("tensor", ">= 0.9")):
        row(f"real digits, {mode} pipeline, vs synthetic tensors (small CNN, via spawn_train)",
            m[f"nb_{mode}"], m["nb_synthetic"], goal)
    print(f"\npeak RSS per rank: built-in worker epoch-end RSS (rank 0) per run {rss_builtin} MB; "
          f"plain DDP peak {m['rss_plain']:.0f} MB")
    print("\nall runs (img/s):")
    for k, v in rows.items():
        print(f"  {k}: {[round(x) for x in v]}")


if __name__ == "__main__":
    main()
