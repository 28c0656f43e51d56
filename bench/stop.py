"""Stop loses no step: what the mid-epoch checkpoint costs, and how long Stop takes.

    python bench/stop.py [--part all|save|around|stop|interrupt] [--repeats 5]

``around``: the step after a checkpoint when the checkpoint is written on the step's path
(``atomic_save``, as before) or in the background (``checkpoint.BackgroundSaver``, what the
built-in worker does), side by side in one process.

``save``: the checkpoint the built-in worker writes in the middle of an epoch, for ResNet34 with
10 classes (model, SGD momentum, schedule, history, every rank's random state): its size, and
rank 0's ``checkpoint.atomic_save`` time (temp file, fsync, rename, fsync of the folder), median
of ``--repeats`` writes into a fresh folder each time (after one write to warm the page cache).

``stop``: the digits (data/digits), ResNet34 at image_size 32, 2 CPU ranks, batch 32: launched
in the background, ``handle.stop()`` is called a few steps into the second epoch (so the stop
writes a mid-epoch checkpoint, then evaluates the best epoch and exports it, as a real Stop
does), and the time from the call to the ``TrainResult(stopped=True)`` is measured; rank 0's log
says when its checkpoint was written and how long that took. ``interrupt``: the same with the
cell's Interrupt (``RunHandle.end_interrupted``) instead, to ``TrainingInterrupted``: the workers
write the checkpoint and exit, with no final evaluation nor export.
"""

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))


def checkpoint_dict(world: int = 2) -> dict:
    """A mid-epoch checkpoint of ResNet34 as the built-in worker writes it (after a few steps)."""
    import torch

    from nbddp import TrainConfig
    from nbddp.tasks.classification.models import build_model

    model = build_model("resnet34", 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()  # momentum buffers exist, as after any step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    rng = {"torch": torch.get_rng_state(), "cuda": None, "python": random.getstate()}
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": None, "epoch": 1, "step": 5, "best_accuracy": 0.5, "best_epoch": 0,
            "rng": rng, "rank_rng": [rng] * world, "config": TrainConfig().to_dict(), "classes": list("0123456789"),
            "history": [{"epoch": 0, "train_loss": 1.0, "val_accuracy": 0.5}]}


def bench_save(repeats: int) -> dict:
    from nbddp.contract.checkpoint import atomic_save

    ck = checkpoint_dict()
    times, size = [], 0
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # the disk runs are written to
        for i in range(repeats + 1):
            path = Path(tmp) / f"r{i}" / "last.pt"
            t0 = time.perf_counter()
            atomic_save(ck, path)
            dt = time.perf_counter() - t0
            size = path.stat().st_size
            if i:  # the first write warms up
                times.append(dt)
            path.unlink()
    return {"size_mb": round(size / 2**20, 1), "atomic_save_s": round(statistics.median(times), 3),
            "atomic_save_s_all": [round(t, 3) for t in times]}


def bench_around(repeats: int, device: str = "cpu") -> dict:
    """The step after a checkpoint, written on the step's path (``atomic_save``) or in the background
    (``checkpoint.BackgroundSaver``): seconds from the checkpoint's start to the next step's end,
    against a step without one, side by side in one process. ResNet34 with 10 classes (its model
    and SGD-momentum state: ~163 MB); on the CPU at 64 px, batch 8; on ``cuda`` as the GPU fast
    path trains (224 px, batch 256, bf16 autocast, channels_last), synchronised around each step."""
    import torch

    from nbddp.contract.checkpoint import BackgroundSaver, atomic_save
    from nbddp.tasks.classification.models import build_model

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    size, batch = (224, 256) if cuda else (64, 8)
    fmt = torch.channels_last if cuda else torch.contiguous_format
    model = build_model("resnet34", 10).to(dev, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,), device=dev)
    if cuda:
        torch.backends.cudnn.benchmark = True

    def step():
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)  # the step's end, not its launch

    def state():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}

    for _ in range(3 if cuda else 1):  # cuDNN's autotuning and the allocator stay out of the numbers
        step()
    plain, sync, background, on_path = [], [], [], []
    saver = BackgroundSaver()
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        for i in range(repeats):
            t0 = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            atomic_save(state(), Path(tmp) / f"s{i}.pt")
            step()
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            saver.save(state(), Path(tmp) / f"b{i}.pt")
            on_path.append(time.perf_counter() - t0)
            step()
            background.append(time.perf_counter() - t0)
            saver.wait()
    med = {k: statistics.median(v) for k, v in
           (("step_s", plain), ("checkpoint_and_step_s", sync), ("background_checkpoint_and_step_s", background),
            ("background_on_path_s", on_path))}
    out = {k: round(v, 3) for k, v in med.items()}
    sync_cost = med["checkpoint_and_step_s"] - med["step_s"]
    background_cost = med["background_checkpoint_and_step_s"] - med["step_s"]
    out["checkpoint_cost_s"] = {"sync": round(sync_cost, 3), "background": round(background_cost, 3)}
    # None when the machine's noise is larger than the checkpoint itself: run it again, alone.
    out["checkpoint_cost_ratio_background_vs_sync"] = round(background_cost / sync_cost, 3) if sync_cost > 0.02 else None
    out["device"] = torch.cuda.get_device_name(dev) if cuda else "cpu"
    out["checkpoint_mb"] = round(sum(t.numel() * t.element_size() for t in _tensors(state())) / 1e6, 1)
    return out


def _tensors(obj):
    if hasattr(obj, "numel"):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def bench_stop(how: str = "stop") -> dict:
    from nbddp import TrainConfig, TrainingInterrupted, spawn_train

    with tempfile.TemporaryDirectory(dir=ROOT) as runs:
        cfg = TrainConfig(data_path=str(ROOT / "data" / "digits"), model="resnet34", image_size=32, epochs=20,
                          batch_size=32, lr=0.01, nprocs=2, crop_scale=0.5, hflip=False, runs_dir=runs,
                          name="stop-bench")
        h = spawn_train(cfg, block=False, echo=False)
        deadline = time.time() + 900
        while time.time() < deadline and h.running:
            p = h.progress
            if p.get("epoch") == 1 and (p.get("step") or 0) >= 3:
                break
            time.sleep(0.05)
        at_click = dict(h.progress)
        t0 = time.time()
        if how == "stop":
            h.stop()
            stopped = h.wait().stopped
        else:
            try:
                h.end_interrupted()  # what the cell's Interrupt calls
            except TrainingInterrupted:
                stopped = True
        t1 = time.time()
        log = (h.run_dir / "logs" / "rank0.log").read_text()
        saved = re.search(r"checkpoint of epoch (\d+) step (\d+) .*?\(([\d.]+) MB in ([\d.]+) s", log)
        last = h.run_dir / "checkpoints" / "last.pt"
        return {"stopped": stopped, "click_to_end_s": round(t1 - t0, 2),
                "click_to_checkpoint_s": round(last.stat().st_mtime - t0, 2),
                "steps_per_epoch": at_click.get("steps"), "step_at_click": at_click.get("step"),
                "step_s": round(2 * cfg.batch_size / at_click["images_per_s"], 2) if at_click.get("images_per_s") else None,
                "checkpoint_line": saved.group(0) if saved else None,
                "checkpoint_write_s": float(saved.group(4)) if saved else None,
                "checkpoint_mb": float(saved.group(3)) if saved else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["all", "save", "around", "stop", "interrupt"], default="all")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="where --part around trains: cpu or cuda")
    args = ap.parse_args()
    out = {}
    if args.part in ("all", "save"):
        out["save"] = bench_save(args.repeats)
    if args.part in ("all", "around"):
        out["around"] = bench_around(args.repeats, args.device)
    if args.part in ("all", "stop"):
        out["stop"] = bench_stop("stop")
    if args.part in ("all", "interrupt"):
        out["interrupt"] = bench_stop("interrupt")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
