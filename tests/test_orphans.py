"""Nothing outlives the launching process, however it ends.

A fresh Python process (a kernel stand-in) launches 2 ranks whose PIL loaders run 2 worker
processes each, and is ended with SIGTERM, SIGKILL or SIGHUP during start-up, data loading,
training or evaluation (tests/launchers_end.py). Every process of that launch carries a marker in
its environment (inherited from the launcher), so survivors are found wherever they went: ranks,
their loader workers, the forkserver, orphans reparented to init. A zombie counts as a survivor.

And a rank's loader workers end with the rank's main thread, even when the rank lingers as a
zombie leader with live threads (as one killed inside the CUDA driver does): neither waitpid nor
the workers' own watchdog (which compares getppid()) can tell that the rank is gone.
"""

import os
import signal
import subprocess
import sys
import uuid

import pytest

from nbddp import TrainingInterrupted, spawn_train
from nbddp.contract.system import start_time
from conftest import ROOT, WORKERS, proc_state, survivors, wait_for
from launchers_end import end_launchers, marked

# Each phase once and each signal at least once (SIGKILL, which no handler sees, in the two phases
# where the most is running); every signal in every phase is bench/orphans.py (12 launches, minutes).
PAIRS = [("start-up", "SIGKILL"), ("loading", "SIGTERM"), ("training", "SIGKILL"), ("evaluation", "SIGHUP")]


@pytest.mark.parametrize("phase, sig", PAIRS)
def test_no_process_outlives_the_launching_process(tmp_path, phase, sig):
    left = end_launchers(tmp_path, phase, [sig])
    assert not any(left.values()), f"processes left 10 s after the launcher ended, by signal: {left}"


def test_loader_workers_end_with_their_ranks_main_thread(runs_dir):
    h = spawn_train(f"{WORKERS / 'lifecycle.py'}:main_thread_exits", nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False, grace_s=1.0)
    try:
        log = h.run_dir / "logs" / "rank0.log"
        assert wait_for(lambda: log.exists() and "workers " in log.read_text(), 60)
        workers = [int(p) for p in log.read_text().split("workers ", 1)[1].split()]
        assert wait_for(lambda: proc_state(h.pids[0]) == "Z", 30), "rank 0 is a zombie leader"
        # Its other threads keep the process: neither waitpid nor a worker's getppid() sees it gone.
        assert len(os.listdir(f"/proc/{h.pids[0]}/task")) > 1
        # The workers stop at once (zombies until their parent's last thread ends and init
        # reaps them), though the item they are in would take an hour.
        assert wait_for(lambda: set(survivors(workers).values()) <= {"Z"}, 10), survivors(workers)
    finally:
        h.stop(wait=False)
        with pytest.raises(TrainingInterrupted):
            h.wait(timeout=60)
    assert survivors(h.pids) == {}
    assert wait_for(lambda: not survivors(workers), 10), survivors(workers)


_LATE_CHILD = """
import ctypes, os, platform, threading, time
from nbddp.rank import process
os.register_at_fork(after_in_child=lambda: time.sleep(1.0))  # runs before the rank's own hook
process.fork_children()
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
pid = os.fork()
if pid == 0:
    time.sleep(3600)
    os._exit(0)
print(pid, flush=True)
ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)  # this thread only
"""


def test_a_child_forked_just_before_the_ranks_main_thread_ended_goes_too():
    """The parent-death signal follows the forking thread: a loader worker that reaches its prctl
    after the rank's main thread ended (a zombie leader with live threads) would wait forever."""
    proc = subprocess.Popen([sys.executable, "-c", _LATE_CHILD], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)})
    try:
        child = int(proc.stdout.readline())
        assert wait_for(lambda: proc_state(child) in (None, "Z"), 30), proc_state(child)
    finally:
        proc.kill()
        proc.wait()


def _alive(hidden: dict) -> dict:
    """``{how: state}`` of the hidden children that still exist (a zombie counts)."""
    return {how: proc_state(pid) for how, (pid, started) in hidden.items()
            if proc_state(pid) is not None and start_time(pid) == started}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_children_that_hide_from_every_trace_end_with_the_run(tmp_path, start_method):
    """A rank's children in a session of their own with an empty environment and stdio on
    /dev/null, forked from a thread, without a parent-death signal, or double-forked: the rank is
    their subreaper and ends and reaps them all before it exits; /proc shows none after the run."""
    result = spawn_train(f"{WORKERS / 'hiding.py'}:hide", nprocs=1, runs_dir=tmp_path / "runs", echo=False,
                         start_method=start_method)
    assert len(result.value) == 4
    assert _alive(result.value) == {}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_children_of_a_killed_rank_end_with_the_run(tmp_path, start_method):
    """A rank killed by SIGKILL cannot end what it started: the kernel ends what the rank recorded
    as its descendants when the run ends (under forkserver they re-parent to the warm server, a
    subreaper, which would end them when the kernel exits); after the launching process exits
    nothing of the launch is left, the server and the resource tracker included."""
    marker, found = uuid.uuid4().hex, tmp_path / "hidden.txt"
    code = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom nbddp import spawn_train\n"
            f"spawn_train({str(WORKERS / 'hiding.py') + ':hide'!r}, nprocs=1, runs_dir={str(tmp_path / 'runs')!r}, "
            f"kwargs={{'kill_self': {str(found)!r}}}, echo=False, start_method={start_method!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NBDDP_TEST_MARKER": marker},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode != 0 and found.exists(), proc.stderr.decode()[-2000:]
    hidden = eval(found.read_text())  # noqa: S307 - the test's own file
    try:
        assert wait_for(lambda: not _alive(hidden) and not marked(marker), 10), (_alive(hidden), marked(marker))
    finally:
        for pid, started in hidden.values():
            if start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)
