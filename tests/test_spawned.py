"""The echo of a launcher script's processes: their logs read piece by piece into the launcher's
output, each piece marked with its rank, nothing cut or joined wrongly whatever a read splits."""

from nbddp.rank.spawned import LogEcho, _Followed, function_form, pieces_of


def test_pieces_end_at_newlines_and_carriage_returns_only():
    assert pieces_of("a\nb\r\nc\rd") == (["a\n", "b\r\n", "c\r"], "d")
    assert pieces_of("page\x0cbreak\u2028same line\n") == (["page\x0cbreak\u2028same line\n"], "")
    assert pieces_of("50%\r") == ([], "50%\r"), "a \\r at the end may be the start of \\r\\n"
    assert pieces_of("50%\r", final=True) == (["50%\r"], "")
    assert pieces_of("last", final=True) == (["last\n"], "")


def test_a_read_that_cuts_a_character_or_a_crlf_changes_nothing(tmp_path):
    log = tmp_path / "spawned1.log"
    log.write_bytes(b"")
    shown = []
    echo = LogEcho(shown.append)
    echo._files = {"rank1": _Followed(log)}  # followed without the thread: reads are made by hand below
    text = "température 1\r\nprogress 50%\rprogress 100%\nfin".encode()
    cut = text.index("é".encode()) + 1  # inside the two bytes of "é"
    crlf = text.index(b"\r\n") + 1      # between \r and \n
    for a, b in ((0, cut), (cut, crlf), (crlf, len(text))):
        with open(log, "ab") as f:
            f.write(text[a:b])
        echo.read()
    echo.read(final=True)
    assert "".join(shown) == "[rank1] température 1\r\n[rank1] progress 50%\r[rank1] progress 100%\n[rank1] fin\n"


def test_the_function_form_is_written_out_only_when_it_can_be_copied(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("def main(rank, n, name='x'):\n    pass\n")
    ns: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    main = ns["main"]
    main.__qualname__ = "main"
    assert function_form(str(script), main, (2, "a"), 2) == f"spawn_train('{script}:main', 2, 'a', nprocs=2, call='mp.spawn')"
    assert "argument 1 (str) is too long" in function_form(str(script), main, ("x" * 300,), 2)
    assert "argument 1 (object) is not a plain value" in function_form(str(script), main, (object(),), 2)
    assert "does not fit" in function_form(str(script), main, (1, 2, 3, 4), 2)  # more than it takes


def test_a_traceback_every_process_prints_alike_is_shown_once(tmp_path):
    """The same code failing on every process: its traceback shown for the first, a line for the others
    (whole in their logs); a different error, or the code's output around a traceback, shown as it is."""
    tb = ('Traceback (most recent call last):\n  File "w.py", line 3, in work\n    fail()\n'
          'ValueError: boom\n')
    chained = ('Traceback (most recent call last):\n  File "w.py", line 9, in load\nKeyError: 3\n\n'
               'During handling of the above exception, another exception occurred:\n\n' + tb)
    logs = {label: tmp_path / f"spawned{i}.log" for i, label in enumerate(("rank0", "rank1", "rank2"))}
    for log in logs.values():
        log.write_bytes(b"")
    shown = []
    echo = LogEcho(shown.append)
    echo._files = {label: _Followed(log) for label, log in logs.items()}
    logs["rank0"].write_text("step 1\n" + tb[:60])  # a traceback cut by a read: held until its error line
    echo.read()
    assert "".join(shown) == "[rank0] step 1\n"
    with open(logs["rank0"], "a") as f:
        f.write(tb[60:] + "after\n")
    logs["rank1"].write_text(chained)
    logs["rank2"].write_text(tb.replace("boom", "other"))
    echo.read()
    text = "".join(shown)
    assert text.count("ValueError: boom") == 1 and "[rank0] after\n" in text, text
    assert "[rank1] the same error as rank0; its traceback is in logs/spawned1.log\n" in text, text
    assert "KeyError" not in text and "[rank2] ValueError: other\n" in text, text
