"""A sweep's live table in the notebook: one row per trial, best first, updated while it runs."""

from __future__ import annotations

import html
import time
from typing import List

import ipywidgets as W

_COLOURS = {"COMPLETE": "#2e7d32", "RUNNING": "#1565c0", "PRUNED": "#8d6e63", "FAIL": "#c62828",
            "WAITING": "#757575"}


class SweepTable:
    """``nbddp.sweep``'s table: number, params, state, metric so far, seconds, run folder."""

    def __init__(self, name: str, metric: str, direction: str):
        self.metric, self.direction = metric, direction
        self.title = W.HTML(f"<b>sweep {html.escape(name)}</b> &middot; {html.escape(direction)} "
                            f"<code>{html.escape(metric)}</code>")
        self.body = W.HTML()
        self.widget = W.VBox([self.title, self.body])
        self._shown = None
        self._at = 0.0

    def display(self) -> None:
        from IPython.display import display

        display(self.widget)

    def update(self, rows: List[dict], final: bool = False) -> None:
        """Redraw when the rows changed, at most twice a second (always at the end)."""
        now = time.time()
        if rows == self._shown or (not final and now - self._at < 0.5):
            return
        self._shown, self._at = rows, now
        self.body.value = render(rows, self.metric)


def render(rows: List[dict], metric: str) -> str:
    """The rows as an HTML table."""
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{h}</th>"
                   for h in ("#", "params", "state", html.escape(metric), "s", "run folder"))
    lines = []
    for r in rows:
        params = ", ".join(f"{k}={_short(v)}" for k, v in r["params"].items())
        state = r["state"]
        colour = _COLOURS.get(state.split(" ")[0], "inherit")
        value = f"{r['value']:.4g}" if isinstance(r["value"], (int, float)) else ""
        seconds = f"{r['seconds']:.1f}" if isinstance(r["seconds"], (int, float)) else ""
        cells = (str(r["number"]), html.escape(params), f"<span style='color:{colour}'>{html.escape(state)}</span>",
                 value, seconds, f"<code>{html.escape(str(r['run_dir'] or ''))}</code>")
        lines.append("<tr>" + "".join(f"<td style='padding:2px 8px'>{c}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
