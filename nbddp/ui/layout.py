"""The panel's look, shared by its parts: label widths, full-width boxes, grids, colours."""

from __future__ import annotations

from typing import List

import ipywidgets as W

LABEL = {"description_width": "110px"}
# Full-width widgets get side margins of 0: ipywidgets gives every widget a 2px margin, and
# "width: 100%" plus margins overflows its box (clipped inputs, a horizontal scrollbar).
FULL = dict(width="100%", margin="2px 0")
GREY = "color:var(--jp-ui-font-color2,#666)"
ROW = dict(align_items="center", flex_flow="row wrap")


def field(widget_cls, description: str, **kw) -> W.Widget:
    """A labelled input that fills its grid cell."""
    return widget_cls(description=description, style=LABEL, layout=W.Layout(**FULL), **kw)


def grid(children: List[W.Widget], min_px: int) -> W.GridBox:
    """As many columns of at least ``min_px`` as fit the page."""
    return W.GridBox(children, layout=W.Layout(grid_template_columns=f"repeat(auto-fit, minmax({min_px}px, 1fr))",
                                               grid_gap="4px 16px", width="100%"))


def note(text_html: str, italic: bool = True, **layout) -> W.HTML:
    """Grey explanatory text."""
    tag = "i" if italic else "span"
    return W.HTML(f"<{tag} style='{GREY}'>{text_html}</{tag}>", layout=W.Layout(**layout))
