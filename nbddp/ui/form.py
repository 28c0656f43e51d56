"""The built-in classifier's form: one widget per ``TrainConfig`` field that declares one.

Every widget comes from its field's :class:`nbddp.contract.fieldspec.Widget` (kind, label, range,
section), so a new field shows up here by its declaration alone. The one rule written here is
the one ``TrainConfig`` enforces between two fields: ticking *Freeze layers* unticks and greys
out *SyncBN*, with the reason, and unticking it gives the earlier choice back.
"""

from __future__ import annotations

import html
from typing import Any, Dict, List, Optional

import ipywidgets as W

from ..contract.config import FREEZE_REASON, TrainConfig
from ..contract.errors import ConfigError
from ..contract.fieldspec import Widget, specs
from .layout import FULL, ROW, field, grid, note

_ADVANCED_NOTE = ("Accumulate k: one optimizer step every k batches (k × the global batch). Early stop after n: every "
                  "process stops once validation accuracy has not improved for n epochs (0: off); the export keeps "
                  "the best epoch.")


def attr_name(name: str, w: Widget) -> str:
    """The panel's attribute for a field's widget: ``epochs_input``, ``sync_bn_toggle``..."""
    return w.attr or f"{name}_{'toggle' if w.kind == 'check' else 'input'}"


def _make(w: Widget, value: Any, help_: str, values: tuple) -> W.Widget:
    """The ipywidget for one field, holding ``value``."""
    if w.kind == "check":
        return W.Checkbox(value=value == w.on, description=w.label, indent=False, tooltip=help_,
                          layout=W.Layout(width="auto"))
    bounds = {k: v for k, v in (("min", w.low), ("max", w.high), ("step", w.step)) if v is not None}
    if w.kind == "int":
        return field(W.BoundedIntText, w.label, value=value, tooltip=help_, **bounds)
    if w.kind == "float":
        cls = W.BoundedFloatText if w.low is not None or w.high is not None else W.FloatText
        return field(cls, w.label, value=value, tooltip=help_, **bounds)
    if w.kind == "choice":
        return field(W.Dropdown, w.label, options=list(values), value=value, tooltip=help_)
    if w.kind == "combo":
        value = ",".join(value) if isinstance(value, tuple) else value  # trackers: ("mlflow", "wandb")
        return field(W.Combobox, w.label, value=value, options=w.options, ensure_option=False,
                     placeholder=w.placeholder, tooltip=help_)
    return field(W.Text, w.label, value="" if value is None else str(value), placeholder=w.placeholder,
                 tooltip=help_)


class ConfigForm:
    """The widgets of a :class:`TrainConfig`, and the config they describe.

    Args:
        base: the config the widgets start from; fields without a widget keep its values.
        on_gpu: GPUs are present (else a GPU-only setting says that CPU runs ignore it).

    Attributes:
        inputs: ``{field name: widget}``, in declaration order.
        widgets: what a run in progress locks.
        parts: the form's boxes, top to bottom: paths, numbers, options, the collapsed Advanced.
        advanced: the ``Accordion`` of the advanced section.
        sync_bn_reason: why SyncBN is off while layers are frozen (empty otherwise).
    """

    def __init__(self, base: TrainConfig, on_gpu: bool):
        self.base = base
        self.inputs: Dict[str, W.Widget] = {}
        self._specs = {}
        sections: Dict[str, List[W.Widget]] = {}
        for f, s in specs(base):
            if s.widget is None:
                continue
            values = s.check.values if s.check is not None else ()
            self.inputs[f.name] = widget = _make(s.widget, getattr(base, f.name), s.help, values)
            self._specs[f.name] = (s.widget, f.default)
            setattr(self, attr_name(f.name, s.widget), widget)
            sections.setdefault(s.widget.section, []).append(self._row(f.name, s.widget, widget, on_gpu))
        self.widgets = list(self.inputs.values())
        self._busy = False
        self._sync_saved: Optional[bool] = None  # SyncBN value from before freeze-layers was ticked
        self.inputs["freeze_layers"].observe(self._apply_freeze_rule, names="value")
        self.parts = [grid(sections.get("paths", []), 320), grid(sections.get("numbers", []), 240),
                      W.VBox(sections.get("options", [])), self._advanced(sections.get("advanced", []))]
        self._apply_freeze_rule()

    def _row(self, name: str, w: Widget, widget: W.Widget, on_gpu: bool) -> W.Widget:
        """A check with its note beside it (GPU-only, or why it is off); any other widget as it is."""
        if name == "sync_bn":
            self.sync_bn_reason = W.HTML("", layout=W.Layout(margin="0 0 0 10px"))
            return W.HBox([widget, self.sync_bn_reason], layout=W.Layout(**ROW))
        if w.gpu_only:
            text = "applies on GPU only" + ("" if on_gpu else "; CPU runs ignore it")
            return W.HBox([widget, note(text, margin="0 0 0 10px")], layout=W.Layout(**ROW))
        return widget

    def _advanced(self, rows: List[W.Widget]) -> W.Accordion:
        """The training recipe, collapsed: its inputs in a grid, then its checks, then what they mean."""
        inputs = [r for r in rows if not isinstance(r, W.Checkbox)]
        checks = [r for r in rows if isinstance(r, W.Checkbox)]
        self.advanced = W.Accordion(children=[W.VBox([grid(inputs, 240), *checks,
                                                      note(html.escape(_ADVANCED_NOTE), **FULL)])],
                                    selected_index=None, layout=W.Layout(**FULL))
        self.advanced.set_title(0, "Advanced")
        return self.advanced

    # ------------------------------------------------------------------ reading
    def values(self) -> Dict[str, Any]:
        """``{field: value}`` of every widget, as ``TrainConfig`` takes them (not yet validated).

        Raises:
            ConfigError: a required text box is empty, or a number box holds no number.
        """
        out = {name: self._read(name, widget) for name, widget in self.inputs.items()}
        if out.get("freeze_layers"):
            out["sync_bn"] = False
        return out

    def _read(self, name: str, widget: W.Widget) -> Any:
        w, default = self._specs[name]
        v = widget.value
        if w.kind == "check":
            return w.on if v else w.off
        if w.kind in ("text", "combo"):
            v = v.strip()
            if not v and w.required:
                raise ConfigError(f"{w.label} is empty: {w.required}")
            return None if not v and default is None else v
        if w.kind == "int":
            return int(v)
        if w.kind == "float":
            try:
                return float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{w.label} {v!r} is not a number") from None
        return v

    # ------------------------------------------------------------------ locking and the freeze rule
    def set_busy(self, busy: bool) -> None:
        """Lock the form while a run goes on (SyncBN stays off while layers are frozen)."""
        self._busy = busy
        for w in self.widgets:
            w.disabled = busy
        self._apply_freeze_rule()

    def _apply_freeze_rule(self, _change=None) -> None:
        # TrainConfig refuses sync_bn with freeze_layers; the form makes the pair impossible.
        sync, frozen = self.inputs["sync_bn"], self.inputs["freeze_layers"].value
        if frozen:
            if self._sync_saved is None:
                self._sync_saved = sync.value
            sync.value, sync.disabled = False, True
            self.sync_bn_reason.value = note(f"off: {html.escape(FREEZE_REASON)}").value
        else:
            if self._sync_saved is not None:
                sync.value, self._sync_saved = self._sync_saved, None
            sync.disabled = self._busy
            self.sync_bn_reason.value = ""


__all__ = ["ConfigForm", "attr_name"]
