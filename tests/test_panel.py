"""The training panel: widgets -> TrainConfig, real background runs (2 CPU processes, gloo).

No browser: widget values are read and set from Python, buttons are clicked with ``.click()``,
which calls the same handler the front end triggers, on this (the "kernel's" main) thread.
"""

import json
import re
import time

import pytest

import nbddp.ui.panel as panel_mod
from nbddp import ConfigError, DataError, TrainingInterrupted, TrainResult, WorkerError
from nbddp.contract.gpus import GPUInfo
from nbddp.ui import TrainingPanel
from conftest import fault_env, small_cfg, survivors, text_of, wait_for, worker_children

PROGRESS = re.compile(r"epoch \d+/(\d+) · step \d+/\d+ · loss \d+\.\d{4} · [\d,]+ img/s")


# Every run here uses CPU processes, even on a machine with GPUs (the GPU test overrides).
pytestmark = pytest.mark.usefixtures("no_gpu")


def test_cpu_controls_and_config_follow_the_widgets(tmp_path, tree, runs_dir):
    assert TrainingPanel().nprocs_input.value == 2  # no config: 2 CPU processes
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel", nprocs=1, val_fraction=0.3, seed=7))
    assert panel.gpu_checkboxes == [] and panel.nprocs_input.value == 1  # from the config
    assert "No GPU found" in panel.device_note.value and "gloo" in panel.device_note.value

    panel.epochs_input.value = 3
    panel.batch_size_input.value = 8
    panel.lr_input.value = 0.05
    panel.nprocs_input.value = 2
    panel.image_size_input.value = 64
    panel.model_input.value = "mobilenet_v3_small"
    panel.weights_input.value = "  "
    panel.amp_toggle.value = True
    panel.sync_bn_toggle.value = True
    cfg = panel.config
    assert (cfg.epochs, cfg.batch_size, cfg.lr, cfg.nprocs, cfg.image_size) == (3, 8, 0.05, 2, 64)
    assert cfg.model == "mobilenet_v3_small" and cfg.weights is None and cfg.amp and cfg.sync_bn
    assert (cfg.val_fraction, cfg.seed, cfg.name, cfg.gpus) == (0.3, 7, "panel", ())  # fields not shown: kept
    assert cfg.data_pipeline == "pil" and panel.pipeline_input.value == "pil"
    assert list(panel.pipeline_input.options) == ["pil", "tensor", "decode"]
    panel.pipeline_input.value = "tensor"
    assert panel.config.data_pipeline == "tensor"
    assert TrainingPanel(small_cfg(tree, runs_dir, name="panel", data_pipeline="decode")).pipeline_input.value == "decode"

    panel.freeze_toggle.value = True  # SyncBN is disabled and unchecked, with the reason
    assert panel.sync_bn_toggle.disabled and not panel.sync_bn_toggle.value
    assert "nothing to synchronise" in panel.sync_bn_reason.value
    assert panel.config.freeze_layers and not panel.config.sync_bn
    panel.freeze_toggle.value = False  # the choice made before freezing comes back
    assert not panel.sync_bn_toggle.disabled and panel.sync_bn_toggle.value
    assert panel.sync_bn_reason.value == ""

    panel.lr_input.value = 0.0
    with pytest.raises(ConfigError, match="lr"):
        panel.config
    panel.train_button.click()  # the callback shows the error; nothing escapes, nothing starts
    assert "TrainConfig.lr=0.0" in text_of(panel.status) and "error" in panel.status.value
    assert panel.handle is None and not panel.running and not panel.train_button.disabled


def test_gpu_picker_lists_gpus_with_memory_and_utilisation(monkeypatch, tmp_path, tree, runs_dir):
    gpus = [GPUInfo(0, "NVIDIA A100-SXM4-40GB", 40960, 30000, 3), GPUInfo(1, "NVIDIA A100-SXM4-40GB", 40960, 512, 97)]
    monkeypatch.setattr(panel_mod, "list_gpus", lambda: gpus)
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel", gpus=[1]))
    assert panel.nprocs_input is None
    assert [b.description for b in panel.gpu_checkboxes] == [g.label() for g in gpus]
    assert "10.7/40.0 GiB used · 3% busy" in panel.gpu_checkboxes[0].description
    assert [b.value for b in panel.gpu_checkboxes] == [False, True]  # the config's choice
    panel.gpu_checkboxes[0].value = True
    assert panel.config.gpus == (0, 1) and panel.config.world_size == 2
    for b in panel.gpu_checkboxes:
        b.value = False
    with pytest.raises(ConfigError, match="no GPU selected"):
        panel.config


def test_panel_displays_as_one_widget_that_fits_the_page(tmp_path, tree, runs_dir):
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel"))
    bundle = panel._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.widget.model_id
    assert panel.widget.layout.max_width == "1000px" and panel.widget.layout.width == "100%"
    assert panel.chart.value[:8] == b"\x89PNG\r\n\x1a\n"  # an empty chart before any run
    assert text_of(panel.progress_label) == "not started"
    assert panel.stop_button.disabled and not panel.train_button.disabled


@pytest.mark.timeout(120)
def test_train_button_runs_in_background_and_widgets_follow_the_run(tmp_path, tree, runs_dir, monkeypatch):
    import nbddp.ui.run_view as run_view

    drawn, said_done = [0], []  # epochs in the last chart drawn; (epochs said done, epochs drawn then)
    draw = run_view.training_curves_png
    monkeypatch.setattr(run_view, "training_curves_png",
                        lambda metrics, *a, **k: (drawn.__setitem__(0, len(metrics)), draw(metrics, *a, **k))[1])
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel"))

    def on_status(change):
        done = re.search(r"epoch (\d+)/\d+ done", text_of(panel.status))
        if done:
            said_done.append((int(done.group(1)), drawn[0]))

    panel.status.observe(on_status, names="value")
    panel.train_button.click()
    handle = panel.handle
    assert handle is not None and handle.running, text_of(panel.status)
    empty_chart = panel.chart.value  # reset for the new run, no epoch yet
    # The click returned while the run goes on (a time limit here measured the machine's load, not the panel).
    assert panel.train_button.disabled and not panel.stop_button.disabled
    assert panel.data_input.disabled  # the form is locked while it runs
    assert "starting 2 CPU processes" in text_of(panel.progress_label) or panel.progress_bar.value > 0

    # The notebook thread is free meanwhile: the monitor thread drives the widgets.
    assert wait_for(lambda: panel.progress_bar.value > 0, timeout=60), text_of(panel.status)
    # A step's loss reaches the host one step later (rank/readback.py): the first step shows none.
    assert wait_for(lambda: PROGRESS.search(text_of(panel.progress_label)), timeout=60), \
        text_of(panel.progress_label)
    assert wait_for(lambda: panel.chart.value != empty_chart, timeout=60), "chart not redrawn after an epoch"
    assert handle.metrics and panel.chart.value[:4] == b"\x89PNG"

    result = panel.wait(timeout=90)
    assert isinstance(result, TrainResult) and panel.result is result and not result.stopped
    status = text_of(panel.status)
    assert "Finished" in status and "best val accuracy" in status, status
    assert str(result.run_dir) in status and str(result.weights_path) in status
    assert PROGRESS.search(text_of(panel.progress_label)).group(1) == "2"
    assert "epoch 2/2 · step 3/3 ·" in text_of(panel.progress_label), "the last step's progress was not shown"
    # beside it, the last finished epoch's rates (no MFU on a CPU)
    assert " TFLOP/s · data wait " in text_of(panel.progress_label) and "MFU" not in text_of(panel.progress_label)
    assert panel.progress_bar.value == 1.0 and panel.progress_bar.bar_style == "success"
    assert "epoch 2/2" in text_of(panel.log) and "data: 3 classes" in text_of(panel.log)
    assert not panel.train_button.disabled and panel.stop_button.disabled and not panel.data_input.disabled
    assert not survivors(handle.pids)
    # Whenever the status line said "epoch N done", the chart already showed N epochs (never empty charts).
    assert said_done and all(drawn_then >= n for n, drawn_then in said_done), said_done


@pytest.mark.timeout(120)
def test_stop_mid_run_leaves_no_worker_and_says_stopped(tmp_path, tree, runs_dir):
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel", epochs=50))  # far longer than the test waits
    panel.train_button.click()
    handle = panel.handle
    assert wait_for(lambda: panel.progress_bar.value > 0, timeout=60), text_of(panel.status)
    panel.stop_button.click()
    assert panel.stop_button.disabled and "Stopping" in panel.stop_button.description
    t0 = time.monotonic()
    try:
        outcome = panel.wait(timeout=30)
        assert outcome.stopped
    except TrainingInterrupted as exc:  # stopped before a step boundary: the signals ended it
        outcome = exc
    assert wait_for(lambda: not survivors(handle.pids), timeout=15), survivors(handle.pids)
    assert time.monotonic() - t0 < 30
    assert "stopped" in text_of(panel.status).lower(), text_of(panel.status)
    assert panel.progress_bar.bar_style == "warning"
    assert not panel.train_button.disabled and panel.stop_button.disabled


@pytest.mark.timeout(120)
def test_run_blocks_and_returns_the_result(tmp_path, capsys, tree, runs_dir):
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel", epochs=1))
    result = panel.run()
    assert isinstance(result, TrainResult) and panel.result is result
    assert [m["epoch"] for m in result.metrics] == [0]
    assert not panel.running and "Finished" in text_of(panel.status)
    assert panel.progress_bar.value == 1.0
    assert "[rank0] epoch 1/1" in capsys.readouterr().out  # run() echoes rank 0's log in the cell
    assert not survivors(panel.handle.pids)


def test_bad_value_shows_the_error_and_starts_nothing(tmp_path, tree, runs_dir):
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel"))
    panel.batch_size_input.value = 64  # 30 training images over 2 processes: 15 each
    panel.train_button.click()
    status = text_of(panel.status)
    assert "batch_size=64" in status and "Not started" in status, status
    assert panel.handle is None and not panel.running and not worker_children()
    assert not panel.train_button.disabled and panel.stop_button.disabled and not panel.data_input.disabled
    with pytest.raises(DataError, match="batch_size=64"):
        panel.run()  # the scripted path raises what the button shows

    panel.batch_size_input.value = 4
    panel.model_input.value = "resnet19"
    panel.train_button.click()
    assert "did you mean" in text_of(panel.status) and panel.handle is None


@pytest.mark.timeout(150)
def test_in_a_real_kernel_a_front_end_click_trains_and_updates_arrive_from_the_monitor_thread(tmp_path):
    """The product path: a Jupyter kernel, the Train click arriving as a comm message (as from
    JupyterLab), widget updates sent to the front end while no cell runs."""
    import queue

    pytest.importorskip("jupyter_client")
    from conftest import ROOT
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        setup = f"""
import sys, json, threading
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
import nbddp.ui.panel as pm
pm.list_gpus = lambda: []
from conftest import make_tree
from nbddp import TrainConfig
from nbddp.ui import TrainingPanel
make_tree(__import__('pathlib').Path('data'))
panel = TrainingPanel(TrainConfig(data_path='data', model='shufflenet_v2_x0_5', image_size=32, epochs=2, batch_size=4,
                                  lr=0.01, nprocs=2, runs_dir='runs'))
clicked_on = []
panel.train_button.on_click(lambda b: clicked_on.append(threading.current_thread() is threading.main_thread()))
display(panel)
print(json.dumps({{k: getattr(panel, k).model_id for k in ('train_button', 'progress_bar', 'chart', 'status')}}))
"""
        msg_id = kc.execute(setup)
        ids, deadline = None, time.time() + 60
        while ids is None and time.time() < deadline:
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                ids = json.loads(msg["content"]["text"].strip().splitlines()[-1])
            assert msg["msg_type"] != "error", "\n".join(msg["content"].get("traceback", []))
        assert ids, "the panel cell printed no widget ids"

        # What JupyterLab sends when the button is clicked.
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": ids["train_button"],
                                                          "data": {"method": "custom", "content": {"event": "click"}}}))
        seen, finished = {"progress_bar": 0, "chart": 0}, False
        deadline = time.time() + 110
        while not finished and time.time() < deadline:
            try:
                msg = kc.get_iopub_msg(timeout=5)
            except queue.Empty:
                continue
            if msg["msg_type"] != "comm_msg" or msg["content"]["data"].get("method") != "update":
                continue
            comm, state = msg["content"]["comm_id"], msg["content"]["data"].get("state", {})
            for name in seen:
                if comm == ids[name]:
                    seen[name] += 1
            if comm == ids["status"] and ("Finished" in state.get("value", "") or "failed" in state.get("value", "")):
                finished = True
                assert "Finished" in state["value"], state["value"]
        assert finished, f"no end shown in the status widget; updates seen: {seen}"
        assert seen["progress_bar"] >= 2 and seen["chart"] >= 2, seen  # reset + per epoch

        check = kc.execute("print(json.dumps([clicked_on, panel.result is not None, panel.handle.pids]))")
        while True:
            msg = kc.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") == check and msg["msg_type"] == "stream":
                clicked, has_result, pids = json.loads(msg["content"]["text"])
                break
        assert clicked == [True], "the click handler must run on the kernel's main thread"
        assert has_result and not survivors(pids)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(120)
def test_a_failing_rank_is_named_in_red(tmp_path, monkeypatch, tree, runs_dir):
    # The test fault hook (tests/workers/faults.py): rank 1 raises after its first epoch.
    real = panel_mod.spawn_train
    monkeypatch.setattr(panel_mod, "spawn_train", lambda cfg, **kw: real(cfg, env=fault_env("epoch0:1:raise"), **kw))
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel"))
    panel.train_button.click()
    with pytest.raises(WorkerError) as err:
        panel.wait(timeout=90)
    assert err.value.rank == 1
    status = text_of(panel.status)
    assert "Training failed on rank 1" in status and "injected fault on rank 1" in status, status
    assert "error-color" in panel.status.value and panel.progress_bar.bar_style == "danger"
    assert panel.result is None and not panel.train_button.disabled
    assert not survivors(panel.handle.pids)


def test_without_sbatch_on_the_path_the_panel_offers_no_slurm(monkeypatch, tree, runs_dir):
    import os
    import sys

    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # python, but none of SLURM's commands
    panel = TrainingPanel(small_cfg(tree, runs_dir, name="panel"))
    assert panel.cluster_box.layout.display == "none" and panel.cluster_box in panel.widget.children
    panel.where_toggle.value = "SLURM"  # even set by code: nothing to submit with, the run stays here
    assert panel._launch_args()[1].get("cluster") is None
