"""GPU fast path: ResNet34 training throughput, as the built-in worker runs it, on the GPU(s).

    python bench/gpu.py                      # ResNet34, 224 px, batch 256, GPU 0, all variants
    python bench/gpu.py --gpus 0,1 --compile # more GPUs (NCCL), and torch.compile rows
    python bench/gpu.py --smoke              # CPU, tiny sizes: checks every code path (tests)

Everything runs inside one spawn_train launch (one process per GPU), each variant measured
``--repeats`` times, interleaved, median quoted:

1. synthetic tensors already on the GPU: fp32, bf16 autocast, bf16 + channels_last;
2. DDP options on the bf16 + channels_last step: gradient_as_bucket_view, static_graph,
   bucket_cap_mb (25 is DDP's default);
3. torch.compile of that step (``--compile``), with its compile time;
4. real data, flowers-sized (3,670 JPEG photos of 320x240 written once to a temp folder):
   the tensor pipeline (decoded once into GPU memory, batches augmented on the GPU) and the
   PIL pipeline (DataLoader workers from the cores per rank, pin_memory, persistent_workers);
5. the all-reduce time of ResNet34's gradients (21.8 M parameters, 87 MB in fp32) and the
   peak GPU memory.

Throughput is also given as achieved TFLOP/s: 3 x 3.6 GFLOP (forward + backward) x
(image_size / 224)^2 per image, about 21.75 GFLOP at 224 px.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import bench_models  # noqa: E402

GFLOP_224 = 21.75  # ResNet34 training step per image at 224 px (forward 3.6 GFLOP, x3)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(device, channels_last, ddp_kwargs, compile_model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbddp.dist import no_forward_buffer_sync
    from nbddp.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet34", 10).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **no_forward_buffer_sync(),
              **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step_model = torch.compile(ddp) if compile_model else ddp
    return step_model, opt


def _step(model, opt, x, y, amp, channels_last):
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _time(run_steps, device, steps, batch, world):
    _sync(device)
    t0 = time.perf_counter()
    run_steps(steps)
    _sync(device)
    return steps * batch * world / (time.perf_counter() - t0)


def _flowers_like(root: Path, n: int, size=(320, 240)) -> Path:
    """A class-folder tree of ``n`` JPEG photos (5 classes), like the flower photos' 3,670."""
    from PIL import Image

    if (root / "done").exists():
        return root
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        c = root / f"class{i % 5}"
        c.mkdir(parents=True, exist_ok=True)
        base = torch.randint(0, 256, (3, 1, 1), generator=g, dtype=torch.uint8)
        noise = torch.randint(0, 64, (3, size[1] // 8, size[0] // 8), generator=g, dtype=torch.uint8)
        img = (base + noise).repeat_interleave(8, 1).repeat_interleave(8, 2)
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(c / f"{i:05d}.jpg", quality=90)
    (root / "done").write_text("ok")
    return root


def worker(ctx, image_size, batch, steps, repeats, do_compile, data_root, n_images):
    from torch.utils.data import DataLoader, DistributedSampler

    from nbddp import data as D
    from nbddp import tensor_data as TD

    dev, world = ctx.device, ctx.world_size
    x = torch.randn(batch, 3, image_size, image_size, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)

    variants = {  # name: (amp, channels_last, ddp kwargs)
        "fp32": (False, False, {}),
        "bf16": (True, False, {}),
        "bf16 + channels_last": (True, True, {}),
        "+ gradient_as_bucket_view": (True, True, {"gradient_as_bucket_view": True}),
        "+ static_graph": (True, True, {"gradient_as_bucket_view": True, "static_graph": True}),
        "+ bucket_cap_mb=50": (True, True, {"gradient_as_bucket_view": True, "bucket_cap_mb": 50}),
        "+ bucket_cap_mb=100": (True, True, {"gradient_as_bucket_view": True, "bucket_cap_mb": 100}),
    }
    built, compile_s = {}, None
    for name, (amp, cl, kw) in variants.items():
        built[name] = (*_model(dev, cl, kw, False), amp, cl)
    if do_compile:
        model, opt = _model(dev, True, {"gradient_as_bucket_view": True}, True)
        t0 = time.perf_counter()
        _step(model, opt, x, y, True, True)  # the first call compiles
        _sync(dev)
        compile_s = time.perf_counter() - t0
        built["torch.compile (bf16 + channels_last)"] = (model, opt, True, True)

    # Real data, flowers-sized: the tensor pipeline and the PIL pipeline with DataLoader workers.
    _, samples = D.scan_class_folders(data_root)
    samples = samples[:n_images]
    t0 = time.perf_counter()
    workers = D.loader_workers(world, at_least=1)
    cache = TD.TensorCache(samples, image_size, dev, workers)
    decode_s = time.perf_counter() - t0
    t_sampler = DistributedSampler(cache, num_replicas=world, rank=ctx.rank, seed=0)
    t_loader = TD.TensorBatches(cache, t_sampler, batch, drop_last=True)
    augment = TD.BatchAugment(image_size)
    train_tf, _ = D.build_transforms(image_size)
    p_ds = D.ImageListDataset(samples, train_tf)
    p_sampler = DistributedSampler(p_ds, num_replicas=world, rank=ctx.rank, seed=0)
    p_loader = DataLoader(p_ds, batch_size=batch, sampler=p_sampler, drop_last=True, num_workers=workers,
                          pin_memory=dev.type == "cuda", persistent_workers=True, prefetch_factor=4)
    model_rd, opt_rd, amp_rd, cl_rd = built["+ gradient_as_bucket_view"]

    def loop_over(loader, sampler, transform):
        def run(n):
            for xb, yb in bench_models.repeat_epochs(loader, sampler, n):
                xb = xb.to(dev, non_blocking=True)
                yb = yb.to(dev, non_blocking=True)
                _step(model_rd, opt_rd, transform(xb) if transform else xb, yb, amp_rd, cl_rd)
        return run

    rows = {name: [] for name in built}
    rows["real data: tensor pipeline (GPU augmentation)"] = []
    rows["real data: PIL pipeline (DataLoader workers)"] = []
    runners = {name: (lambda n, m=m: [_step(m[0], m[1], x, y, m[2], m[3]) for _ in range(n)])
               for name, m in built.items()}
    runners["real data: tensor pipeline (GPU augmentation)"] = loop_over(t_loader, t_sampler, augment)
    runners["real data: PIL pipeline (DataLoader workers)"] = loop_over(p_loader, p_sampler, None)
    for run in runners.values():  # warm-up: cuDNN autotuning, allocator, loader workers
        run(2)
    for _ in range(repeats):
        for name, run in runners.items():
            rows[name].append(_time(run, dev, steps, batch, world))

    # The all-reduce DDP does each step, alone: ResNet34's gradients as one flat fp32 tensor.
    flat = torch.zeros(sum(p.numel() for p in built["fp32"][0].parameters()), device=dev)
    times = []
    for _ in range(5 + 1):
        _sync(dev)
        t0 = time.perf_counter()
        torch.distributed.all_reduce(flat)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return {"rows": {k: statistics.median(v) for k, v in rows.items()}, "compile_s": compile_s,
            "decode_s": decode_s, "allreduce_ms": statistics.median(times[1:]) * 1000,
            "grad_mb": flat.numel() * 4 / 1e6, "peak_gib": peak, "world": world, "backend": ctx.backend,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "images": len(samples), "loader_workers": workers}


def main(argv=None):
    from nbddp import spawn_train

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="0", help="GPU ids, e.g. 0,1")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", type=int, default=3670, help="real-data images (flowers: 3,670)")
    ap.add_argument("--compile", action="store_true", help="add torch.compile rows (reports compile time)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: check the code paths only")
    ap.add_argument("--work-dir", default=None, help="for the generated photos and the run (default: temp)")
    a = ap.parse_args(argv)
    tmp = Path(a.work_dir or Path(tempfile.gettempdir()) / "nbddp-bench")
    if a.smoke:
        a.image_size, a.batch_size, a.steps, a.repeats, a.images = 32, 4, 2, 1, 40
    data_root = _flowers_like(tmp / f"flowers-like-{a.images}", a.images)
    launch = dict(nprocs=1) if a.smoke else dict(gpus=[int(g) for g in a.gpus.split(",")])
    r = spawn_train(f"{Path(__file__).resolve()}:worker", **launch, echo=False, name="bench-gpu",
                    runs_dir=tmp / "runs",
                    kwargs=dict(image_size=a.image_size, batch=a.batch_size, steps=a.steps, repeats=a.repeats,
                                do_compile=a.compile, data_root=str(data_root), n_images=a.images)).value
    gflop = GFLOP_224 * (a.image_size / 224) ** 2
    base = r["rows"]["fp32"]
    print(f"\n{r['device']} x {r['world']} ({r['backend']}), torch {r['torch']}, ResNet34 at {a.image_size} px, "
          f"batch {a.batch_size} per GPU, median of {a.repeats} x {a.steps} steps\n")
    print("| variant | images/s | vs fp32 | TFLOP/s |")
    print("|---|---|---|---|")
    for name, ips in r["rows"].items():
        print(f"| {name} | {ips:,.0f} | {ips / base:.2f}x | {ips * gflop / 1000:.0f} |")
    comp = f"{r['compile_s']:.1f} s" if r["compile_s"] is not None else "not run (--compile)"
    print(f"\ntorch.compile time: {comp}; decoding {r['images']} images into the tensor cache: {r['decode_s']:.1f} s; "
          f"PIL loader workers per rank: {r['loader_workers']}")
    print(f"all-reduce of the gradients ({r['grad_mb']:.0f} MB fp32, world {r['world']}): {r['allreduce_ms']:.2f} ms; "
          f"peak GPU memory per rank: {r['peak_gib']:.1f} GiB")
    return r


if __name__ == "__main__":
    main()
