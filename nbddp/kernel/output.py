"""A rank's output as a terminal shows it, read from its log file while it runs.

People print progress the way terminals draw it: tqdm, Keras-style bars and
``print(..., end="\\r")`` rewrite one line with ``\\r``. Read line by line, that output arrives
only when a newline finally comes, as one long line. :class:`OutputTail` splits what was appended
since the last read into complete lines and rewrites of the current line; :class:`CellEcho`
prints them into the cell, a rewrite in place (a notebook's output honours ``\\r`` as a terminal
does). A line longer than :data:`MAX_LINE` characters is cut with a note (its whole text stays
in the log), and a read takes at most :data:`MAX_READ` bytes, so one huge line never holds up the
kernel. The last line, if the rank ended without a newline, is shown at the end.

Kernel side.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

#: Characters of one line shown in the cell; the rest is cut with a note (the log keeps all).
MAX_LINE = 4000
#: Bytes read from the log per poll; what is left is read at the next poll.
MAX_READ = 1 << 20

LINE, UPDATE = "line", "update"


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
        for i, ch in enumerate(text):
            if ch in "\n\r":
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
        """The last line if the file ended without a newline (call once the writer is gone)."""
        pieces = self.read()
        if self.partial and not self.cut:
            pieces.append((LINE, self._shown(self.partial)))
        self.partial = ""
        return pieces

    def _shown(self, line: str) -> str:
        if self.cut:
            return ""  # the tail of a line already cut
        if len(line) <= self.max_line:
            return line
        return (f"{line[:self.max_line]} … [cut: {len(line) - self.max_line:,} more characters; the whole line is in "
                f"{self.path.name}]")


class CellEcho:
    """Prints a rank's pieces into the cell with a prefix; an ``UPDATE`` rewrites the line in place."""

    def __init__(self, prefix: str):
        self.prefix, self.open_update = prefix, False

    def show(self, kind: str, text: str) -> None:
        if kind == UPDATE:
            print(f"\r{self.prefix}{text}", end="", flush=True)
            self.open_update = True
        else:
            print(f"{chr(13) if self.open_update else ''}{self.prefix}{text}", flush=True)
            self.open_update = False

    def close(self) -> None:
        if self.open_update:  # a bar left mid-line: end it, so what follows starts a new line
            print(flush=True)
            self.open_update = False


def _incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of ``data`` start a UTF-8 character that is not complete yet."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back if need > back else 0
    return 0


__all__ = ["MAX_LINE", "MAX_READ", "LINE", "UPDATE", "OutputTail", "CellEcho"]
