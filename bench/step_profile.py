"""Where a steady training step of the built-in worker spends its time, per data pipeline.

    python bench/step_profile.py --data DIR [--pipelines tensor,decode,pil] [--gpus 0] [--json out.json]
    python bench/step_profile.py --smoke   # CPU, tiny sizes: the code path only (tests)

One launch of the built-in worker per pipeline, two epochs: the first warms up (cuDNN's
autotuning, the loaders, the data cache), then ``torch.profiler`` records ``--steps`` consecutive
steps of the second epoch on rank 0. The worker is the built-in one, called from this file's
``worker`` so that the engine's parts carry profiler ranges (``bench: data wait``, ``bench:
prepare``, ``bench: forward``, ``bench: agreement``, ``bench: backward``, ``bench: optimizer``):
the engine itself has none. Per step:

- device time by part (on a GPU, each kernel counted in the part whose range launched it; the
  backward's kernels come from autograd's own thread; NCCL's are the all-reduce), host time on
  the CPU;
- the host's own time by part (what the host spends queueing each part, or waiting in it);
- the host synchronisations: the CUDA calls that block the host until the device catches up
  (``bench/gpu.py``'s ``SYNC_CALLS``), how many, how long they blocked, and in which part.

The ranges come from wrapping the engine's private functions: a renamed function fails here (and
in tests/test_bench.py) rather than going unprofiled.
"""

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

#: Engine function -> the profiler range its calls get.
PARTS = {"_next_batch": "bench: data wait", "_prepare": "bench: prepare", "_forward": "bench: forward",
         "_backward": "bench: backward", "_optimizer_step": "bench: optimizer", "_settle": "bench: agreement"}
#: The step agreement's methods, ranged alike.
AGREEMENT = ("__init__", "wait")


@contextlib.contextmanager
def labelled_engine():
    """The engine's parts inside profiler ranges while inside (the functions put back after)."""
    from torch.profiler import record_function

    from nbddp.rank import engine

    def ranged(fn, name):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return inner

    saved = {name: getattr(engine, name) for name in PARTS}
    saved_agreement = {m: getattr(engine._StepAgreement, m) for m in AGREEMENT}
    try:
        for name, label in PARTS.items():
            setattr(engine, name, ranged(saved[name], label))
        for m in AGREEMENT:
            setattr(engine._StepAgreement, m, ranged(saved_agreement[m], "bench: agreement"))
        yield engine
    finally:
        for name, fn in saved.items():
            setattr(engine, name, fn)
        for m, fn in saved_agreement.items():
            setattr(engine._StepAgreement, m, fn)


def summarize(events, steps: int, cuda: bool) -> dict:
    """Per step: device (or host) time by part, the host's own time by part, the host syncs and where they happen."""
    from gpu import SYNC_CALLS, _group_of

    device, host, syncs, sync_us, sync_where = {}, {}, 0, 0.0, {}
    labels = [e for e in events if e.name.startswith("bench: ")]
    for e in labels:  # the host's time in each part, less the parts nested in it
        inner = sum(c.cpu_time_total for c in _nearest_labels(e))
        host[_group_of(e)] = host.get(_group_of(e), 0.0) + e.cpu_time_total - inner
    for e in events:
        if _is_device(e):
            continue  # device events are counted through the CPU op that launched them (e.kernels)
        if e.name in SYNC_CALLS:
            syncs += 1
            sync_us += e.cpu_time_total
            where = _group_of(e)
            sync_where[where] = sync_where.get(where, 0) + 1
        if cuda:
            for k in e.kernels:
                group = _group_of(e, k.name)
                device[group] = device.get(group, 0.0) + k.duration
        elif not e.name.startswith("bench: "):
            device[_group_of(e)] = device.get(_group_of(e), 0.0) + e.self_cpu_time_total

    def per_step(d):
        return {k: round(v / 1000 / steps, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {"steps": steps, "time_kind": "device" if cuda else "host", "by_part_ms": per_step(device),
            "host_by_part_ms": per_step(host), "host_syncs_per_step": syncs / steps,
            "host_sync_ms_per_step": round(sync_us / 1000 / steps, 3),
            "host_syncs_by_part": {k: v / steps for k, v in sync_where.items()},
            "data_wait_ms": round(host.get("data wait", 0.0) / 1000 / steps, 3)}


def _nearest_labels(e):
    out, todo = [], list(e.cpu_children)
    while todo:
        c = todo.pop()
        if c.name.startswith("bench: "):
            out.append(c)
        else:
            todo.extend(c.cpu_children)
    return out


def _is_device(event) -> bool:
    return getattr(getattr(event, "device_type", None), "name", "CPU") != "CPU"


def worker(ctx, config: dict, skip: int, steps: int) -> dict:
    """In every rank: the built-in worker's ``train``; rank 0 profiles ``steps`` steps of the second epoch after its
    first ``skip``, or as many as the epoch has (its end stops the profile, before the evaluation)."""
    from torch.profiler import ProfilerActivity, profile

    from nbddp import TrainConfig
    from nbddp.tasks.classification import worker as builtin

    cuda = ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    state = {"prof": None, "t0": 0.0, "done": 0, "summary": None}
    with labelled_engine() as engine:
        step, epoch = engine._train_step, builtin.train_one_epoch

        def counted(run, n, *args, **kwargs):
            if ctx.is_main and run.epoch == 1 and n == skip and state["summary"] is None:
                state["prof"] = profile(activities=activities)
                state["prof"].start()
                state["t0"] = time.perf_counter()
            if state["prof"] is not None and state["done"] == steps:
                _stop(state, cuda)
            out = step(run, n, *args, **kwargs)
            state["done"] += state["prof"] is not None
            return out

        def one_epoch(*args, **kwargs):
            try:
                return epoch(*args, **kwargs)
            finally:
                if state["prof"] is not None:  # the epoch ended first: the steps recorded
                    _stop(state, cuda)

        engine._train_step, builtin.train_one_epoch = counted, one_epoch
        try:
            result = builtin.train(ctx, TrainConfig.from_dict(config))
        finally:
            engine._train_step, builtin.train_one_epoch = step, epoch
    return {"profile": state["summary"], "metrics": result.get("metrics", [])}


def _stop(state: dict, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()  # the device's work of the steps recorded, in the profile
    wall = time.perf_counter() - state["t0"]
    prof, state["prof"] = state["prof"], None
    prof.stop()
    steps = max(state["done"], 1)
    state["summary"] = summarize(prof.events(), steps, cuda)
    state["summary"]["wall_ms_per_step"] = round(wall * 1000 / steps, 3)


def profile_pipeline(pipeline: str, data: str, a, runs_dir: Path) -> dict:
    """One launch of the built-in worker with ``pipeline``; rank 0's profile of ``a.steps`` steady steps."""
    from nbddp import TrainConfig, spawn_train

    # The config as bench/gpu.py's end-to-end launches have it: default loader workers on a GPU.
    cfg = dict(data_path=data, model=a.model, image_size=a.image_size, batch_size=a.batch_size, epochs=2, amp=True,
               channels_last=True, data_pipeline=pipeline, runs_dir=str(runs_dir), name=f"profile-{pipeline}")
    if a.smoke:
        where = dict(nprocs=1)
        cfg.update(nprocs=1, num_workers=0)
    else:
        where = dict(gpus=[int(g) for g in a.gpus.split(",")])
        cfg.update(gpus=where["gpus"])
    t0 = time.perf_counter()
    r = spawn_train(f"{Path(__file__).resolve()}:worker", **where, runs_dir=runs_dir, echo=False,
                    name=f"profile-{pipeline}", kwargs=dict(config=TrainConfig(**cfg).to_dict(), skip=a.skip,
                                                              steps=a.steps)).value
    r["launch_s"] = time.perf_counter() - t0
    return r


def report(results: dict) -> str:
    lines = []
    for pipe, r in results.items():
        p = r.get("profile")
        if not p:
            lines.append(f"{pipe}: no profile ({r.get('error', 'the epoch ended before the profiled steps')})")
            continue
        parts = ", ".join(f"{k} {v:.2f}" for k, v in p["by_part_ms"].items())
        host = ", ".join(f"{k} {v:.2f}" for k, v in p["host_by_part_ms"].items())
        where = ", ".join(f"{k} {v:.1f}" for k, v in p["host_syncs_by_part"].items()) or "none"
        if p["time_kind"] == "device":
            lines.append(f"{pipe}: {p['wall_ms_per_step']:.1f} ms/step on the host clock; device ms/step: {parts}")
        lines.append(f"{pipe}: {p['wall_ms_per_step']:.1f} ms/step, host ms/step: {host}; data wait "
                     f"{p['data_wait_ms']:.2f} ms; host syncs {p['host_syncs_per_step']:.1f}/step ({where}), "
                     f"blocked {p['host_sync_ms_per_step']:.2f} ms/step")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="a class-folder tree (default: a flowers-like one in --work-dir)")
    ap.add_argument("--images", type=int, default=3670, help="images of the generated folder")
    ap.add_argument("--pipelines", default="tensor,decode,pil")
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--model", default="resnet34")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="steady steps profiled")
    ap.add_argument("--skip", type=int, default=2, help="steps of the second epoch before the profile")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the code path only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.model, a.image_size, a.batch_size, a.images, a.steps, a.skip = "squeezenet1_1", 32, 4, 20, 2, 1
    from gpu import _flowers_like

    work = Path(a.work_dir or Path(tempfile.gettempdir()) / "nbddp-bench")
    work.mkdir(parents=True, exist_ok=True)
    data = a.data or str(_flowers_like(work / f"flowers-like-{a.images}", a.images))
    results = {}
    for pipe in a.pipelines.split(","):
        try:
            results[pipe] = profile_pipeline(pipe, data, a, work / "runs")
        except Exception as exc:  # noqa: BLE001 - one pipeline failing leaves the others' profiles
            results[pipe] = {"error": f"{type(exc).__name__}: {exc}"}
        if a.json:  # after each pipeline: a step cut short keeps the ones done
            Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    return results


if __name__ == "__main__":
    main()
