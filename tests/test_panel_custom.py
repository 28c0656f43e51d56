"""The training panel for any worker function: a form of its keyword arguments, charts of its
``ctx.log`` scalars, Train / Stop / run() on 2 CPU processes (gloo).

The worker files are written to tmp_path. The kernel (this process) only parses them: a marker
that the file's top level writes proves that nothing imported it before the run.
"""

import sys
import textwrap
import time

import ipywidgets as W
import pytest

import nbddp.ui.panel as panel_mod
from nbddp import ConfigError, TrainResult, WorkerError
from nbddp.ui import TrainingPanel
from nbddp.ui.charts import scalar_charts_png, scalar_series
from conftest import survivors, text_of, wait_for

WORKER = '''
import time
from pathlib import Path
from typing import Literal

FACTOR = 3
Path(__file__).with_suffix(".imported").touch()  # proves when the file was executed


def train(ctx, steps: int = 5, lr=0.5, warmup=False, tag="demo", opt: Literal["sgd", "adamw"] = "sgd",
          pause=0.0, scale=FACTOR * 2, note=None):
    loss, done = 1.0, 0
    for i in range(steps):
        if ctx.should_stop():
            break
        loss *= 1 - lr
        ctx.log(step=i, loss=loss, lr=lr, warm=1.0 if warmup else 0.0)
        done += 1
        time.sleep(pause)
    if ctx.rank == 1 and tag == "fail":
        raise ValueError("rank 1 was told to fail")
    return {"steps": done, "lr": lr, "warmup": warmup, "tag": tag, "opt": opt, "scale": scale, "note": note,
            "stopped": ctx.should_stop()}
'''


pytestmark = pytest.mark.usefixtures("no_gpu")  # CPU processes, even on a machine with GPUs


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "toy_worker.py"
    path.write_text(WORKER)
    return path


def descriptions(widget):
    """Every description in the widget tree."""
    found = [getattr(widget, "description", "")]
    for child in getattr(widget, "children", ()):
        found += descriptions(child)
    return found


def toy_panel(worker, tmp_path, **kw):
    return TrainingPanel(f"{worker}:train", nprocs=2, runs_dir=str(tmp_path / "runs"), **kw)


def test_the_form_follows_the_signature_and_kwargs_without_running_the_file(worker, tmp_path):
    panel = toy_panel(worker, tmp_path, kwargs={"steps": 6, "lr": 0.25})
    assert not worker.with_suffix(".imported").exists(), "the kernel executed the worker file"
    assert not [m for m in sys.modules if m.startswith("nbddp_user_")]

    inputs = panel.kwargs_inputs
    assert list(inputs) == ["steps", "lr", "warmup", "tag", "opt", "pause"]  # ctx skipped, in order
    kinds = {name: (type(w), w.value) for name, w in inputs.items()}
    assert kinds == {"steps": (W.IntText, 6), "lr": (W.FloatText, 0.25), "warmup": (W.Checkbox, False),
                     "tag": (W.Text, "demo"), "opt": (W.Dropdown, "sgd"), "pause": (W.FloatText, 0.0)}
    assert [value for _label, value in inputs["opt"].options] == ["sgd", "adamw"]  # typing.Literal
    # Not plain values: greyed out, and left to the function (nothing passed for them).
    assert {n: (w.disabled, w.value) for n, w in panel.fixed_inputs.items()} == {
        "scale": (True, "FACTOR * 2  (the function's default)"), "note": (True, "None")}
    assert panel.worker_kwargs == {"steps": 6, "lr": 0.25, "warmup": False, "tag": "demo", "opt": "sgd", "pause": 0.0}

    # The same devices and controls as the built-in panel; no classifier settings.
    assert panel.nprocs_input.value == 2 and panel.gpu_checkboxes == []
    shown = " ".join(descriptions(panel.widget))
    assert "Train" in shown and "Stop" in shown and "CPU processes" in shown
    assert not any(word in shown for word in ("SyncBN", "Freeze", "Model", "Data folder", "Weights"))
    assert not hasattr(panel, "sync_bn_toggle")
    assert panel.chart.value[:8] == b"\x89PNG\r\n\x1a\n" and panel.chart_keys == []
    with pytest.raises(ConfigError, match="worker_kwargs"):
        panel.config

    # choices= turns a text argument into a drop-down; the given value must be one of them.
    panel = toy_panel(worker, tmp_path, kwargs={"tag": "b"}, choices={"tag": ["a", "b"]})
    assert type(panel.kwargs_inputs["tag"]) is W.Dropdown and panel.kwargs_inputs["tag"].value == "b"
    with pytest.raises(ConfigError, match=r"opt='rmsprop' is not one of its choices \['sgd', 'adamw'\]"):
        toy_panel(worker, tmp_path, kwargs={"opt": "rmsprop"})
    with pytest.raises(ConfigError, match="takes no parameter 'epochs'.*steps, lr"):
        toy_panel(worker, tmp_path, kwargs={"epochs": 3})
    assert not worker.with_suffix(".imported").exists()


def test_a_parameter_without_a_default_must_be_given(tmp_path):
    path = tmp_path / "needs_data.py"
    path.write_text(textwrap.dedent('''
        import torch

        def train(ctx, data, steps=2, device=torch.device("cpu"), *args, limit: float = 1, **options):
            return data
    '''))
    with pytest.raises(ConfigError) as err:
        TrainingPanel(f"{path}:train")
    assert "'data'" in str(err.value) and "no default" in str(err.value) and "kwargs={'data': ...}" in str(err.value)

    panel = TrainingPanel(f"{path}:train", kwargs={"data": "digits", "scheme": "cosine", "layers": [1, 2]})
    assert type(panel.kwargs_inputs["data"]) is W.Text and panel.kwargs_inputs["data"].value == "digits"
    assert type(panel.kwargs_inputs["limit"]) is W.FloatText  # annotated float, default 1
    assert type(panel.kwargs_inputs["scheme"]) is W.Text  # taken by **options
    assert "torch.device('cpu')" in panel.fixed_inputs["device"].value
    assert panel.fixed_inputs["layers"].value == "[1, 2]"
    assert panel.worker_kwargs == {"data": "digits", "steps": 2, "limit": 1.0, "scheme": "cosine", "layers": [1, 2]}
    with pytest.raises(ConfigError, match="TrainConfig"):
        TrainingPanel(panel_mod.TrainConfig(), kwargs={"steps": 1})


def test_a_function_object_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "toy_module_worker.py").write_text(textwrap.dedent('''
        from __future__ import annotations
        from typing import Literal

        def train(ctx, epochs: int = 3, mode: Literal["fast", "exact"] = "fast", ratio=0.5):
            return epochs
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    from toy_module_worker import train

    hooks, finders = list(sys.path_hooks), dict(sys.path_importer_cache)
    panel = TrainingPanel(train, kwargs={"ratio": 0.75})
    # Reading the signature in the kernel leaves its imports as they were (a rank's source-only
    # import hook would make every later import of the session skip its bytecode cache).
    assert sys.path_hooks == hooks
    assert all(sys.path_importer_cache.get(k) is f for k, f in finders.items())
    assert {n: (type(w), w.value) for n, w in panel.kwargs_inputs.items()} == {
        "epochs": (W.IntText, 3), "mode": (W.Dropdown, "fast"), "ratio": (W.FloatText, 0.75)}
    assert "toy_module_worker:train" in text_of(panel.widget.children[0])
    # A function from a cell: its own parameters make the form; it is launched by value.
    ns = {"TrainingPanel": TrainingPanel, "__name__": "__main__"}
    exec("def here(ctx, lr: float = 0.1, steps=3): pass\npanel = TrainingPanel(here)", ns)
    assert {n: w.value for n, w in ns["panel"].kwargs_inputs.items()} == {"lr": 0.1, "steps": 3}
    assert text_of(ns["panel"].widget.children[0]).endswith("training · here")


def test_scalar_charts_pick_the_x_axis_per_key():
    metrics = [{"time": 1.0, "step": i, "loss": 1 / (i + 1), "ok": True} for i in range(4)]
    metrics += [{"time": 2.0, "epoch": 0, "val_acc": 0.5}, {"time": 3.0, "score": 2.0}, {"loss": float("nan")}]
    series = scalar_series(metrics)
    assert list(series) == ["loss", "val_acc", "score"]  # not time, step, epoch or bools
    assert series["loss"] == ("step", [0.0, 1.0, 2.0, 3.0], [1.0, 0.5, 1 / 3, 0.25])  # NaN left out
    assert series["val_acc"][:2] == ("epoch", [0.0]) and series["score"][:2] == ("record", [6.0])
    assert scalar_charts_png(metrics)[:4] == b"\x89PNG" and scalar_charts_png([])[:4] == b"\x89PNG"


@pytest.mark.timeout(120)
def test_run_applies_the_form_and_charts_every_logged_key(worker, tmp_path, capsys):
    panel = toy_panel(worker, tmp_path, kwargs={"steps": 6, "lr": 0.25})
    empty_chart = panel.chart.value
    panel.kwargs_inputs["steps"].value = 8
    panel.kwargs_inputs["opt"].value = "adamw"
    panel.kwargs_inputs["warmup"].value = True
    panel.kwargs_inputs["tag"].value = "from the form"
    result = panel.run()
    assert isinstance(result, TrainResult) and panel.result is result and not result.stopped
    assert result.world_size == 2 and result.backend == "gloo"
    assert result.value == {"steps": 8, "lr": 0.25, "warmup": True, "tag": "from the form", "opt": "adamw",
                            "scale": 6, "note": None, "stopped": False}  # scale: the function's own default
    assert [m["step"] for m in result.metrics] == list(range(8))
    assert panel.chart_keys == ["loss", "lr", "warm"] and panel.chart.value != empty_chart
    status = text_of(panel.status)
    assert "Finished" in status and "8 records logged" in status and "'opt': 'adamw'" in status, status
    assert str(result.run_dir) in status and result.run_dir.parent == tmp_path / "runs"
    assert panel.progress_bar.value == 1.0 and panel.progress_bar.bar_style == "success"
    assert "step 7/8" in text_of(panel.progress_label)  # a worker that only logs moves the bar too
    assert not panel.running and not panel.train_button.disabled and not panel.kwargs_inputs["steps"].disabled
    assert not survivors(panel.handle.pids)


def cell_function(name: str = "train"):
    """The toy worker as a notebook defines it: a function of ``__main__`` compiled from a cell,
    under the file name ipykernel gives cells (a file the ranks do not have)."""
    source = "\n".join(line for line in WORKER.splitlines() if "__file__" not in line)
    ns = {"__name__": "__main__"}
    exec(compile(source, "/tmp/ipykernel_4242/2716057093.py", "exec"), ns)
    return ns[name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["file", "cell"])
def test_stop_after_the_first_metrics_returns_a_stopped_result(worker, tmp_path, where):
    kwargs = {"steps": 100_000, "pause": 0.05}
    panel = (toy_panel(worker, tmp_path, kwargs=kwargs) if where == "file" else
             TrainingPanel(cell_function(), nprocs=2, runs_dir=str(tmp_path / "runs"), kwargs=kwargs))
    source = "toy_worker.py" if where == "file" else "2716057093.py"
    panel.train_button.click()
    handle = panel.handle
    assert handle is not None and handle.running, text_of(panel.status)
    assert panel.kwargs_inputs["steps"].disabled and panel.nprocs_input.disabled  # locked while it runs
    assert wait_for(lambda: handle.metrics, timeout=60), text_of(panel.status)
    assert wait_for(lambda: panel.chart_keys == ["loss", "lr", "warm"], timeout=10)  # drawn live
    assert not panel.where_button.disabled

    def both_in_train() -> bool:
        panel.where_button.click()  # "Where are they?": every rank's stack, in the panel
        shown = text_of(panel.stacks)
        return f"rank 0 is in `train` ({source}:" in shown and f"rank 1 is in `train` ({source}:" in shown

    # Nothing waits for rank 1 before rank 0 logs (no collective): on a loaded machine rank 1 can still
    # be loading the file when rank 0's first metrics arrive, and the panel says so. Asked again, as a user would.
    assert wait_for(both_in_train, timeout=30, interval=0.5), text_of(panel.stacks)
    panel.stop_button.click()
    assert panel.stop_button.disabled and "Stopping" in panel.stop_button.description
    result = panel.wait(timeout=60)
    assert result.stopped and result.value["stopped"] and result.value["steps"] < 100_000
    assert "Stopped" in text_of(panel.status) and panel.progress_bar.bar_style == "warning"
    assert not panel.train_button.disabled and panel.stop_button.disabled and panel.where_button.disabled
    assert wait_for(lambda: not survivors(handle.pids), timeout=15), survivors(handle.pids)


@pytest.mark.timeout(120)
def test_a_failing_worker_is_shown_like_the_built_in_one(worker, tmp_path):
    panel = toy_panel(worker, tmp_path, kwargs={"steps": 2, "tag": "fail"})
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        panel.run()
    assert err.value.rank == 1 and time.monotonic() - t0 < 90
    status = text_of(panel.status)
    assert "Training failed on rank 1" in status and "rank 1 was told to fail" in status, status
    assert panel.progress_bar.bar_style == "danger" and panel.result is None
    assert not survivors(panel.handle.pids)
