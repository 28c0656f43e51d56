"""Looking inside a run with one argument each: profile= (every rank's trace, result.profile) and trackers=.

Real 2-rank CPU runs of a worker with no profiler or tracker code (tests/workers/observed.py),
sharing one runs folder (and so one MLflow SQLite store, made once). MLflow runs offline in
``<runs>/mlflow.db``; W&B in offline mode.
"""

import gzip
import json
import subprocess
import sys
import time

import pytest

from nbddp import ConfigError, TrainConfig, spawn_train
from nbddp.contract import rundir
from conftest import WORKERS

OBSERVED = f"{WORKERS / 'observed.py'}:train"
WINDOW = {"wait": 1, "warmup": 1, "active": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("observed-runs")


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def profiled(runs):
    """One launch, profiled and tracked: rank 1 sleeps 0.1 s a step, so rank 0 waits for it."""
    return spawn_train(OBSERVED, nprocs=2, runs_dir=runs, name="profiled", echo=False, profile=WINDOW,
                       trackers=["mlflow"], kwargs=dict(steps=6, slow_rank=1, checkpoint=False))


def mlflow_client(result):
    from mlflow.tracking import MlflowClient

    ids = result.trackers["mlflow"]
    return MlflowClient(ids["uri"]), ids


def trace_names(path):
    with gzip.open(path, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_every_rank_writes_a_trace_and_the_summary_names_who_waits(profiled):
    for rank in (0, 1):
        names = trace_names(rundir.profile_trace_path(profiled.run_dir, rank))
        assert len({n for n in names if n.startswith("ProfilerStep#")}) == 3, sorted(names)[:20]  # active steps
        assert any("allreduce" in n for n in names)
    summary = profiled.profile
    assert sorted(summary.ranks) == [0, 1]
    assert all(r.steps == 3 and r.comm_ms > 0 and r.top_ops for r in summary.ranks.values())
    for r in summary.ranks.values():  # the four parts are the profiled steps' whole time
        assert r.compute_ms + r.comm_ms + r.data_ms + r.idle_ms == pytest.approx(r.wall_ms, abs=0.01)
    assert summary.waited_for == 1  # rank 0 spends rank 1's sleep in the all-reduce
    text = str(summary)
    assert "communication" in text and "data loading" in text and "idle" in text
    assert "the others wait for rank 1" in text
    assert text.count("top operators") == 2 and "<table>" in summary._repr_html_()


def test_one_mlflow_run_holds_every_value_and_the_settings(profiled):
    client, ids = mlflow_client(profiled)
    experiment = client.get_experiment_by_name("profiled")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(ids["run_id"], "loss")
    assert [m.step for m in history] == list(range(6))
    assert [m.value for m in history] == pytest.approx([m["loss"] for m in profiled.metrics])
    assert run.data.params["kwargs.steps"] == "6" and run.data.params["world_size"] == "2"


def test_a_restart_and_a_resume_continue_the_same_mlflow_run(runs):
    first = spawn_train(OBSERVED, nprocs=2, runs_dir=runs, name="healed", echo=False, trackers=["mlflow"],
                        max_restarts=1, restart_backoff_s=0, kwargs=dict(steps=5, fail_once_at=2))
    assert len(first.restarts) == 1
    again = spawn_train(OBSERVED, nprocs=2, runs_dir=runs, name="healed", echo=False, trackers=["mlflow"],
                        resume=first.run_dir, kwargs=dict(steps=7))
    assert again.run_dir == first.run_dir and again.value["start"] == 5
    client, ids = mlflow_client(again)
    experiment = client.get_experiment_by_name("healed")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [ids["run_id"]]
    steps = [m.step for m in client.get_metric_history(ids["run_id"], "loss")]
    # 0-2 before the failure, 3-4 after the restart, 5-6 in the resumed launch
    assert sorted(set(steps)) == list(range(7)), steps
    assert client.get_run(ids["run_id"]).info.status == "FINISHED"


def test_wandb_offline_writes_one_run(runs):
    result = spawn_train(OBSERVED, nprocs=2, runs_dir=runs, name="wb", echo=False, trackers="wandb",
                         kwargs=dict(steps=3, checkpoint=False))
    ids = result.trackers["wandb"]
    assert ids["mode"] == "offline"
    written = sorted((result.run_dir / "wandb").glob("offline-run-*"))
    assert [p.name.rsplit("-", 1)[1] for p in written] == [ids["id"]]
    assert (written[0] / f"run-{ids['id']}.wandb").stat().st_size > 0


def test_a_missing_tracker_package_and_memory_on_cpu_are_refused_before_anything_starts(monkeypatch, tmp_path,
                                                                                           capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: its import fails
    with pytest.raises(ConfigError, match=r"pip install 'nbddp\[mlflow\]'"):
        spawn_train(OBSERVED, nprocs=2, runs_dir=tmp_path, trackers=["mlflow"])
    from nbddp import cli

    assert cli.main(["run", OBSERVED, "--nprocs", "2", "--trackers", "mlflow,wandb"]) == 2  # the command line too
    assert "pip install 'nbddp[mlflow]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "wandb", None)
    config = TrainConfig(data_path=str(tmp_path / "no-data"), runs_dir=str(tmp_path), trackers="wandb")
    with pytest.raises(ConfigError, match=r"pip install 'nbddp\[wandb\]'"):
        spawn_train(config)
    with pytest.raises(ConfigError, match="CUDA allocator.*needs GPUs"):
        spawn_train(OBSERVED, nprocs=2, runs_dir=tmp_path, profile={"memory": True})
    with pytest.raises(ConfigError, match="unknown key"):
        spawn_train(OBSERVED, nprocs=2, runs_dir=tmp_path, profile={"steps": 3})
    assert list(tmp_path.iterdir()) == []  # no run folder: nothing started


def test_the_panel_shows_the_profile_and_the_tracker_run_at_the_end(profiled):
    from nbddp.ui.run_view import RunView

    view = RunView(worker=True, on_idle=lambda: None, plan=(None, None))
    view._show_result(profiled)
    shown = view.status.value
    assert "Finished." in shown and "the others wait for rank 1" in shown and "<table>" in shown
    assert f"mlflow run <code>{profiled.trackers['mlflow']['run_id']}</code>" in shown


def test_trackers_in_the_config_the_panel_and_the_command_line(tmp_path):
    from nbddp.cli import _add_config_flags, build_config
    from nbddp.ui.form import ConfigForm
    import argparse

    cfg = TrainConfig(data_path=str(tmp_path), trackers=("mlflow",))
    form = ConfigForm(cfg, on_gpu=False)
    box = form.inputs["trackers"]
    assert box.value == "mlflow"
    box.value = "mlflow, wandb"
    assert cfg.replace(**form.values()).trackers == ("mlflow", "wandb")
    p = argparse.ArgumentParser()
    _add_config_flags(p)
    p.add_argument("--config", default=None)
    ns = p.parse_args(["--data-path", str(tmp_path), "--trackers", "wandb", "--gpus", ""])
    assert build_config(ns).trackers == ("wandb",)
    with pytest.raises(ConfigError, match="trackers"):
        TrainConfig(data_path=str(tmp_path), trackers="neptune")


TRACKED_AT_ONCE = """
import sys, time
from pathlib import Path
from nbddp.contract.observe import tracker_plan
from nbddp.rank.trackers import _MLflow
runs, start = Path(sys.argv[1]), float(sys.argv[2])
plan = tracker_plan(["mlflow"], "at-once", runs, {"lr": 0.1})
import mlflow.store.tracking.sqlalchemy_store  # imported before the start, as a rank has by its first log
time.sleep(max(0.0, start - time.time()))
run_dir = runs / sys.argv[3]
run_dir.mkdir()
_MLflow(run_dir, plan)
"""


def test_runs_side_by_side_open_one_new_mlflow_store_at_once_and_leave_it_whole(tmp_path):
    """A sweep's trials side by side on a new runs folder: MLflow fails when two processes make the
    tables of one new SQLite store at once, and leaves it mid-migration for every later run."""
    runs = tmp_path / "runs"
    runs.mkdir()
    start = time.time() + 10.0  # every process has imported MLflow by then
    procs = [subprocess.Popen([sys.executable, "-c", TRACKED_AT_ONCE, str(runs), str(start), f"trial{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("at-once")
    runs_made = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs_made) == ["trial0", "trial1", "trial2"]
    assert not list(runs.glob(".*.tmp-*")), "a scratch store was left behind"


def test_a_resume_continues_only_its_own_tracker_run_whatever_trackers_json_says(tmp_path, capsys):
    """trackers.json sits in the run folder, which a group member may write: pointed at another
    run's MLflow id or W&B id, a resume still logs into its own run, never into that one."""
    from nbddp.contract.observe import tracker_plan
    from nbddp.rank.trackers import _MLflow, _WandB, wandb_id

    runs = tmp_path / "runs"
    a, b = runs / "a", runs / "b"
    a.mkdir(parents=True), b.mkdir()
    plan = tracker_plan(["mlflow", "wandb"], "own", runs, {"lr": 0.1})
    theirs, mine = _MLflow(a, plan).run_id, _MLflow(b, plan).run_id
    assert _MLflow(b, plan).run_id == mine  # a resume of b continues b's run
    shown = b / "trackers.json"
    edited = json.loads(shown.read_text())
    edited["mlflow"]["run_id"] = theirs
    edited["wandb"] = {"id": "theirs12345a", "project": "own", "mode": "offline"}
    shown.write_text(json.dumps(edited))
    again = _MLflow(b, plan)
    assert again.run_id != theirs
    assert again.client.get_run(again.run_id).data.tags["nbddp.run_dir"] == str(b)
    assert f"trackers.json names MLflow run {theirs}, which is not this run folder's" in capsys.readouterr().out
    wb = _WandB(b, plan)
    try:
        assert wb.run.id == wandb_id(b) != wandb_id(a)
    finally:
        wb.end(True, [])
    assert json.loads(shown.read_text())["wandb"]["id"] == wandb_id(b)
