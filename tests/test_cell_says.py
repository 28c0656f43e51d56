"""What the cell says, round 2: every case as a user meets it, in one real Jupyter kernel (jupyter_client).

- A script that calls ``mp.spawn`` itself, whose processes raise: the cell reads like any other
  failure (the failed process named with what it raised, its traceback from the user's code on, no
  frame of nbddp's, the root error at most twice, at most 80 lines), a ``BaseException`` subclass too.
- ``handle.stop()`` says what Jupyter's Interrupt says: a short notice, no rank's traceback in the
  cell (the rank's log keeps it).
- An Interrupt while the ranks meet (one is late to the rendezvous): the ranks are ended at once
  (nothing of the user's ran yet) and the notice says they were meeting, not torch's internals.
- A failure's ranks table: a rank alive until the end has a recent heartbeat, whatever its progress;
  the root's place is the step it last reported, never "at" a step it may have finished.
"""

import os
import re
import time
from pathlib import Path

import pytest

from conftest import ROOT, WORKERS, execute, fault_env, free_port, real_kernel, wait_for

pytest.importorskip("jupyter_client")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

SPAWNS = """\
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Abort(BaseException):
    pass


def work(rank, world, port, mode):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    for step in range(4):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        print(f"process {rank} step {step}", flush=True)
        if step == 1:
            fail(rank, mode)


def fail(rank, mode):
    if mode == "abort" and rank == 1:
        raise Abort("abort-sp: the data is gone")
    if mode == "all":
        raise ValueError("boom-sp")


if __name__ == "__main__":
    mp.spawn(work, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""

LATE = """\
import os, time
import torch.distributed as dist

if int(os.environ["RANK"]) == 1:
    time.sleep(120)  # rank 1 is late: rank 0 waits for it in its own rendezvous (C++)
print("meeting", flush=True)
dist.init_process_group("gloo")
"""

CELL_WORKERS = """\
import pathlib, time

def loop(ctx, marks):
    pathlib.Path(marks, f"started{ctx.rank}").touch()
    step = 0
    while True:
        time.sleep(0.05)
        step += 1
        ctx.heartbeat(step=step)

def fail_in_the_fourth_step(ctx):
    for step in range(4):
        ctx.heartbeat(step=step)
        time.sleep(0.1)
    if ctx.rank == 1:
        time.sleep(4)  # the fourth step takes long, then fails; rank 0 stays alive meanwhile
        raise ValueError("fourth-step-boom")
    time.sleep(600)
"""


def _messages(kc, msg_id, timeout=240, every_cell=False):
    """What a cell showed: (stream text, ``(ename, evalue, rendered traceback)`` or None). ``every_cell``:
    stream text of any cell until this one ends (a background run's echo goes to the cell that launched it)."""
    texts, error = [], None
    deadline = time.time() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.time()))
        mine = msg["parent_header"].get("msg_id") == msg_id
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and (mine or every_cell):
            texts.append(content["text"])
        elif kind == "error" and mine:
            error = (content["ename"], content["evalue"], _ANSI.sub("", "\n".join(content["traceback"])))
        elif kind == "status" and mine and content["execution_state"] == "idle":
            return "".join(texts), error


def _cell(kc, code, **kw):
    return _messages(kc, kc.execute(code), **kw)


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """A warm kernel in a project folder holding the script, with the cell's workers defined."""
    project = tmp_path_factory.mktemp("project")
    (project / "spawns.py").write_text(SPAWNS)
    (project / "late.py").write_text(LATE)
    with real_kernel(project, env={**os.environ, "PYTHONPATH": str(ROOT)}) as (km, kc):
        reply, out = execute(kc, "import nbddp\n" + CELL_WORKERS)
        assert reply["status"] == "ok", out
        yield project, km, kc


def test_processes_a_script_started_fail_as_briefly_as_ranks(notebook):
    project, _, kc = notebook
    # Every process raises the same error (a bug in code they all run).
    stream, error = _cell(kc, f"nbddp.spawn_train('spawns.py', argv=['{free_port()}', 'all'], runs_dir='runs')")
    assert error is not None and error[0] == "WorkerError", (stream, error)
    _, message, shown = error
    cell = stream + shown
    assert re.match(r"Training failed: process [01] of 2 \(work\) raised ValueError: boom-sp$",
                    message.splitlines()[0]), message
    assert cell.count("ValueError: boom-sp") <= 2, cell
    assert len(cell.splitlines()) <= 80, cell
    assert str(ROOT / "nbddp") not in cell and "spawned.py" not in cell and "ProcessRaisedException" not in cell, cell
    assert "line 18, in work" in message and "line 25, in fail" in message, message  # the user's frames
    log = re.search(r"log: (\S+spawned[01]\.log)", message)[1]
    assert "ValueError: boom-sp" in (project / log if not Path(log).is_absolute() else Path(log)).read_text()

    # A BaseException subclass of the code's own: named with its message, not "exit code 1".
    stream, error = _cell(kc, f"nbddp.spawn_train('spawns.py', argv=['{free_port()}', 'abort'], runs_dir='runs')")
    assert error is not None and error[0] == "WorkerError", (stream, error)
    message = error[1]
    assert message.splitlines()[0] == ("Training failed: process 1 of 2 (work) raised Abort: abort-sp: the data is "
                                       "gone"), message
    assert "exit code 1" not in message and (stream + error[2]).count("Abort: abort-sp") <= 2, (stream, message)


def test_a_stop_says_what_an_interrupt_says_and_no_traceback(notebook, tmp_path):
    _, _, kc = notebook
    marks = tmp_path / "marks"
    marks.mkdir()
    reply, out = execute(kc, f"h = nbddp.spawn_train(loop, {str(marks)!r}, nprocs=1, runs_dir='runs', block=False, "
                             "grace_s=1)")
    assert reply["status"] == "ok", out
    assert wait_for(lambda: (marks / "started0").exists(), timeout=120)
    stream, error = _cell(kc, "h.stop()\ntry:\n    h.wait()\nexcept nbddp.TrainingInterrupted as e:\n"
                              "    print('outcome:', e)", every_cell=True)
    assert error is None, error
    assert "Traceback" not in stream and not re.search(r"^(\[rank0\] )?KeyboardInterrupt", stream, re.M), stream
    assert "stopping the worker of" in stream and "1 workers" not in stream, stream
    assert re.search(r"where they were: rank 0: Cell In\[\d+\], line \d+, loop", stream), stream
    reply, out = execute(kc, "print((h.run_dir / 'logs' / 'rank0.log').read_text())")
    assert "KeyboardInterrupt" in out, out  # the log keeps it


def test_an_interrupt_while_the_ranks_meet_ends_them_and_says_so(notebook):
    _, km, kc = notebook
    env = fault_env("entry:1:hang")  # rank 1 never gets past its start: rank 0 waits for it in the rendezvous
    msg_id = kc.execute(f"nbddp.spawn_train({str(WORKERS / 'interrupted.py') + ':return_at_once'!r}, 'marks', "
                        f"nprocs=2, runs_dir='runs', env={env!r}, grace_s=30)")
    project = notebook[0]
    runs = project / "runs"

    def starting():  # rank 0 beats, in nbddp's set-up: on its way to the rendezvous
        beats = list(runs.glob("*-interrupted-return_at_once/.nbddp/rank0.json"))
        return bool(beats) and all('"state": "starting"' in b.read_text() for b in beats)

    assert wait_for(starting, timeout=120)
    time.sleep(2)  # rank 0 in the rendezvous
    t0 = time.time()
    km.interrupt_kernel()
    stream, error = _messages(kc, msg_id)
    took = time.time() - t0
    assert error is not None and error[0] == "TrainingInterrupted", (stream, error)
    where = next(ln for ln in error[1].splitlines() if "where they were:" in ln)
    assert "rank 0: meeting the other ranks (rendezvous)" in where, error[1]
    assert "_create_gloo" not in where and "<string>" not in where and "distributed_c10d" not in where, where
    # Nothing of the user's ran: no grace to wait out (grace_s=30 would take a minute: SIGINT, then SIGTERM).
    assert took < 30, (took, error[1])

    # A script meeting in its own rendezvous: its heartbeat thread beats on, but the code never took the
    # KeyboardInterrupt (it waits in C++). It was waited for as "finishing" up to stop_timeout_s (300 s).
    msg_id = kc.execute("nbddp.spawn_train('late.py', nprocs=2, runs_dir='runs', echo=False)")
    assert wait_for(lambda: any("meeting" in p.read_text() for p in runs.glob("*-late/logs/rank0.log")), 120)
    time.sleep(1)
    t0 = time.time()
    km.interrupt_kernel()
    stream, error = _messages(kc, msg_id)
    took = time.time() - t0
    assert error is not None and error[0] == "TrainingInterrupted", (stream, error)
    assert "rank 0: meeting the other ranks (rendezvous) at late.py:7, <module>" in error[1], error[1]
    assert took < 30, (took, error[1])  # before: 303 s


def test_a_failure_table_tells_heartbeat_from_progress(notebook):
    _, _, kc = notebook
    stream, error = _cell(kc, "nbddp.spawn_train(fail_in_the_fourth_step, nprocs=2, runs_dir='runs', echo=False)")
    assert error is not None and error[0] == "WorkerError", (stream, error)
    message = error[1]
    assert "after it reported step 3 ·" in message, message  # the fourth step (0-based 3) failed, not "at step 3"
    row = next(ln for ln in message.splitlines() if re.match(r"\s+0\s", ln))
    # Rank 0 was alive (beating every second) until nbddp ended it; its progress stopped seconds before.
    assert re.search(r"heartbeat [01] s ago", row) and re.search(r"progress [4-9] s ago", row), message


def test_where_ranks_were_is_said_in_words_never_in_torchs_frames():
    """The "where they were" line of an Interrupt: a rank meeting the others, one still starting, and
    ranks whose stacks cannot be asked from the kernel (a SLURM job's) placed by their heartbeats."""
    import sysconfig

    from nbddp.contract.protocol import Heartbeat
    from nbddp.kernel.interrupt import where_line
    from nbddp.kernel.stacks import RankStack, Stacks, parse

    torch_c10d = os.path.join(sysconfig.get_paths()["purelib"], "torch", "distributed", "distributed_c10d.py")
    runtime = str(ROOT / "nbddp" / "rank" / "runtime.py")
    meeting = (f'Current thread 0x1 (most recent call first):\n'
               f'  File "{torch_c10d}", line 669 in _create_gloo_process_group\n'
               f'  File "{torch_c10d}", line 1800 in init_process_group\n'
               f'  File "{runtime}", line 631 in init_process_group\n  File "{runtime}", line 699 in run_rank\n'
               f'  File "{runtime}", line 671 in entry\n')
    forking = 'Current thread 0x1 (most recent call first):\n  File "<string>", line 1 in <module>\n'
    stacks = Stacks({0: RankStack(0, parse(meeting)), 1: RankStack(1, parse(forking))})
    assert where_line(stacks, 2) == "rank 0: meeting the other ranks (rendezvous) · rank 1: starting (its code had not begun)"
    beats = {0: Heartbeat(0, state="running", step=12), 1: Heartbeat(1, state="running", step=12),
             2: Heartbeat(2, state="starting")}
    assert where_line(None, 3, beats) == "ranks 0-1: last reported step 12 · rank 2: starting (its code had not begun)"
