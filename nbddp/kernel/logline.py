"""Rank 0's ``ctx.log`` values as one short line for the cell: the latest value of every name logged.

A worker that only calls ``ctx.log(step=..., loss=...)`` prints nothing, yet its values are what a
person watches. The kernel already reads every record from ``metrics.jsonl`` at each poll (for
``handle.metrics`` and the panel); :class:`LoggedValues` keeps the latest value of each name, in
the order the names first came, and :attr:`LoggedValues.text` says them in one line
(``ctx.log: step 120 · loss 0.4317 · val_acc 0.91``). :class:`nbddp.kernel.output.CellEcho` shows
that line under rank 0's output: rewritten in place a few times a second in a notebook or a
terminal, a plain line now and then in a log file.

Names of one record that come once an epoch (``val_acc``) stay beside those of every step: the
line shows the latest of each, as a progress bar's postfix does.

Kernel side.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

#: Characters of the line; the rest is cut with "…" (the values are all in ``metrics.jsonl``).
MAX_TEXT = 160
#: Characters of one text value.
MAX_VALUE = 40
#: Keys of a record that are not the worker's values (``ctx.log`` adds the time).
_NOT_SHOWN = ("time",)


class LoggedValues:
    """The latest value of every name rank 0 has logged since this launch began.

    Args:
        skip: records to pass over first: those an earlier launch of a resumed run wrote.
    """

    def __init__(self, skip: int = 0):
        self._skip = skip
        self._values: Dict[str, Any] = {}
        self._text: Optional[str] = None

    def add(self, record: Dict[str, Any]) -> None:
        """Take one ``ctx.log`` record (a line of ``metrics.jsonl``); formatted only when the line is asked for."""
        if self._skip > 0:
            self._skip -= 1
            return
        self._values.update(record)  # a name keeps its first place, with its latest value
        self._text = None

    @property
    def text(self) -> Optional[str]:
        """``ctx.log: step 120 · loss 0.4317``, or None before any value came."""
        if self._text is None:
            shown = ((k, _value(v)) for k, v in self._values.items() if k not in _NOT_SHOWN)
            parts = [f"{k} {v}" for k, v in shown if v is not None]
            if not parts:
                return None
            text = "ctx.log: " + " · ".join(parts)
            self._text = text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 1] + "…"
        return self._text


def _value(value: Any) -> Optional[str]:
    """A logged value as the line shows it; None for what does not fit a line (lists, dicts, None)."""
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"  # 0.4317, 1.235e+04: four digits say a loss or a rate
    if isinstance(value, str):
        return value if len(value) <= MAX_VALUE else value[:MAX_VALUE - 1] + "…"
    return None


def lines_in(path) -> int:
    """How many complete lines ``path`` holds (0 when it does not exist): a resumed run's earlier records."""
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


__all__ = ["MAX_TEXT", "LoggedValues", "lines_in"]
