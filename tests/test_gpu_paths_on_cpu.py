"""What differs on a GPU, exercised on the CPU: start-up errors, NCCL's error kinds, bounded waits.

Each test here stands for something a GPU server showed: CUDA's own start-up error lost,
NCCL set-up errors read as consequences, a rank hung in validation never named, warnings cut
in half in the cell.
"""

import datetime
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nbddp import WorkerError, spawn_train
from nbddp.kernel.report import RankEnd, build_worker_error
from nbddp.rank.runtime import is_secondary, one_line_warning
from conftest import EXAMPLES, WORKERS, fault_env, make_tree, survivors
from fake_gpu import install_fake_nvidia_smi

EVAL = f"{WORKERS / 'eval_worker.py'}"


def _torch_error_files():
    return set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))


def test_failure_before_nbddp_error_handling_is_quoted_and_its_torch_error_file_removed(runs_dir):
    before = _torch_error_files()
    h = spawn_train(f"{EVAL}:warn_once", nprocs=2, runs_dir=runs_dir, block=False, echo=False,
                    env=fault_env("entry:1:raise"))
    with pytest.raises(WorkerError) as info:
        h.wait(timeout=120)
    err = info.value
    assert err.rank == 1 and err.exc_type == "RuntimeError", str(err)
    assert "rank 1 raised RuntimeError: injected fault on rank 1" in str(err)
    assert "without a Python exception" not in str(err)
    assert all(not os.path.exists(p) for p in h._procs.error_files if p)
    assert _torch_error_files() <= before
    assert survivors(h.pids) == {}


def test_cuda_failure_at_worker_start_names_rank_0_and_quotes_cuda(tmp_path, runs_dir, monkeypatch):
    """nbddp believes a GPU exists (a fake nvidia-smi); the worker's CUDA start-up fails for real."""
    install_fake_nvidia_smi(tmp_path, monkeypatch)
    before = _torch_error_files()
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{EXAMPLES}/linear_regression.py:train", gpus=[0], runs_dir=runs_dir, echo=False)
    err = info.value
    cuda_message = ("Found no NVIDIA driver" if torch.version.cuda else "Torch not compiled with CUDA enabled")
    assert err.rank == 0 and cuda_message in str(err), str(err)
    assert f"rank 0 raised {err.exc_type}: " in str(err) and err.exc_type in ("RuntimeError", "AssertionError")
    assert "without a Python exception" not in str(err)
    assert _torch_error_files() <= before


@pytest.mark.parametrize("message, during_init, secondary", [
    ("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error, NCCL version 2.28.9\n"
     "ncclSystemError: System call (e.g. socket, malloc) or external library call failed. Error while creating "
     "shared memory segment /dev/shm/nccl-abc (size 9637888)", True, False),
    ("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details), ncclUnhandledCudaError", False, False),
    ("NCCL error: internal error, ncclInternalError: P2P set-up failed", True, False),
    ("failed to connect: connection refused; the peer at 127.0.0.1 never came (timed out after 600s)", True, True),
    ("ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
     False, True),
    ("NCCL communicator was aborted on rank 0.", False, True),
    ("some backend failure", True, False),
    ("some backend failure", False, True),
])
def test_nccl_setup_and_system_errors_are_causes_and_peer_losses_consequences(message, during_init, secondary):
    exc = dist.DistBackendError(message)
    assert is_secondary(exc, during_init=during_init) is secondary


def test_cuda_start_up_errors_are_causes():
    for message in ("Found no NVIDIA driver on your system.", "CUDA error: invalid device ordinal",
                    "CUDA-capable device(s) is/are busy or unavailable", "Torch not compiled with CUDA enabled"):
        assert not is_secondary(RuntimeError(message), during_init=True)
        assert not is_secondary(AssertionError(message))


def test_a_sigabrt_after_nccls_watchdog_is_a_consequence_and_the_lagging_rank_is_named(tmp_path):
    import json
    import time

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / ".nbddp").mkdir()
    (run / "logs" / "rank0.log").write_text(
        "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=41, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.\n"
        "terminate called after throwing an instance of 'c10::DistBackendError'\n")
    (run / "logs" / "rank1.log").write_text("epoch 1 ...\n")
    now = time.time()
    beats = {0: {"rank": 0, "pid": 10, "state": "running", "epoch": 0, "step": 7, "phase": "train", "waiting": True,
                 "progress_time": now - 5},
             1: {"rank": 1, "pid": 11, "state": "running", "epoch": 0, "step": 3, "phase": "train", "waiting": False,
                 "progress_time": now - 600}}
    for r, b in beats.items():
        (run / ".nbddp" / f"rank{r}.json").write_text(json.dumps(b))
    ends = {0: RankEnd(0, 10, -signal.SIGABRT, now, False), 1: RankEnd(1, 11, -signal.SIGKILL, now + 1, True)}
    err = build_worker_error(run, ends, 2)
    assert err.rank == 1, str(err)
    assert "rank 1 stopped making progress" in str(err)
    assert "rank 0: aborted by NCCL's watchdog while waiting for rank 1" in str(err)


def test_a_rank_hung_in_validation_is_named_by_the_stall_detector(tmp_path, runs_dir):
    tree = make_tree(tmp_path / "data", per_class=6)
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{EVAL}:hang_in_eval", str(tree), nprocs=2, runs_dir=runs_dir, echo=False,
                    stall_timeout_s=3, grace_s=1)
    err = info.value
    assert err.rank == 1 and "stopped making progress" in str(err), str(err)
    assert err.epoch == 0


def test_worker_warnings_reach_the_cell_whole_on_one_line(runs_dir):
    lines = []
    spawn_train(f"{EVAL}:warn_once", nprocs=1, runs_dir=runs_dir, echo=False,
                on_event=lambda kind, payload: lines.append(payload) if kind == "line" else None)
    warned = [ln for ln in lines if "Warning" in ln]
    assert len(warned) == 2, lines
    assert "UserWarning: a worker warning with a second line (eval_worker.py:" in warned[0]
    assert warned[1].startswith("FutureWarning: old API, use the new one (")
    assert not [ln for ln in lines if ln.startswith(" ")], f"orphaned source lines: {lines}"


def test_one_line_warning_format():
    text = one_line_warning(UserWarning("a\n  b"), UserWarning, "/x/y/z.py", 7, "  src()")
    assert text == "UserWarning: a b (z.py:7)\n"


def test_process_group_is_bound_to_its_gpu_where_torch_accepts_device_id(monkeypatch):
    import nbddp.rank.dist as D

    seen = {}

    def with_device_id(backend, store=None, rank=-1, world_size=-1, timeout=None, device_id=None):
        seen.update(backend=backend, timeout=timeout, device_id=device_id)

    def without_device_id(backend, store=None, rank=-1, world_size=-1, timeout=None):
        seen.update(backend=backend, timeout=timeout, device_id="absent")

    monkeypatch.setattr(D.dist, "init_process_group", with_device_id)
    D.init_process_group("nccl", None, 0, 1, 42.0, torch.device("cuda", 0))
    assert seen == {"backend": "nccl", "timeout": datetime.timedelta(seconds=42), "device_id": torch.device("cuda", 0)}
    D.init_process_group("gloo", None, 0, 1, 42.0, torch.device("cpu"))
    assert seen["device_id"] is None
    monkeypatch.setattr(D.dist, "init_process_group", without_device_id)
    D.init_process_group("nccl", None, 0, 1, 42.0, torch.device("cuda", 0))
    assert seen["device_id"] == "absent"


def test_nbddps_own_gloo_group_waits_as_long_as_the_launch_timeout(monkeypatch):
    import nbddp.rank.dist as D

    made = {}
    monkeypatch.setattr(D, "is_dist", lambda: True)
    monkeypatch.setattr(D.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(D.dist, "new_group", lambda **kw: made.update(kw) or "group")
    monkeypatch.setattr(D, "_CPU_GROUPS", {})
    monkeypatch.setattr(D, "_TIMEOUT", datetime.timedelta(seconds=17))
    assert D.cpu_group() == "group"
    assert made == {"backend": "gloo", "timeout": datetime.timedelta(seconds=17)}


def test_a_config_with_gpus_runs_one_process_per_gpu_whatever_its_cpu_count(tmp_path, runs_dir, monkeypatch):
    """``TrainConfig.nprocs`` counts CPU processes; with GPUs chosen (the panel's picker) it is not a conflict."""
    from nbddp import TrainConfig

    install_fake_nvidia_smi(tmp_path, monkeypatch)
    cfg = TrainConfig(data_path=str(make_tree(tmp_path / "data", per_class=6)), model="resnet18", image_size=32,
                      epochs=1, batch_size=4, nprocs=2, gpus=(0,), runs_dir=str(runs_dir))
    with pytest.raises(WorkerError) as info:
        spawn_train(cfg, echo=False)
    cuda_message = "Found no NVIDIA driver" if torch.version.cuda else "Torch not compiled with CUDA enabled"
    assert info.value.rank == 0 and cuda_message in str(info.value), str(info.value)
