"""The tensor pipeline's cache build, first and second launch, without and with the decoded-image store.

    python bench/decoded_store.py [--images 400] [--image-size 224] [--ranks 1] [--repeats 3] [--workers 0]
                                  [--before <git revision>]

A flowers-like folder (JPEGs of 320x240, made once into a temp folder, as bench/gpu.py makes
them). Each launch is a fresh process (``--ranks`` of them started together, as a launch's ranks
are) that times ``TensorCache(samples, image_size)`` alone, imports excluded:

- **before**: the code of ``--before`` (default: the last commit without the store), unpacked with
  ``git archive`` into a temp folder: every launch, every rank decodes the whole folder;
- **store, first launch**: today's code over an empty store: one rank decodes and writes, the
  others wait and read back;
- **store, second launch**: the same again: every rank reads back.

Each repeat runs the three in turn (the same minutes) with a new store folder; the medians of the
slowest rank's seconds are printed, with the images the ranks decoded in total, and the ratios.
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
sys.path.insert(0, str(HERE))

BEFORE = "a7c6344"  # the last commit whose TensorCache decodes on every launch

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from nbddp.tasks.classification import data as D
from nbddp.tasks.classification.tensor_data import TensorCache
torch.set_num_threads(1)
_, samples = D.scan_class_folders(sys.argv[2])
go = float(sys.argv[5])
while time.time() < go:  # the ranks of a launch start their cache build together
    time.sleep(0.001)
t = time.perf_counter()
cache = TensorCache(samples, int(sys.argv[3]), torch.device("cpu"), int(sys.argv[4]))
print(json.dumps({"s": time.perf_counter() - t, "decoded": getattr(cache, "decoded", len(samples))}))
"""


def launch(code_root: Path, data: Path, a, env: dict) -> dict:
    """One launch: ``a.ranks`` processes, each timing its cache build; the slowest, and the images decoded."""
    go = time.time() + 8.0 + 2.0 * a.ranks  # after every rank's imports
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(code_root), str(data), str(a.image_size),
                               str(a.workers), str(go)], stdout=subprocess.PIPE, env=env, text=True)
             for _ in range(a.ranks)]
    rows = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a launch failed (exit {p.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return {"s": max(r["s"] for r in rows), "decoded": sum(r["decoded"] for r in rows)}


def main(argv=None) -> dict:
    from gpu import _flowers_like

    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--work-dir", default=None)
    a = ap.parse_args(argv)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="nbddp-store-bench-"))
    data = _flowers_like(work / f"flowers{a.images}", a.images)
    old = work / "before"
    if not (old / "nbddp").exists():
        old.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.before, "nbddp"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    runs = {"before": [], "store, first launch": [], "store, second launch": []}
    for r in range(a.repeats):
        cache = work / f"cache{r}-{os.getpid()}"
        cache.mkdir(mode=0o700)
        env = {**os.environ, "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1"}
        env.pop("NBDDP_DECODED_CACHE_GB", None)
        runs["before"].append(launch(old, data, a, env))
        runs["store, first launch"].append(launch(ROOT, data, a, env))
        runs["store, second launch"].append(launch(ROOT, data, a, env))
    base = statistics.median(x["s"] for x in runs["before"])
    result = {"images": a.images, "image_size": a.image_size, "ranks": a.ranks, "workers": a.workers, "rows": {}}
    print(f"TensorCache build, {a.images} JPEGs 320x240 at load size {int(a.image_size / 0.875)}, {a.ranks} rank(s) "
          f"started together, {a.workers} decode workers each, median of {a.repeats}:")
    for name, xs in runs.items():
        s = statistics.median(x["s"] for x in xs)
        decoded = xs[-1]["decoded"]
        result["rows"][name] = {"s": s, "all_s": [x["s"] for x in xs], "decoded": decoded}
        each = ", ".join(f"{x['s']:.3f}" for x in xs)
        print(f"  {name:<22} {s:7.3f} s  (runs {each})  images decoded "
              f"{decoded:5d}  ratio to before {s / base:.3f}")
    return result


if __name__ == "__main__":
    main()
