"""Launch latency: from the launch call to the end of the first optimizer step, 2 CPU ranks.

    python bench/launch.py [--repeats 5]

Every method is measured in the same run, interleaved, each repetition in a fresh Python
process (as a fresh kernel would be), the median quoted:
- nbddp spawn / forkserver: cold = first launch in the process, warm = the relaunch after it;
- torchrun (a new command each time, like a user in a terminal) running bench/plain_ddp.py;
- torch.multiprocessing.spawn of the same plain function;
- Accelerate's notebook_launcher (fork), if accelerate is installed (it is not a dependency).
The driver imports torch before the clock starts, as a notebook kernel would have.

And the first launch in a fresh Jupyter kernel (jupyter_client, this Python's ``python3``
kernelspec), 5 s after ``import nbddp``, with the forkserver pre-warmed at import (the default)
and without (``NBDDP_PREWARM=0``), interleaved: time of ``import nbddp`` (torch already
imported), then the launch call to the worker's first line and to the end of its first step,
then the same for a relaunch in that kernel. ``--part kernel`` runs only these rows.

``--part costs``: the built-in worker's fixed costs, one line each, in a fresh Python process (torch
imported first, as a kernel would have): ``import nbddp``, then for a first launch and the relaunches
after it (tensor pipeline twice, then decode and pil) each cost the worker's first epoch record holds
(:mod:`nbddp.tasks.classification.startup`: kernel checks, processes, rendezvous, data scan, cache
build, model build, first step), and the launch call to the end of its first step, on a flowers-like
folder (JPEGs of 320x240) with 2 CPU ranks.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

DRIVER = r'''
import json, sys, time, os
sys.path.insert(0, {here!r})
import torch, torch.distributed  # a kernel that has been used has these already
method = {method!r}
out = {{}}
if method in ("spawn", "forkserver"):
    from nbddp import spawn_train
    for label in ("cold", "warm"):
        t0 = time.time()
        r = spawn_train({here!r} + "/workers.py:train", nprocs=2, kwargs=dict(steps=2, warmup=1),
                        runs_dir={runs!r}, echo=False, start_method=method)
        out[label] = r.value["first_step"] - t0
elif method == "mp.spawn":
    import plain_spawn
    for label in ("cold", "warm"):
        out[label] = plain_spawn.run()
elif method == "notebook_launcher":
    import plain_spawn
    from accelerate import notebook_launcher
    for label in ("cold",):  # fork: a second launch in the same process is what it is built for too
        out[label] = plain_spawn.run_accelerate(notebook_launcher)
print(json.dumps(out))
'''


def run_driver(method: str, runs: Path) -> dict:
    code = DRIVER.format(here=str(HERE), method=method, runs=str(runs))
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"{method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_torchrun(tmp: Path) -> float:
    out = tmp / "torchrun.jsonl"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(HERE), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(HERE / "plain_ddp.py"), "--steps", "2", "--warmup", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text().splitlines()[-1])["first_step"] - t0


KERNEL_SETUP = "import sys, json, time; sys.path.insert(0, {here!r}); import torch, torch.distributed"
KERNEL_IMPORT = "t = time.perf_counter(); import nbddp; print(json.dumps(time.perf_counter() - t))"
KERNEL_LAUNCH = """t0 = time.time()
r = nbddp.spawn_train({here!r} + "/workers.py:train", nprocs=2, kwargs=dict(steps=2, warmup=1),
                      runs_dir={runs!r}, echo=False)
print(json.dumps([r.value["first_line"] - t0, r.value["first_step"] - t0]))"""
KERNEL_VARIANTS = {"pre-warmed (default)": "1", "NBDDP_PREWARM=0": "0"}


def run_kernel(prewarm: str, runs: Path, wait_s: float = 5.0) -> dict:
    """One fresh kernel: import time, then first launch ``wait_s`` after the import, then a relaunch."""
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", NBDDP_PREWARM=prewarm)
    runs.mkdir(parents=True, exist_ok=True)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(runs), env=env)

    def cell(code: str):
        out = []
        hook = lambda m: out.append(m["content"]["text"]) if m["msg_type"] == "stream" else None  # noqa: E731
        reply = kc.execute_interactive(code, timeout=300, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"kernel cell failed: {reply['content'].get('evalue')}\n{''.join(out)}")
        return json.loads("".join(out).strip().splitlines()[-1]) if out else None

    try:
        cell(KERNEL_SETUP.format(here=str(HERE)))
        got = {"import": cell(KERNEL_IMPORT)}
        time.sleep(wait_s)
        got["first"] = cell(KERNEL_LAUNCH.format(here=str(HERE), runs=str(runs)))
        got["relaunch"] = cell(KERNEL_LAUNCH.format(here=str(HERE), runs=str(runs)))
        return got
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def print_kernel_table(results: dict, repeats: int) -> None:
    med = lambda vals: statistics.median(vals)  # noqa: E731
    print(f"\nfirst launch in a fresh kernel, 5 s after `import nbddp` (torch imported before); 2 CPU ranks, "
          f"small CNN; seconds, median of {repeats}")
    print("| kernel | import nbddp | first launch: worker's first line | first launch: first step "
          "| relaunch: first line | relaunch: first step |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        first, again = [r["first"] for r in runs], [r["relaunch"] for r in runs]
        print(f"| {name} | {med([r['import'] for r in runs]):.3f} | {med([f[0] for f in first]):.2f} | "
              f"{med([f[1] for f in first]):.2f} | {med([f[0] for f in again]):.2f} | {med([f[1] for f in again]):.2f} |")
    for name, runs in results.items():
        print(f"{name}, every run: import {[round(r['import'], 3) for r in runs]}, first line "
              f"{[round(r['first'][0], 2) for r in runs]}, relaunch first line {[round(r['relaunch'][0], 2) for r in runs]}")


COSTS_CHILD = r"""
import json, sys, time
sys.path.insert(0, {here!r})
import torch, torch.distributed  # what a kernel has before its first launch
t0 = time.perf_counter()
import nbddp
from nbddp import TrainConfig, spawn_train
out = {{"import": time.perf_counter() - t0, "launches": []}}
cfg = TrainConfig(**json.loads({config!r}))
for key, pipeline in (("first", "tensor"), ("warm", "tensor"), ("warm decode", "decode"), ("warm pil", "pil")):
    seen = {{}}
    def first_step(kind, payload, t=time.perf_counter()):
        if kind == "progress" and (payload.get("step") or 0) >= 1 and "to_first_step" not in seen:
            seen["to_first_step"] = time.perf_counter() - t
    r = spawn_train(cfg.replace(data_pipeline=pipeline), echo=False, on_event=first_step)
    out["launches"].append(dict(key=key, record=r.metrics[0], **seen))
print(json.dumps(out))
"""


def run_costs(tmp: Path, images: int) -> dict:
    """One fresh process: ``import nbddp``, then the launches of :data:`COSTS_CHILD`."""
    sys.path.insert(0, str(HERE))
    from gpu import _flowers_like

    data = _flowers_like(tmp / "flowers", images)
    config = dict(data_path=str(data), model="resnet18", image_size=32, epochs=1, batch_size=16, nprocs=2,
                  runs_dir=str(tmp / "cost-runs"), name="costs")
    code = COSTS_CHILD.format(here=str(HERE), config=json.dumps(config))
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(f"the costs process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_costs(runs: list) -> None:
    """Each launch's costs, one line each: the median over the fresh processes."""
    try:
        from nbddp.tasks.classification.startup import NAMES
    except ImportError:  # a checkout from before the worker recorded them: the totals only
        NAMES = ()

    med = statistics.median
    print(f"\nfixed costs of the built-in worker's launches, 2 CPU ranks, seconds, median of {len(runs)} fresh processes")
    print(f"fixed cost, first launch: {'import nbddp':<13} {med(r['import'] for r in runs):7.3f} s")
    for i, launch in enumerate(runs[0]["launches"]):
        key = launch["key"]
        records = [r["launches"][i]["record"] for r in runs]
        for name in NAMES:
            values = [rec[f"startup_{name}_s"] for rec in records if f"startup_{name}_s" in rec]
            if values:
                print(f"fixed cost, {key} launch: {name.replace('_', ' '):<13} {med(values):7.3f} s")
        total = [r["launches"][i].get("to_first_step") for r in runs]
        total = [t for t in total if t is not None]
        parts = med(sum(rec.get(f"startup_{n}_s", 0.0) for n in NAMES) for rec in records)
        if total:
            print(f"fixed cost, {key} launch: {'call to step 1':<13} {med(total):7.3f} s "
                  f"(the costs above: {parts:.3f} s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--part", choices=["all", "launchers", "kernel", "costs"], default="all")
    ap.add_argument("--images", type=int, default=300, help="--part costs: photos in the folder")
    a = ap.parse_args()
    if a.part == "costs":
        tmp = Path(tempfile.mkdtemp())
        print_costs([run_costs(tmp, a.images) for _ in range(a.repeats)])
        return
    methods = [] if a.part == "kernel" else ["spawn", "forkserver", "torchrun", "mp.spawn"]
    if methods:
        try:
            import accelerate  # noqa: F401

            methods.append("notebook_launcher")
        except ImportError:
            print("(accelerate not installed: notebook_launcher skipped; pip install accelerate to include it)")
    kernels = a.part != "launchers"
    if kernels:
        try:
            import jupyter_client  # noqa: F401
        except ImportError:
            print("(jupyter_client not installed: the kernel rows are skipped; pip install -e '.[test]')")
            kernels = False
    tmp = Path(tempfile.mkdtemp())
    results, kernel_results = {}, {}
    for r in range(a.repeats):
        for m in methods:  # interleaved: machine noise hits every method alike
            if m == "torchrun":
                got = {"cold": run_torchrun(tmp)}
            else:
                got = run_driver(m, tmp / "runs")
            for k, v in got.items():
                results.setdefault((m, k), []).append(v)
        for name, prewarm in (KERNEL_VARIANTS.items() if kernels else ()):
            kernel_results.setdefault(name, []).append(run_kernel(prewarm, tmp / "kernel-runs"))
    if methods:
        torchrun = statistics.median(results[("torchrun", "cold")])
        print(f"\nlaunch -> end of first step, 2 CPU ranks, small CNN; median of {a.repeats} (cores: {os.cpu_count()})")
        print(f"| {'method':<28} | {'seconds':>8} | {'vs torchrun':>11} |")
        print(f"|{'-' * 30}|{'-' * 10}|{'-' * 13}|")
        for (m, k), vals in results.items():
            med = statistics.median(vals)
            print(f"| {m + ' (' + k + ')':<28} | {med:8.2f} | {med / torchrun:10.2f}x |")
    if kernel_results:
        print_kernel_table(kernel_results, a.repeats)


if __name__ == "__main__":
    main()
