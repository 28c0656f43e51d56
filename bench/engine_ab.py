"""The engine's training step at a git revision against the working tree's, side by side in one process.

    python bench/engine_ab.py                 # against main: steps/s of each, interleaved, and the ratio
    python bench/engine_ab.py --rev HEAD~1 --repeats 9 --steps 200

For a change on the step's path (``nbddp/rank/engine.py``): both engines run
``train_one_epoch`` on the same small CNN over the same in-memory batches (one process, no
process group, no loader: the engine's own cost shows), alternating, ``--repeats`` times each;
the medians (steps per CPU second) and their ratio are printed (1.0: no change). The revision's engine is loaded from
``git show REV:nbddp/rank/engine.py`` beside the working tree's other modules, so a change that
reaches past the engine is measured with today's helpers on both sides.
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def engine_at(rev):
    """``nbddp/rank/engine.py`` as it was at ``rev`` (None: the working tree's), a module of the package ``nbddp.rank``.

    Both sides are loaded so, alike: neither is the module the package imported.
    """
    import nbddp.rank  # noqa: F401 - the package its relative imports resolve in

    source = (ROOT / "nbddp/rank/engine.py").read_text() if rev is None else subprocess.run(
        ["git", "show", f"{rev}:nbddp/rank/engine.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rev = rev or "worktree"
    name = "nbddp.rank._engine_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "nbddp.rank"
    sys.modules[name] = module
    exec(compile(source, f"{rev}:nbddp/rank/engine.py", "exec"), module.__dict__)
    return module


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 16, 10))


def steps_per_s(engine, batches) -> float:
    """Steps per second of this process's CPU time (one thread): a machine shared with other work
    delays the wall clock, not the CPU time the steps take."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.process_time()
    engine.train_one_epoch(model, opt, batches, torch.device("cpu"), 0)
    return len(batches) / (time.process_time() - t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="main", help="the revision to compare with (default main)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    before, now = engine_at(a.rev), engine_at(None)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(a.batch, 3, 16, 16, generator=g), torch.randint(0, 10, (a.batch,), generator=g))
               for _ in range(a.steps)]
    runs = {"before": [], "after": []}
    steps_per_s(now, batches[:5])  # warm-up
    for i in range(a.repeats):  # each goes first every other time: neither gains from the order
        for key in (("before", "after") if i % 2 == 0 else ("after", "before")):
            runs[key].append(steps_per_s(before if key == "before" else now, batches))
    med = {k: statistics.median(v) for k, v in runs.items()}
    best = {k: max(v) for k, v in runs.items()}  # on a shared machine, the run least disturbed by others
    ratio, best_ratio = med["after"] / med["before"], best["after"] / best["before"]
    print(f"engine at {a.rev}: {med['before']:.1f} steps/s (best {best['before']:.1f}); working tree: "
          f"{med['after']:.1f} steps/s (best {best['after']:.1f}); ratio {ratio:.3f}, best to best {best_ratio:.3f} "
          f"(median of {a.repeats} x {a.steps} steps, interleaved)")
    return {"rev": a.rev, "steps_per_s": med, "best_steps_per_s": best, "runs": runs, "ratio": ratio,
            "best_ratio": best_ratio}


if __name__ == "__main__":
    main()
