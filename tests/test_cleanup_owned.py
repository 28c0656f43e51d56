"""nbddp.cleanup ends only processes that are provably workers of the run: real processes."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbddp import cleanup, spawn_train
from nbddp.kernel.procs import carries_marker, live_workers
from nbddp.contract.system import is_same_process, start_time
from conftest import WORKERS, proc_state, wait_for

FAULTY = str(WORKERS / "faulty.py")


def write_record(run_dir, pids, start_times=None):
    state = run_dir / ".nbddp"
    state.mkdir(parents=True, exist_ok=True)
    rec = {"pids": pids}
    if start_times is not None:
        rec["start_times"] = start_times
    (state / "launch.json").write_text(json.dumps(rec))


@pytest.fixture
def sleeper():
    """An unrelated process, as any user of the machine may have running."""
    procs = []

    def start(env=None):
        p = subprocess.Popen(["sleep", "600"], env=env)
        procs.append(p)
        # Running `sleep` itself (not a child still on its way to exec), as the tests assume.
        assert wait_for(lambda: Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"sleep\0"), 10)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_record_without_start_times_ends_nothing(tmp_path, sleeper):
    stranger = sleeper()
    write_record(tmp_path, [stranger.pid])  # an old or hand-written record: pids only
    assert live_workers(tmp_path) == []
    with pytest.warns(UserWarning, match=rf"no start times.*cannot prove.*\[{stranger.pid}\]"):
        assert cleanup(tmp_path, grace_s=0.2) == []
    assert stranger.poll() is None, "cleanup killed a process it cannot prove is a worker"


def test_matching_start_time_without_the_runs_marker_ends_nothing(tmp_path, sleeper):
    stranger = sleeper()
    write_record(tmp_path, [stranger.pid], [start_time(stranger.pid)])
    assert cleanup(tmp_path, grace_s=0.2) == []
    assert stranger.poll() is None


def test_marker_of_another_run_ends_nothing(tmp_path, sleeper):
    other = tmp_path / "other-run"
    stranger = sleeper({**os.environ, "NBDDP_RUN_DIR": str(other)})
    write_record(tmp_path / "run", [stranger.pid], [start_time(stranger.pid)])
    assert cleanup(tmp_path / "run", grace_s=0.2) == []
    assert stranger.poll() is None


def test_marked_worker_with_matching_start_time_is_ended(tmp_path, sleeper):
    stale = sleeper({**os.environ, "NBDDP_RUN_DIR": str(tmp_path)})
    stranger = sleeper()
    write_record(tmp_path, [stale.pid, stranger.pid], [start_time(stale.pid), start_time(stranger.pid)])
    assert live_workers(tmp_path) == [stale.pid]
    assert cleanup(tmp_path, grace_s=2.0) == [stale.pid]
    assert stale.wait(5) == -signal.SIGTERM
    assert stranger.poll() is None


def test_cleanup_never_signals_the_calling_process(tmp_path):
    # A kernel that carries the run's marker itself (it was started from a worker's shell, say)
    # and whose own pid ended up in the record must survive its own cleanup call.
    code = textwrap.dedent("""
        import json, os, sys
        from pathlib import Path
        from nbddp.kernel.procs import cleanup
        from nbddp.contract.system import start_time
        run = Path(sys.argv[1])
        (run / ".nbddp").mkdir(parents=True)
        (run / ".nbddp" / "launch.json").write_text(
            json.dumps({"pids": [os.getpid()], "start_times": [start_time(os.getpid())]}))
        print("ended", cleanup(run, grace_s=0.2))
    """)
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NBDDP_RUN_DIR": str(run)})
    assert done.returncode == 0, done.stderr
    assert "ended []" in done.stdout


def test_another_users_process_is_reported_not_raised(tmp_path, sleeper, monkeypatch):
    stale = sleeper({**os.environ, "NBDDP_RUN_DIR": str(tmp_path)})
    write_record(tmp_path, [stale.pid], [start_time(stale.pid)])
    real_kill = os.kill

    def kill(pid, sig):  # what the kernel answers for a process of another user
        if pid == stale.pid:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)

    # The process is provably the run's worker, so only the kernel's refusal stands in the way.
    assert is_same_process(stale.pid, start_time(stale.pid)) and carries_marker(stale.pid, tmp_path)
    monkeypatch.setattr(os, "kill", kill)
    with pytest.warns(UserWarning, match=rf"pid {stale.pid}.*another user.*sudo kill {stale.pid}"):
        assert cleanup(tmp_path, grace_s=0.2) == []
    assert stale.poll() is None


@pytest.mark.timeout(120)
def test_real_workers_carry_the_marker(runs_dir):
    # Workers forked from the warm server do not show the launch's environment in /proc; their
    # rank log on fd 1 marks them instead. Both start methods must be found by live_workers.
    for method in ("forkserver", "spawn"):
        handle = spawn_train(f"{FAULTY}:barrier_and_sleep", nprocs=2, runs_dir=runs_dir, echo=False,
                             block=False, start_method=method)
        try:
            assert wait_for(lambda: all((handle.run_dir / "logs" / f"rank{r}.log").exists() for r in (0, 1)))
            assert wait_for(lambda: sorted(live_workers(handle.run_dir)) == sorted(handle.pids)), method
            if method == "spawn":  # marked from birth, before the log is open
                marker = f"NBDDP_RUN_DIR={handle.run_dir}".encode()
                assert all(marker in open(f"/proc/{p}/environ", "rb").read().split(b"\0") for p in handle.pids)
        finally:
            handle.stop()
        assert all(proc_state(p) is None for p in handle.pids)
