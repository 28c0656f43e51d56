"""Warm starts: the forkserver with torch preloaded keeps every guarantee of spawn; it starts when
nbddp is imported in a Jupyter kernel, and ends with the kernel.

The pre-warm is checked in real kernels, driven with jupyter_client. Timings are never asserted: a
pre-warmed first launch is recognised by its workers' parent, the server that was running before
the launch.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nbddp import TrainingInterrupted, WorkerError, spawn_train
from nbddp.kernel.procs import live_workers
from conftest import EXAMPLES, ROOT, WORKERS, children_of, kernel_pid, survivors, wait_for, worker_children

FAULTY = str(WORKERS / "faulty.py")
WARM = dict(start_method="forkserver", echo=False)  # the default, spelled out


def test_warm_regression_and_fast_relaunch(runs_dir):
    first = spawn_train(f"{EXAMPLES}/linear_regression.py:train", nprocs=2, runs_dir=runs_dir, **WARM)
    assert [v for (v,) in first.value["w"]] == pytest.approx([2.0, 3.0], abs=1e-3)
    again = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, **WARM)
    assert again.value["env"]["MASTER_PORT"] != first.value.get("port")  # fresh port per launch
    assert again.value["env"]["GLOO_SOCKET_IFNAME"] == "lo"  # the child got this launch's env


def test_warm_workers_see_the_environment_of_each_launch(runs_dir, monkeypatch):
    spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, **WARM)  # the server is running now
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # nbddp's own value must still win
    monkeypatch.setenv("NBDDP_TEST_MARKER", "set-after-the-server-started")
    env = spawn_train(f"{FAULTY}:env_var", "NBDDP_TEST_MARKER", nprocs=2, runs_dir=runs_dir, **WARM).value
    assert env == "set-after-the-server-started"


def test_warm_exception_names_the_rank(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{FAULTY}:raise_on", nprocs=2, kwargs={"rank": 1, "at_step": 2}, runs_dir=runs_dir, **WARM)
    assert info.value.rank == 1 and info.value.step == 2
    launch = json.loads((info.value.run_dir / ".nbddp" / "launch.json").read_text())
    assert survivors(launch["pids"]) == {}


def test_warm_interrupt_in_a_collective(runs_dir):
    pids = []

    def interrupt():
        # The rank files can appear before the launcher has written its launch record.
        if wait_for(lambda: len(list(runs_dir.glob("*/.nbddp/rank*.json"))) == 2
                    and list(runs_dir.glob("*/.nbddp/launch.json")), 60):
            pids.extend(json.loads(next(runs_dir.glob("*/.nbddp/launch.json")).read_text())["pids"])
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(TrainingInterrupted):
        spawn_train(f"{FAULTY}:barrier_and_sleep", nprocs=2, runs_dir=runs_dir, grace_s=1.0, **WARM)
    assert pids and wait_for(lambda: survivors(pids) == {}, 10)


@pytest.mark.parametrize("start_method, cycles", [("forkserver", 12), ("spawn", 3)])
def test_soak_short(tmp_path, start_method, cycles):
    """Launch/teardown cycles: no hang, no leaked process or port, no temp file left."""
    runs = tmp_path / "runs"
    for i in range(cycles):
        t0 = time.time()
        r = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs, echo=False, start_method=start_method)
        assert time.time() - t0 < 60, f"cycle {i} took too long"
        launch = json.loads((r.run_dir / ".nbddp" / "launch.json").read_text())
        assert survivors(launch["pids"]) == {}
        # nbddp's own group met in a private FileStore: its folder is gone (a TCP store: its port free)
        assert launch["store"] == "file" and not Path(launch["store_path"]).parent.exists()
    assert not worker_children()
    assert not [p for p in runs.rglob("*") if ".tmp" in p.name]


# ------------------------------------------------------------------------------ the pre-warm in a kernel
FIRST_LINE = str(WORKERS / "warm.py") + ":first_line"  # reports its parent, env and __main__
SERVER_CMD = b"from multiprocessing.forkserver import main"


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def servers_of(pid: int):
    """The forkservers that are children of ``pid``."""
    return [c for c in children_of(pid) if SERVER_CMD in cmdline(c)]


def has_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def descendants(pid: int):
    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


@pytest.fixture(autouse=True)
def prewarm_on(monkeypatch):
    monkeypatch.delenv("NBDDP_PREWARM", raising=False)  # the default, whatever the shell says


def run_cell(kc, code: str, timeout: float = 120.0) -> str:
    """Run a cell; return what it printed. Fails the test if the cell raised."""
    out = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def last_json(text: str):
    return json.loads(text.strip().splitlines()[-1])


IMPORT = f"import sys, os, json, multiprocessing; sys.path.insert(0, {str(ROOT)!r}); import nbddp\n"


def launch_cell(runs: Path) -> str:
    return (f"NOTEBOOK_SECRET = 42\n"
            f"os.environ['NBDDP_SET_AFTER_IMPORT'] = 'yes'\n"
            f"r = nbddp.spawn_train({FIRST_LINE!r}, nprocs=2, runs_dir={str(runs)!r}, echo=False,\n"
            f"                      kwargs=dict(env_names=['NBDDP_SET_AFTER_IMPORT'], main_names=['NOTEBOOK_SECRET']))\n"
            f"print(json.dumps(r.value))\n")


def check_worker(value: dict, server: int) -> None:
    assert value["ppid"] == server, "the workers forked from the server that was started at import"
    assert value["env"] == {"NBDDP_SET_AFTER_IMPORT": "yes"}, "the kernel's environment of the launch"
    assert value["main_names"] == [] and value["modules_ipython"] == [], "nothing of the notebook"


def test_import_in_a_kernel_starts_the_server_and_the_first_launch_uses_it(kernel, tmp_path):
    km, kc = kernel
    pid = kernel_pid(km)
    out = run_cell(kc, IMPORT + "print(json.dumps(multiprocessing.get_start_method(allow_none=True)))")
    assert last_json(out) is None, "the pre-warm leaves the notebook's start method unset"
    assert wait_for(lambda: len(servers_of(pid)) == 1 and has_torch(servers_of(pid)[0]), 60), \
        f"no forkserver with torch under the kernel: {[cmdline(c) for c in children_of(pid)]}"
    server = servers_of(pid)[0]
    assert b"ipykernel" not in cmdline(server) and b"__main__" not in cmdline(server)
    assert last_json(run_cell(kc, "print(json.dumps(nbddp.kernel.forkserver.server_pid()))")) == server

    check_worker(last_json(run_cell(kc, launch_cell(tmp_path / "runs"))), server)
    assert servers_of(pid) == [server]
    out = run_cell(kc, "import threading; print(json.dumps([multiprocessing.get_start_method(allow_none=True), "
                       "sys.modules['__main__'] is get_ipython().user_module, NOTEBOOK_SECRET]))")
    assert last_json(out)[1:] == [True, 42], "the notebook's __main__ is untouched"


def test_a_launch_during_the_pre_warm_waits_for_it_and_uses_the_same_server(kernel, tmp_path):
    km, kc = kernel
    pid = kernel_pid(km)
    # The launch comes while the pre-warm thread starts the server (or before it does): either
    # way one server, the one the workers came from.
    value = last_json(run_cell(kc, IMPORT + launch_cell(tmp_path / "runs")))
    assert len(servers_of(pid)) == 1
    check_worker(value, servers_of(pid)[0])


@pytest.mark.parametrize("how", ["restart", "sigkill"])
def test_the_warm_server_and_everything_under_it_end_with_the_kernel(kernel, tmp_path, how):
    """The kernel SIGKILLed (the OOM killer's way) or restarted: the server, its workers and the resource
    tracker end with it (the workers by their parent-death signal, init reaps them); a restarted kernel
    launches again."""
    km, kc = kernel
    pid = kernel_pid(km)
    runs = tmp_path / "runs"
    run_cell(kc, IMPORT)
    assert wait_for(lambda: len(servers_of(pid)) == 1 and has_torch(servers_of(pid)[0]), 60)
    server = servers_of(pid)[0]
    run_cell(kc, f"h = nbddp.spawn_train({str(WORKERS / 'faulty.py') + ':barrier_and_sleep'!r}, nprocs=2, "
                 f"runs_dir={str(runs)!r}, echo=False, block=False)")
    launch = lambda: next(runs.glob("*/.nbddp/launch.json"), None)  # noqa: E731
    assert wait_for(lambda: launch() is not None and len(list(runs.glob("*/.nbddp/rank*.json"))) == 2, 60)
    workers = json.loads(launch().read_text())["pids"]
    assert set(workers) <= set(children_of(server))
    # cleanup's proof of ownership holds for workers of a server that was started before the run
    assert wait_for(lambda: sorted(live_workers(launch().parent.parent)) == sorted(workers), 30)
    left = descendants(pid)  # the server, its workers, the resource tracker
    assert server in left and set(workers) <= set(left)
    if how == "sigkill":
        os.kill(pid, signal.SIGKILL)  # the OOM killer's way: only the kernel
    else:
        km.restart_kernel(now=True)
    assert wait_for(lambda: survivors(left) == {}, 15), {p: cmdline(p) for p in survivors(left)}
    if how == "restart":  # the restarted kernel launches again, from a server of its own
        kc.wait_for_ready(timeout=60)
        out = run_cell(kc, IMPORT + f"print(nbddp.spawn_train({str(WORKERS / 'faulty.py') + ':info'!r}, nprocs=2, "
                                    f"runs_dir={str(runs)!r}, echo=False).value['world_size'])")
        assert out.split()[-1] == "2", out
        assert server not in servers_of(kernel_pid(km)) and len(servers_of(kernel_pid(km))) == 1


def test_no_pre_warm_with_nbddp_prewarm_0(tmp_path, monkeypatch):
    pytest.importorskip("jupyter_client")
    from jupyter_client.manager import start_new_kernel

    monkeypatch.setenv("NBDDP_PREWARM", "0")  # the kernel inherits it, as from the user's shell
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        run_cell(kc, IMPORT)
        time.sleep(3)
        assert servers_of(kernel_pid(km)) == []
        out = run_cell(kc, "import threading; print(json.dumps([nbddp.kernel.forkserver.server_pid(), "
                           "[t.name for t in threading.enumerate() if t.name == 'nbddp-prewarm']]))")
        assert last_json(out) == [None, []]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


SCRIPT = """
import sys, json, threading, time
sys.path.insert(0, {root!r})
import nbddp
time.sleep(2)
import nbddp.kernel.forkserver  # asks the server's pid, starts nothing
print(json.dumps([nbddp.kernel.forkserver.server_pid(), [t.name for t in threading.enumerate()]]))
"""


def test_a_script_importing_nbddp_starts_no_server():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        kids = children_of(proc.pid)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert kids == []
    assert json.loads(out.strip().splitlines()[-1]) == [None, ["MainThread"]]


PREWARM_SCRIPT = """
import sys, json, multiprocessing
from multiprocessing import spawn
sys.path.insert(0, {root!r})
import nbddp
from nbddp.kernel import forkserver
original = spawn.get_preparation_data
if {panel!r}:
    from nbddp.ui import TrainingPanel
    TrainingPanel()
    thread = forkserver._thread
else:
    thread = forkserver.prewarm()
thread.join()
server = forkserver.server_pid()
after = [multiprocessing.get_start_method(allow_none=True), spawn.get_preparation_data is original,
         repr(forkserver.last_error)]
r = nbddp.spawn_train({target!r}, nprocs=2, runs_dir={runs!r}, echo=False)
print(json.dumps([server, after, r.value["ppid"]]))
"""


@pytest.mark.parametrize("panel", [False, True])
def test_prewarm_starts_the_server_that_launches_use_and_changes_nothing_else(tmp_path, panel):
    """Outside a kernel, ``prewarm()`` (what the import runs in one) and a TrainingPanel start it."""
    if panel:
        pytest.importorskip("ipywidgets")
    code = PREWARM_SCRIPT.format(root=str(ROOT), panel=panel, target=FIRST_LINE, runs=str(tmp_path / "runs"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    server, after, ppid = json.loads(out.stdout.strip().splitlines()[-1])
    assert server and ppid == server
    assert after == [None, True, "None"], "start method left unset, preparation data restored, no error"
