"""What a ``%%ranks`` cell costs against a plain kernel cell, and against nbdistributed and ipyparallel.

    python bench/interactive.py [--rounds 30] [--peers]

Real Jupyter kernels driven with jupyter_client; each cell timed from ``execute`` to the kernel's
``idle``, as a person waits for it. One kernel holds an nbddp group of 2 CPU ranks
(``nbddp.start_ranks``) and runs, in every round, a trivial kernel cell (``1``) and the same
trivial cell on the ranks (``%%ranks``). With ``--peers``, nbdistributed's ``%%distributed`` and
ipyparallel's ``%%px`` (2 engines) run the same cell in kernels of their own in the same rounds,
side by side (each tool's kernel, since nbdistributed sends every cell to its workers once
started). They are installed for this run only, into a temporary folder on the kernels'
``PYTHONPATH`` (``pip install --no-deps --target``); never into the environment. Without
``--peers`` their rows say how to get them.

nbdistributed's ``%dist_shutdown`` ends processes by name (``pkill -f worker.py``, anyone's
matching process), so this script never calls it: it ends that kernel's descendants by pid.

Prints the median and the 90th percentile per row, and each row's cost over the kernel cell.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nbddp.contract.system import descendants

ROOT = Path(__file__).resolve().parent.parent
PEERS = ["nbdistributed", "ipyparallel", "decorator", "psutil", "python-dateutil"]
TRIVIAL = "1"


def run(kc, code: str, timeout: float = 120.0, out: list = None) -> float:
    """Seconds from sending ``code`` to the kernel's idle after it; raises on an error. ``out`` gets its text."""
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    error = None
    out = [] if out is None else out
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer to {code!r} within {timeout} s") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] in ("execute_result", "display_data"):
            out.append(str(msg["content"]["data"].get("text/plain", "")))
        if msg["msg_type"] == "error":
            error = f"{msg['content']['ename']}: {msg['content']['evalue']}"
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            took = time.perf_counter() - t0
            break
    if error:
        raise RuntimeError(f"{code!r} failed: {error}")
    return took


def install_peers(folder: Path) -> str:
    """Install the peers into ``folder`` (not the environment); '' when done, else why not."""
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), *PEERS],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["pip failed"])[-1]
    return ""


def start_kernel(cwd: Path, pythonpath: str = ""):
    from jupyter_client.manager import start_new_kernel

    # nbdistributed starts its workers as `python` from the PATH: this environment's.
    env = {**os.environ, "NBDDP_PREWARM": "1", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return start_new_kernel(kernel_name="python3", cwd=str(cwd), env=env)


def stats(times: list) -> str:
    ms = sorted(t * 1000 for t in times)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"median {statistics.median(ms):7.1f} ms   p90 {p90:7.1f} ms"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--peers", action="store_true", help="also nbdistributed and ipyparallel (pip, temporary)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="nbddp-bench-interactive-"))
    kernels, rows, why_not = {}, {}, ""
    try:
        km, kc = start_kernel(work)
        kernels["nbddp"] = (km, kc)
        run(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r})\nimport nbddp\n%load_ext nbddp", timeout=300)
        first = run(kc, "r = nbddp.start_ranks(nprocs=2, runs_dir='runs')", timeout=300)
        again = run(kc, "r = nbddp.start_ranks(nprocs=2, runs_dir='runs')", timeout=300)  # replaces the first
        cells = {"kernel cell": (kc, TRIVIAL), "nbddp %%ranks": (kc, "%%ranks\n" + TRIVIAL)}
        if args.peers:
            why_not = install_peers(work / "peers")
            if not why_not:
                km2, kc2 = start_kernel(work, str(work / "peers"))
                kernels["nbdistributed"] = (km2, kc2)
                run(kc2, "%load_ext nbdistributed\n%dist_init -n 2", timeout=300)
                cells["nbdistributed %%distributed"] = (kc2, "%%distributed\n" + TRIVIAL)
                km3, kc3 = start_kernel(work, str(work / "peers"))
                kernels["ipyparallel"] = (km3, kc3)
                run(kc3, "import ipyparallel as ipp\ncluster = ipp.Cluster(n=2)\n"
                         "rc = cluster.start_and_connect_sync()\nrc.wait_for_engines(2)\ndv = rc[:]\ndv.block = True\ndv.activate()",
                    timeout=300)
                cells["ipyparallel %%px"] = (kc3, "%%px\n" + TRIVIAL)
        for name, (kc_, code) in cells.items():  # untimed: first-use costs are not a cell's
            for attempt in range(3):  # nbdistributed's first cell may time out (30 s) while its workers start
                said: list = []
                run(kc_, code.replace(TRIVIAL, "print('alive', 41 + 1)"), out=said)
                if "alive 42" in " ".join("".join(said).split()):  # a tool may print its failure, not raise it
                    break
            else:
                raise RuntimeError(f"{name} did not run the cell: {''.join(said)[-500:]}")
        times = {name: [] for name in cells}
        for _ in range(args.rounds):
            for name, (kc_, code) in cells.items():
                times[name].append(run(kc_, code))
        base = statistics.median(times["kernel cell"])
        print(f"start_ranks(nprocs=2): {first:.2f} s right after import nbddp, {again:.2f} s again (warm server)")
        rows["start_s"] = {"first": first, "again": again}
        print(f"{args.rounds} rounds, 2 ranks or engines on the CPU, each cell '{TRIVIAL}'")
        for name, ts in times.items():
            extra = statistics.median(ts) - base
            rows[name] = {"median_ms": statistics.median(ts) * 1000, "extra_ms": extra * 1000}
            print(f"  {name:30s} {stats(ts)}   {'+' if extra >= 0 else ''}{extra * 1000:6.1f} ms over a kernel cell")
        if not args.peers:
            print("  nbdistributed, ipyparallel: not measured; run with --peers (installs them into a temporary "
                  "folder for this run: pip install nbdistributed ipyparallel)")
        elif why_not:
            print(f"  nbdistributed, ipyparallel: not measured, pip failed ({why_not}); pip install nbdistributed "
                  "ipyparallel into this environment's reach and run again with --peers")
    finally:
        # Every process the kernels started, noted before anything ends (an ended parent's children
        # are re-parented and no longer found), then ended by pid, never by name.
        left = [pid for km_, _ in kernels.values() for pid in descendants(km_.provisioner.process.pid)]
        stops = {"ipyparallel": "cluster.stop_cluster_sync()", "nbddp": "r.stop()"}
        for name, code in stops.items():
            if name in kernels:
                try:
                    run(kernels[name][1], code, timeout=60)
                except Exception:  # noqa: BLE001 - what is left is ended below anyway
                    pass
        for km_, kc_ in kernels.values():
            kc_.stop_channels()
            km_.shutdown_kernel(now=True)
        deadline = time.time() + 5
        while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in left):
            time.sleep(0.1)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
