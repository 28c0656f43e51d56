"""The fault matrix (CPU, gloo, 2 ranks): every fault injected, nothing left running, nothing lost.

For each fault: no live or zombie worker within a bounded time; the error names the
root-cause rank (not the one that timed out waiting), the epoch and step, and the signal or
exception; the last checkpoint loads with weights_only=True, no temp file is left, and a
resumed run in the same process finishes from it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbddp import ConfigError, TrainConfig, WeightsError, WorkerError, cleanup, spawn_train
from nbddp.contract.checkpoint import load_checkpoint
from conftest import WORKERS, fault_env, make_tree, small_cfg, survivors, wait_for, worker_children

FAULTY = str(WORKERS / "faulty.py")


def launched_pids(run_dir: Path):
    return json.loads((run_dir / ".nbddp" / "launch.json").read_text())["pids"]


def assert_recoverable(err: WorkerError, cfg: TrainConfig):
    """No survivors, checkpoint intact, no temp files, and resume finishes the run."""
    run_dir = err.run_dir
    assert survivors(launched_pids(run_dir)) == {}
    assert not worker_children()
    ckpt = run_dir / "checkpoints"
    assert load_checkpoint(ckpt / "last.pt")["epoch"] == 0  # epoch 0 was saved before the fault
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name]
    resumed = spawn_train(cfg.replace(resume=str(run_dir)), echo=False)  # the port is free at once
    assert [m["epoch"] for m in load_checkpoint(ckpt / "last.pt")["history"]] == [0, 1]
    assert resumed.value["weights_path"]


FAULTS = {
    # name: (fault spec, launch kwargs, root rank, (epoch, step), text the error must contain)
    "exception": ("step1.2:1:raise", {}, 1, (1, 2), "rank 1 raised RuntimeError: injected fault on rank 1"),
    "sigkill": ("step1.2:1:sigkill", {}, 1, (1, 2), "rank 1 was killed by SIGKILL"),
    "nonzero exit": ("step1.2:1:exit3", {}, 1, (1, 2), "rank 1 exited with code 3"),
    "nan on one rank": ("nan1.2:1:on", {}, 1, (1, 2), "NonFiniteLossError"),
    "disk full while saving": ("diskfull1:0:on", {}, 0, (1, None), "No space left on device"),
    "hang (heartbeat)": ("step1.2:1:hang", {"stall_timeout_s": 3.0}, 1, (1, 2), "rank 1 stopped making progress"),
    "hang (pg timeout)": ("step1.2:1:hang", {"stall_timeout_s": 0, "timeout_s": 6.0}, 1, (1, 2),
                          "rank 1 stopped making progress"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_in_builtin_worker(tree, runs_dir, name):
    fault, launch_kw, root, (epoch, step), text = FAULTS[name]
    cfg = small_cfg(tree, runs_dir, name="fault")
    t0 = time.time()
    with pytest.raises(WorkerError) as info:
        spawn_train(cfg, echo=False, grace_s=1.0, env=fault_env(fault), **launch_kw)
    err = info.value
    assert time.time() - t0 < 90, "bounded by grace + a few seconds, never the default timeout"
    assert err.rank == root, str(err)
    assert err.epoch == epoch and (step is None or err.step == step), str(err)
    assert text in str(err)
    assert_recoverable(err, cfg)


def test_rank_hook_runs_first_in_every_rank(runs_dir):
    result = spawn_train(f"{FAULTY}:env_var", nprocs=2, runs_dir=runs_dir, echo=False, kwargs={"name": "HOOKED"},
                         env={"NBDDP_RANK_HOOK": f"{FAULTY}:mark_rank"})
    assert result.value == "0 None", "called with the rank, before the rank's variables are set"


def test_external_sigterm_to_a_worker(runs_dir):
    h = spawn_train(f"{FAULTY}:sigterm_target", nprocs=2, runs_dir=runs_dir, block=False, echo=False)
    assert wait_for(lambda: h.progress or (h.run_dir / ".nbddp" / "rank1.json").exists(), 60)
    time.sleep(1.0)
    os.kill(h.pids[1], signal.SIGTERM)
    with pytest.raises(WorkerError) as info:
        h.wait(timeout=60)
    assert info.value.rank == 1 and info.value.signal == "SIGTERM"
    assert "rank 1 was killed by SIGTERM" in str(info.value)
    assert survivors(h.pids) == {}


@pytest.mark.parametrize("split", ["train", "val"])
def test_corrupt_image_found_at_run_time_stops_every_rank_at_one_step(tmp_path, runs_dir, split):
    from nbddp.tasks.classification.data import scan_class_folders, split_samples

    tree = make_tree(tmp_path / "data", per_class=12)
    cfg = small_cfg(tree, runs_dir, name="fault", check_images=False, epochs=1)
    train, val = split_samples(scan_class_folders(tree)[1], cfg.val_fraction, cfg.seed)
    victim = Path((train if split == "train" else val)[0][0])
    victim.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # truncated PNG
    with pytest.raises(WorkerError) as info:
        spawn_train(cfg, echo=False)
    err = info.value
    assert err.exc_type == "DataError" and victim.name in str(err)
    recs = [json.loads((err.run_dir / ".nbddp" / f"error.rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["type"] for r in recs) == ["DataError", "PeerError"]
    assert recs[0]["step"] == recs[1]["step"], "both ranks left at the same step"
    assert survivors(launched_pids(err.run_dir)) == {}


def test_ranks_with_different_batch_counts_fail_before_the_first_step(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{FAULTY}:uneven_batches", nprocs=2, runs_dir=runs_dir, echo=False)
    assert "ranks disagree on batches per epoch (rank 0: 3, rank 1: 4)" in str(info.value)
    assert not worker_children()


def test_busy_requested_port_is_not_used(runs_dir, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))  # a user's environment names a busy port
        result = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, echo=False)
        assert result.value["env"]["MASTER_PORT"] != str(port)
        assert os.environ["MASTER_PORT"] == str(port), "the user's variable is restored"


def test_stale_workers_are_refused_and_cleanup_ends_only_them(tree, runs_dir, tmp_path):
    cfg = small_cfg(tree, runs_dir, name="fault", epochs=1)
    first = spawn_train(cfg, echo=False)
    # Stand-ins for workers an earlier kernel left behind, and an unrelated twin process.
    # The stale one carries the run's marker, as real workers do; the twin does not.
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env={**os.environ, "NBDDP_RUN_DIR": str(first.run_dir)})
    twin = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        rec_path = first.run_dir / ".nbddp" / "launch.json"
        rec = json.loads(rec_path.read_text())
        from nbddp.contract.system import start_time

        rec.update(pids=[stale.pid], start_times=[start_time(stale.pid)])
        rec_path.write_text(json.dumps(rec))
        with pytest.raises(ConfigError, match=r"still has running workers .*nbddp.cleanup"):
            spawn_train(cfg.replace(resume=str(first.run_dir), epochs=2), echo=False)
        assert cleanup(first.run_dir) == [stale.pid]
        assert stale.poll() is not None
        assert twin.poll() is None, "cleanup must never touch processes it did not start"
        spawn_train(cfg.replace(resume=str(first.run_dir), epochs=2), echo=False)
    finally:
        for p in (stale, twin):
            p.kill()
            p.wait()


def test_crash_between_temp_write_and_rename(tree, runs_dir):
    cfg = small_cfg(tree, runs_dir, name="fault", epochs=1)
    first = spawn_train(cfg, echo=False)
    ckpt = first.run_dir / "checkpoints"
    leftover = ckpt / ".last.pt.tmp-999999-deadbeef"
    leftover.write_bytes(b"half a checkpoint")  # what a crash mid-rename leaves behind
    assert load_checkpoint(ckpt / "last.pt")["epoch"] == 0
    spawn_train(cfg.replace(resume=str(first.run_dir), epochs=2), echo=False)
    assert not leftover.exists()
    assert load_checkpoint(ckpt / "last.pt")["epoch"] == 1


def test_truncated_checkpoint_refused_on_resume(tree, runs_dir):
    cfg = small_cfg(tree, runs_dir, name="fault", epochs=1)
    first = spawn_train(cfg, echo=False)
    last = first.run_dir / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(WeightsError, match="last.pt"):
        spawn_train(cfg.replace(resume=str(first.run_dir), epochs=2), echo=False)
    assert not worker_children()


def test_malicious_checkpoint_refused_on_resume(tree, runs_dir, tmp_path):
    import torch

    cfg = small_cfg(tree, runs_dir, name="fault", epochs=1)
    first = spawn_train(cfg, echo=False)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": Evil(), "epoch": 0}, first.run_dir / "checkpoints" / "last.pt")
    with pytest.raises(WeightsError, match="weights-only|weights_only"):
        spawn_train(cfg.replace(resume=str(first.run_dir), epochs=2), echo=False)
    assert not marker.exists(), "the pickle payload must never run"


def test_every_rank_failing_the_same_way_names_the_lowest_rank_whichever_wrote_first():
    """The same code failing on every rank (argparse's exit): the report names rank 0, not
    whichever rank the machine's load let write first; different failures: the earliest."""
    from nbddp.contract.protocol import ErrorRecord
    from nbddp.kernel.report import find_root_cause

    same = {r: ErrorRecord(rank=r, time=t, type="SystemExit", message="2") for r, t in ((0, 2.0), (1, 1.0))}
    assert find_root_cause({}, same, {}) == 0
    other = {**same, 0: ErrorRecord(rank=0, time=2.0, type="ValueError", message="bad")}
    assert find_root_cause({}, other, {}) == 1
