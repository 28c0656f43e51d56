"""The GPU round's summary: each GPU goal, what its step measured, met or not (bench/gpu_round.py).

Reads what the round's steps left in ``$OUT`` (``step.json``, ``e2e.json``, ``profiles.json``,
``fsdp.json``, ``decode.json``, the test logs) and writes ``summary.md`` and ``summary.json`` there. A
figure a step did not produce (it failed, ran out of time, was skipped) reads ``n/a``, its goal
``not measured``: a goal is never called met without its figure.
"""

import json
import math
import re
import statistics
from pathlib import Path
from typing import Optional

PLAIN_EAGER = "plain PyTorch, eager"  # bench/gpu.py's row names and ratio keys
STEP_RATIO, COMPILED_RATIO = "nbddp step / plain eager", "nbddp compiled / plain compiled"
#: The decode and PIL pipelines' best validation accuracies agree "within noise": two standard
#: errors of a difference of accuracies on ~730 validation images (sqrt(2 * 0.25 / 730) ~ 0.026).
ACCURACY_NOISE = 0.03


def _load(out: Path, name: str) -> Optional[dict]:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _row(goal: str, value: Optional[float], target: str, test, fmt: str = "{:.3f}", text: Optional[str] = None) -> dict:
    value = _num(value)
    met = None if value is None or test is None else bool(test(value))
    shown = text if text is not None else ("n/a" if value is None else fmt.format(value))
    status = ("not measured" if value is None else "met" if met else "missed" if met is False else "reported")
    return {"goal": goal, "measured": value, "shown": shown, "target": target, "met": met, "status": status}


def _best_accuracy(launch: Optional[dict]) -> Optional[float]:
    accs = [m.get("val_accuracy") for m in (launch or {}).get("metrics", [])]
    accs = [a for a in accs if _num(a) is not None]
    return max(accs) if accs else None


def _pytest_counts(log: Path) -> dict:
    """``{"passed": n, "failed": n, "skipped": n, "error": n}`` from pytest's last summary line in ``log``."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    try:
        text = log.read_text()
    except OSError:
        return {}
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln)]
    if not lines:
        return {}
    for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1]):
        counts["error" if kind.startswith("error") else kind] += int(n)
    return counts


def _suite_row(goal: str, out: Path, name: str, steps: dict) -> dict:
    step = steps.get(name, {})
    counts = _pytest_counts(out / f"{name}.log")
    if "skipped" in step:
        return _row(goal, None, "all pass", None, text=f"not run: {step['skipped']}")
    if not counts:
        return _row(goal, None, "all pass", None)
    text = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    text += " (ran out of time)" if step.get("timed_out") else ""
    ok = counts["failed"] == 0 and counts["error"] == 0 and not step.get("timed_out")
    return {**_row(goal, counts["passed"], "all pass", None, text=text), "met": ok, "status": "met" if ok else "missed"}


def _fsdp_rows(fsdp: Optional[dict]) -> list:
    def peak_per_param(name):
        recs = (fsdp or {}).get(name) or []
        peaks = [max(r.get("cuda_peak_bytes") or 0 for r in rec["ranks"]) / rec["parameters"] for rec in recs]
        return statistics.median(peaks) if peaks and all(peaks) else None

    def step_s(name):
        steps = [r["step_s"] for r in (fsdp or {}).get(name) or []]
        return statistics.median(steps) if steps else None

    per = {k: peak_per_param(k) for k in ("ddp", "fsdp", "fsdp + CPU offload")}
    shown = ", ".join(f"{k} {v:.1f}" for k, v in per.items() if v is not None) or "n/a"
    rows = [_row("FSDP, ~1B transformer, AdamW bf16, one GPU: peak bytes per parameter (DDP, FSDP, + CPU offload)",
                 per["ddp"], "against DDP's 16", None, text=None if per["ddp"] is None else shown)]
    ours, theirs = step_s("fsdp"), step_s("fsdp under torchrun")
    rows.append(_row("FSDP step, spawn_train / torchrun", ours / theirs if ours and theirs else None, "<= 1.05",
                     lambda v: v <= 1.05))
    return rows


#: The bench's own FLOP count (bench/gpu.py's GFLOP_224) is ResNet34's: nbddp's is compared with it for that model only.
COUNTED_MODEL = "resnet34"


def _steady_records(e2e: dict, pipe: str) -> list:
    """The built-in worker's steady epoch records (each launch's after its first) of one pipeline."""
    keys = ("first", "warm") if pipe == "tensor" else (pipe,)
    return [m for k in keys for m in ((e2e.get(k) or {}).get("metrics") or [])[1:]]


def _median_of(records: list, key: str) -> Optional[float]:
    values = [_num(m.get(key)) for m in records]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _flop_rows(step: dict, e2e: dict) -> list:
    """nbddp's TFLOP/s (so its MFU, over the same peak) against the bench's own FLOP count, within 5 %:
    of the plain-PyTorch step (nbddp.count_flops of its model) and of the built-in worker (its records)."""
    bench = _num(step.get("gflop_per_image"))
    ours = _num(step.get("gflop_nbddp") or (step.get("step") or {}).get("gflop_nbddp"))
    world = (step.get("step") or {}).get("world") or 1
    resnet34 = (step.get("config") or {}).get("model") == COUNTED_MODEL
    plain = ours / bench if resnet34 and ours and bench else None
    ratios = [m["tflops"] / (m["images_per_s"] / world * bench / 1000)
              for m in _steady_records(e2e, "tensor") if _num(m.get("tflops")) and _num(m.get("images_per_s"))]
    builtin = statistics.median(ratios) if resnet34 and bench and ratios else None
    target = "1 ± 0.05"
    return [_row("MFU nbddp reports for the plain-PyTorch step / the bench's FLOP count", plain, target,
                 lambda v: abs(v - 1) <= 0.05),
            _row("MFU the built-in worker reports / the bench's FLOP count (tensor pipeline, steady)", builtin,
                 target, lambda v: abs(v - 1) <= 0.05)]


def throughput_table(out: Path) -> list:
    """Markdown lines: each row's images/s per GPU, TFLOP/s, MFU and data wait, as nbddp counts and reports them.

    The plain and step rows: bench/gpu.py's rates with nbddp's FLOP count of the model and its
    peak table; the built-in worker's: the medians of its steady epoch records (``tflops``,
    ``mfu``, ``data_wait``). ``-``: not known (no MFU on a CPU or an unknown GPU; no data wait
    where the rows feed batches already on the device).
    """
    step, e2e = _load(out, "step.json") or {}, _load(out, "e2e.json") or {}
    world = (step.get("step") or {}).get("world") or 1
    rows = []
    ours = _num(step.get("gflop_nbddp"))
    for r in step.get("table") or []:
        ips = _num(r.get("images_per_s_per_gpu"))
        rows.append((r["row"], ips, ips * ours / 1000 if ips and ours else None, _num(r.get("mfu")),
                     _num(r.get("data_wait"))))
    for pipe in ("tensor", "decode", "pil"):
        recs = _steady_records(e2e, pipe)
        if recs:
            ips = _median_of(recs, "images_per_s")
            rows.append((f"built-in worker, {pipe} pipeline, steady epochs", ips / world if ips else None,
                         _median_of(recs, "tflops"), _median_of(recs, "mfu"), _median_of(recs, "data_wait")))
    if not rows:
        return []

    def shown(v, fmt):
        return "-" if v is None else fmt.format(v)

    lines = ["| row | images/s per GPU | TFLOP/s | MFU | data wait |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {shown(ips, '{:,.0f}')} | {shown(tf, '{:.1f}')} | {shown(mfu, '{:.1%}')} | "
              f"{shown(wait, '{:.1%}')} |" for name, ips, tf, mfu, wait in rows]
    return lines


def goal_rows(out: Path, steps: dict) -> list:
    step, e2e = _load(out, "step.json") or {}, _load(out, "e2e.json") or {}
    ratios = step.get("ratios", {})
    world = (step.get("step") or {}).get("world") or 1
    plain = _num(((step.get("plain") or {}).get("rows") or {}).get(PLAIN_EAGER, {}).get("images_per_s"))
    rows = [_row("nbddp's step / plain PyTorch, eager, same run", ratios.get(STEP_RATIO, {}).get("measured"), ">= 0.97",
                 lambda v: v >= 0.97),
            _row("nbddp's step / plain PyTorch, torch.compile, same run",
                 ratios.get(COMPILED_RATIO, {}).get("measured"), ">= 0.97", lambda v: v >= 0.97)]
    steady = e2e.get("steady_images_per_s_by_pipeline") or {}
    for pipe, goal in (("tensor", 0.9), ("decode", 0.9), ("pil", 0.8)):
        v = _num(steady.get(pipe))
        rows.append(_row(f"built-in worker's steady epochs ({pipe}) / plain eager",
                         v / world / plain if v and plain else None, f">= {goal}", lambda x, g=goal: x >= g))
    dec = _num(steady.get("decode"))
    rows.append(_row("decode pipeline, flowers-sized folder, images/s per GPU", dec / world if dec else None,
                     ">= 5,000", lambda v: v >= 5000, fmt="{:,.0f}"))
    a_dec, a_pil = _best_accuracy(e2e.get("decode")), _best_accuracy(e2e.get("pil"))
    both = a_dec is not None and a_pil is not None
    rows.append(_row("decode vs PIL best validation accuracy", a_dec - a_pil if both else None,
                     f"difference within ±{ACCURACY_NOISE}", lambda v: abs(v) <= ACCURACY_NOISE,
                     text=f"{a_dec:.3f} vs {a_pil:.3f}" if both else None))
    rows.append(_row("flowers 3 epochs, first launch in a fresh process, s", (e2e.get("first") or {}).get("wall_s"),
                     "<= 12", lambda v: v <= 12, fmt="{:.1f}"))
    rows.append(_row("flowers 3 epochs, warm relaunch, s", (e2e.get("warm") or {}).get("wall_s"), "<= 5",
                     lambda v: v <= 5, fmt="{:.1f}"))
    rows += _flop_rows(step, e2e)
    rows += _fsdp_rows(_load(out, "fsdp.json"))
    rows.append(_suite_row("tests/test_gpu.py on the GPU", out, "gpu-tests", steps))
    rows.append(_suite_row("notebooks under nbmake on the GPU", out, "notebooks", steps))
    return rows


def _profile_lines(out: Path) -> list:
    from step_profile import report

    lines = []
    prof = ((_load(out, "step.json") or {}).get("step") or {}).get("profile")
    if prof:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in prof["groups_ms"].items())
        lines.append(f"nbddp's step on batches already on the device: {prof['step_ms']:.1f} ms/step; "
                     f"{prof['time_kind']} ms/step: {parts}; host syncs {prof['host_syncs_per_step']:.1f}/step, "
                     f"{prof['host_sync_ms']:.2f} ms blocked")
    profiles = _load(out, "profiles.json")
    if profiles:
        lines += report(profiles).splitlines()
    decode = _load(out, "decode.json")
    if decode:
        lines.append(f"decode pipeline alone (bench/decode.py, no loader): {decode.get('decode', float('nan')):,.0f} "
                     f"images/s, PIL {decode.get('pil', float('nan')):,.0f}")
    return lines


def summarize(out: Path, steps: dict, smoke: bool = False) -> dict:
    """Write ``summary.md`` and ``summary.json`` into ``out``; returns ``{"rows", "steps", "profiles", "markdown"}``.

    ``smoke``: the round ran on the CPU at tiny sizes (``--smoke``), which the heading says: its
    figures and statuses test the round, not nbddp.
    """
    rows = goal_rows(out, steps)
    step = _load(out, "step.json") or {}
    part = step.get("step") or {}
    machine = f"{part.get('device', 'n/a')}, torch {part.get('torch', 'n/a')}, {step.get('date', 'date n/a')}"
    heading = f"GPU round: {machine}" + (" (--smoke: CPU, tiny sizes; the figures mean nothing)" if smoke else "")
    md = [heading, "", "| goal | measured | target | status |", "|---|---|---|---|"]
    md += [f"| {r['goal']} | {r['shown']} | {r['target']} | {r['status']} |" for r in rows]
    rates = throughput_table(out)
    md += ["", "Throughput as nbddp counts and reports it (TFLOP/s and MFU per GPU; data wait: rank 0's share "
           "of the epoch spent waiting for batches):", "", *rates] if rates else []
    md += ["", "| step | result | seconds | CPU s |", "|---|---|---|---|"]
    for name, s in steps.items():
        result = (f"skipped ({s['skipped']})" if "skipped" in s else "ran out of time" if s.get("timed_out")
                  else "ok" if s.get("rc") == 0 else f"failed (exit {s.get('rc')})")
        md.append(f"| {name} | {result} | {s.get('seconds', '-')} | {s.get('cpu_s', '-')} |")
    profiles = _profile_lines(out)
    md += ["", "Profiles of steady steps:", *[f"- {ln}" for ln in profiles]] if profiles else []
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text)
    summary = {"rows": rows, "steps": steps, "profiles": profiles, "machine": machine, "smoke": smoke,
               "throughput": rates}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return {**summary, "markdown": text}
