"""Launch latency: from the launch call to the end of the first optimizer step, 2 CPU ranks.

    python bench/launch.py [--repeats 5]

Every method is measured in the same run, interleaved, each repetition in a fresh Python
process (as a fresh kernel would be), the median quoted:
- nbddp spawn / forkserver: cold = first launch in the process, warm = the relaunch after it;
- torchrun (a new command each time, like a user in a terminal) running bench/plain_ddp.py;
- torch.multiprocessing.spawn of the same plain function;
- Accelerate's notebook_launcher (fork), if accelerate is installed (it is not a dependency).
The driver imports torch before the clock starts, as a notebook kernel would have.
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
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(HERE / "plain_ddp.py"), "--steps", "2", "--warmup", "1", "--out", str(out)],
                   env=env, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text().splitlines()[-1])["first_step"] - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    methods = ["spawn", "forkserver", "torchrun", "mp.spawn"]
    try:
        import accelerate  # noqa: F401

        methods.append("notebook_launcher")
    except ImportError:
        print("(accelerate not installed: notebook_launcher skipped; pip install accelerate to include it)")
    tmp = Path(tempfile.mkdtemp())
    results = {}
    for r in range(a.repeats):
        for m in methods:  # interleaved: machine noise hits every method alike
            if m == "torchrun":
                got = {"cold": run_torchrun(tmp)}
            else:
                got = run_driver(m, tmp / "runs")
            for k, v in got.items():
                results.setdefault((m, k), []).append(v)
    torchrun = statistics.median(results[("torchrun", "cold")])
    print(f"\nlaunch -> end of first step, 2 CPU ranks, small CNN; median of {a.repeats} (cores: {os.cpu_count()})")
    print(f"| {'method':<28} | {'seconds':>8} | {'vs torchrun':>11} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 13}|")
    for (m, k), vals in results.items():
        med = statistics.median(vals)
        print(f"| {m + ' (' + k + ')':<28} | {med:8.2f} | {med / torchrun:10.2f}x |")


if __name__ == "__main__":
    main()
