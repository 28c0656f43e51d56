"""Jupyter's Interrupt at any moment of a launch, in real kernels (jupyter_client), as users press it.

The first launch of a fresh kernel is interrupted at a few moments (nbddp loading torch, the
warm server starting, the ranks starting, the ranks running): the cell ends with
``TrainingInterrupted`` and a short notice, never a bare ``KeyboardInterrupt`` nor a helper
process's traceback; afterwards the kernel has no zombie child and no worker, and its warm
server (if any) is alive and was not hit. In a warm kernel: a ``fn(ctx)`` loop that never asks
``ctx.should_stop()`` is stopped as Python stops plain code (its ``finally:`` runs), and a run
that ends just as the Interrupt arrives keeps its result.
"""

import json
import os
import re
import sys

import pytest

from conftest import ROOT, WORKERS, children_of, execute, kernel_pid, proc_state, real_kernel, wait_for

jupyter_client = pytest.importorskip("jupyter_client")

TARGET = f"{WORKERS / 'interrupted.py'}"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _cell_messages(kc, msg_id, timeout=60):
    """Everything a cell showed: its stream text and, if it failed, ``(ename, evalue, traceback)``."""
    texts, error = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            texts.append(content["text"])
        elif kind == "error":
            error = (content["ename"], content["evalue"], _ANSI.sub("", "\n".join(content["traceback"])))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(texts), error


def _kernel_children(km):
    """The kernel's children: ``{pid: (state, command line)}`` (zombies included)."""
    out = {}
    for pid in children_of(kernel_pid(km)):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            cmd = ""
        out[pid] = (proc_state(pid), cmd)
    return out


def _only_helpers_left(km):
    """No zombie child and no worker: only multiprocessing's resource tracker and nbddp's warm server, alive."""
    kids = _kernel_children(km)
    return all(state not in (None, "Z") and ("resource_tracker" in cmd or "forkserver" in cmd)
               for state, cmd in kids.values()), kids


@pytest.fixture
def fresh_kernel(tmp_path):
    """A fresh kernel per case: its first launch is the one interrupted."""
    with real_kernel(tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}) as pair:
        yield pair


@pytest.mark.parametrize("delay", [0.3, 1.5, 4.0])
def test_an_interrupt_of_a_fresh_kernels_first_launch_ends_it_with_training_interrupted(fresh_kernel, tmp_path, delay):
    km, kc = fresh_kernel
    marks, runs = tmp_path / "marks", tmp_path / "runs"
    msg_id = kc.execute(f"import nbddp; r = nbddp.spawn_train({TARGET + ':loop_without_checking'!r}, {str(marks)!r}, "
                        f"nprocs=2, runs_dir={str(runs)!r}, grace_s=1)")
    import time

    time.sleep(delay)
    km.interrupt_kernel()  # SIGINT to the kernel's whole process group, as JupyterLab's button
    stream, error = _cell_messages(kc, msg_id)
    assert error is not None and error[0] == "TrainingInterrupted", (stream, error)
    assert "Traceback" not in stream + error[2], (stream, error)  # no helper's traceback, no bare KeyboardInterrupt
    assert not re.search(r"^KeyboardInterrupt", stream + error[2], re.M), (stream, error)
    assert len(stream.splitlines()) + len(error[2].splitlines()) <= 15, (stream, error[2])  # all the cell shows
    assert wait_for(lambda: _only_helpers_left(km)[0], timeout=10), _only_helpers_left(km)[1]
    server = [pid for pid, (_, cmd) in _kernel_children(km).items() if "forkserver" in cmd]
    # The server never took the Interrupt: the next launch uses it and works.
    reply, out = execute(kc, f"r = nbddp.spawn_train({TARGET + ':return_at_once'!r}, {str(marks)!r}, nprocs=2, "
                             f"runs_dir={str(runs)!r}, echo=False); print(r.value['answer'])")
    assert reply["status"] == "ok" and "42" in out, out
    assert all(proc_state(pid) not in (None, "Z") for pid in server), "the warm server was not restarted"


@pytest.fixture(scope="module")
def warm_kernel(tmp_path_factory):
    with real_kernel(tmp_path_factory.mktemp("kernel"), env={**os.environ, "PYTHONPATH": str(ROOT)}) as (km, kc):
        reply, out = execute(kc, "import sys, nbddp; from nbddp import spawn_train")
        assert reply["status"] == "ok", out
        yield km, kc


def test_a_ctx_loop_that_never_checks_should_stop_runs_its_finally_and_the_notice_is_short(warm_kernel, tmp_path):
    km, kc = warm_kernel
    marks, runs = tmp_path / "marks", tmp_path / "runs"
    msg_id = kc.execute(f"spawn_train({TARGET + ':loop_without_checking'!r}, {str(marks)!r}, nprocs=2, "
                        f"runs_dir={str(runs)!r}, grace_s=1)")
    assert wait_for(lambda: all((marks / f"started{r}").exists() for r in (0, 1)), timeout=90)
    assert wait_for(lambda: len(list(runs.glob("*/.nbddp/rank*.json"))) == 2, timeout=30)
    km.interrupt_kernel()
    stream, error = _cell_messages(kc, msg_id)
    assert error is not None and error[0] == "TrainingInterrupted", (stream, error)
    # Plain code stopped as Python stops it: a KeyboardInterrupt between statements, finally: ran.
    assert all((marks / f"finally{r}").read_text() == "ran" for r in (0, 1))
    assert "ranks 0-1: KeyboardInterrupt at the interrupt" in error[1], error[1]
    assert re.search(r"where they were: ranks 0-1: interrupted\.py:\d+, loop_without_checking$", error[1], re.M), error[1]
    assert "logs:" in error[1] and "they finish their step and checkpoint" not in stream, stream
    # A short notice: the ranks' tracebacks stay in their logs.
    assert "Traceback" not in stream + error[2], (stream, error[2])
    assert len(stream.splitlines()) + len(error[2].splitlines()) <= 15, (stream, error[2])  # all the cell shows
    run = next(runs.iterdir())
    assert "KeyboardInterrupt" in (run / "logs" / "rank0.log").read_text()
    assert wait_for(lambda: _only_helpers_left(km)[0], timeout=10), _only_helpers_left(km)[1]


def test_a_run_that_ends_just_as_the_interrupt_arrives_keeps_its_result(warm_kernel, tmp_path):
    km, kc = warm_kernel
    marks, runs = tmp_path / "marks", tmp_path / "runs"
    msg_id = kc.execute(f"r = spawn_train({TARGET + ':return_at_once'!r}, {str(marks)!r}, nprocs=2, "
                        f"runs_dir={str(runs)!r}, grace_s=1)")
    assert wait_for(lambda: all((marks / f"returning{r}").exists() for r in (0, 1)), timeout=90, interval=0.01)
    km.interrupt_kernel()
    stream, error = _cell_messages(kc, msg_id)
    if error is not None:  # the Interrupt reached the cell: it stops, the result is kept
        assert error[0] == "TrainingInterrupted", (stream, error)
        assert "the Interrupt came after the end" in error[1] and "sys.last_value.result" in error[1], error[1]
        reply, out = execute(kc, "r = sys.last_value.result")
        assert reply["status"] == "ok", out
    # else the cell had returned before the Interrupt came (an idle kernel ignores it)
    reply, out = execute(kc, "print(r.value)")
    assert reply["status"] == "ok" and "'answer': 42" in out, out


def test_an_interrupt_never_breaks_a_checkpoint_being_written(warm_kernel, tmp_path):
    """A fn(ctx) loop under FSDP saving every step (a write takes most of the step) and never checking
    ctx.should_stop(): the Interrupt's KeyboardInterrupt waits until the write is whole. No
    CheckpointException, no temporary folder, the notice says what happens, the newest checkpoint resumes."""
    km, kc = warm_kernel
    marks, runs = tmp_path / "marks", tmp_path / "runs"
    marks.mkdir()
    target = f"{WORKERS / 'saving.py'}:save_every_step"
    msg_id = kc.execute(f"spawn_train({target!r}, {str(marks)!r}, nprocs=2, strategy='fsdp', runs_dir={str(runs)!r}, "
                        "grace_s=1)")
    assert wait_for(lambda: all((marks / f"saved{r}").exists() for r in (0, 1)), timeout=120)
    import time

    time.sleep(2)
    km.interrupt_kernel()
    stream, error = _cell_messages(kc, msg_id, timeout=120)
    assert error is not None and error[0] == "TrainingInterrupted", (stream, error)
    assert "they finish their step and checkpoint" not in stream, stream  # the worker never checks should_stop
    assert "once a checkpoint being written is whole" in stream, stream
    # Each rank ended by its KeyboardInterrupt, after the write: none was cut by SIGTERM (or SIGKILL).
    assert "KeyboardInterrupt" in error[1] and not re.search("SIGTERM|SIGKILL|CheckpointException", error[1]), error[1]
    run = next(runs.iterdir())
    logs = "".join((run / "logs" / f"rank{r}.log").read_text() for r in (0, 1))
    assert "CheckpointException" not in logs and "CheckpointException" not in stream + error[2], logs[-3000:]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["last.dcp"]  # no temporary folder left
    saved = int((marks / "saved0").read_text())
    reply, out = execute(kc, f"r = spawn_train({target!r}, {str(marks)!r}, nprocs=2, strategy='fsdp', "
                             f"runs_dir={str(runs)!r}, resume={str(run)!r}, echo=False); print(r.value)")
    assert reply["status"] == "ok", out
    resumed = int(re.search(r"'resumed_from': (\d+)", out).group(1))
    assert resumed >= saved, (resumed, saved)  # the newest whole checkpoint, never an older one
