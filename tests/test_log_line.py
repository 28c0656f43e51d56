"""A worker that only calls ``ctx.log`` is seen in the cell while it runs: one line of its values
under rank 0's output, rewritten in place a few times a second (a notebook, a terminal), a plain
line now and then in a log file; ``echo=False`` shows nothing."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
from datetime import timedelta

from conftest import WORKERS, launcher_env
from nbddp.kernel.logline import LoggedValues
from nbddp.kernel.output import LINE, UPDATE, CellEcho

WORKER = f"{WORKERS / 'logging_only.py'}:train"
STATUS = re.compile(r"\r\[rank0\] (ctx\.log: [^\r\n]*)")


class Clock:
    """A clock the test moves: the echo's pace follows it, not the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def rendered(text: str) -> list:
    """The lines a notebook shows for ``text``: on each line, what the last ``\\r`` began (as JupyterLab does)."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def terminal(text: str) -> list:
    """The lines a terminal (and Jupyter's older front ends) shows for ``text``: ``\\r`` goes back to
    the line's start, and what follows covers only as many characters as it has."""
    lines, line, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    return [shown for shown in lines + ["".join(line).rstrip()] if shown]


def logging_run(echo: CellEcho, clock: Clock, records: int, every_s: float, line_at: int = -1) -> None:
    """``records`` ctx.log records, a poll after each one ``every_s`` apart; the rank prints one line at ``line_at``."""
    values = LoggedValues()
    for step in range(records):
        values.add({"time": 1.0, "step": step, "loss": 1 / (step + 1)})
        if step == line_at:
            echo.show(LINE, f"at step {step}")
        echo.status(values.text)
        echo.flush()
        clock.now += every_s
    echo.close()


def test_the_line_is_rewritten_in_place_at_most_four_times_a_second_under_the_rank_s_lines():
    out, clock = io.StringIO(), Clock()
    logging_run(CellEcho("[rank0] ", out=out, clock=clock, in_place=True), clock, records=1000, every_s=0.002,
                line_at=500)
    text = out.getvalue()
    states = [s.rstrip() for s in STATUS.findall(text)]
    changes = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
    assert len(changes) <= 1 + 2.0 / 0.25  # 2 s of the echo's clock: one change at most every 0.25 s
    assert changes[0] == "ctx.log: step 0 · loss 1" and changes[-1] == "ctx.log: step 999 · loss 0.001"
    # The rank's line stands on its own line above the values, which end the output.
    assert rendered(text) == terminal(text) == ["[rank0] at step 500", "[rank0] ctx.log: step 999 · loss 0.001"]


def test_the_rank_s_own_bar_is_the_line_shown_while_it_draws_and_the_values_come_back_after():
    out, clock = io.StringIO(), Clock()
    echo = CellEcho("[rank0] ", out=out, clock=clock, in_place=True)
    echo.status("ctx.log: step 1 · loss 10.25")
    echo.flush()
    echo.status("ctx.log: step 2 · loss 1")  # shorter: what the longer one left is covered
    clock.now += 0.5
    echo.flush()
    assert terminal(out.getvalue()) == ["[rank0] ctx.log: step 2 · loss 1"]
    for i in range(3):
        clock.now += 0.5
        echo.show(UPDATE, f"{i + 1}/3")
        echo.status(f"ctx.log: step {i + 3} · loss 1")
        echo.flush()
    assert rendered(out.getvalue()) == terminal(out.getvalue()) == ["[rank0] 3/3"]  # the bar, not the values
    clock.now += 0.5
    echo.show(LINE, "bar done")
    echo.flush()
    echo.close()
    assert rendered(out.getvalue()) == terminal(out.getvalue()) == ["[rank0] bar done",
                                                                    "[rank0] ctx.log: step 5 · loss 1"]


def test_in_a_log_file_the_values_are_a_plain_line_now_and_then():
    out, clock = io.StringIO(), Clock()
    logging_run(CellEcho("[rank0] ", out=out, clock=clock, in_place=False), clock, records=1000, every_s=0.025,
                line_at=500)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    logged = [line for line in lines if line.startswith("[rank0] ctx.log: ")]
    assert len(logged) <= 1 + 25 / 10 + 1  # the first, one every 10 s of the clock, the last
    assert logged[0] == "[rank0] ctx.log: step 0 · loss 1" and lines[-1] == "[rank0] ctx.log: step 999 · loss 0.001"
    assert "[rank0] at step 500" in lines


def test_a_worker_that_only_logs_is_seen_in_the_cell_while_it_runs_and_echo_false_keeps_it_quiet(kernel, tmp_path):
    km, kc = kernel
    go = tmp_path / "go"
    code = (f"from nbddp import spawn_train\n"
            f"r = spawn_train({WORKER!r}, nprocs=2, kwargs={{'steps': 300, 'go': {str(go)!r}}}, "
            f"runs_dir={str(tmp_path / 'runs')!r})\n"
            "print('after the run', r.value)")
    msg_id = kc.execute(code)
    texts, seen_running = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=180)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            texts.append((msg["header"]["date"], msg["content"]["text"]))
            shown = rendered("".join(t for _, t in texts))
            if seen_running is None and shown and shown[-1].startswith("[rank0] ctx.log: step 299 · loss "):
                seen_running = shown  # the run waits for the go file: it is still going
                go.touch()
        elif msg["msg_type"] == "error":
            said = "".join(t for _, t in texts) + "\n".join(msg["content"]["traceback"])
            raise AssertionError(f"the run failed; the ctx.log values {'showed' if seen_running else 'never showed'} "
                                 f"while it went: {said}")
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    out = "".join(t for _, t in texts)
    assert seen_running is not None, f"the ctx.log values never showed while the run went: {out!r}"
    # The rank's prints stand on their own lines, the values last, one line, in place.
    assert seen_running[:3] == ["[rank0] at step 0", "[rank0] at step 100", "[rank0] at step 200"]
    assert [line for line in seen_running if "ctx.log" in line] == [seen_running[-1]]
    assert rendered(out)[-2:] == [seen_running[-1], "after the run 300"]
    # A few rewrites a second at most, on the kernel's clock, whatever the rank logs.
    changes, last = [], None
    for sent, text in texts:
        for state in STATUS.findall(text):
            if state.rstrip() != last:
                changes.append(sent)
                last = state.rstrip()
    busiest = max(sum(1 for t in changes if s <= t < s + timedelta(seconds=1)) for s in changes)
    assert busiest <= 5, f"{busiest} rewrites of the values in one second"
    assert len(changes) < 300

    quiet = kc.execute(f"r = spawn_train({WORKER!r}, nprocs=2, kwargs={{'steps': 30}}, echo=False, "
                       f"runs_dir={str(tmp_path / 'runs')!r})\nprint('quiet', r.value)")
    said = []
    while True:
        msg = kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != quiet:
            continue
        if msg["msg_type"] in ("stream", "error"):
            said.append(msg["content"].get("text") or "\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert "".join(said) == "quiet 30\n"


def test_a_script_s_log_gets_plain_readable_lines_of_the_values(tmp_path):
    go = tmp_path / "go"
    script = (f"from nbddp import spawn_train\n"
              f"r = spawn_train({WORKER!r}, nprocs=2, kwargs={{'steps': 300, 'go': {str(go)!r}}}, "
              f"runs_dir={str(tmp_path / 'runs')!r})\n"
              "print('after the run', r.value)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=launcher_env(), cwd=tmp_path)
    lines, first = [], threading.Event()

    def read():
        for raw in proc.stdout:
            lines.append(raw.decode())
            if raw.startswith(b"[rank0] ctx.log: step "):
                first.set()
        first.set()  # the script ended: what it printed says why

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        first.wait(180)
        assert any(line.startswith("[rank0] ctx.log: step ") for line in lines), \
            f"no line of the values while the run went (it waits for {go.name}): {''.join(lines)}"
        go.touch()
        assert proc.wait(120) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    reader.join(10)
    out = "".join(lines)
    assert "\r" not in out, out  # a log file keeps every rewrite: none is written
    logged = [line.rstrip("\n") for line in lines if line.startswith("[rank0] ctx.log: ")]
    assert re.fullmatch(r"\[rank0\] ctx\.log: step 299 · loss [0-9.e+-]+", logged[-1]), logged
    assert len(logged) < 300 / 60  # now and then, not one per record
    assert out.index("[rank0] at step 200\n") < out.index(logged[-1]) < out.index("after the run 300")


def test_the_line_says_the_latest_value_of_each_name_short():
    values = LoggedValues(skip=1)
    values.add({"time": 1.0, "step": 99, "loss": 9.0})  # an earlier launch's record: not this one's
    assert values.text is None
    values.add({"time": 2.0, "step": 0, "loss": 0.123456, "note": "warm-up", "hist": [1, 2]})
    values.add({"time": 3.0, "epoch": 1, "val_acc": 0.91, "best": True})
    values.add({"time": 4.0, "step": 12, "loss": 12345.678, "lr": 1e-5})
    assert values.text == ("ctx.log: step 12 · loss 1.235e+04 · note warm-up · epoch 1 · val_acc 0.91 · best True"
                           " · lr 1e-05")
    values.add({"step": 13, "text": "x" * 500})
    assert len(values.text) <= 160 and values.text.endswith("…")
