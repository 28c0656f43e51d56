"""spawn_train inside a real Jupyter kernel, driven with jupyter_client: that is where users live."""

import json
import time

import pytest

from conftest import ROOT, WORKERS, execute, kernel_pid, real_kernel, survivors, wait_for

jupyter_client = pytest.importorskip("jupyter_client")


@pytest.fixture(scope="module")
def shared_kernel(tmp_path_factory):
    """One real kernel for the tests that leave it usable, as a user's kernel is used cell after cell
    (interrupted runs included); the tests that kill or restart their kernel get their own."""
    with real_kernel(tmp_path_factory.mktemp("kernel")) as pair:
        yield pair


def test_interrupt_in_real_kernel_stops_every_worker_and_kernel_stays_usable(shared_kernel, tmp_path):
    km, kc = shared_kernel
    runs = tmp_path / "runs"
    reply, out = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r}); from nbddp import spawn_train")
    assert reply["status"] == "ok", out

    msg_id = kc.execute(
        f"spawn_train({str(WORKERS / 'faulty.py') + ':barrier_and_sleep'!r}, nprocs=2, "
        f"runs_dir={str(runs)!r}, grace_s=1.0)"
    )

    def running():
        beats = list(runs.glob("*/.nbddp/rank*.json"))
        return len(beats) == 2 and all(json.loads(b.read_text())["state"] == "running" for b in beats)

    assert wait_for(running, timeout=90), "workers did not start"
    launch = json.loads(next(runs.glob("*/.nbddp/launch.json")).read_text())
    time.sleep(0.5)
    t0 = time.time()
    km.interrupt_kernel()  # SIGINT to the kernel's process group, as JupyterLab's Interrupt does

    # The cell ends with a clear exception, and its output showed rank 0's live line.
    texts, ename = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])
        if msg["msg_type"] == "error":
            ename = msg["content"]["ename"]
            texts.append(msg["content"]["evalue"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert ename == "TrainingInterrupted", texts
    assert "[rank0] rank 0 ready" in "".join(texts)
    assert time.time() - t0 < 20
    assert survivors(launch["pids"]) == {}, "no live or zombie worker after the interrupt"

    # The kernel is usable, and a new launch in it works at once.
    reply, out = execute(
        kc, f"r = spawn_train({str(WORKERS / 'faulty.py') + ':info'!r}, nprocs=2, runs_dir={str(runs)!r}); "
            "print('world', r.value['world_size'])")
    assert reply["status"] == "ok", out
    assert "world 2" in out


def test_a_notebook_function_that_cannot_cross_is_refused_in_kernel(shared_kernel, tmp_path):
    km, kc = shared_kernel
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from nbddp import spawn_train\n"
        f"notes = open({str(tmp_path / 'notes.txt')!r}, 'w')\n"
        "def train(ctx):\n    notes.write('hi')\n"
        f"spawn_train(train, nprocs=2, runs_dir={str(tmp_path / 'runs')!r})\n"
    )
    reply, out = execute(kc, code)
    assert reply["status"] == "error" and reply["ename"] == "ConfigError"
    assert "`notes` (a global that train uses) is an open file" in reply["evalue"]
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# Kernel-level faults: what happens to the workers when the kernel is interrupted, killed or
# restarted. Workers are identified by the pids in the run's launch record.


def start_run_in_kernel(kc, runs, code_target: str, extra: str = ""):
    """Execute a blocking spawn_train in the kernel; return (msg_id, run_dir, pids) once running."""
    setup, _ = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r}); import nbddp; from nbddp import spawn_train, TrainConfig")
    assert setup["status"] == "ok"
    msg_id = kc.execute(f"r = spawn_train({code_target}, runs_dir={str(runs)!r}, grace_s=1.0{extra})")

    def running():
        beats = list(runs.glob("*/.nbddp/rank*.json"))
        return len(beats) >= 2 and all(json.loads(b.read_text())["state"] == "running" for b in beats)

    assert wait_for(running, timeout=90), "workers did not start"
    launch = next(runs.glob("*/.nbddp/launch.json"))
    return msg_id, launch.parent.parent, json.loads(launch.read_text())["pids"]


def wait_reply(kc, msg_id, timeout=60):
    """The error name of a cell's reply (None if it succeeded)."""
    while True:
        msg = kc.get_shell_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            c = msg["content"]
            return c.get("ename") if c["status"] == "error" else None


def test_interrupt_sent_to_the_kernel_pid_only(shared_kernel, tmp_path):
    km, kc = shared_kernel
    runs = tmp_path / "runs"
    msg_id, run_dir, pids = start_run_in_kernel(kc, runs, repr(str(WORKERS / "faulty.py") + ":barrier_and_sleep") + ", nprocs=2")
    import os
    import signal as sig

    os.kill(kernel_pid(km), sig.SIGINT)  # not the process group: only the kernel hears it
    assert wait_reply(kc, msg_id) == "TrainingInterrupted"
    assert wait_for(lambda: survivors(pids) == {}, timeout=20)


def test_interrupt_reaches_a_script_that_never_checks_should_stop(shared_kernel, tmp_path):
    """A torchrun script knows nothing of nbddp: Jupyter's Interrupt (SIGINT to the kernel's whole
    process group) must still end it between two statements, and the cell says how each rank ended."""
    km, kc = shared_kernel
    runs = tmp_path / "runs"
    setup, _ = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r}); from nbddp import spawn_train")
    assert setup["status"] == "ok"
    msg_id = kc.execute(f"spawn_train({str(WORKERS / 'own_code' / 'endless.py')!r}, nprocs=2, argv=['120'], "
                        f"runs_dir={str(runs)!r}, grace_s=5.0)")

    def spinning():
        logs = list(runs.glob("*/logs/rank[0-9].log"))
        return len(logs) == 2 and all("spinning" in p.read_text() for p in logs)

    assert wait_for(spinning, timeout=90), "the script did not start"
    pids = json.loads(next(runs.glob("*/.nbddp/launch.json")).read_text())["pids"]
    t0 = time.time()
    km.interrupt_kernel()
    reply = None
    while reply is None:
        msg = kc.get_shell_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id:
            reply = msg["content"]
    # Out of time.sleep at the next statement, well before the 5 s grace would send SIGTERM.
    assert time.time() - t0 < 5
    assert reply["status"] == "error" and reply["ename"] == "TrainingInterrupted", reply
    assert "ranks 0-1: KeyboardInterrupt at the interrupt" in reply["evalue"], reply["evalue"]
    assert "no checkpoint was written" in reply["evalue"]
    assert wait_for(lambda: survivors(pids) == {}, timeout=10), survivors(pids)


def test_interrupt_during_training_keeps_the_checkpoint_and_resume_works(shared_kernel, tmp_path):
    import sys as _sys

    _sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tree

    km, kc = shared_kernel
    tree = make_tree(tmp_path / "data")
    runs = tmp_path / "runs"
    cfg = (f"TrainConfig(data_path={str(tree)!r}, model='shufflenet_v2_x0_5', image_size=32, epochs=40, batch_size=2, "
           f"lr=0.01, nprocs=2, runs_dir={str(runs)!r}, name='k')")
    msg_id, run_dir, pids = start_run_in_kernel(kc, runs, cfg)
    assert wait_for(lambda: (run_dir / "checkpoints" / "last.pt").exists(), timeout=120)
    km.interrupt_kernel()
    assert wait_reply(kc, msg_id) == "TrainingInterrupted"
    assert survivors(pids) == {}
    from nbddp.contract.checkpoint import load_checkpoint

    epoch = load_checkpoint(run_dir / "checkpoints" / "last.pt")["epoch"]
    reply, out = execute(kc, f"r2 = spawn_train({cfg}.replace(epochs={epoch + 2}, resume={str(run_dir)!r})); "
                             "print('epochs', [m['epoch'] for m in r2.value['metrics']])")
    assert reply["status"] == "ok", out
    assert f"epochs {list(range(epoch + 2))}" in out
