"""``%%ranks`` in a real Jupyter kernel, driven with jupyter_client: one kernel and one group for the module,
used cell after cell as a person uses it (errors, Interrupts, a killed rank, a stuck collective, restarts)."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import ROOT, execute, fault_env, kernel_pid, real_kernel, survivors, wait_for

jupyter_client = pytest.importorskip("jupyter_client")


def run_interrupted(km, kc, code: str, ready: str, count: int, timeout: float = 60.0):
    """Run ``code``; once ``ready`` was printed ``count`` times, Interrupt it. (ename, evalue, output, seconds)."""
    msg_id = kc.execute(code)
    out, ename, evalue, sent = [], None, "", None
    deadline = time.time() + timeout
    while time.time() < deadline:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.time()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
            if sent is None and "".join(out).count(ready) >= count:
                sent = time.time()
                km.interrupt_kernel()
        elif kind == "error":
            ename, evalue = content["ename"], content["evalue"]
            out.append("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while True:
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    return ename, evalue, "".join(out), (time.time() - sent) if sent else None


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A kernel with ``%load_ext nbddp`` and a group of 2 CPU ranks as ``r``."""
    cwd = tmp_path_factory.mktemp("ranks")
    with real_kernel(cwd) as (km, kc):
        reply, out = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                                 "import nbddp\n%load_ext nbddp\n"
                                 "r = nbddp.start_ranks(nprocs=2, runs_dir='runs')\nprint(r.run_dir)")
        assert reply["status"] == "ok", out
        yield km, kc, cwd / out.strip().splitlines()[-1]


def ok(kc, code: str) -> str:
    reply, out = execute(kc, code)
    assert reply["status"] == "ok", out
    return out


def test_cells_keep_state_show_each_ranks_output_and_last_value(group):
    km, kc, run_dir = group
    out = ok(kc, "%%ranks\nx = torch.full((2,), float(rank))\nprint('world', world_size, device)")
    assert "[rank0] world 2 cpu" in out and "[rank1] world 2 cpu" in out
    out = ok(kc, "%%ranks\ny = x.clone()\ndist.all_reduce(y)\ny.sum().item()")
    assert "[rank0] 2.0" in out and "[rank1] 2.0" in out  # the last expression's repr, per rank
    out = ok(kc, "%%ranks 1\nprint('only', rank)")
    assert "[rank1] only 1" in out and "[rank0]" not in out
    # The run folder keeps every cell and its output, per rank.
    log = (run_dir / "logs" / "rank1.log").read_text()
    assert "print('only', rank)" in log and "only 1" in log


def test_one_ranks_bar_is_drawn_in_place_and_every_ranks_lines_arrive(group):
    km, kc, _ = group
    out = ok(kc, "%%ranks\nimport time\nfor i in range(4):\n    print(f'step {i}', end='\\r', flush=True)\n"
                 "    time.sleep(0.3)\nprint('end', rank)")
    assert "[rank0] end 0" in out and "[rank1] end 1" in out
    drawn = set(re.findall(r"\r\[rank(\d)\] step", out))
    assert len(drawn) <= 1, out  # two bars would overwrite each other's line


def test_pull_and_push(group):
    km, kc, _ = group
    out = ok(kc, "vals = r.pull('x'); print([v.tolist() for v in vals], vals[1].device)")
    assert "[[0.0, 0.0], [1.0, 1.0]] cpu" in out
    ok(kc, "import torch; r.push(z=41, ranks=[1]); r.push(w=torch.ones(1))")
    out = ok(kc, "%%ranks\nprint('z', globals().get('z'), w.item())")
    assert "[rank0] z None 1.0" in out and "[rank1] z 41 1.0" in out
    reply, out = execute(kc, "r.pull('nothing_here')")
    assert reply["ename"] == "NbddpError" and "not defined on rank 0" in reply["evalue"]
    assert "traceback" not in reply["evalue"]


def test_bad_input_is_refused_in_the_kernel_before_any_rank_runs(group):
    km, kc, _ = group
    reply, out = execute(kc, "%%ranks\nprint('never')\nx = (")
    assert reply["ename"] == "SyntaxError" and "[rank" not in out
    reply, out = execute(kc, "%%ranks 5\n1")
    assert reply["ename"] == "ConfigError" and "ranks 0 to 1" in reply["evalue"]
    reply, out = execute(kc, "%%ranks --group other\n1")
    assert reply["ename"] == "NbddpError" and "no group named 'other'" in reply["evalue"]
    reply, out = execute(kc, "import threading; r.push(lock=threading.Lock())")
    assert reply["ename"] == "ConfigError" and "push(lock)" in reply["evalue"]


def test_the_magic_line():
    from nbddp.contract.errors import ConfigError
    from nbddp.kernel.interactive.magics import parse_line

    assert parse_line("") == (None, None)
    assert parse_line("1") == ([1], None)
    assert parse_line("0,2 --group big") == ([0, 2], "big")
    assert parse_line("--group=big all") == (None, "big")
    with pytest.raises(ConfigError, match="not understood"):
        parse_line("rank1")


def test_an_error_on_one_rank_is_shown_once_and_the_group_stays(group):
    km, kc, _ = group
    reply, out = execute(kc, "%%ranks\nprint('before', rank)\nif rank == 1:\n    raise ValueError('boom')\n"
                             "print('after', rank)")
    assert reply["status"] == "error" and reply["ename"] == "RankCellError", out
    assert "rank 1 raised ValueError: boom" in reply["evalue"]
    assert "[rank0] after 0" in out and "[rank1] before 1" in out
    assert out.count("Traceback (most recent call last)") == 1
    assert "[rank1]     raise ValueError('boom')" in out
    assert "nbddp/rank" not in out and "nbddp/kernel" not in out  # nbddp's frames left out
    assert "[rank1] 2.0" in ok(kc, "%%ranks 1\nx.sum().item()")  # state kept


@pytest.mark.parametrize("body", ["while True:\n    pass", "time.sleep(60)"], ids=["busy", "sleep"])
def test_interrupt_raises_keyboardinterrupt_in_every_rank_and_keeps_the_group(group, body):
    km, kc, _ = group
    ename, evalue, out, took = run_interrupted(
        km, kc, f"%%ranks\nimport time\nprint('spinning', flush=True)\n{body}", "spinning", 2)
    assert ename == "RanksInterrupted", out
    assert "KeyboardInterrupt" in out and "ranks 0, 1" in evalue and "kept" in evalue
    assert took < 10
    out = ok(kc, "print(issubclass(nbddp.kernel.interactive.members.RanksInterrupted, KeyboardInterrupt))\n"
                 "r.pull('x')[1].tolist()")
    assert "True" in out
    assert "[rank0] 0.0" in ok(kc, "%%ranks\nx.sum().item()")


def test_a_collective_only_one_rank_joined_is_named_then_restart(group):
    km, kc, _ = group
    ename, evalue, out, took = run_interrupted(
        km, kc, "%%ranks 0\nprint('alone', flush=True)\ndist.all_reduce(torch.ones(1))", "alone", 1)
    assert ename == "RanksInterrupted", out
    assert "rank 0 is in" in evalue and "waiting in `all_reduce`" in evalue and "r.restart()" in evalue, evalue
    assert took < 15
    reply, out = execute(kc, "%%ranks\n1")
    assert reply["status"] == "error" and "r.restart()" in reply["evalue"]
    old = json.loads(ok(kc, "import json; print(json.dumps(r.pids))").strip())
    out = ok(kc, "r.restart()\n")
    assert "variables are gone" in out
    assert wait_for(lambda: not survivors(old), timeout=10)
    out = ok(kc, "%%ranks\nprint('x' in globals(), rank)\nt = torch.ones(1); dist.all_reduce(t); t.item()")
    assert "[rank0] False 0" in out and "[rank1] 2.0" in out


def test_a_killed_rank_is_named_and_restart_brings_the_group_back(group):
    km, kc, _ = group
    reply, out = execute(kc, "%%ranks 1\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert reply["status"] == "error" and reply["ename"] == "WorkerError", out
    assert "rank 1 ended (killed by SIGKILL" in reply["evalue"] and "r.restart()" in reply["evalue"]
    reply, out = execute(kc, "%%ranks\n1")
    assert reply["status"] == "error" and "rank 1 has ended" in reply["evalue"]
    assert "[rank0] 7" in ok(kc, "%%ranks 0\n7")  # the living rank still answers
    ok(kc, "r.restart()")
    assert "[rank1] 1" in ok(kc, "%%ranks\nrank")


def test_a_rank_that_fails_to_start_is_named_and_nothing_is_left(group):
    km, kc, _ = group
    out = ok(kc, "import json\n"
                 "try:\n"
                 f"    nbddp.start_ranks(nprocs=2, name='bad', runs_dir='runs', env={fault_env('start:1:raise')!r})\n"
                 "except nbddp.WorkerError as exc:\n"
                 "    print(json.dumps([str(exc), str(exc.run_dir)]))")
    message, run_dir = json.loads(out.strip().splitlines()[0])
    assert "rank 1 raised RuntimeError: injected fault on rank 1" in message
    assert "[rank0] the first group is still up" in ok(kc, "%%ranks\nprint('the first group is still up')")
    record = json.loads((Path(run_dir) / ".nbddp" / "launch.json").read_text())
    assert wait_for(lambda: not survivors(record["pids"]), timeout=10), survivors(record["pids"])
    assert not os.path.exists(record["tmp_dir"])  # the private folder, its channel socket in it, removed


def test_stop_leaves_nothing_and_spawn_train_works_beside_a_group(group):
    km, kc, run_dir = group
    out = ok(kc, "import json\n"
                 f"res = nbddp.spawn_train({str(ROOT / 'tests' / 'workers' / 'faulty.py') + ':info'!r}, nprocs=2, "
                 "runs_dir='runs')\nprint('world', res.value['world_size'])\n"
                 "print(json.dumps(r.pids))")
    assert "world 2" in out
    pids = json.loads(out.strip().splitlines()[-1])
    ok(kc, "r.stop(); r.stop()")
    assert survivors(pids) == {}
    reply, out = execute(kc, "%%ranks\n1")
    assert reply["status"] == "error" and "start one with" in reply["evalue"]
    ok(kc, "r = nbddp.start_ranks(nprocs=2, runs_dir='runs')")  # the module's later tests get a group


def test_a_kernel_restart_ends_the_group(group):
    km, kc, _ = group  # the module's last use of its kernel
    pids = json.loads(ok(kc, "import json; print(json.dumps(r.pids))").strip().splitlines()[-1])
    assert all(survivors([p]) for p in pids)
    km.restart_kernel(now=False)  # Jupyter's Restart: a shutdown request, then a new kernel
    assert wait_for(lambda: not survivors(pids), timeout=10), survivors(pids)


def test_a_killed_kernel_leaves_no_rank(tmp_path):
    with real_kernel(tmp_path) as (km, kc):
        reply, out = execute(kc, f"import sys, json; sys.path.insert(0, {str(ROOT)!r})\nimport nbddp\n"
                                 "r = nbddp.start_ranks(nprocs=2, runs_dir='runs')\nprint(json.dumps(r.pids))")
        assert reply["status"] == "ok", out
        pids = json.loads(out.strip().splitlines()[-1])
        assert all(survivors([p]) for p in pids)
        os.kill(kernel_pid(km), signal.SIGKILL)
        assert wait_for(lambda: not survivors(pids), timeout=10), survivors(pids)

