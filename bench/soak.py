"""Soak: launch/teardown cycles, counting hangs, leaked processes and ports, temp files.

    python bench/soak.py [--cycles 100]

Runs --cycles launches with spawn (every one cold: fresh interpreters) and with the
forkserver (warm), each a 2-rank gloo run of a worker that joins the process group, all-reduces
and returns. A cycle over 60 s counts as a hang (and is stopped).
"""

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKER = '''
import torch, torch.distributed as dist
def work(ctx):
    t = torch.ones(4)
    dist.all_reduce(t)
    return t.sum().item()
'''


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def alive(pid: int) -> bool:
    try:
        state = [l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("State:")]
        return bool(state)  # a zombie still counts
    except OSError:
        return False


def soak(method: str, cycles: int, tmp: Path) -> dict:
    from nbddp import TrainingInterrupted, spawn_train

    (tmp / "soak_worker.py").write_text(WORKER)
    times, hangs, leaked, ports = [], 0, 0, 0
    for _ in range(cycles):
        t0 = time.time()
        h = spawn_train(f"{tmp}/soak_worker.py:work", nprocs=2, runs_dir=tmp / "runs", echo=False,
                        start_method=method, block=False)
        try:
            r = h.wait(timeout=60)
            assert r.value == 8.0
        except TimeoutError:
            hangs += 1
            h.stop()
        except TrainingInterrupted:
            hangs += 1
        times.append(time.time() - t0)
        rec = json.loads((h.run_dir / ".nbddp" / "launch.json").read_text())
        leaked += sum(alive(p) for p in rec["pids"])
        # A TCP store's port must be free again; nbddp's private FileStore's folder must be gone.
        store_left = not port_free(rec["port"]) if rec.get("port") else Path(rec["store_path"]).parent.exists()
        ports += int(store_left)
    temps = [p for p in (tmp / "runs").rglob("*") if ".tmp" in p.name]
    return {"cycles": cycles, "median_s": statistics.median(times), "max_s": max(times), "hangs": hangs,
            "leaked_processes": leaked, "leaked_stores": ports, "temp_files": len(temps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=100)
    a = ap.parse_args()
    print("| start method | cycles | median s | max s | hangs | leaked processes | leaked stores | temp files |")
    print("|---|---|---|---|---|---|---|---|")
    for method in ("spawn", "forkserver"):
        r = soak(method, a.cycles, Path(tempfile.mkdtemp()))
        print(f"| {method} | {r['cycles']} | {r['median_s']:.2f} | {r['max_s']:.2f} | {r['hangs']} | "
              f"{r['leaked_processes']} | {r['leaked_stores']} | {r['temp_files']} |", flush=True)


if __name__ == "__main__":
    main()
