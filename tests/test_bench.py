"""The benchmark scripts run on the CPU at tiny sizes: the GPU round, every path of bench/gpu.py, bench/decode.py.

Only correctness is checked here; timings are never asserted (docs/benchmarks.md has them).
"""

import importlib.util
import json
import math

import pytest

from conftest import ROOT


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_round_runs_every_step_and_every_part_of_the_gpu_bench_on_the_cpu(tmp_path, capsys):
    """bench/gpu_round.py --smoke: each step's own command at tiny sizes, then the summary of the GPU goals.

    Its step and e2e steps are bench/gpu.py's three parts (parts 1-2, then part 3 alone), every code
    path: the DDP option variants, the compiled rows, the four launches; ``gpu.py --report-from``
    then prints the report one run of all three parts prints, from their two files.
    """
    gpu_round, gpu = load("gpu_round"), load("gpu")
    out = tmp_path / "out"
    summary = gpu_round.main(["--smoke", "--out", str(out), "--work-dir", str(tmp_path / "work")])

    steps = json.loads((out / "steps.json").read_text())
    assert list(steps) == [s.name for s in gpu_round.STEPS]
    assert steps["install"] == {"skipped": "nbddp is installed"}
    ran = {name: s for name, s in steps.items() if "skipped" not in s}
    assert {"machine", "step", "e2e", "profiles", "fsdp", "decode", "gpu-tests"} <= set(ran), steps
    assert all(s["rc"] == 0 and not s["timed_out"] for s in ran.values()), steps
    assert all((out / f"{name}.log").read_text().startswith("$ ") for name in ran)

    # 1. plain PyTorch, in its own process, which never imported nbddp
    r = json.loads((out / "step.json").read_text())
    assert set(r["plain"]["rows"]) == {gpu.PLAIN_EAGER, gpu.PLAIN_COMPILED}
    assert r["plain"]["nbddp_imported"] is False
    assert r["plain"]["compile_s"] > 0 and r["plain"]["amp_dtype"] == r["step"]["amp_dtype"]
    # 2. nbddp's step: every DDP variant and the compiled step
    assert set(r["step"]["rows"]) == set(gpu.STEP_VARIANTS) | {gpu.STEP_COMPILED}
    assert r["step"]["compile_s"] > 0 and r["step"]["grad_mb"] > 2  # squeezenet1_1: 0.7 M parameters
    rates = [row["images_per_s"] for part in ("plain", "step") for row in r[part]["rows"].values()]
    assert all(v > 0 and math.isfinite(v) for v in rates), rates
    prof = r["step"]["profile"]
    assert {"forward", "backward", "optimizer", "all-reduce"} <= set(prof["groups_ms"]), prof["groups_ms"]
    assert prof["step_ms"] > 0 and prof["top_ops"]
    # nbddp's FLOP count of the bench's step, and no peak (so no MFU) on a CPU
    assert r["gflop_nbddp"] > 0 and r["peak_tflops"] is None and all(row["mfu"] is None for row in r["table"])
    step_log = (out / "step.log").read_text()
    assert "| row | images/s per GPU | vs plain eager | TFLOP/s | MFU | data wait | peak GiB |" in step_log
    assert "| nbddp step / plain eager |" in step_log and "| nbddp compiled / plain compiled |" in step_log
    assert "profile of one nbddp step" in step_log and "all-reduce of the gradients" in step_log

    # 3. the built-in worker end to end: a fresh process, a warm relaunch, the decode and the PIL pipelines
    e2e = json.loads((out / "e2e.json").read_text())
    assert len(e2e["first"]["metrics"]) == len(e2e["warm"]["metrics"]) == 2
    assert e2e["first"]["wall_s"] > 0 and e2e["warm"]["wall_s"] > 0 and e2e["import_s"] > 0
    assert e2e["steady_images_per_s"] > 0 and len(e2e["pil_images_per_s"]) == 2
    assert len(e2e["decode"]["metrics"]) == 2 and set(e2e["steady_images_per_s_by_pipeline"]) == {
        "tensor", "decode", "pil"}
    # The fixed costs, a line each: launch to first step, then per epoch loader, evaluation, checkpoint.
    assert e2e["first"]["first_step_s"] > 0 and e2e["warm"]["first_step_s"] > 0
    assert all(k in e2e["first"]["metrics"][0] for k in ("first_batch_s", "eval_s", "checkpoint_s"))
    e2e_log = (out / "e2e.log").read_text()
    assert "warm relaunch" in e2e_log and "fixed cost, first launch: spawn_train to the first step" in e2e_log
    assert "fixed cost, warm launch, epoch 2: first batch" in e2e_log and "checkpoint" in e2e_log
    assert "fixed cost, decode launch, epoch 2" in e2e_log

    # bench/decode.py: both pipelines measured side by side
    d = json.loads((out / "decode.json").read_text())
    assert d["pil"] > 0 and d["decode"] > 0 and d["decode_vs_pil"] > 0 and d["images"] == 16

    # The three parts' report from the two files: every pipeline's steady epochs against plain eager.
    capsys.readouterr()
    whole = gpu.main(["--report-from", str(out)])
    pipes = [f"built-in steady ({p}){tail} / plain eager" for p in ("tensor", "decode", "pil")
             for tail in ("", ", each epoch's first batch left out")]
    assert set(whole["ratios"]) == {"nbddp step / plain eager", "nbddp compiled / plain compiled", *pipes}
    assert all(math.isfinite(v["measured"]) and v["measured"] > 0 for v in whole["ratios"].values())
    assert any(row["data_wait"] is not None for row in whole["table"]), "the built-in worker's records carry it"
    printed = capsys.readouterr().out
    assert "| built-in worker, decode pipeline, epoch 2 |" in printed and "warm relaunch" in printed
    assert "decode pipeline, steady:" in printed and "fixed cost, decode launch, epoch 2" in printed
    (out / "e2e.json").write_text(json.dumps({**e2e, "config": {**e2e["config"], "image_size": 64}}))
    with pytest.raises(SystemExit, match="e2e.json ran image_size=64, step.json 32"):
        gpu.main(["--report-from", str(out)])

    rows = {r["goal"]: r for r in summary["rows"]}
    # What a CPU measures has its figure; what only a GPU has reads "not measured", never "met".
    for goal in ("nbddp's step / plain PyTorch, eager, same run", "nbddp's step / plain PyTorch, torch.compile, same run",
                 "built-in worker's steady epochs (tensor) / plain eager",
                 "flowers 3 epochs, first launch in a fresh process, s", "flowers 3 epochs, warm relaunch, s"):
        assert rows[goal]["measured"] is not None and math.isfinite(rows[goal]["measured"]), rows[goal]
    assert rows["FSDP step, spawn_train / torchrun"]["status"] == "not measured", rows
    assert rows["tests/test_gpu.py on the GPU"]["shown"].endswith("skipped"), "no GPU here: every GPU test skips"
    assert "| goal | measured | target | status |" in (out / "summary.md").read_text()

    # A steady step of the built-in worker, profiled: its parts, and no host synchronisation (a CPU has none).
    prof = json.loads((out / "profiles.json").read_text())["tensor"]["profile"]
    assert {"forward", "backward", "optimizer", "data wait", "agreement"} <= set(prof["host_by_part_ms"]), prof
    assert prof["host_syncs_per_step"] == 0 and prof["steps"] == 2
    assert any(line.startswith("tensor: ") for line in summary["profiles"])


def test_gpu_round_summary_shows_tflops_mfu_and_data_wait_and_checks_the_flop_counts(tmp_path, monkeypatch):
    """The round's table of the rates nbddp reports, from a GPU round's files (made up here: no GPU runs)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as bench/gpu_round.py runs it
    summary = load("gpu_round_summary")
    steady = {"images_per_s": 7000.0, "tflops": 7000 * 21.7 / 1000, "mfu": 7000 * 21.7 / 1000 / 989.4,
              "data_wait": 0.021}
    step = {"config": {"model": "resnet34"}, "gflop_per_image": 21.8, "gflop_nbddp": 21.7, "peak_tflops": 989.4,
            "step": {"world": 1}, "table": [{"row": "plain PyTorch, eager", "images_per_s_per_gpu": 8000.0,
                                             "mfu": 8000 * 21.7 / 1000 / 989.4, "data_wait": None}]}
    e2e = {"first": {"metrics": [{"images_per_s": 100.0}, steady]}, "warm": {"metrics": [{}, steady]}}
    (tmp_path / "step.json").write_text(json.dumps(step))
    (tmp_path / "e2e.json").write_text(json.dumps(e2e))
    s = summary.summarize(tmp_path, {})
    assert s["throughput"][0] == "| row | images/s per GPU | TFLOP/s | MFU | data wait |"
    assert "| plain PyTorch, eager | 8,000 | 173.6 | 17.5% | - |" in s["throughput"]
    assert "| built-in worker, tensor pipeline, steady epochs | 7,000 | 151.9 | 15.4% | 2.1% |" in s["throughput"]
    rows = {r["goal"]: r for r in s["rows"]}
    plain = rows["MFU nbddp reports for the plain-PyTorch step / the bench's FLOP count"]
    builtin = rows["MFU the built-in worker reports / the bench's FLOP count (tensor pipeline, steady)"]
    assert plain["status"] == builtin["status"] == "met" and plain["measured"] == pytest.approx(21.7 / 21.8)
    assert "| row | images/s per GPU | TFLOP/s | MFU | data wait |" in (tmp_path / "summary.md").read_text()
    # Another model than the bench's count is of: the comparison is not made, never called met.
    (tmp_path / "step.json").write_text(json.dumps({**step, "config": {"model": "squeezenet1_1"}}))
    rows = {r["goal"]: r for r in summary.summarize(tmp_path, {})["rows"]}
    assert rows["MFU nbddp reports for the plain-PyTorch step / the bench's FLOP count"]["status"] == "not measured"
