"""Rank 0's output in the cell as a terminal shows it: \\r bars update in place, long lines are cut."""

from __future__ import annotations

import io
import re
from pathlib import Path

from conftest import ROOT
from nbddp import spawn_train
from nbddp.kernel.output import LINE, UPDATE, CellEcho, OutputTail

WORKERS = Path(__file__).parent / "workers"


def test_pieces_split_lines_from_rewrites_across_reads(tmp_path):
    log = tmp_path / "rank0.log"
    tail = OutputTail(log, max_line=20)
    log.write_bytes(b"first\n 10%\r 20%\r 3")
    assert tail.read() == [(LINE, "first"), (UPDATE, " 10%"), (UPDATE, " 20%")]
    with open(log, "ab") as f:
        f.write(b"0%\r100%\ndos\r\nend")
    assert tail.read() == [(UPDATE, " 30%"), (LINE, "100%"), (LINE, "dos")]
    assert tail.rest() == [(LINE, "end")]
    assert tail.rest() == []


def test_a_long_line_is_cut_once_with_a_note_even_before_it_ends(tmp_path):
    log = tmp_path / "rank0.log"
    tail = OutputTail(log, max_line=10, max_read=16)
    log.write_bytes(b"a" * 40 + b"\nshort\n" + "é".encode() * 10 + b"\n")
    pieces = []
    for _ in range(10):  # a bounded read per poll: the rest comes at the next ones
        pieces += tail.read()
    assert pieces[0] == (LINE, "a" * 10 + " … [cut: 6 more characters; the whole line is in rank0.log]")
    assert (LINE, "short") in pieces and (LINE, "é" * 10) in pieces
    assert len([p for p in pieces if p[1].startswith("a")]) == 1


class Clock:
    """A clock the test moves: the echo's batches and allowance follow it, not the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_echo_writes_batches_a_bar_at_its_latest_state_and_ends_it():
    out, clock = io.StringIO(), Clock()
    echo = CellEcho("[rank0] ", out=out, clock=clock)
    writes = []
    out.write = lambda text, write=out.write: (writes.append(text), write(text))[1]
    for kind, text in [(LINE, "hi"), (UPDATE, "1/3"), (UPDATE, "2/3")]:
        echo.show(kind, text)
        echo.flush()  # the first flush writes; the next ones wait for FLUSH_S
    clock.now += 0.1
    echo.flush()
    echo.show(UPDATE, "3/3")
    echo.show(LINE, "done")  # written over the bar, as a terminal does
    echo.show(UPDATE, "x")
    echo.flush()  # too soon: nothing
    echo.close()
    assert writes == ["[rank0] hi\n", "\r[rank0] 2/3", "\r[rank0] done\n\r[rank0] x\n"]


def test_a_flood_shows_its_first_and_last_lines_and_how_many_were_skipped(tmp_path):
    out, clock = io.StringIO(), Clock()
    log = tmp_path / "logs" / "rank0.log"
    echo = CellEcho("", log=log, out=out, clock=clock, burst=1000, rate=100, tail_lines=5)
    for i in range(1000):  # 10 bytes a line: 100 fit the burst, the rest is cut
        echo.show(LINE, f"line {i:04d}")
        echo.flush()
    clock.now += 0.5  # a pause too short for the flood's end to fit the allowance: it waits
    echo.flush()
    assert out.getvalue().splitlines() == [f"line {i:04d}" for i in range(100)]
    clock.now += 3.0  # the flood is over: its notice and its end come, and lines flow again
    echo.flush()
    echo.show(LINE, "after")
    echo.close()
    shown = out.getvalue().splitlines()
    assert shown[100:] == [f"... 895 lines skipped (the whole output is in {log}) ...",
                           *[f"line {i:04d}" for i in range(995, 1000)], "after"]
    # A flood cut by the end of the run shows its end too.
    for i in range(1000):
        echo.show(LINE, f"more {i:04d}")
    echo.close()
    more = out.getvalue().splitlines()[101 + 5 + 1:]
    skipped = int(re.fullmatch(r"\.\.\. (\d+) lines skipped .*", more[-6]).group(1))
    assert more[:-6] == [f"more {i:04d}" for i in range(1000 - 5 - skipped)]  # what the allowance had left
    assert more[-5:] == [f"more {i:04d}" for i in range(995, 1000)]


def test_a_rank_s_bars_tqdm_huge_line_and_last_line_reach_the_cell(tmp_path, capsys):
    events = []
    result = spawn_train(f"{WORKERS / 'printing.py'}:bars", nprocs=2, kwargs={"long_line": 50_000},
                         runs_dir=tmp_path, on_event=lambda kind, payload: events.append((kind, payload)))
    out = capsys.readouterr().out
    assert result.value == 0
    updates = [p for k, p in events if k == "update"]
    # The bar arrived as it was drawn, one rewrite at a time, not as one line at the end.
    assert "step 1/5" in updates and "step 5/5" in updates
    # The cell shows the bar's states in order (those drawn within one batch as the latest), then the line.
    shown = [int(n) for n in re.findall(r"\r\[rank0\] step (\d)/5", out)]
    assert shown and shown == sorted(set(shown)) and "[rank0] bar done\n" in out
    assert any(u.startswith("tqdm: 100%") for u in updates) or any("tqdm: 100%" in p for k, p in events)
    assert "[rank0] " + "x" * 4000 + " … [cut: 46,000 more characters" in out
    assert out.rstrip().endswith("[rank0] the end, no newline")
    assert ("line", "the end, no newline") in events


def test_a_flood_in_a_real_kernel_comes_in_few_messages_with_its_end_and_the_cell_s_own_print(kernel, tmp_path):
    """40,000 lines as fast as a rank can print them: a Jupyter server drops a kernel's output above
    1,000 messages a second, the cell's own prints after the run included."""
    from datetime import timedelta

    km, kc = kernel
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from nbddp import spawn_train\n"
            f"r = spawn_train({str(WORKERS / 'printing.py') + ':flood'!r}, nprocs=2, runs_dir={str(tmp_path)!r})\n"
            "print('after the run', r.value)")
    msg_id = kc.execute(code)
    texts, sent = [], []
    while True:
        msg = kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])
            sent.append(msg["header"]["date"])  # the kernel's clock: the rate as it sent them
        elif msg["msg_type"] == "error":
            texts.append("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    out = "".join(texts)
    assert "after the run 0" in out, out[-2000:]
    busiest = max(sum(1 for t in sent if s <= t < s + timedelta(seconds=1)) for s in sent)
    assert busiest <= 15, f"{busiest} messages in one second"  # ~10 batches a second, and a few of nbddp's own
    lines = [line for line in out.splitlines() if line.startswith("[rank0] line ")]
    skipped = re.findall(r"\[rank0\] \.\.\. ([\d,]+) lines skipped \(the whole output is in (.+)\) \.\.\.", out)
    assert skipped and Path(skipped[-1][1]).name == "rank0.log"
    assert len(lines) + sum(int(n.replace(",", "")) for n, _ in skipped) == 40_000
    assert lines[0].startswith("[rank0] line 000000") and lines[-1].startswith("[rank0] line 039999")
    assert out.index(lines[-1]) < out.index("[rank0] FINAL LINE") < out.index("after the run")
    assert (Path(skipped[-1][1]).read_text().count("\n")) == 40_001  # the log keeps every line
