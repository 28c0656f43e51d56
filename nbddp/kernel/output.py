"""A rank's output as a terminal shows it, read from its log file while it runs, sent to the cell
in a few messages a second, a flood shown by its first and last lines.

People print progress the way terminals draw it: tqdm, Keras-style bars and
``print(..., end="\\r")`` rewrite one line with ``\\r``. Read line by line, that output arrives
only when a newline finally comes, as one long line. :class:`OutputTail` splits what was appended
since the last read into complete lines and rewrites of the current line. A line longer than
:data:`MAX_LINE` characters is cut with a note (its whole text stays in the log), and a read takes
at most :data:`MAX_READ` bytes, so one huge line never holds up the kernel; at the end of a run
everything left is read, and the last line, if the rank ended without a newline, is shown.

:class:`CellEcho` prints the pieces into the cell. Jupyter sends every write to a cell as one
message, and a Jupyter server drops a kernel's output above 1,000 messages or 1 MB a second
(``iopub_msg_rate_limit``, ``iopub_data_rate_limit``) — later output too, the cell's own prints
after the run included. So the echo writes at most every :data:`FLUSH_S` seconds, one message
holding what arrived, a ``\\r`` bar collapsed to its latest state; and it shows at most
:data:`BURST_BYTES` at once and :data:`RATE_BYTES` a second after that: the lines of a flood
beyond it are skipped, and once the flood ends (or the run does) a notice says how many, with the
log that holds them all, followed by the flood's last :data:`TAIL_LINES` lines.

Under rank 0's lines the echo keeps one status line (:meth:`CellEcho.status`: the values the
worker passed to ``ctx.log``, :mod:`nbddp.kernel.logline`). Where ``\\r`` rewrites a line (a
notebook, a terminal) it is rewritten in place, at most every :data:`STATUS_S` seconds, and the
rank's lines are written above it; while the rank draws a ``\\r`` bar of its own, the bar is the
line shown. Elsewhere (a log file, a CI job) it is a plain line, at most every
:data:`PLAIN_STATUS_S` seconds, so the log stays readable. At the end its last state stays.

Kernel side.
"""

from __future__ import annotations

import re
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable, Deque, List, Optional, TextIO, Tuple

#: Characters of one line shown in the cell; the rest is cut with a note (the log keeps all).
MAX_LINE = 4000
#: Bytes read from the log per poll; what is left is read at the next poll.
MAX_READ = 1 << 20
#: Seconds between two writes into the cell (each write is one Jupyter message).
FLUSH_S = 0.1
#: Characters of rank output the cell shows at once (about 2,000 lines of 80), and the rate the
#: allowance comes back at (about 200 such lines a second): far below a Jupyter server's limit.
BURST_BYTES, RATE_BYTES = 160_000, 16_000
#: The last lines of a flood shown after its skipped middle (at most this many characters).
TAIL_LINES, TAIL_BYTES = 200, 32_000
#: Seconds between two rewrites of the status line where it updates in place (a notebook, a terminal).
STATUS_S = 0.25
#: Seconds between two plain status lines where it cannot (a log file, a CI job's output).
PLAIN_STATUS_S = 10.0

LINE, UPDATE = "line", "update"
#: Room kept for the notice of a skipped flood when its end is shown.
_NOTICE_BYTES = 200

_BREAK = re.compile(r"[\r\n]")


class OutputTail:
    """What a file gained since the last read, as ``(LINE | UPDATE, text)`` pieces.

    ``LINE``: a line that ended with ``\\n``. ``UPDATE``: the current line was rewritten (it
    ended with ``\\r``); the next piece replaces it. ``start`` is where the reading begins: a
    resumed launch appends to its run's log, and only what this launch writes is its output.
    """

    def __init__(self, path: Path, max_line: int = MAX_LINE, max_read: int = MAX_READ, start: int = 0):
        self.path, self.max_line, self.max_read = Path(path), max_line, max_read
        self.offset, self.partial, self.cut = start, "", 0

    def read(self) -> List[Tuple[str, str]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(self.max_read)
        except OSError:
            return []
        if not data:
            return []
        # A multi-byte character split by the read limit waits for its other bytes.
        keep = _incomplete_utf8_tail(data) if len(data) == self.max_read else 0
        data = data[:len(data) - keep] if keep else data
        self.offset += len(data)
        text = self.partial + data.decode("utf-8", "replace").replace("\r\n", "\n")
        pieces: List[Tuple[str, str]] = []
        start = 0
        for m in _BREAK.finditer(text):  # the regex finds the breaks at C speed: floods are long
            i, ch = m.start(), m.group()
            piece = text[start:i]
            if ch == "\n" or piece:  # "\r" right after "\r" or "\n" rewrites nothing
                pieces.append((LINE if ch == "\n" else UPDATE, self._shown(piece)))
            if ch == "\n":
                self.cut = 0
            start = i + 1
        self.partial = text[start:]
        if len(self.partial) > self.max_line:
            # One line with no end in sight: show its start once, drop the rest until its end.
            if not self.cut:
                pieces.append((LINE, self._shown(self.partial)))
            self.cut += len(self.partial)
            self.partial = ""
        return pieces

    def rest(self) -> List[Tuple[str, str]]:
        """Everything left, and the last line if the file ended without a newline (call once the
        writer is gone): the end of the output is what a person looks for."""
        pieces: List[Tuple[str, str]] = []
        while self._unread():
            before = self.offset
            pieces += self.read()
            if self.offset == before:  # unreadable now: what was read is all there is
                break
        if self.partial and not self.cut:
            pieces.append((LINE, self._shown(self.partial)))
        self.partial = ""
        return pieces

    def _unread(self) -> bool:
        try:
            return self.path.stat().st_size > self.offset
        except OSError:
            return False

    def _shown(self, line: str) -> str:
        if self.cut:
            return ""  # the tail of a line already cut
        if len(line) <= self.max_line:
            return line
        return (f"{line[:self.max_line]} … [cut: {len(line) - self.max_line:,} more characters; the whole line is in "
                f"{self.path.name}]")


class CellEcho:
    """Prints a rank's pieces into the cell with a prefix, in batches; see the module docstring.

    :meth:`show` takes each piece as it is read; :meth:`flush` writes what is due (call it at
    every poll: it writes at most every ``flush_s`` seconds); :meth:`close` writes everything
    now, the end of a skipped flood included, and ends a bar left mid-line (call it before other
    output, and at the end of the run).

    Args:
        prefix: put before every line (``"[rank0] "``).
        log: the file that holds the whole output, named by the notice of a skipped flood.
        out: where to write (``None``: ``sys.stdout`` at each write, as Jupyter and pytest swap it).
        clock: seconds, monotonic (tests pass their own).
        in_place: whether the status line is rewritten in place (``None``: where ``out`` is a
            terminal or a Jupyter kernel's stream, see :func:`rewrites_in_place`).
    """

    def __init__(self, prefix: str, log: Optional[Path] = None, out: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic, flush_s: float = FLUSH_S,
                 burst: int = BURST_BYTES, rate: int = RATE_BYTES, tail_lines: int = TAIL_LINES,
                 tail_bytes: int = TAIL_BYTES, status_s: float = STATUS_S, plain_status_s: float = PLAIN_STATUS_S,
                 in_place: Optional[bool] = None):
        self.prefix, self.log, self._out, self._clock = prefix, log, out, clock
        self.flush_s, self.burst, self.rate = flush_s, burst, rate
        self.tail_lines, self.tail_bytes = tail_lines, tail_bytes
        self.status_s, self.plain_status_s, self.in_place = status_s, plain_status_s, in_place
        self.open_update = False  # the cell's last line is a bar: what comes next is written over it
        self._rank_bar = False  # the rank's current line is a \r bar of its own: it, not the status, is shown
        self._status: Optional[str] = None  # the status line's latest text
        self._status_shown: Optional[str] = None  # ... as last written
        self._status_open = False  # the cell's last line is the status line
        self._status_kept = False  # the run's end (or a notice) ended the status line: it stays above
        self._status_at = float("-inf")  # when the status was last written
        self._probed, self._probed_in_place = None, False  # the stream last asked whether it rewrites in place
        self.skipped = 0  # lines of the current flood that will not be shown
        self._lines: List[str] = []  # lines to write at the next flush
        self._bar: Optional[str] = None  # the bar's latest state, to write at the next flush
        self._tail: Deque[str] = deque()  # a flood's latest lines
        self._tail_size = 0
        self._allowance, self._refilled, self._written = float(burst), clock(), float("-inf")

    @property
    def cutting(self) -> bool:
        """A flood is being cut: its lines go to the tail, and the notice comes when it ends."""
        return bool(self._tail) or self.skipped > 0

    def status(self, text: Optional[str]) -> None:
        """The status line's text from now on (written at the next writes that are due; see the module docstring)."""
        self._status = text

    def show(self, kind: str, text: str) -> None:
        """Take one piece of :class:`OutputTail`: kept for the next write, or, in a flood, for its end."""
        if kind == UPDATE:
            self._bar = text  # only the latest state of a bar is worth a message
            self._rank_bar = True
            return
        self._bar = None  # a line is written over the bar, as a terminal does after "\r"
        self._rank_bar = False
        line = self.prefix + text
        self._refill()
        if not self.cutting and self._allowance >= len(line) + 1:
            self._allowance -= len(line) + 1
            self._lines.append(line)
            return
        self._tail.append(line)
        self._tail_size += len(line) + 1
        while len(self._tail) > 1 and (len(self._tail) > self.tail_lines or self._tail_size > self.tail_bytes):
            self._tail_size -= len(self._tail.popleft()) + 1
            self.skipped += 1

    def flush(self) -> None:
        """Write what arrived since the last write, if the last write is ``flush_s`` old."""
        if self._clock() - self._written >= self.flush_s:
            self._write(final=False)
        elif self._status != self._status_shown and self._clock() - self._status_at >= (
                self.status_s if self._rewrites(self._out or sys.stdout) else self.plain_status_s):
            self._write(final=False)  # the status changed and may be written again: one message

    def close(self) -> None:
        """Write everything now; end a bar left mid-line, so what follows starts a new line."""
        self._write(final=True)

    def _refill(self) -> None:
        now = self._clock()
        self._allowance = min(float(self.burst), self._allowance + (now - self._refilled) * self.rate)
        self._refilled = now

    def _write(self, final: bool) -> None:
        self._refill()
        lines, self._lines = self._lines, []
        if self.cutting and (final or self._allowance >= self._tail_size + _NOTICE_BYTES):
            # The flood is over (its end fits the allowance again), or the run is: its end is shown.
            lines += self._notice()
            lines += self._tail
            self._allowance -= self._tail_size
            self._tail.clear()
            self._tail_size, self.skipped = 0, 0
        out = self._out or sys.stdout
        in_place = self._rewrites(out)
        if not in_place and self._plain_status_due(final):
            lines.append(self.prefix + self._status)
            self._status_shown, self._status_at = self._status, self._clock()
        text = ""
        if lines:
            text = self._over_last_line() + "\n".join(lines) + "\n"
            self.open_update = self._status_open = False
        if self._bar is not None:
            text += (self._over_last_line() or "\r") + self.prefix + self._bar  # "\r" starts a bar's every state
            self._allowance -= len(self._bar)
            self._bar, self.open_update, self._status_open = None, True, False
        elif in_place:
            text += self._status_rewrite(final, pushed_up=bool(lines))
        if final and self.open_update:
            text += "\n"
            self._status_kept = self._status_open  # it stays as it was; written again once it changes
            self.open_update = self._status_open = False
        self._written = self._clock()
        if text:
            out.write(text)  # one write, one flush: one message in a Jupyter kernel
            out.flush()

    def _rewrites(self, out: TextIO) -> bool:
        """Whether ``\\r`` rewrites a line of ``out`` (``in_place``, else asked once per stream: polls are many)."""
        if self.in_place is not None:
            return self.in_place
        if out is not self._probed:
            self._probed, self._probed_in_place = out, rewrites_in_place(out)
        return self._probed_in_place

    def _over_last_line(self) -> str:
        """What starts a write over the cell's last line: ``\\r`` after a bar; after the status line,
        blanks over it first (a terminal's ``\\r``, and Jupyter's, leave what a shorter line does not cover)."""
        if self._status_open:
            self._status_open = False
            return f"\r{' ' * len(self.prefix + (self._status_shown or ''))}\r"
        return "\r" if self.open_update else ""

    def _plain_status_due(self, final: bool) -> bool:
        """A plain status line is due: its text changed, and it is the first, ``plain_status_s`` old, or the last."""
        if self._status is None or self._status == self._status_shown:
            return False
        return final or self._clock() - self._status_at >= self.plain_status_s

    def _status_rewrite(self, final: bool, pushed_up: bool) -> str:
        """The status line written over the cell's last line, or ``""`` when it is not due.

        Due when it changed and its last change was written ``status_s`` ago (or the run ends),
        or, as it was, when the rank's lines were just written over it; never while the rank's
        own ``\\r`` bar is the current line.
        """
        if self._status is None or self._rank_bar:
            return ""
        now = self._clock()
        if self._status != self._status_shown and (final or now - self._status_at >= self.status_s):
            shown, self._status_at = self._status, now
        elif pushed_up and self._status_shown is not None and not self._status_kept:
            shown = self._status_shown
        else:
            return ""
        # Spaces over what a longer earlier state left: a terminal's "\r" does not clear the line.
        pad = " " * max(0, len(self._status_shown or "") - len(shown)) if self._status_open else ""
        self._status_shown, self._status_open, self._status_kept, self.open_update = shown, True, False, True
        return f"\r{self.prefix}{shown}{pad}"

    def _notice(self) -> List[str]:
        if not self.skipped:
            return []
        where = f" (the whole output is in {self.log})" if self.log else ""
        return [f"{self.prefix}... {self.skipped:,} lines skipped{where} ..."]


def rewrites_in_place(out: TextIO) -> bool:
    """True where a ``\\r`` rewrites the line: a terminal, or a Jupyter kernel's stream (a notebook).

    A file or a pipe (a CI job, ``python train.py > log``) keeps every rewrite as text.
    """
    try:
        if out.isatty():
            return True
    except (AttributeError, ValueError, OSError):  # a closed or odd stream
        return False
    return type(out).__module__.startswith("ipykernel.")  # ipykernel.iostream.OutStream says it is no tty


def _incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of ``data`` start a UTF-8 character that is not complete yet."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back if need > back else 0
    return 0


__all__ = ["MAX_LINE", "MAX_READ", "FLUSH_S", "BURST_BYTES", "RATE_BYTES", "TAIL_LINES", "TAIL_BYTES", "STATUS_S",
           "PLAIN_STATUS_S", "LINE", "UPDATE", "OutputTail", "CellEcho", "rewrites_in_place"]
