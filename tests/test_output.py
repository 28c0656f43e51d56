"""Rank 0's output in the cell as a terminal shows it: \\r bars update in place, long lines are cut."""

from __future__ import annotations

from pathlib import Path

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


def test_the_echo_rewrites_a_bar_in_place_and_ends_it(capsys):
    echo = CellEcho("[rank0] ")
    for kind, text in [(LINE, "hi"), (UPDATE, "1/2"), (UPDATE, "2/2"), (LINE, "done"), (UPDATE, "x")]:
        echo.show(kind, text)
    echo.close()
    assert capsys.readouterr().out == "[rank0] hi\n\r[rank0] 1/2\r[rank0] 2/2\r[rank0] done\n\r[rank0] x\n"


def test_a_rank_s_bars_tqdm_huge_line_and_last_line_reach_the_cell(tmp_path, capsys):
    events = []
    result = spawn_train(f"{WORKERS / 'printing.py'}:bars", nprocs=2, kwargs={"long_line": 50_000},
                         runs_dir=tmp_path, on_event=lambda kind, payload: events.append((kind, payload)))
    out = capsys.readouterr().out
    assert result.value == 0
    updates = [p for k, p in events if k == "update"]
    # The bar arrived as it was drawn, one rewrite at a time, not as one line at the end.
    assert "step 1/5" in updates and "step 5/5" in updates
    assert "\r[rank0] step 2/5\r[rank0] step 3/5" in out and "\r[rank0] bar done\n" in out
    assert any(u.startswith("tqdm: 100%") for u in updates) or any("tqdm: 100%" in p for k, p in events)
    assert "[rank0] " + "x" * 4000 + " … [cut: 46,000 more characters" in out
    assert out.rstrip().endswith("[rank0] the end, no newline")
    assert ("line", "the end, no newline") in events
