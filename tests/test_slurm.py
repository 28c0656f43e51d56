"""spawn_train(cluster=nbddp.Slurm(...)) against a real SLURM cluster (scripts/install_slurm.sh makes one on this host).

Each submission is shared by the assertions about it: a job costs SLURM's own start-up (seconds).
"""

import os
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


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A file.py:function (not blocking, events collected) and a cell function (blocking), queued side by side."""
    import nbddp

    root = tmp_path_factory.mktemp("slurm")
    events = []
    handle = nbddp.spawn_train(f"{WORKERS / 'logging_only.py'}:train", nprocs=2, kwargs={"steps": 30, "print_every": 10},
                               runs_dir=root / "runs", cluster=nbddp.Slurm(), threads_per_proc=1, block=False,
                               on_event=lambda kind, payload: events.append((kind, payload)))
    cell = in_main(CELL, "add_ranks")
    cell_result = nbddp.spawn_train(cell, 10, nprocs=2, runs_dir=root / "runs", cluster=nbddp.Slurm(),
                                    threads_per_proc=1, all_values=True)
    return handle, handle.wait(timeout=300), events, cell_result


def test_a_cell_function_runs_as_a_slurm_job_and_every_rank_s_value_comes_back(two_runs):
    *_, result = two_runs
    assert result.values == [{"rank": 0, "total": 30.0}, {"rank": 1, "total": 30.0}]
    assert result.value == result.values[0]
    job, folder = _job_of(result.run_dir)
    assert not _in_queue(job) and not _processes_of(folder)


def test_a_file_function_s_output_values_and_progress_reach_the_handle_and_its_value_comes_back(two_runs):
    handle, result, events, _ = two_runs
    assert result.value == 30 and not result.stopped
    kinds = {kind for kind, _ in events}
    assert {"line", "metrics", "end", "notice"} <= kinds
    notices = [p for k, p in events if k == "notice"]
    job, folder = _job_of(result.run_dir)
    assert any(f"SLURM job {job}" in n for n in notices), notices
    assert [m["step"] for m in handle.metrics][-1] == 29
    assert any("at step 20" in p for k, p in events if k == "line")
    assert not _in_queue(job) and not _processes_of(folder)


def test_stop_cancels_the_job_which_leaves_the_queue_with_nothing_left_running(tmp_path):
    import nbddp

    # After its steps the worker waits for a file that never comes: only Stop ends it.
    handle = nbddp.spawn_train(f"{WORKERS / 'logging_only.py'}:train", nprocs=2,
                               kwargs={"steps": 5, "go": str(tmp_path / "never"), "print_every": 0},
                               runs_dir=tmp_path / "runs", cluster=nbddp.Slurm(), threads_per_proc=1, block=False,
                               echo=False, stop_timeout_s=3.0, grace_s=1.0)
    assert wait_for(lambda: len(handle.metrics) >= 5, timeout=180), "the job never logged"
    job, folder = _job_of(handle.run_dir)
    assert _in_queue(job) and _processes_of(folder)
    handle.stop()
    # A worker that never asks ctx.should_stop() ends by the SIGINT that follows: as locally, the run raises.
    with pytest.raises(nbddp.TrainingInterrupted, match="stopped and reaped"):
        handle.wait(timeout=120)
    assert not _in_queue(job)
    assert wait_for(lambda: not _processes_of(folder), timeout=10), _processes_of(folder)


def test_the_built_in_worker_trains_as_a_slurm_job(tmp_path):
    import nbddp

    cfg = small_cfg(make_tree(tmp_path / "data"), tmp_path / "runs", epochs=1)
    result = nbddp.spawn_train(cfg, cluster=nbddp.Slurm(), threads_per_proc=1, echo=False)
    assert 0.0 <= result.value["best_accuracy"] <= 1.0
    assert Path(result.weights_path).exists()


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
