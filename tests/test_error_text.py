"""What the cell says when a run fails or is interrupted: true, short, and said once.

Each case runs as a user runs it, in a real Jupyter kernel (jupyter_client), and counts what that
kernel sends: the stream output and the error's traceback as IPython renders it.

- A torchrun-style script trains 4 steps, then raises ``ValueError("boom-4")`` on both ranks: the
  error line comes once in the exception and at most once in the echoed output, the cell shows at
  most 80 lines and no frame of nbddp's or runpy's, says the rank printed before it failed (never
  "before its first step") and names the rank's whole log.
- A plain error of ``init_process_group`` on both ranks is that error: no forged-key paragraph,
  no rank that "did not answer", no rank "waiting" in the function that raised.
- An Interrupt of a function from a cell names it as IPython does (``Cell In[N], line L``), for
  every rank.
"""

import os
import re
import time
from pathlib import Path

import pytest

from conftest import ROOT, execute, real_kernel, wait_for

pytest.importorskip("jupyter_client")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

BOOM = """\
import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    evaluate()


def evaluate():
    raise ValueError("boom-4")


if __name__ == "__main__":
    main()
"""

INIT_ERROR = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo", device_id=torch.device("cpu"))
"""

CELL_WORKER = """\
import pathlib, time

def work(ctx, marks):
    pathlib.Path(marks, f"started{ctx.rank}").touch()
    while True: time.sleep(0.05)
"""


def _cell(kc, code, timeout=240):
    """Run ``code`` as a cell: (stream text, ``(ename, evalue, rendered traceback)`` or None)."""
    return _messages(kc, kc.execute(code), timeout)


def _messages(kc, msg_id, timeout=240):
    texts, error = [], None
    deadline = time.time() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.time()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            texts.append(content["text"])
        elif kind == "error":
            error = (content["ename"], content["evalue"], _ANSI.sub("", "\n".join(content["traceback"])))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(texts), error


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """A warm kernel in a project folder holding the scripts."""
    project = tmp_path_factory.mktemp("project")
    (project / "boom.py").write_text(BOOM)
    (project / "init_error.py").write_text(INIT_ERROR)
    with real_kernel(project, env={**os.environ, "PYTHONPATH": str(ROOT)}) as (km, kc):
        reply, out = execute(kc, "import nbddp")
        assert reply["status"] == "ok", out
        yield project, km, kc


def test_a_script_that_trained_then_raised_says_it_once_in_a_short_cell(notebook):
    project, _, kc = notebook
    stream, error = _cell(kc, "nbddp.spawn_train('boom.py', nprocs=2, runs_dir='runs')")
    assert error is not None and error[0] == "WorkerError", (stream, error)
    _, message, shown = error
    cell = stream + shown
    # The root error once in the exception, at most once more in the echoed output.
    assert message.count("ValueError: boom-4") == 1, message
    assert stream.count("ValueError: boom-4") <= 1, stream
    assert len(stream.splitlines()) + len(shown.splitlines()) <= 80, cell
    # Where the rank was, as far as it is known: it printed 4 steps, it reported none.
    assert "before its first step" not in cell, message
    assert "after its output began" in message.splitlines()[1], message
    # The line that launched, and the user's frames: none of nbddp's or of runpy's.
    assert "Cell In[" in shown and 'line 20, in evaluate' in message, shown
    assert "runpy" not in cell and str(ROOT / "nbddp") not in cell, cell
    # The rank's whole log, a path away.
    log = Path(re.search(r"log: (\S+rank0\.log)", message)[1])
    log = log if log.is_absolute() else project / log
    text = log.read_text()
    assert "rank 0 step 3 loss" in text and "ValueError: boom-4" in text, text


def test_a_plain_init_error_on_every_rank_is_that_error_and_no_other_story(notebook):
    _, _, kc = notebook
    stream, error = _cell(kc, "nbddp.spawn_train('init_error.py', nprocs=2, runs_dir='runs', echo=False)")
    assert error is not None and error[0] == "WorkerError", (stream, error)
    message = error[1]
    assert message.splitlines()[0].startswith("Training failed: rank 0 raised ValueError: init_process_group device_id"), \
        message
    assert message.count("must be an accelerator with an index") == 1, message
    # Explanations only for the causes they describe.
    assert "every local user can read and write" not in message and "not a lack of memory" not in message, message
    assert "did not answer" not in message, message
    assert "waiting in `_new_process_group_helper`" not in message, message
    assert "before its first step" not in message, message


def test_an_interrupt_names_a_cell_function_by_its_cell_for_every_rank(notebook, tmp_path):
    _, km, kc = notebook
    marks = tmp_path / "marks"
    marks.mkdir()
    reply, out = execute(kc, CELL_WORKER)
    assert reply["status"] == "ok", out
    cell_number = reply["execution_count"]
    msg_id = kc.execute(f"nbddp.spawn_train(work, {str(marks)!r}, nprocs=2, runs_dir='runs', grace_s=1)")
    assert wait_for(lambda: all((marks / f"started{r}").exists() for r in (0, 1)), timeout=120)
    km.interrupt_kernel()
    stream, error = _messages(kc, msg_id)
    assert error is not None and error[0] == "TrainingInterrupted", (stream, error)
    where = next((ln for ln in error[1].splitlines() if ln.strip().startswith("where they were:")), "")
    assert where.strip() == f"where they were: ranks 0-1: Cell In[{cell_number}], line 5, work", error[1]


def test_a_rank_whose_first_heartbeats_came_before_its_start_was_noted_answers(tmp_path, runs_dir):
    """A warm server starts a rank in milliseconds: its first heartbeats can come before the
    kernel notes the start's time (after every process is started). A heartbeat written by this
    start's own process is this start's, whatever its time, and the rank answers for its stack."""
    from nbddp import spawn_train

    (tmp_path / "looping.py").write_text(CELL_WORKER)
    marks = tmp_path / "marks"
    marks.mkdir()
    h = spawn_train(f"{tmp_path / 'looping.py'}:work", str(marks), nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False)
    try:
        assert wait_for(lambda: all((marks / f"started{r}").exists() for r in (0, 1)), timeout=120)
        h._ranks.started_at = time.time() + 3600  # every heartbeat so far predates the noted start
        assert sorted(h.stacks()) == [0, 1]
    finally:
        h.stop(timeout=60)
