"""A rank's pdb prompt answered in the notebook, through a real kernel's stdin channel.

The kernel is driven with jupyter_client as JupyterLab drives it: the cell's ``input()`` becomes an
``input_request`` on the stdin channel, answered with ``kc.input``; Interrupt is
``km.interrupt_kernel()``; nbmake's cells run with ``allow_stdin=False``.
"""

import json
import queue
import time

import pytest

from conftest import ROOT, WORKERS, execute, real_kernel, survivors

jupyter_client = pytest.importorskip("jupyter_client")

HELD = str(WORKERS / "debugging.py") + ":held"
PLAIN = str(WORKERS / "debugging.py") + ":plain_breakpoint"
#: held()'s value on rank 0, with or without the breakpoint: (1+2) + (2+3) + (3+4).
HELD_VALUE = 15.0


@pytest.fixture(scope="module")
def debug_kernel(tmp_path_factory):
    """One real kernel for every test here: each leaves it usable, as a user's kernel is used cell after cell."""
    with real_kernel(tmp_path_factory.mktemp("kernel")) as (km, kc):
        reply, out = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r}); from nbddp import spawn_train")
        assert reply["status"] == "ok", out
        yield km, kc


def run_cell(kc, code, answer, allow_stdin=True, timeout=120.0):
    """Run ``code`` as a cell; ``answer(prompt, output so far)`` answers each input request (None: no answer).

    Returns:
        (reply content, everything the cell printed, the prompts it asked, the error's name or None).
    """
    msg_id = kc.execute(code, allow_stdin=allow_stdin)
    out, prompts, ename = [], [], None
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            msg = kc.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            msg = None
        if msg is not None and msg["msg_type"] == "input_request":
            prompts.append(msg["content"]["prompt"])
            line = answer(msg["content"]["prompt"], "".join(out))
            if line is not None:
                kc.input(line)
        idle = False
        while True:
            try:
                msg = kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                ename = content["ename"]
                out.append("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        if idle:
            break
    else:
        raise TimeoutError(f"the cell did not finish within {timeout}s; output so far: {''.join(out)}")
    while True:
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], "".join(out), prompts, ename


def test_prompt_of_the_chosen_rank_every_command_and_continue_after_the_collective_timeout(debug_kernel, tmp_path):
    km, kc = debug_kernel
    runs = tmp_path / "runs"
    commands = iter(["p secret", "w", "l", "n", "p total", "HOLD", "c"])

    def answer(prompt, out):
        command = next(commands)
        if command == "HOLD":  # the person reads the code longer than any collective may wait
            time.sleep(7.0)
            return "p 'held', step"
        return command

    reply, out, prompts, ename = run_cell(
        kc, f"r = spawn_train({HELD!r}, nprocs=2, runs_dir={str(runs)!r}, timeout_s=5, all_values=True)\n"
            "print('values', r.values)", answer)
    assert reply["status"] == "ok", out
    assert prompts == ["(Pdb) [rank 1] "] * 7, prompts
    assert "debugging.py(17)held()" in out, "where the rank stopped, and w's innermost frame"
    assert "\n107\n" in out, "p secret printed rank 1's local variable"
    assert "ctx.breakpoint(rank=1)" in out, "l listed the source around the line"
    assert "tensor([3.])" in out, "n ran the line, p total printed the new value"
    assert "('held', 0)" in out
    assert f"values [{HELD_VALUE}, {HELD_VALUE}]" in out
    assert "timed out" not in out.lower() and "no rank has made progress" not in out


def test_headless_breakpoint_is_skipped_with_a_line(debug_kernel, tmp_path):
    km, kc = debug_kernel
    runs = tmp_path / "runs"
    reply, out, prompts, ename = run_cell(
        kc, f"r = spawn_train({HELD!r}, nprocs=2, runs_dir={str(runs)!r}, timeout_s=5)\nprint('value', r.value)",
        answer=lambda prompt, out: pytest.fail("a headless cell was asked for input"), allow_stdin=False)
    assert reply["status"] == "ok", out
    assert prompts == []
    assert "rank 1 reached a breakpoint (debugging.py:" in out and "skipped" in out
    assert f"value {HELD_VALUE}" in out


def test_interrupt_at_the_prompt_ends_every_rank_and_the_kernel_stays_usable(debug_kernel, tmp_path):
    km, kc = debug_kernel
    runs = tmp_path / "runs"

    def answer(prompt, out):
        km.interrupt_kernel()  # Interrupt while the input box is open
        return None

    # breakpoint() in an mp.spawn function, on rank 1 only: debug=True relays it.
    reply, out, prompts, ename = run_cell(
        kc, f"spawn_train({PLAIN!r}, nprocs=2, runs_dir={str(runs)!r}, call='mp.spawn', debug=True, grace_s=1)",
        answer)
    assert prompts == ["(Pdb) [rank 1] "], out
    assert ename == "TrainingInterrupted", out
    launch = json.loads(next(runs.glob("*/.nbddp/launch.json")).read_text())
    assert survivors(launch["pids"]) == {}, "no live or zombie rank"
    reply, out = execute(kc, "print('still here', 1 + 1)")
    assert reply["status"] == "ok" and "still here 2" in out


CELL = """
import torch, torch.distributed as dist

def cell_held(ctx):
    total = torch.zeros(1)
    dist.all_reduce(total)
    secret = ctx.rank * 100 + 7
    ctx.breakpoint(rank=1)
    return secret  # the line rank 1 stops at
"""


def test_a_background_run_says_where_a_rank_waits_and_q_in_handle_debug_ends_it(debug_kernel, tmp_path):
    """A function from a cell: pdb lists the cell's lines in the rank, where no cell is a file."""
    km, kc = debug_kernel
    runs = tmp_path / "runs"
    reply, out = execute(kc, CELL)
    assert reply["status"] == "ok", out
    reply, out = execute(kc, f"import time\nh = spawn_train(cell_held, nprocs=2, runs_dir={str(runs)!r}, block=False)\n"
                             "while h.at_breakpoint is None and h.running: time.sleep(0.1)\nprint(h.at_breakpoint)")
    assert reply["status"] == "ok", out
    assert "rank 1 is waiting at a breakpoint (" in out and ".py:8)" in out, out  # IPython drops the cell's first blank line
    commands = iter(["p secret", "l", "q"])
    reply, out, prompts, ename = run_cell(kc, "h.debug()", lambda prompt, out: next(commands))
    assert prompts == ["(Pdb) [rank 1] "] * 3 and "107" in out
    assert "->\t    return secret  # the line rank 1 stops at" in out, out
    assert ename == "TrainingInterrupted", out
    launch = json.loads(next(runs.glob("*/.nbddp/launch.json")).read_text())
    assert survivors(launch["pids"]) == {}, "no live or zombie rank"


def test_a_bad_debug_value_is_refused_before_anything_starts(tmp_path):
    from nbddp import spawn_train
    from nbddp.contract.errors import ConfigError

    with pytest.raises(ConfigError, match=r"debug='yes': use True .* False, or 'always'"):
        spawn_train(HELD, nprocs=2, runs_dir=str(tmp_path), debug="yes")
    assert not (tmp_path).exists() or not any(tmp_path.iterdir())
