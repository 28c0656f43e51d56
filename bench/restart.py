"""What a restart costs: a rank SIGKILLed mid-epoch and healed by ``max_restarts``, against the
same run uninterrupted, side by side.

    python bench/restart.py [--repeats 3] [--epochs 2] [--model resnet18]

The digits (data/digits), 2 CPU ranks, batch 32, image_size 32, ``checkpoint_every_s=0.001``
(a mid-epoch checkpoint after every step, so a restart loses at most one step), warm launch
server. Each repeat runs, in turn, the uninterrupted run and the run whose rank 1 is SIGKILLed at
step 5 of epoch 1 (through nbddp's per-rank start-up hook, ``tests/workers/faults.py``) with
``max_restarts=1`` and ``restart_backoff_s=0``. Printed: the wall time of both (median), their
difference (what one restart costs end to end: noticing the death, reaping every rank, starting
the ranks again, loading ``last.pt``, the loader's start and the lost step), and whether the two
runs ended with the same weights (they must: the restart resumes exactly).
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

FAULTS = ROOT / "tests" / "workers" / "faults.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--model", default="resnet18")
    a = ap.parse_args()

    import torch
    from nbddp import TrainConfig, spawn_train
    from nbddp.contract.checkpoint import load_state_dict_file as load_weights_file

    runs = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    cfg = TrainConfig(data_path=str(ROOT / "data" / "digits"), model=a.model, image_size=32, epochs=a.epochs,
                      batch_size=32, lr=0.01, nprocs=2, runs_dir=str(runs), name="plain", checkpoint_every_s=0.001,
                      num_workers=0, check_images=False)
    fault = {"NBDDP_RANK_HOOK": f"{FAULTS}:install", "NBDDP_FAULT": "step1.5:1:sigkill"}
    spawn_train(cfg.replace(epochs=1, name="warm-up"), echo=False)  # the launch server and page cache
    plain, healed, same = [], [], []
    for _ in range(a.repeats):
        t = time.perf_counter()
        r0 = spawn_train(cfg, echo=False)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        r1 = spawn_train(cfg.replace(name="healed", max_restarts=1), echo=False, env=fault, restart_backoff_s=0)
        healed.append(time.perf_counter() - t)
        assert len(r1.restarts) == 1, r1.restarts
        w0, w1 = load_weights_file(r0.weights_path), load_weights_file(r1.weights_path)
        same.append(all(torch.equal(w0[k], w1[k]) for k in w0))
    p, h = statistics.median(plain), statistics.median(healed)
    print(f"restart: {a.model}, digits, 2 CPU ranks, {a.epochs} epochs, median of {a.repeats}")
    print(f"  uninterrupted run          {p:7.2f} s")
    print(f"  rank 1 killed, restarted   {h:7.2f} s")
    print(f"  one restart costs          {h - p:7.2f} s (x{h / p:.2f} of the run)")
    print(f"  same weights               {all(same)} ({sum(same)}/{len(same)})")
    shutil.rmtree(runs, ignore_errors=True)


if __name__ == "__main__":
    main()
