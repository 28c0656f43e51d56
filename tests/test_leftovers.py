"""Nothing a worker starts outlives the run: not in the rank's group, not in a session of its own.

A worker's ``subprocess.Popen(["sleep", "313"])`` used to survive the run, re-parented to init,
after success and after failure, with either start method; ``nbddp.cleanup`` could not find it.
Each rank leads its own process group, ended once the rank exits; a process that left the group
(``start_new_session=True``) carries the run's marker in its environment and is found by it.
"""

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from nbddp import WorkerError, spawn_train
from nbddp.kernel.procs import MARKER_ENV
from conftest import proc_state, wait_for

_WORKER = """
import subprocess, time
from pathlib import Path


def train(ctx, new_session: bool, fail: bool, pids: str):
    child = subprocess.Popen(["sleep", "313"], start_new_session=new_session)
    Path(pids, f"rank{ctx.rank}").write_text(str(child.pid))
    if fail:
        raise RuntimeError("this rank fails after starting its child")
    return child.pid
"""


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for init to reap it (it runs nothing)."""
    return proc_state(pid) in (None, "Z")


def _started(pids_dir: Path) -> list:
    return [int(p.read_text()) for p in sorted(pids_dir.glob("rank*"))]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
@pytest.mark.parametrize("new_session", [False, True], ids=["same-group", "own-session"])
def test_what_a_worker_starts_ends_with_the_run(tmp_path, start_method, fail, new_session):
    worker = tmp_path / "starts_a_child.py"
    worker.write_text(_WORKER)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    kwargs = dict(new_session=new_session, fail=fail, pids=str(pids_dir))
    try:
        if fail:
            with pytest.raises(WorkerError, match="this rank fails"):
                spawn_train(f"{worker}:train", nprocs=2, kwargs=kwargs, runs_dir=tmp_path / "runs", echo=False,
                            start_method=start_method, grace_s=1)
        else:
            spawn_train(f"{worker}:train", nprocs=2, kwargs=kwargs, runs_dir=tmp_path / "runs", echo=False,
                        start_method=start_method)
        ended = time.time()
        children = _started(pids_dir)
        assert children, "the workers started no child"
        assert wait_for(lambda: all(_gone(p) for p in children), timeout=5, interval=0.05), (
            f"still running {time.time() - ended:.1f} s after the run's end: "
            f"{[p for p in children if not _gone(p)]}")
    finally:
        for pid in _started(pids_dir):
            if not _gone(pid):
                os.kill(pid, 9)


def test_cleanup_ends_a_marked_process_in_a_session_of_its_own(tmp_path):
    """What an earlier launch's rank started and left in its own session (the kernel that ran it
    died), found by the run's marker though the launch record does not name it."""
    run = tmp_path / "run"
    (run / ".nbddp").mkdir(parents=True)
    left = subprocess.Popen(["sleep", "313"], start_new_session=True, env={**os.environ, MARKER_ENV: str(run)})
    other = subprocess.Popen(["sleep", "313"], start_new_session=True,
                             env={**os.environ, MARKER_ENV: str(tmp_path / "another-run")})
    try:
        # Its parent is this process here; a rank's child left behind has init as its parent.
        # Stand in for that: the record names a dead rank, and the caller is not its kernel.
        # The dead kernel also left the launch's private temp folder (the ranks' TMPDIR, its FileStore).
        from nbddp.kernel.launch import private_tmp

        tmp = Path(private_tmp(run))  # as the launch made it: naming its run
        (tmp / "nbddp-rendezvous-x").mkdir()
        (tmp / "nbddp-rendezvous-x" / "store").write_bytes(b"")
        (run / ".nbddp" / "launch.json").write_text(json.dumps({"pids": [], "start_times": [], "tmp_dir": str(tmp)}))
        assert wait_for(lambda: Path(f"/proc/{left.pid}/cmdline").read_bytes().startswith(b"sleep"), 10)
        ended = _cleanup_from_elsewhere(run)
        assert left.pid in ended
        assert left.wait(5) is not None
        assert other.poll() is None, "cleanup ended a process of another run"
        assert not tmp.exists(), "cleanup left the launch's temp folder"
    finally:
        for p in (left, other):
            p.kill()
            p.wait()


def test_cleanup_removes_only_a_temp_folder_nbddp_made(tmp_path):
    """A launch record that names a link, another name or a folder elsewhere removes nothing."""
    from nbddp.kernel.procs import remove_left_temp_folder

    run = tmp_path / "run"
    (run / ".nbddp").mkdir(parents=True)
    keep = tmp_path / "precious"
    keep.mkdir()
    link = Path(tempfile.gettempdir()) / f"nbddp-link-{os.getpid()}"
    link.symlink_to(keep)
    plain = Path(tempfile.mkdtemp(prefix="mine-"))
    try:
        for named in (keep, link, plain):
            (run / ".nbddp" / "launch.json").write_text(json.dumps({"tmp_dir": str(named)}))
            assert not remove_left_temp_folder(run)
        assert keep.is_dir() and link.is_symlink() and plain.is_dir()
    finally:
        link.unlink()
        plain.rmdir()


def _cleanup_from_elsewhere(run: Path) -> list:
    """``nbddp.cleanup(run)`` called by another process (a new kernel): it spares its own children."""
    import sys

    code = f"import nbddp; print(nbddp.cleanup({str(run)!r}, grace_s=1))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != MARKER_ENV})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
