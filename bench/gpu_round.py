"""One command for a GPU session: every row of the GPU goals, and a profile of a steady step per pipeline, into $OUT.

    python3 bench/gpu_round.py                  # a lent GPU machine, from the repository root: <= 9 min on one H100
    python3 bench/gpu_round.py --only e2e,fsdp  # rerun some steps; their files in $OUT are replaced
    python3 bench/gpu_round.py --smoke          # the CPU, tiny sizes: every step's command (tests/test_bench.py)

From a fresh machine as docs/benchmarks.md ("GPU round") says: torch there, no package registry;
nbddp is installed (``pip install --no-deps --no-build-isolation -e .``) when it is not yet. Each
step is a subprocess of its own under its own timeout, its output teed to ``$OUT/<step>.log`` and
its figures written to ``$OUT/<step>.json``; a step that fails or runs out of time leaves what it
wrote and the next one starts. The steps, in order (the goals are the rows of ``summary.md``):

- ``machine``: the GPU, torch, CUDA (``nvidia-smi``);
- ``install``: only when nbddp is not installed;
- ``step``: ``bench/gpu.py --no-e2e --step-rows eager --compile --profile``: plain PyTorch against
  nbddp's step, eager and compiled, and a profile of the step on batches already on the GPU;
- ``e2e``: ``bench/gpu.py --e2e-only``: the built-in worker on a flowers-sized folder, the first
  launch in a fresh process, a warm relaunch, the decode and the PIL pipelines;
- ``profiles``: ``bench/step_profile.py``: a steady step of the built-in worker per pipeline (host
  syncs, data wait, forward, backward, optimizer, agreement);
- ``fsdp``: ``bench/shard.py --gpu``: the ~1B-parameter transformer under DDP, FSDP, FSDP with CPU
  offload, and FSDP under torchrun;
- ``decode``: ``bench/decode.py --device cuda``: the decode pipeline's own rate, no loader;
- ``gpu-tests``: ``pytest -m gpu tests/test_gpu.py`` (the step's read-back rule on the GPU among
  them), in what is left of the budget;
- ``notebooks``: ``pytest --nbmake notebooks/`` when nbmake is installed (it is not on a lent
  machine unless its wheels were carried).

Then ``summary.md`` and ``summary.json``: each goal, its measure, met or not (among them nbddp's
FLOP count, so its MFU, against the bench's own, for the plain step and the built-in worker), and
a table of the rates as nbddp counts and reports them: images/s, TFLOP/s, MFU and data wait per
row (the plain and nbddp steps; each pipeline's steady epochs of the built-in worker). ``--budget`` (540 s)
bounds the whole round: a step's timeout is its own or what is left, whichever is less, and a step
with less than its minimum left is skipped, named in the summary. The photos and the runs go to
``--work-dir`` (a temp folder), never to ``$OUT``, which comes back from the machine.
"""

import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_round_summary import summarize  # noqa: E402


@dataclass
class Step:
    """A step of the round: its command (for the GPU, or ``--smoke``), its timeout, the least time worth a start."""

    name: str
    command: Callable[[argparse.Namespace], List[str]]
    timeout_s: float  # on one H100; --smoke stretches it (a.stretch)
    min_s: float
    skip_why: Callable[[argparse.Namespace], Optional[str]] = lambda a: None  # a reason not to run it, or None


def _py(*args) -> List[str]:
    return [sys.executable, *map(str, args)]


def _machine(a):
    code = ("import os, shutil, subprocess, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, "
            "'available', torch.cuda.is_available(), 'cpus', os.cpu_count()); "
            "torch.cuda.is_available() and print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)); "
            "shutil.which('nvidia-smi') and subprocess.run(['nvidia-smi'])")
    return _py("-c", code)


def _installed() -> bool:
    # Asked from outside the checkout: its own folder (and any nbddp.egg-info in it) does not count.
    check = "import importlib.metadata as m; m.version('nbddp')"
    return subprocess.run(_py("-c", check), cwd=tempfile.gettempdir(), capture_output=True).returncode == 0


# The smoke runs each step's own command at its smallest, and every code path of bench/gpu.py between
# the two steps (tests/test_bench.py): the DDP option variants too, and the compiled rows with
# dynamo's eager backend.
def _step(a):
    cmd = _py(HERE / "gpu.py", "--no-e2e", "--compile", "--profile", "--work-dir", a.work_dir,
              "--json", a.out / "step.json")
    return cmd + (["--smoke", "--step-rows", "all"] if a.smoke else ["--step-rows", "eager", "--steps", "20",
                                                                    "--repeats", "2"])


def _e2e(a):
    # gpu.py stops its own launches first, so that the ones done are written (a killed gpu.py writes nothing).
    cmd = _py(HERE / "gpu.py", "--e2e-only", "--work-dir", a.work_dir, "--json", a.out / "e2e.json",
              "--part-timeout", round(a.timeout_s - 20 * a.stretch))
    return cmd + (["--smoke"] if a.smoke else [])


def _profiles(a):
    cmd = _py(HERE / "step_profile.py", "--work-dir", a.work_dir, "--json", a.out / "profiles.json")
    return cmd + (["--smoke", "--pipelines", "tensor"] if a.smoke else [])


def _fsdp(a):
    if a.smoke:  # the CPU variant: 2 gloo ranks, a ~3.7M-parameter transformer
        return _py(HERE / "shard.py", "--repeats", "1", "--json", a.out / "fsdp.json")
    return _py(HERE / "shard.py", "--gpu", "--repeats", "1", "--json", a.out / "fsdp.json")


def _decode(a):
    size = ["--images", "16", "--image-size", "32", "--batch", "8", "--repeats", "1"] if a.smoke else [
        "--images", "1024", "--batch", "256", "--repeats", "2", "--device", "cuda"]
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import decode; "
            f"r = decode.main({size!r}); open({str(a.out / 'decode.json')!r}, 'w').write(json.dumps(r))")
    return _py("-c", code)


def _gpu_tests(a):
    return _py("-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider", "-rs")


def _has_nbmake() -> bool:
    return subprocess.run(_py("-c", "import nbmake, ipykernel"), capture_output=True).returncode == 0


def _notebooks(a):
    return _py("-m", "pytest", "--nbmake", "notebooks/", "-q", "-p", "no:cacheprovider",
               *(["--collect-only"] if a.smoke else []))


#: In order. Timeouts are caps: the budget bounds the round (the expected seconds on one H100, from
#: GPU round 3's figures: step ~90, e2e ~105, profiles ~60, fsdp ~100, decode ~15; the tests get the rest).
STEPS = [
    Step("machine", _machine, 30, 5),
    Step("install", lambda a: _py("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."),
         120, 30, lambda a: "nbddp is installed" if _installed() else None),
    Step("step", _step, 150, 60),
    Step("e2e", _e2e, 150, 45),
    Step("profiles", _profiles, 90, 30),
    Step("fsdp", _fsdp, 120, 40),
    Step("decode", _decode, 30, 15),
    Step("gpu-tests", _gpu_tests, 150, 30),
    Step("notebooks", _notebooks, 90, 30,
         lambda a: None if _has_nbmake() else "nbmake or ipykernel not installed: carry their wheels"),
]


def _stop(p: subprocess.Popen) -> None:
    """End a step that ran out of time: SIGINT first (nbddp ends its ranks as on Jupyter's Interrupt), then SIGKILL."""
    for sig, wait_s in ((signal.SIGINT, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(name: str, cmd: List[str], timeout_s: float, out: Path) -> dict:
    """Run ``cmd`` in a session of its own, its output teed to ``out/<name>.log``.

    Returns:
        ``{"rc", "seconds", "cpu_s", "timed_out"}``; ``cpu_s``: the CPU time of the step's processes that ended
        (on a shared machine, what the step cost apart from the wait for the cores).
    """
    log = out / f"{name}.log"
    t0 = time.monotonic()
    cpu0 = _children_cpu_s()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))

        def tee():
            for line in p.stdout:
                f.write(line)
                f.flush()
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(p)
            rc = p.returncode
        reader.join(10)
        if timed_out:
            f.write(f"\n[gpu_round] {name}: stopped after its {timeout_s:.0f} s\n")
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "cpu_s": round(_children_cpu_s() - cpu0, 1),
            "timed_out": timed_out}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-round-out",
                    help="where the logs and tables go ($OUT)")
    ap.add_argument("--work-dir", default=None, help="photos and runs (default: a temp folder), never under --out")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole round (540; --smoke: none, and each step 4x its GPU timeout)")
    ap.add_argument("--only", default=None, help="comma-separated steps to run (the others keep their files)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: every step's command, not its figures")
    a = ap.parse_args(argv)
    a.out = Path(a.out).resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work_dir = str(Path(a.work_dir or Path(tempfile.gettempdir()) / "nbddp-gpu-round").resolve())
    names = [s.name for s in STEPS]
    only = a.only.split(",") if a.only else names
    unknown = sorted(set(only) - set(names))
    if unknown:
        ap.error(f"--only: unknown step(s) {unknown}; the steps are {names}")
    record_path = a.out / "steps.json"
    steps = json.loads(record_path.read_text()) if a.only and record_path.exists() else {}
    budget = a.budget if a.budget is not None else float("inf") if a.smoke else 540.0
    a.stretch = 4.0 if a.smoke else 1.0  # a small shared CPU runs the tiny sizes slower than a GPU the real ones
    deadline = time.monotonic() + budget
    for step in STEPS:
        if step.name not in only:
            continue
        left = deadline - time.monotonic()
        why = step.skip_why(a)
        if not why and left < step.min_s:
            why = f"{left:.0f} s of the budget left, the step needs {step.min_s:.0f} s"
        if why:
            print(f"[gpu_round] {step.name}: skipped ({why})", flush=True)
            steps[step.name] = {"skipped": why}
        else:
            a.timeout_s = timeout_s = min(step.timeout_s * a.stretch, left)
            cmd = step.command(a)
            print(f"[gpu_round] {step.name}: {shlex.join(cmd)} (timeout {timeout_s:.0f} s)", flush=True)
            steps[step.name] = run_step(step.name, cmd, timeout_s, a.out)
        record_path.write_text(json.dumps(steps, indent=1))
    summary = summarize(a.out, steps, smoke=a.smoke)
    print(summary["markdown"], flush=True)
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
