"""The benchmark scripts run: every code path of bench/gpu.py on the CPU at tiny sizes.

Only correctness is checked here; timings are never asserted (docs/benchmarks.md has them).
"""

import importlib.util
import math

from conftest import ROOT


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_runs_every_variant_on_the_cpu(tmp_path, capsys):
    r = load("gpu").main(["--smoke", "--work-dir", str(tmp_path)])
    rows = r["rows"]
    assert {"fp32", "bf16 + channels_last", "+ static_graph", "real data: tensor pipeline (GPU augmentation)",
            "real data: PIL pipeline (DataLoader workers)"} <= set(rows)
    assert all(v > 0 and math.isfinite(v) for v in rows.values()), rows
    assert r["images"] == 40 and r["grad_mb"] > 80  # ResNet34: 21.8 M parameters
    out = capsys.readouterr().out
    assert "| variant | images/s | vs fp32 | TFLOP/s |" in out and "all-reduce of the gradients" in out
