"""Where is each rank: every rank's Python stack on a hang, a collective timeout, and on demand."""

import re
import types

import pytest

from nbddp import WorkerError, spawn_train
from nbddp.kernel.stacks import Frame, from_traceback, parse
from conftest import WORKERS, survivors, wait_for

STUCK = WORKERS / "stuck.py"


def test_a_hang_names_the_function_and_line_of_every_rank(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{STUCK}:one_rank_stuck", nprocs=2, runs_dir=runs_dir, stall_timeout_s=2, echo=False)
    err = info.value
    text = str(err)
    assert err.rank == 1 and err.kind == "hang", text
    line = next(ln for ln in text.splitlines() if ln.startswith("Where the ranks were: "))
    assert "rank 0 is in `one_rank_stuck` (stuck.py:24), waiting in `all_reduce`" in line, line
    assert re.search(r"rank 1 is in `load_batch` \(stuck.py:1[23]\)", line), line  # its loop: check or sleep
    # Every rank in one table: how it ended, its last heartbeat, where it was.
    table = text[text.index("--- every rank ---"):]
    assert "train, epoch 0, step 0, in a collective" in table and re.search(r"`load_batch` \(stuck.py:1[23]\)", table), table
    assert "--- rank 0: last 20 lines of rank0.log ---\nrank 0 at step 0" in text, text


def test_a_collective_that_times_out_shows_where_every_rank_was(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{STUCK}:one_rank_stuck", nprocs=2, runs_dir=runs_dir, timeout_s=5, stall_timeout_s=0,
                    echo=False)
    text = str(info.value)
    assert "without a Python exception" not in text, text
    assert re.search(r"rank 1 is in `load_batch` \(stuck.py:1[23]\)", text), text


def test_a_collective_timeout_in_a_worker_without_heartbeats_names_the_rank_it_waited_for(runs_dir):
    """Code people bring never calls ctx.heartbeat: the rank that timed out in ``all_reduce`` is
    not the cause, the rank it waited for is, and both say where they were."""
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{STUCK}:one_rank_stuck_quietly", nprocs=2, runs_dir=runs_dir, timeout_s=5,
                    stall_timeout_s=0, echo=False)
    err, text = info.value, str(info.value)
    assert err.rank == 1 and err.kind == "hang", text
    assert "without a Python exception" not in text and "before its first step" not in text, text
    headline = text.splitlines()[0]
    assert headline.startswith("Training failed: rank 1 stopped making progress"), headline
    assert "; rank 0 gave up waiting for it: RuntimeError: " in headline and "Timed out" in headline, headline
    line = next(ln for ln in text.splitlines() if ln.startswith("Where the ranks were: "))
    # rank 0 raised: its traceback says where it was; rank 1 answered the stack signal
    assert "rank 0 is in `one_rank_stuck_quietly` (stuck.py:33), waiting in `all_reduce`" in line, line
    assert re.search(r"rank 1 is in `load_batch` \(stuck.py:1[23]\)", line), line


def test_a_traceback_reads_as_a_stack():
    text = ('Traceback (most recent call last):\n'
            '  File "/x/nbddp/rank/runtime.py", line 581, in run_rank\n    value = call()\n'
            '  File "/home/me/train.py", line 33, in train\n    dist.all_reduce(t)\n'
            '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3913, in all_reduce\n'
            '    work.wait()\nRuntimeError: Timed out waiting 5000ms\n')
    stack = from_traceback(3, text)
    assert [f.function for f in stack.main] == ["all_reduce", "train", "run_rank"]
    assert stack.where() == "rank 3 is in `train` (train.py:33), waiting in `all_reduce`"
    assert from_traceback(0, "no traceback here").where() == "rank 0 did not answer"


def test_a_function_from_a_cell_is_placed_in_its_cell_as_ipython_names_it(monkeypatch):
    """A cell's code file is ``/tmp/ipykernel_<pid>/<hash>.py``: the kernel says which cell it was,
    through the compiler IPython runs cells with (the shell itself is left out: it keeps history)."""
    IPython = pytest.importorskip("IPython")
    from IPython.core.compilerop import CachingCompiler

    compiler = CachingCompiler()
    cell = "def train(ctx):\n    return ctx\n"
    path = compiler.cache(cell, number=5)
    ns = {}
    exec(compile(cell, path, "exec"), ns)
    frame = Frame(ns["train"].__code__.co_filename, 2, "train")
    assert frame.short() == f"`train` ({path.rsplit('/', 1)[-1]}:2)"  # outside a kernel: the file
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(compile=compiler))
    assert frame.short() == "`train` (Cell In[5], line 2)" and not frame.in_library
    assert Frame(__file__, 7, "f").short() == "`f` (test_stacks.py:7)"  # a file stays a file


def test_stacks_on_demand_from_a_background_run(tmp_path, runs_dir):
    go = tmp_path / "go"
    h = spawn_train(f"{STUCK}:one_rank_stuck", str(go), nprocs=2, runs_dir=runs_dir, block=False, echo=False)
    try:
        assert wait_for(lambda: h.progress is not None and all(
            (h.run_dir / ".nbddp" / f"rank{r}.json").exists() for r in (0, 1)), 60)
        seen = []

        def stuck_as_expected():  # the ranks may still be joining the group when first asked
            seen.append(h.stacks())
            s = seen[-1]
            return len(s) == 2 and getattr(s[1].code_frame, "function", None) == "load_batch" and \
                s[0].waiting_in == "all_reduce"

        assert wait_for(stuck_as_expected, 30), str(seen[-1])
        s = seen[-1]
        assert "rank 1 is in `load_batch`" in repr(s) and "rank 0:" in str(s)
        assert (h.run_dir / "logs" / "rank1.stacks.log").read_text().count("load_batch") >= 1
    finally:
        go.write_text("go")
        assert h.wait(timeout=60).value == 2.0
    assert survivors(h.pids) == {}


def test_parse_reads_faulthandler_dumps():
    import threading

    text = ('Thread 0x00007f0000000001 (most recent call first):\n'
            f'  File "{threading.__file__}", line 331 in wait\n'
            '\n'
            'Current thread 0x00007f0000000002 (most recent call first):\n'
            '  File "/home/u/w.py", line 42 in load_batch\n'
            '  File "/home/u/w.py", line 50 in train\n')
    threads = parse(text)
    assert [[f.function for f in t] for t in threads] == [["wait"], ["load_batch", "train"]]
    assert threads[1][0].line == 42 and not threads[1][0].in_library and threads[0][0].in_library


def test_the_flight_recorder_dump_is_summarised_and_never_builds_objects(tmp_path):
    import os
    import pickle

    from nbddp.contract import rundir
    from nbddp.kernel.report import build_worker_error
    from nbddp.kernel.stacks import FLIGHT_RECORDER_PREFIX, flight_recorder_env, last_collectives

    run = tmp_path / "run"
    rundir.prepare_launch(run, 2)
    env = flight_recorder_env(run)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_FR_DUMP_TEMP_FILE"].startswith(
        str(rundir.state_dir(run).absolute()))
    dump = {"version": "2.4", "entries": [
        {"profiling_name": "nccl:broadcast", "collective_seq_id": 11, "state": "completed"},
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 12, "state": "started"}]}
    (rundir.state_dir(run) / f"{FLIGHT_RECORDER_PREFIX}0").write_bytes(pickle.dumps(dump))

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    (rundir.state_dir(run) / f"{FLIGHT_RECORDER_PREFIX}1").write_bytes(pickle.dumps({"entries": [Payload()]}))
    assert last_collectives(run, 2) == {0: "all_reduce #12 (started)"}
    assert not (tmp_path / "ran").exists()
    text = str(build_worker_error(run, {}, 2))
    assert "NCCL's flight recorder, each rank's last collective: rank 0: all_reduce #12 (started)" in text, text
