"""spawn_train(cluster=nbddp.Slurm(...)) against a real SLURM cluster (scripts/install_slurm.sh makes one on this host).

Each submission is shared by the assertions about it: a job costs SLURM's own start-up (seconds).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_tree, small_cfg, wait_for
from test_cells import in_main

WORKERS = Path(__file__).parent / "workers"


def _cluster_answers() -> str:
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no SLURM cluster here ({exc}); scripts/install_slurm.sh makes a one-host one"
    return "" if done.returncode == 0 and done.stdout.strip() else f"sinfo does not answer: {done.stderr.strip()}"


pytestmark = pytest.mark.skipif(bool(_cluster_answers()), reason=_cluster_answers() or "")


def _in_queue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
    return bool(out.strip())


def _processes_of(folder: Path) -> list:
    """Processes whose command line names the job's folder: the task guardians and their ranks."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmd:
            found.append(int(pid))
    return found


def _job_of(run_dir) -> tuple:
    from nbddp.contract import rundir
    from nbddp.kernel.slurm_group import job_folder

    record = rundir.read_launch_record(run_dir)
    return record["slurm"]["job"], job_folder(run_dir)


CELL = """
import torch
import torch.distributed as dist

def add_ranks(ctx, scale):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.log(step=0, total=float(t))
    return {"rank": ctx.rank, "total": float(t) * scale}
"""


ATTACHED = """
import sys
import nbddp

handle = nbddp.spawn_train(sys.argv[1], nprocs=1, kwargs={"steps": 20, "print_every": 0}, runs_dir=sys.argv[2],
                           cluster=nbddp.Slurm(), threads_per_proc=1, block=False, echo=False)
print(handle.run_dir, flush=True)
"""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every job of the file, queued side by side (each costs SLURM's and the ranks' start-up): a
    file.py:function (events collected), a cell function, the built-in worker, a run Stop ends, one
    submitted by a process that exits (attach follows it), one preempted, and one whose ranks never start."""
    import nbddp

    root = tmp_path_factory.mktemp("slurm")
    runs = root / "runs"
    logging_only = f"{WORKERS / 'logging_only.py'}:train"
    submitter = subprocess.Popen([sys.executable, "-c", ATTACHED, logging_only, str(root / "attached")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    quiet = dict(cluster=nbddp.Slurm(), threads_per_proc=1, block=False, echo=False)
    events = []
    handles = {
        "file": nbddp.spawn_train(logging_only, nprocs=2, kwargs={"steps": 30, "print_every": 10}, runs_dir=runs,
                                  cluster=nbddp.Slurm(), threads_per_proc=1, block=False,
                                  on_event=lambda kind, payload: events.append((kind, payload))),
        "cell": nbddp.spawn_train(in_main(CELL, "add_ranks"), 10, nprocs=2, runs_dir=runs, all_values=True, **quiet),
        # After its steps the worker waits for a file that never comes: only Stop ends it.
        "stop": nbddp.spawn_train(logging_only, nprocs=2, kwargs={"steps": 5, "go": str(root / "never"),
                                                                  "print_every": 0, "go_wait_s": 900},
                                  runs_dir=runs, stop_timeout_s=3.0, grace_s=1.0, **quiet),
        "builtin": nbddp.spawn_train(small_cfg(make_tree(root / "data"), runs, epochs=1, nprocs=1), **quiet),
        "preempt": nbddp.spawn_train(f"{WORKERS / 'preemptible.py'}:train", nprocs=1, runs_dir=runs,
                                     **{**quiet, "cluster": nbddp.Slurm(time_min=10, preempt_s=60)}),
        # sbatch takes --ntasks=1 beside the job's 2 tasks a node; srun then starts 1 task of a 2-rank run.
        "unstarted": nbddp.spawn_train(logging_only, nprocs=2, runs_dir=runs,
                                       **{**quiet, "cluster": nbddp.Slurm(extra=("--ntasks=1",))}),
    }
    from nbddp.ui import TrainingPanel

    panel = TrainingPanel(logging_only, kwargs={"steps": 10, "print_every": 5}, nprocs=1, runs_dir=str(runs))
    panel.where_toggle.value = "SLURM"  # the partition dropdown lists sinfo's partitions, the default first
    panel.train_button.click()
    handles["panel"] = panel.handle
    locked = panel.where_toggle.disabled and panel.partition_dropdown.disabled  # while it runs
    yield handles, events, submitter, (panel, locked)
    for handle in handles.values():  # a test that failed early leaves nothing queued
        if handle.running:
            with contextlib.suppress(Exception):
                handle.stop(timeout=60)


# First: its signal, requeue and second start overlap the other jobs.
def test_slurm_s_signal_makes_the_ranks_checkpoint_and_the_requeued_job_resumes_from_the_run_folder(jobs):
    handle = jobs[0]["preempt"]
    events = []
    handle.subscribe(lambda kind, payload: events.append((kind, payload)))
    assert wait_for(lambda: len(handle.metrics) >= 21, timeout=180), "the job never reached half-way"
    job, _ = _job_of(handle.run_dir)
    # What SLURM sends preempt_s before the time limit: USR1 to every task.
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    # SLURM holds a requeued job until the credentials of its last start have expired (its
    # BeginTime): the test cluster's cred_expire is 20 s (scripts/install_slurm.sh). Starting it
    # sooner (scontrol update StartTime=now) races that: the start is refused, "Job credential revoked".
    result = handle.wait(timeout=300)
    assert result.value["restart_count"] == 1 and 0 < result.value["start"] < 40, result.value
    steps = [m["step"] for m in result.metrics]
    assert steps[-1] == 39 and set(steps) == set(range(40)), steps
    assert any("requeued" in p for k, p in events if k == "notice"), events
    assert not _in_queue(job)


def test_a_cell_function_runs_as_a_slurm_job_and_every_rank_s_value_comes_back(jobs):
    result = jobs[0]["cell"].wait(timeout=300)
    assert result.values == [{"rank": 0, "total": 30.0}, {"rank": 1, "total": 30.0}]
    assert result.value == result.values[0]
    job, folder = _job_of(result.run_dir)
    assert not _in_queue(job) and not _processes_of(folder)


def test_a_file_function_s_output_values_and_progress_reach_the_handle_and_its_value_comes_back(jobs):
    handles, events, *_ = jobs
    handle = handles["file"]
    result = handle.wait(timeout=300)
    assert result.value == 30 and not result.stopped
    kinds = {kind for kind, _ in events}
    assert {"line", "metrics", "end", "notice"} <= kinds
    notices = [p for k, p in events if k == "notice"]
    job, folder = _job_of(result.run_dir)
    assert any(f"SLURM job {job}" in n for n in notices), notices
    assert [m["step"] for m in handle.metrics][-1] == 29
    assert any("at step 20" in p for k, p in events if k == "line")
    assert not _in_queue(job) and not _processes_of(folder)


def test_stop_cancels_the_job_which_leaves_the_queue_with_nothing_left_running(jobs):
    import nbddp

    handle = jobs[0]["stop"]
    assert wait_for(lambda: len(handle.metrics) >= 5, timeout=180), "the job never logged"
    job, folder = _job_of(handle.run_dir)
    assert _in_queue(job) and _processes_of(folder)
    handle.stop()
    # A worker that never asks ctx.should_stop() ends by the SIGINT that follows: as locally, the run raises.
    with pytest.raises(nbddp.TrainingInterrupted, match="stopped and reaped"):
        handle.wait(timeout=120)
    # The SIGINT went through each task's guardian to its rank alone, as a local start sends it.
    assert json.loads((folder / "signals").read_text())[0] == signal.SIGINT
    from nbddp.contract import rundir

    assert "KeyboardInterrupt: nbddp: the notebook asked this run to stop" in rundir.rank_log(handle.run_dir,
                                                                                              1).read_text()
    assert not _in_queue(job)
    assert wait_for(lambda: not _processes_of(folder), timeout=10), _processes_of(folder)


def test_the_built_in_worker_trains_as_a_slurm_job(jobs):
    result = jobs[0]["builtin"].wait(timeout=300)
    assert 0.0 <= result.value["best_accuracy"] <= 1.0
    assert Path(result.weights_path).exists()


def test_a_run_whose_submitting_process_exited_is_followed_again_from_its_folder_to_its_value(jobs, tmp_path):
    import nbddp
    from nbddp.contract import rundir
    from nbddp.contract.private import NotPrivate

    out, err = jobs[2].communicate(timeout=120)
    assert jobs[2].returncode == 0, err
    run_dir = Path(out.strip().splitlines()[-1])
    job, folder = _job_of(run_dir)
    handle = nbddp.attach(run_dir, echo=False)
    result = handle.wait(timeout=300)
    assert result.value == 20 and result.run_dir == run_dir
    assert [m["step"] for m in result.metrics] == list(range(20))
    assert not _in_queue(job) and not _processes_of(folder)
    with pytest.raises(nbddp.ConfigError, match="no SLURM job's run"):
        nbddp.attach(tmp_path)
    os.chmod(rundir.launch_record_path(run_dir), 0o664)  # another may write it: the job id is not taken from it
    with pytest.raises(NotPrivate):
        nbddp.attach(run_dir)


def test_a_rank_that_never_started_is_explained_by_the_job_s_output(jobs):
    import nbddp

    with pytest.raises(nbddp.WorkerError, match=r"(?s)SLURM job's output.*rank 0 could not start.*1 tasks but "
                                                r"the run 2 ranks"):
        jobs[0]["unstarted"].wait(timeout=300)


def test_the_panel_offers_slurm_with_the_partitions_and_shows_its_run_as_a_local_one(jobs):
    from conftest import text_of

    panel, locked = jobs[3]
    assert panel.partition_dropdown.options[0] == "debug" and panel.partition_dropdown.layout.display is None
    assert panel.cluster_box.layout.display is None
    assert locked
    result = panel.wait(timeout=300)
    assert result.value == 10 and panel.result is result
    status = text_of(panel.status)
    assert "Finished" in status and str(result.run_dir) in status, status
    assert "at step 5" in text_of(panel.log)
    job, folder = _job_of(result.run_dir)
    assert not _in_queue(job) and not _processes_of(folder)
    assert not panel.where_toggle.disabled


def test_an_unknown_partition_is_refused_before_anything_is_queued(tmp_path):
    import nbddp

    with pytest.raises(nbddp.ConfigError, match=r"partition='nosuch'.*sinfo.*debug"):
        nbddp.spawn_train(f"{WORKERS / 'logging_only.py'}:train", runs_dir=tmp_path / "runs",
                          cluster=nbddp.Slurm(partition="nosuch"))
    assert not (tmp_path / "runs").exists()


def test_more_nodes_or_gpus_than_the_partition_has_are_refused(tmp_path):
    import nbddp

    target = f"{WORKERS / 'logging_only.py'}:train"
    with pytest.raises(nbddp.ConfigError, match=r"nodes=5.*at most 1"):
        nbddp.spawn_train(target, runs_dir=tmp_path / "runs", cluster=nbddp.Slurm(nodes=5))
    with pytest.raises(nbddp.ConfigError, match=r"gpus_per_node=2.*at most 0 GPU"):
        nbddp.spawn_train(target, runs_dir=tmp_path / "runs", cluster=nbddp.Slurm(gpus_per_node=2))
    assert not (tmp_path / "runs").exists()


def test_no_sbatch_on_the_path_is_refused_naming_it_and_the_fix(tmp_path, monkeypatch):
    import nbddp

    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # python, but none of SLURM's commands
    with pytest.raises(nbddp.ConfigError, match=r"`sbatch` is not on the PATH.*login node"):
        nbddp.spawn_train(f"{WORKERS / 'logging_only.py'}:train", runs_dir=tmp_path / "runs", cluster=nbddp.Slurm())


def test_bad_slurm_settings_are_refused_by_name():
    import nbddp

    with pytest.raises(nbddp.ConfigError, match=r"extra=.*one sbatch option"):
        nbddp.Slurm(extra=("--qos=high\n#SBATCH --x",))
    with pytest.raises(nbddp.ConfigError, match=r"nodes=0"):
        nbddp.Slurm(nodes=0)
