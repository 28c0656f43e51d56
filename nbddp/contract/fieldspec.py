"""What a ``TrainConfig`` field is, beside its type and default: declared once, read everywhere.

Each field of :class:`nbddp.contract.config.TrainConfig` carries a :class:`FieldSpec` in its
``dataclasses.field(metadata=...)``. From it, and nothing else:

* ``TrainConfig.validate`` runs the field's :class:`Check` in the field's validation group;
* ``python -m nbddp train`` builds the field's flag (help, choices, ``--x``/``--no-x``, metavar);
* :func:`nbddp.contract.cluster.cli_flags` writes the field into generated commands (or leaves it to the
  launcher);
* the training panel builds the field's :class:`Widget` (kind, label, range, section);
* ``resume`` refuses or takes a changed value (:attr:`FieldSpec.resume`,
  :func:`nbddp.tasks.classification.planning.find_resume_dir`).

Shared, and standard library only: the config, the CLI, the cluster commands and the panel all
import it, and it imports none of them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

#: The validation groups, in the order ``TrainConfig.validate`` runs them.
GROUPS = ("types", "numbers", "recipe", "choices")
#: The panel's sections, in the order it shows them.
SECTIONS = ("paths", "numbers", "options", "advanced")
#: What ``resume`` does when a field differs from the run it continues (:attr:`FieldSpec.resume`):
#: ``same`` refuses the change (it would mix two runs), ``more`` takes a larger value only
#: (``epochs``: the schedule is rebuilt to the new length), ``free`` takes any value.
RESUME_SAME, RESUME_MORE, RESUME_FREE = "same", "more", "free"


def utf8_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be written to logs, JSON and TensorBoard as text, or ``None``.

    A name read from the disk whose bytes are not UTF-8 arrives as a string with surrogate
    escapes (``'\\udcff'``); it opens fine but fails in the worker the first time it is written
    to a UTF-8 file.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = os.fsencode(path)
        return (f"is not valid UTF-8 (byte {raw[exc.start:exc.start + 1]!r} near {path[:exc.start][-20:]!r}); "
                "rename the folder or file to a UTF-8 name (convmv or a file manager can)")
    return None


@dataclass(frozen=True)
class Check:
    """A rule on one field's value; :meth:`problem` says what is wrong, in the words users read.

    Attributes:
        kind: ``"bool"``, ``"int"``, ``"number"``, ``"choice"`` or ``"path"`` (text written to
            logs and JSON: must be UTF-8).
        low, high: the range of an ``int`` (``low`` only) or a ``number``.
        low_open, high_open: the range excludes that end.
        values: the allowed values of a ``choice``.
        why: what the values mean (``int``, ``choice``); for a ``number``, the whole message
            for any value out of range.
        none: ``None`` is allowed and means this (``"count the class folders"``).
    """

    kind: str
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    values: Tuple[Any, ...] = ()
    why: str = ""
    none: str = ""

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` breaks the rule, or ``None``."""
        if value is None and self.none:
            return None
        return getattr(self, "_" + self.kind)(value)

    def _bool(self, v: Any) -> Optional[str]:
        return None if isinstance(v, bool) else "must be True or False (a string such as 'False' is not a bool)"

    def _int(self, v: Any) -> Optional[str]:
        if isinstance(v, bool) or not isinstance(v, int) or v < self.low:
            low = int(self.low)
            return (f"must be an integer >= {low}" + (f", or None to {self.none}" if self.none else "")
                    + (f" ({self.why})" if self.why else ""))
        return None

    def _number(self, v: Any) -> Optional[str]:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return self.why or "must be a finite number"
        if v < self.low or v > self.high or (v == self.low and self.low_open) or (v == self.high and self.high_open):
            return self.why or (f"must be in {'(' if self.low_open else '['}{self.low}, "
                                f"{self.high}{')' if self.high_open else ']'}")
        return None

    def _choice(self, v: Any) -> Optional[str]:
        return None if v in self.values else f"must be one of {self.values}" + (f": {self.why}" if self.why else "")

    def _path(self, v: Any) -> Optional[str]:
        return utf8_problem(v) if isinstance(v, str) else None


@dataclass(frozen=True)
class Widget:
    """How the training panel shows a field.

    Attributes:
        kind: ``"text"``, ``"combo"`` (text with suggestions), ``"int"``, ``"float"``,
            ``"choice"`` (the field's :attr:`Check.values`) or ``"check"``.
        label: the words beside the widget.
        section: ``"paths"``, ``"numbers"``, ``"options"`` or ``"advanced"`` (collapsed).
        low, high, step: the range of a number (``None``: unbounded).
        options: a ``combo``'s suggestions.
        placeholder: grey text in an empty text box.
        required: a text box may not be left empty; the hint says what to type.
        on, off: a ``check``'s field value when ticked and unticked.
        gpu_only: the setting applies to GPU runs only (the panel says so).
        attr: the panel's attribute for the widget (default ``<field>_input``, or
            ``<field>_toggle`` for a check).
    """

    kind: str
    label: str
    section: str = "numbers"
    low: Optional[float] = None
    high: Optional[float] = None
    step: Optional[float] = None
    options: Tuple[str, ...] = ()
    placeholder: str = ""
    required: str = ""
    on: Any = True
    off: Any = False
    gpu_only: bool = False
    attr: str = ""


@dataclass(frozen=True)
class FieldSpec:
    """Everything nbddp says about one ``TrainConfig`` field, beside its type and default.

    Attributes:
        help: one line: the flag's ``--help`` and the widget's tooltip.
        group: the validation group that checks it (:data:`GROUPS`).
        check: the generic rule on its value; ``None`` when its group checks it in code.
        metavar: the flag's placeholder in ``--help`` (default: the type's name).
        launch: decided by the launcher (``gpus``, ``nprocs``, ``resume``), so generated
            torchrun/sbatch commands leave it out.
        widget: how the panel shows it; ``None``: not in the panel.
        resume: whether a resumed run may change it (:data:`RESUME_SAME`, :data:`RESUME_MORE`,
            :data:`RESUME_FREE`); unless declared otherwise a change is refused.
        resume_why: why a change is refused (``same``) or what a change does, in the error.
    """

    help: str
    group: str = "types"
    check: Optional[Check] = None
    metavar: Optional[str] = None
    launch: bool = False
    widget: Optional[Widget] = None
    resume: str = RESUME_SAME
    resume_why: str = "it changes what the run trains"


def spec(default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """``dataclasses.field(default=default, metadata={"nbddp": FieldSpec(**kw)})``."""
    return dataclasses.field(default=default, metadata={"nbddp": FieldSpec(**kw)})


def spec_of(field: dataclasses.Field) -> FieldSpec:
    """The :class:`FieldSpec` of a dataclass field (a bare one for a field declared without)."""
    return field.metadata.get("nbddp") or FieldSpec(help="")


def specs(cls_or_obj: Any):
    """``(field, FieldSpec)`` for every field of a dataclass, in declaration order."""
    return [(f, spec_of(f)) for f in dataclasses.fields(cls_or_obj)]


def flag_name(name: str) -> str:
    """``grad_accum_steps`` -> ``--grad-accum-steps``."""
    return "--" + name.replace("_", "-")


__all__ = ["Check", "FieldSpec", "Widget", "spec", "spec_of", "specs", "flag_name", "GROUPS", "SECTIONS",
           "RESUME_SAME", "RESUME_MORE", "RESUME_FREE"]
