"""GPU fast path, side by side in one run: plain PyTorch, nbddp's training step, the built-in worker.

    python bench/gpu.py --compile --json gpu.json  # the table for docs/benchmarks.md (<= 5 min, one H100)
    python bench/gpu.py --quick                    # a quick pass: fewer steps, one repeat
    python bench/gpu.py --profile                  # + a profiler summary of one nbddp training step
    python bench/gpu.py --e2e-only                 # only the built-in worker's launches (fixed costs, pipelines)
    python bench/gpu.py --no-e2e --step-rows eager # parts 1 and 2 only, nbddp's step without the DDP variants
    python bench/gpu.py --smoke                    # CPU, tiny sizes: every code path (tests)
    python bench/gpu.py --report-from gpu-round-out # the whole table again from a GPU round's step.json and e2e.json

ResNet34 (torchvision, 10 outputs) at 224 px, batch 256 per GPU, autocast (bf16 from compute
capability 8.0, else fp16 with a GradScaler) + channels_last, SGD with momentum,
``cudnn.benchmark`` on. Three parts, one after the other so that none shares a process, a CUDA
context or GPU memory with another:

1. **plain PyTorch**: a subprocess of this script (``--plain-only``): one process, no launcher,
   no DDP, no nbddp import; synthetic tensors already on the GPU; eager and, with
   ``--compile``, ``torch.compile`` of the model (compile time reported). The ceiling.
2. **nbddp's training step**: one ``spawn_train`` launch (one rank per GPU, NCCL) running
   ``nbddp.rank.engine.train_one_epoch`` -- the built-in worker's step, with DDP, the run context's
   heartbeats and progress, the per-step agreement all-reduce -- over an in-memory batch
   source on the GPU, the model built as the built-in worker builds it. Rows: today's DDP
   options, the DDP option variants (``gradient_as_bucket_view``, ``static_graph``,
   ``bucket_cap_mb``) and ``cudnn.benchmark`` off, so the defaults can be chosen from them, and
   ``torch.compile`` (``--compile``). Also the all-reduce time of the gradients alone, and with
   ``--profile`` a profiler summary of one step.
3. **the built-in worker end to end**: a fresh ``python -c`` process calls ``spawn_train`` with a
   ``TrainConfig`` on a flowers-sized folder (3,670 JPEGs of 320x240, 5 classes, generated
   once into the work folder), tensor pipeline, 3 epochs: the first launch, then a warm
   relaunch from that same process, then the decode pipeline (bytes to the GPU, nvJPEG) and the
   PIL pipeline with the default workers (``--e2e-only``: this part alone).
   Steady images/s are the epochs after the first (``images_per_s`` of ``result.metrics``),
   also without each epoch's first batch; the
   peak GPU memory of these rows is the worker's own (``gpu_mem_alloc_gib`` of its records).

Each row of parts 1 and 2 is measured ``--repeats`` times, interleaved, median quoted. The
ratios between the parts are printed, and every figure is written to ``--json``.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
import bench_models  # noqa: E402

# ResNet34 at 224 px: the forward pass is about 3.6 GMAC = 7.3 GFLOP (a multiply-add is 2 FLOP);
# the backward computes the gradients of the activations and of the weights, about twice the
# forward, so a training step is about 3x the forward: 21.8 GFLOP per image. Scales with pixels.
GFLOP_224 = 21.8

PLAIN_COMPILED, PLAIN_EAGER = "plain PyTorch, torch.compile", "plain PyTorch, eager"
STEP_EAGER, STEP_COMPILED = "nbddp step, eager", "nbddp step, torch.compile"
#: nbddp's step as the built-in worker builds it (``nbddp.rank.dist.data_parallel``: the bare model
#: on one GPU), then DDP option variants: name -> (DDP keyword arguments or None, cudnn.benchmark).
STEP_VARIANTS = {
    STEP_EAGER: (None, True),
    "nbddp step under DDP (defaults but no forward buffer sync)": ({}, True),
    "nbddp step, + gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, True),
    "nbddp step, + static_graph": ({"static_graph": True}, True),
    "nbddp step, + gradient_as_bucket_view + static_graph": (
        {"gradient_as_bucket_view": True, "static_graph": True}, True),
    "nbddp step, bucket_cap_mb=50 (DDP default 25)": ({"bucket_cap_mb": 50}, True),
    "nbddp step, bucket_cap_mb=100": ({"bucket_cap_mb": 100}, True),
    "nbddp step, cudnn.benchmark off": ({}, False),
}


# ------------------------------------------------------------------------------ shared helpers
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _amp_dtype(device):
    """The built-in worker's rule (bf16 from compute capability 8.0, else fp16), without nbddp.

    ``None`` (fp32) on the CPU of ``--smoke``, as in the built-in worker: CPU convolutions under
    bf16 autocast take a slow path that would only make the smoke test long.
    """
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def _dtype_name(dtype):
    return "float32" if dtype is None else str(dtype).replace("torch.", "")


def _measure(runners, device, steps, repeats, images_per_step, warmup):
    """Images/s and peak memory of each ``runners[name](n_steps)``, interleaved, median of ``repeats``.

    Args:
        runners: name -> function running that many training steps.
        device: where they run (synchronised around each timed run).
        steps: timed steps per run.
        repeats: timed runs per name; the names take turns so that drifts hit them alike.
        images_per_step: images one step trains (batch x world).
        warmup: untimed steps first (cuDNN autotuning, the allocator, lazy initialisation).

    Returns:
        name -> ``{"images_per_s": median, "runs": [...], "peak_gib": max over the runs}``.
    """
    cuda = device.type == "cuda"
    for run in runners.values():
        run(warmup)
    runs = {name: [] for name in runners}
    peaks = {name: 0.0 for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            run(steps)
            _sync(device)
            runs[name].append(steps * images_per_step / (time.perf_counter() - t0))
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) / 2**30)
    return {name: {"images_per_s": statistics.median(v), "runs": v, "peak_gib": peaks[name] if cuda else None}
            for name, v in runs.items()}


def _flowers_like(root: Path, n: int, size=(320, 240)) -> Path:
    """A class-folder tree of ``n`` JPEG photos (5 classes), like the flower photos' 3,670."""
    from PIL import Image

    if (root / "done").exists():
        return root
    g = torch.Generator().manual_seed(0)
    # Each class has its own mean colour, each photo a random shift of it and coarse noise: labels
    # a model can learn, so that the pipelines' accuracies on the same split compare.
    means = torch.randint(40, 160, (5, 3, 1, 1), generator=g)
    for i in range(n):
        c = root / f"class{i % 5}"
        c.mkdir(parents=True, exist_ok=True)
        base = (means[i % 5] + torch.randint(-40, 41, (3, 1, 1), generator=g)).clamp(0, 191).to(torch.uint8)
        noise = torch.randint(0, 64, (3, size[1] // 8, size[0] // 8), generator=g, dtype=torch.uint8)
        img = (base + noise).repeat_interleave(8, 1).repeat_interleave(8, 2)
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(c / f"{i:05d}.jpg", quality=90)
    (root / "done").write_text("ok")
    return root


# ------------------------------------------------------------------------------ 1. plain PyTorch
def plain(a) -> dict:
    """The plain-PyTorch rows, in this process (run as ``--plain-only``: no nbddp is imported)."""
    device = torch.device("cpu") if a.smoke else torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    amp_dtype = _amp_dtype(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, generator=g).to(device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (a.batch_size,), generator=g).to(device)

    def build(compile_model):
        torch.manual_seed(0)
        model = bench_models.build(a.model, 10).to(device, memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None
        if compile_model:
            model = torch.compile(model, backend=a.compile_backend)

        def run(n):
            for _ in range(n):
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
        return run

    runners = {PLAIN_EAGER: build(False)}
    compile_s = None
    if a.compile:
        run = build(True)
        _sync(device)
        t0 = time.perf_counter()
        run(1)  # the first step compiles the forward and the backward
        _sync(device)
        compile_s = time.perf_counter() - t0
        runners[PLAIN_COMPILED] = run
    rows = _measure(runners, device, a.steps, a.repeats, a.batch_size, a.warmup)
    return {"rows": rows, "compile_s": compile_s, "amp_dtype": _dtype_name(amp_dtype),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "nbddp_imported": any(m.split(".")[0] == "nbddp" for m in sys.modules)}


def _run_plain_child(a, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--plain-only", "--json", str(out),
           "--image-size", str(a.image_size), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
           "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--compile-backend", a.compile_backend]
    cmd += ["--compile"] if a.compile else []
    cmd += ["--smoke"] if a.smoke else []
    env = dict(os.environ)
    if not a.smoke and "CUDA_VISIBLE_DEVICES" not in env:
        # The first GPU of --gpus, numbered as nvidia-smi (and nbddp) number them. A user's own
        # CUDA_VISIBLE_DEVICES is kept: the plain row then runs on its first device.
        env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=a.gpus.split(",")[0])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=a.part_timeout)
    if p.returncode != 0:
        raise RuntimeError(f"the plain-PyTorch process failed ({p.returncode}):\n{p.stderr[-4000:]}")
    r = json.loads(out.read_text())
    r["process_s"] = time.perf_counter() - t0
    return r


# ------------------------------------------------------------------------------ 2. nbddp's step
class _Batches:
    """``steps`` batches of one in-memory batch already on the device: nothing feeds in between."""

    def __init__(self, x, y, steps, label=False):
        self.x, self.y, self.steps, self.label = x, y, steps, label

    def __len__(self):
        return self.steps

    def __iter__(self):
        from torch.profiler import record_function

        for _ in range(self.steps):
            with record_function("bench: data wait") if self.label else contextlib.nullcontext():
                xy = (self.x, self.y)
            yield xy


class _Labelled(torch.nn.Module):
    """The model with its forward marked for the profiler (the engine itself has no hooks)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.profiler import record_function

        with record_function("bench: forward"):
            return self.inner(x)


def step_worker(ctx, model_name, image_size, batch, steps, repeats, warmup, do_compile, compile_backend, profile,
                variants="all"):
    """Part 2, in every rank of a ``spawn_train`` launch: nbddp's training step and its variants
    (``variants="eager"``: the step as the built-in worker builds it, alone)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbddp.rank.dist import data_parallel, no_forward_buffer_sync
    from nbddp.rank.engine import autocast_dtype, grad_scaler, train_one_epoch
    from nbddp.tasks.classification.models import build_model

    dev, world = ctx.device, ctx.world_size
    cuda = dev.type == "cuda"
    torch.backends.cudnn.benchmark = True
    amp_dtype = autocast_dtype(dev)  # the built-in worker's choice (None, fp32, on the CPU of --smoke)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(batch, 3, image_size, image_size, generator=g).to(dev)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)

    def build(ddp_kwargs, compile_model=False):
        # As the built-in worker's _build does it: same model, memory format, DDP options, optimizer.
        torch.manual_seed(0)
        model = build_model(model_name, 10).to(dev, memory_format=torch.channels_last)
        if ddp_kwargs is None:
            ddp = data_parallel(model, dev)
        else:
            ddp = DDP(model, device_ids=[dev.index] if cuda else None, **no_forward_buffer_sync(), **ddp_kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step_model = torch.compile(ddp, backend=compile_backend) if compile_model else ddp
        return step_model, opt, grad_scaler(dev, amp_dtype)

    def runner(model, opt, scaler, cudnn_benchmark=True):
        def run(n):
            torch.backends.cudnn.benchmark = cudnn_benchmark
            try:
                train_one_epoch(model, opt, _Batches(x, y, n), dev, 0, ctx=ctx, scaler=scaler, amp_dtype=amp_dtype,
                                channels_last=True)
            finally:
                torch.backends.cudnn.benchmark = True
        return run

    chosen = {name: v for name, v in STEP_VARIANTS.items() if variants == "all" or name == STEP_EAGER}
    built = {name: build(kw) for name, (kw, _) in chosen.items()}
    runners = {name: runner(*built[name], cudnn_benchmark=bench) for name, (_, bench) in chosen.items()}
    compile_s = None
    if do_compile:
        compiled = build(None, compile_model=True)
        run = runner(*compiled)
        _sync(dev)
        t0 = time.perf_counter()
        run(1)  # the first step compiles (DDP's graph is split at its buckets)
        _sync(dev)
        compile_s = time.perf_counter() - t0
        runners[STEP_COMPILED] = run
    rows = _measure(runners, dev, steps, repeats, batch * world, warmup)
    for row in rows.values():
        row["images_per_s_per_gpu"] = row["images_per_s"] / world

    # The all-reduce DDP does each step, alone: the gradients as one flat fp32 tensor.
    flat = torch.zeros(sum(p.numel() for p in built[STEP_EAGER][0].parameters()), device=dev)
    times = []
    for _ in range(5 + 1):
        _sync(dev)
        t0 = time.perf_counter()
        torch.distributed.all_reduce(flat)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    summary = _profile_step(ctx, *built[STEP_EAGER], x, y, dev, amp_dtype, train_one_epoch) if profile else None
    return {**_flops_as_nbddp_counts(model_name, image_size, dev, amp_dtype), "rows": rows, "compile_s": compile_s, "allreduce_ms": statistics.median(times[1:]) * 1000,
            "grad_mb": flat.numel() * 4 / 1e6, "model": model_name, "world": world, "backend": ctx.backend,
            "amp_dtype": _dtype_name(amp_dtype), "profile": summary,
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__}


def _group_of(evt, kernel_name=""):
    """The part of a training step a profiler event belongs to, from it and its enclosing ranges."""
    if "nccl" in kernel_name.lower():
        return "all-reduce"
    e = evt
    while e is not None:  # innermost first: an all-reduce launched from a backward hook is an all-reduce
        name = e.name
        low = name.lower()
        if "nccl" in low or "allreduce" in low or "all_reduce" in low:
            return "all-reduce"
        if name.startswith("Optimizer.") or "gradscaler" in low or "_amp_foreach" in low:
            return "optimizer"
        if name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if name.startswith("bench: "):  # bench: forward, bench: data wait (and bench/step_profile.py's parts)
            return name[len("bench: "):]
        e = e.cpu_parent
    return "other (loss, agreement flags, copies)"


#: CUDA runtime calls that block the host until the GPU catches up (``.item()``, ``.tolist()``,
#: ``.cpu()`` of a CUDA tensor end in a stream synchronisation).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _profile_step(ctx, model, opt, scaler, x, y, dev, amp_dtype, train_one_epoch, steps=3):
    """Where one nbddp training step spends its time: top ops and a grouped line, per step.

    Device time per group on a GPU (kernels attributed through the ranges that launched them),
    host time on the CPU; the data wait and the host synchronisations are host time.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    labelled = _Labelled(model)
    train_one_epoch(labelled, opt, _Batches(x, y, 2), dev, 0, ctx=ctx, scaler=scaler, amp_dtype=amp_dtype,
                    channels_last=True)  # warm: nothing first-time inside the profile
    _sync(dev)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        train_one_epoch(labelled, opt, _Batches(x, y, steps, label=True), dev, 0, ctx=ctx, scaler=scaler,
                        amp_dtype=amp_dtype, channels_last=True)
        _sync(dev)
        wall = time.perf_counter() - t0
    events = prof.events()
    groups, data_wait_us, sync_us = {}, 0.0, 0.0
    syncs = -1 if cuda else 0  # the profile's own torch.cuda.synchronize() above is not the step's
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue  # device events are counted through the CPU op they belong to (e.kernels)
        if e.name == "bench: data wait":
            data_wait_us += e.cpu_time_total
        if e.name in SYNC_CALLS:
            syncs += 1
            sync_us += e.cpu_time_total
        if cuda:
            for k in e.kernels:
                group = _group_of(e, k.name)
                groups[group] = groups.get(group, 0.0) + k.duration
        else:
            group = _group_of(e)
            groups[group] = groups.get(group, 0.0) + e.self_cpu_time_total
    sort_key = "self_cpu_time_total"
    if cuda:
        sort_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort_key, row_limit=15, max_name_column_width=70)
    except (AttributeError, KeyError, TypeError):  # older profilers name the key differently
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    return {"steps": steps, "step_ms": wall * 1000 / steps, "time_kind": "device" if cuda else "host",
            "groups_ms": {k: v / 1000 / steps for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "data_wait_ms": data_wait_us / 1000 / steps, "host_syncs_per_step": syncs / steps,
            "host_sync_ms": sync_us / 1000 / steps, "top_ops": table, "rank": ctx.rank}


# ------------------------------------------------------------------------------ 3. end to end
def _flops_as_nbddp_counts(model_name, image_size, dev, amp_dtype) -> dict:
    """nbddp's own FLOP count of one image's step (``nbddp.count_flops``, on the meta device) and this
    device's dense peak at the step's precision from nbddp's table (None: a CPU, a GPU it does not know)."""
    from nbddp.contract.throughput import peak_tflops
    from nbddp.rank.flops import count_flops, device_name, device_sms, precision_of
    from nbddp.tasks.classification.models import build_model

    with torch.device("meta"):
        model = build_model(model_name, 10)
    count = count_flops(model, torch.empty(2, 3, image_size, image_size, device="meta")) / 2
    precision = precision_of(amp_dtype)
    return {"gflop_nbddp": count / 1e9, "precision": precision,
            "peak_tflops": peak_tflops(device_name(dev), precision, device_sms(dev))}


E2E_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, nbddp  # what a fresh kernel has done before its first launch
from nbddp import TrainConfig, spawn_train
spec = json.loads(sys.argv[1])
out = {"import_s": time.perf_counter() - t0}
def launch(key, **override):
    cfg = TrainConfig(**dict(spec["config"], **override))
    t = time.perf_counter()
    seen = {}
    def first_step(kind, payload):  # the first progress with a step done: the launch's fixed cost
        if kind == "progress" and (payload.get("step") or 0) >= 1 and "first_step_s" not in seen:
            seen["first_step_s"] = time.perf_counter() - t
    r = spawn_train(cfg, echo=False, on_event=first_step)
    out[key] = {"wall_s": time.perf_counter() - t, "metrics": r.metrics, **seen}
    with open(spec["out"], "w") as f:  # after each launch: a part that runs out of time keeps the rest
        json.dump(out, f)
todo = spec["launches"]
launch("first")
if "warm" in todo: launch("warm")
if "decode" in todo: launch("decode", data_pipeline="decode")
if "pil" in todo: launch("pil", data_pipeline="pil", epochs=spec["pil_epochs"])
"""


def _run_e2e_child(a, data_root: Path, work: Path, out: Path) -> dict:
    config = dict(data_path=str(data_root), model=a.model, image_size=a.image_size, batch_size=a.batch_size,
                  epochs=a.epochs, amp=True, channels_last=True, data_pipeline="tensor", runs_dir=str(work / "runs"),
                  name="bench-e2e")
    if a.smoke:
        # One CPU rank, no loader processes: the code paths of the GPU run at a CPU's pace.
        config.update(nprocs=1, num_workers=0)
    else:
        config.update(gpus=[int(g) for g in a.gpus.split(",")])  # default workers: part of what is measured
    spec = {"config": config, "pil_epochs": a.pil_epochs, "out": str(out), "launches": a.launches.split(",")}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", E2E_CHILD, json.dumps(spec)], env=env, cwd=str(ROOT),
                           capture_output=True, text=True, timeout=a.part_timeout)
    except subprocess.TimeoutExpired:
        # Slow data loading is one of the things measured: report the launches that finished.
        print(f"end-to-end part stopped after --part-timeout {a.part_timeout:.0f} s", file=sys.stderr)
        p = None
    if p is not None and p.returncode != 0:
        raise RuntimeError(f"the end-to-end process failed ({p.returncode}):\n{p.stderr[-4000:]}")
    r = json.loads(out.read_text()) if out.exists() else {"import_s": float("nan")}
    r["timed_out"] = p is None
    r["process_s"] = time.perf_counter() - t0
    r["config"] = config
    for key in ("first", "warm", "decode", "pil"):
        r.setdefault(key, {"wall_s": float("nan"), "metrics": []})
    steady = [m["images_per_s"] for k in ("first", "warm") for m in r[k]["metrics"][1:]]
    r["steady_images_per_s"] = statistics.median(steady) if steady else float("nan")
    r["steady_images_per_s_by_pipeline"] = {
        "tensor": r["steady_images_per_s"],
        "decode": _median([m["images_per_s"] for m in r["decode"]["metrics"][1:]]),
        "pil": _median([m["images_per_s"] for m in r["pil"]["metrics"][1:]])}
    # The same epochs without each epoch's first batch (the loader's start): what the step itself sustains.
    r["steady_images_per_s_after_first_batch"] = {
        "tensor": _median([_after_first_batch(m) for k in ("first", "warm") for m in r[k]["metrics"][1:]]),
        "decode": _median([_after_first_batch(m) for m in r["decode"]["metrics"][1:]]),
        "pil": _median([_after_first_batch(m) for m in r["pil"]["metrics"][1:]])}
    r["pil_images_per_s"] = [m["images_per_s"] for m in r["pil"]["metrics"]]
    return r


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else float("nan")


def _after_first_batch(m):
    """An epoch record's images/s with its first batch's wait taken out of the time (None if not recorded)."""
    if not isinstance(m.get("first_batch_s"), (int, float)) or not m.get("images_per_s"):
        return None
    seconds = m["seconds"] - m["first_batch_s"]
    return m["images_per_s"] * m["seconds"] / seconds if seconds > 0 else None


# ------------------------------------------------------------------------------ report
def _steady(records, key):
    """The median of ``key`` over the built-in worker's epoch records (None where none has it)."""
    v = _median([m.get(key) for m in records])
    return None if math.isnan(v) else v


def _peak_gib(records):
    """The highest ``gpu_mem_alloc_gib`` of the built-in worker's epoch records, or None (CPU runs)."""
    peaks = [m["gpu_mem_alloc_gib"] for m in records if isinstance(m.get("gpu_mem_alloc_gib"), (int, float))]
    return max(peaks) if peaks else None


def fixed_costs(e2e_r) -> str:
    """The fixed costs of the end-to-end launches, a line each: ``spawn_train`` to the first step,
    then per epoch the loader's first batch, the evaluation and the checkpoints on the step's path
    (from the built-in worker's epoch records: ``first_batch_s``, ``eval_s``, ``checkpoint_s``)."""
    lines = []
    for key in ("first", "warm", "decode", "pil"):
        r = e2e_r.get(key) or {}
        start = r.get("first_step_s")
        lines.append(f"fixed cost, {key} launch: spawn_train to the first step "
                     + (f"{start:.2f} s" if isinstance(start, (int, float)) else "n/a"))
        lines += _startup_lines(r.get("metrics", [])[:1], f"fixed cost, {key} launch")
        for m in r.get("metrics", []):
            parts = [f"{k.removesuffix('_s').replace('_', ' ')} {m[k]:.2f} s" for k in ("first_batch_s", "eval_s",
                                                                                       "checkpoint_s", "compile_s")
                     if isinstance(m.get(k), (int, float))]
            lines.append(f"fixed cost, {key} launch, epoch {m.get('epoch', 0) + 1}: " + (", ".join(parts) or "n/a")
                         + f" (epoch {m.get('seconds', float('nan')):.2f} s)")
    return "\n".join(lines)


def _startup_lines(records, prefix: str) -> list:
    """The launch's start-up costs, one line each, from its first epoch record (nbddp.tasks.classification.startup)."""
    try:
        from nbddp.tasks.classification.startup import lines
    except ImportError:  # an nbddp from before the worker recorded them
        return []
    return [line for m in records for line in lines(m, prefix)]


def _best_acc(r):
    accs = [m["val_accuracy"] for m in r.get("metrics", []) if isinstance(m.get("val_accuracy"), (int, float))]
    return max(accs) if accs else float("nan")


def _report(a, plain_r, step_r, e2e_r) -> dict:
    gflop = GFLOP_224 * (a.image_size / 224) ** 2
    world = step_r["world"]
    # MFU as nbddp reports it: nbddp's own FLOP count, its peak table (None: a CPU, a GPU it does not know).
    ours, peak = step_r.get("gflop_nbddp"), step_r.get("peak_tflops")

    def mfu(ips):
        return ips * ours / 1000 / peak if ours and peak else None

    table = []  # (row, images/s per GPU, peak GiB, MFU, data wait)
    for name, row in plain_r["rows"].items():
        table.append((name, row["images_per_s"], row["peak_gib"], mfu(row["images_per_s"]), None))
    for name, row in step_r["rows"].items():
        table.append((name, row["images_per_s_per_gpu"], row["peak_gib"], mfu(row["images_per_s_per_gpu"]), None))
    # The built-in worker's peaks, MFU and data wait are in its epoch records (memory: max over its GPUs; none on the CPU).
    if e2e_r is not None:
        steady = [m for k in ("first", "warm") for m in e2e_r[k]["metrics"][1:]]
        table.append(("built-in worker, tensor pipeline, steady epochs", e2e_r["steady_images_per_s"] / world,
                      _peak_gib(steady), _steady(steady, "mfu"), _steady(steady, "data_wait")))
        for pipe in ("decode", "pil"):
            for i, m in enumerate(e2e_r[pipe]["metrics"]):
                table.append((f"built-in worker, {'PIL' if pipe == 'pil' else pipe} pipeline, epoch {i + 1}",
                              m["images_per_s"] / world, _peak_gib([m]), m.get("mfu"), m.get("data_wait")))
    base = plain_r["rows"][PLAIN_EAGER]["images_per_s"]
    print(f"\n{step_r['device']} x {world} ({step_r['backend']}), torch {step_r['torch']}, {a.model} at "
          f"{a.image_size} px, batch {a.batch_size} per GPU, {step_r['amp_dtype']} autocast + channels_last, "
          f"cudnn.benchmark on; median of {a.repeats} x {a.steps} steps\n")
    print("| row | images/s per GPU | vs plain eager | TFLOP/s | MFU | data wait | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, ips, gib, row_mfu, wait in table:
        print(f"| {name} | {ips:,.0f} | {ips / base:.3f} | {ips * gflop / 1000:.0f} | "
              f"{'-' if row_mfu is None else f'{row_mfu:.1%}'} | {'-' if wait is None else f'{wait:.1%}'} | "
              f"{'-' if gib is None else f'{gib:.1f}'} |")
    print(f"TFLOP/s: the bench's count, {gflop:.1f} GFLOP per image; MFU: nbddp's count "
          f"({'n/a' if ours is None else f'{ours:.1f}'} GFLOP), over nbddp's {step_r.get('precision', 'n/a')} peak of "
          f"this device ({'none known' if peak is None else f'{peak:g} TFLOP/s'})")

    def ratio(num, den):
        return num / den if den else float("nan")

    ratios = {"nbddp step / plain eager": (ratio(step_r["rows"][STEP_EAGER]["images_per_s_per_gpu"], base), 0.97)}
    if a.compile:
        ratios["nbddp compiled / plain compiled"] = (ratio(step_r["rows"][STEP_COMPILED]["images_per_s_per_gpu"],
                                                           plain_r["rows"][PLAIN_COMPILED]["images_per_s"]), 0.97)
    for pipe, v in (e2e_r or {}).get("steady_images_per_s_by_pipeline", {}).items():
        ratios[f"built-in steady ({pipe}) / plain eager"] = (ratio(v / world, base), 0.9)
        after = e2e_r["steady_images_per_s_after_first_batch"][pipe]
        ratios[f"built-in steady ({pipe}), each epoch's first batch left out / plain eager"] = (
            ratio(after / world, base), 0.9)
    print("\n| ratio | measured | goal |\n|---|---|---|")
    for name, (value, goal) in ratios.items():
        print(f"| {name} | {value:.3f} | >= {goal} |")
    if e2e_r is not None:
        _report_e2e(a, e2e_r, world, base)
    comp = (f"plain {plain_r['compile_s']:.1f} s, nbddp (DDP) {step_r['compile_s']:.1f} s" if a.compile
            else "not run (--compile)")
    print(f"torch.compile time: {comp}")
    print(f"all-reduce of the gradients alone ({step_r['grad_mb']:.0f} MB fp32, world {world}): "
          f"{step_r['allreduce_ms']:.2f} ms")
    prof = step_r["profile"]
    if prof is not None:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in prof["groups_ms"].items())
        print(f"\nprofile of one nbddp step (rank {prof['rank']}, mean of {prof['steps']}; profiled wall "
              f"{prof['step_ms']:.1f} ms/step): {prof['time_kind']} ms: {parts}; data wait {prof['data_wait_ms']:.2f} ms "
              f"(host); host syncs {prof['host_syncs_per_step']:.1f} per step, {prof['host_sync_ms']:.2f} ms blocked")
        print(prof["top_ops"])
    return {"config": {k: getattr(a, k) for k in ("gpus", "model", "image_size", "batch_size", "steps", "repeats", "warmup",
                                                   "images", "epochs", "pil_epochs", "compile", "compile_backend", "profile", "smoke")},
            "gflop_per_image": gflop, "gflop_nbddp": ours, "peak_tflops": peak,
            "table": [{"row": n, "images_per_s_per_gpu": v, "peak_gib": p, "vs_plain_eager": v / base,
                       "tflops": v * gflop / 1000, "mfu": u, "data_wait": w} for n, v, p, u, w in table],
            "ratios": {k: {"measured": v, "goal": g} for k, (v, g) in ratios.items()},
            "plain": plain_r, "step": step_r, "e2e": e2e_r, "date": time.strftime("%Y-%m-%d")}


def report_from(a, folder: Path) -> dict:
    """The report of one run of all three parts, from the files of two runs (parts 1-2, then part 3 alone).

    The settings are those parts 1 and 2 ran with (their ``config``); part 3 must have run on the same
    model and image size, or its rows would be compared with another step.
    """
    steps, e2e_r = (json.loads((folder / name).read_text()) for name in ("step.json", "e2e.json"))
    for key, value in steps["config"].items():
        setattr(a, key, value)
    for key in ("model", "image_size"):
        theirs = e2e_r["config"][key]
        if theirs != getattr(a, key):
            raise SystemExit(f"--report-from {folder}: e2e.json ran {key}={theirs!r}, step.json {getattr(a, key)!r}; "
                             f"rerun one of them with the other's settings")
    return _report(a, steps["plain"], steps["step"], e2e_r)


def _report_e2e(a, e2e_r, world, base) -> None:
    """Part 3's lines: the launches' wall times, the decode pipeline, the fixed costs."""

    def ratio(num, den):
        return num / den if den else float("nan")

    first, warm = e2e_r["first"]["wall_s"], e2e_r["warm"]["wall_s"]
    if e2e_r["timed_out"]:
        print(f"\nthe end-to-end part ran out of its {a.part_timeout:.0f} s: launches not finished show nan")
    print(f"\nbuilt-in worker, {a.images} images, {a.epochs} epochs: first launch in a fresh process {first:.1f} s "
          f"(goal <= 12 s; the process took {e2e_r['process_s']:.1f} s with python start and "
          f"{e2e_r['import_s']:.1f} s of import torch/nbddp), warm relaunch {warm:.1f} s (goal <= 5 s), "
          f"PIL pipeline ({e2e_r['pil']['wall_s']:.1f} s wall): "
          f"{', '.join(f'{v:,.0f}' for v in e2e_r['pil_images_per_s'])} images/s by epoch (goal >= 2,500)")
    dec = e2e_r["steady_images_per_s_by_pipeline"]["decode"] / world
    print(f"decode pipeline, steady: {dec:,.0f} images/s per GPU (goal >= 5,000), {ratio(dec, base):.3f} of the "
          f"synthetic-tensor rate (plain eager; goal >= 0.9); best validation accuracy decode "
          f"{_best_acc(e2e_r['decode']):.3f}, pil {_best_acc(e2e_r['pil']):.3f}, tensor {_best_acc(e2e_r['warm']):.3f}")
    print(fixed_costs(e2e_r))


def _e2e_only(a, data_root: Path, work: Path) -> dict:
    """Part 3 alone (``--e2e-only``): each launch's wall time, the pipelines' steady rates, the fixed costs."""
    r = _run_e2e_child(a, data_root, work, work / "e2e.json")
    print(f"\nbuilt-in worker, {a.images} images: first launch in a fresh process {r['first']['wall_s']:.1f} s "
          f"(import {r['import_s']:.1f} s), warm relaunch {r['warm']['wall_s']:.1f} s, decode launch "
          f"{r['decode']['wall_s']:.1f} s, pil launch {r['pil']['wall_s']:.1f} s")
    for pipe, v in r["steady_images_per_s_by_pipeline"].items():
        print(f"{pipe}: steady {v:,.0f} images/s, {r['steady_images_per_s_after_first_batch'][pipe]:,.0f} without each "
              f"epoch's first batch; best accuracy {_best_acc(r['warm' if pipe == 'tensor' else pipe]):.3f}")
    print(fixed_costs(r))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1, default=str))
    return r


def main(argv=None):
    """Run the benchmark; returns every figure as a dict (also written to ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="0", help="GPU ids for nbddp, e.g. 0,1 (the plain row uses the first)")
    ap.add_argument("--model", default="resnet34", help="torchvision classifier (TFLOP/s assume ResNet34)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per row and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per row first")
    ap.add_argument("--images", type=int, default=3670, help="images of the end-to-end folder (flowers: 3,670)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of the end-to-end tensor-pipeline launches")
    ap.add_argument("--pil-epochs", type=int, default=3, help="epochs of the end-to-end PIL-pipeline launch")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile rows (reports compile time)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (--smoke: eager)")
    ap.add_argument("--profile", action="store_true", help="profiler summary of one nbddp training step")
    ap.add_argument("--quick", action="store_true", help="10 steps, 1 repeat: a quick pass")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: check every code path only")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--work-dir", default=None, help="for the generated photos and the runs (default: temp)")
    ap.add_argument("--part-timeout", type=float, default=400, help="seconds each subprocess part may take")
    ap.add_argument("--e2e-only", action="store_true", help="only part 3, the built-in worker end to end")
    ap.add_argument("--no-e2e", action="store_true", help="parts 1 and 2 only (bench/gpu_round.py runs part 3 apart)")
    ap.add_argument("--step-rows", choices=("all", "eager"), default="all",
                    help="eager: nbddp's step as the built-in worker builds it, without the DDP option variants")
    ap.add_argument("--launches", default="first,warm,decode,pil",
                    help="part 3's launches after the first (tensor pipeline), e.g. first,warm,decode")
    ap.add_argument("--report-from", default=None, metavar="DIR",
                    help="measure nothing: print the whole report from DIR/step.json and DIR/e2e.json "
                         "(bench/gpu_round.py's step and e2e files), as one run of all three parts prints it")
    ap.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)  # part 1, in its own process
    a = ap.parse_args(argv)
    if a.report_from:
        return report_from(a, Path(a.report_from))
    if a.quick:
        a.steps, a.repeats = 10, 1
    if a.smoke:
        # A small model: ResNet34 takes seconds per step on a small shared CPU even at 16 px, and
        # the code paths do not depend on the model. 2 epochs still give one steady epoch.
        a.model, a.image_size, a.batch_size, a.steps, a.repeats, a.warmup, a.images = (
            "squeezenet1_1", 32, 4, 2, 1, 1, 20)
        a.epochs, a.pil_epochs = 2, 2
        a.compile_backend = "eager"  # dynamo's whole path, without inductor's minutes of C++ on a CPU
    if a.plain_only:
        r = plain(a)
        Path(a.json).write_text(json.dumps(r))
        return r

    from nbddp import spawn_train

    work = Path(a.work_dir or Path(tempfile.gettempdir()) / "nbddp-bench")
    work.mkdir(parents=True, exist_ok=True)
    data_root = None if a.no_e2e else _flowers_like(work / f"flowers-like-{a.images}", a.images)
    t0 = time.perf_counter()
    if a.e2e_only:
        return _e2e_only(a, data_root, work)
    plain_r = _run_plain_child(a, work / "plain.json")
    launch = dict(nprocs=1) if a.smoke else dict(gpus=[int(g) for g in a.gpus.split(",")])
    step_r = spawn_train(f"{Path(__file__).resolve()}:step_worker", **launch, echo=False, name="bench-gpu",
                         runs_dir=work / "runs",
                         kwargs=dict(model_name=a.model, image_size=a.image_size, batch=a.batch_size, steps=a.steps, repeats=a.repeats,
                                     warmup=a.warmup, do_compile=a.compile, compile_backend=a.compile_backend,
                                     profile=a.profile, variants=a.step_rows)).value
    if a.json:  # parts 1 and 2 kept should the end-to-end part fail
        Path(a.json).write_text(json.dumps({"plain": plain_r, "step": step_r}, indent=1, default=str))
    e2e_r = None if a.no_e2e else _run_e2e_child(a, data_root, work, work / "e2e.json")
    r = _report(a, plain_r, step_r, e2e_r)
    r["bench_s"] = time.perf_counter() - t0
    print(f"\nbenchmark time: {r['bench_s']:.0f} s (not counting the photos' generation)")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1, default=str))
    return r


if __name__ == "__main__":
    main()
