"""A worker function's form: its keyword arguments, read from its signature without running it.

An ``int`` gives an integer field, a ``float`` a number field, a ``bool`` a checkbox, a ``str``
a text field, a ``typing.Literal[...]`` annotation (or ``choices``) a drop-down. Any other value
is shown greyed out: a given kwarg is passed as it is, a default is left to the function.
"""

from __future__ import annotations

import inspect

import html
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import ipywidgets as W

from ..contract.errors import ConfigError
from ..contract.cells import is_cell_function
from ..contract.targets import WorkerSignature, signature_from_inspect, resolve_target, worker_signature
from .layout import GREY, field, grid

_EDITABLE = (bool, int, float, str)


def short(value: Any, limit: int = 160) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass
class _KwField:
    """One keyword argument of a worker as the panel shows it."""

    name: str
    value: Any  # the starting value: the given kwarg, else the signature's default
    given: bool  # from ``kwargs=``: passed to the worker even when the form cannot edit it
    kind: Any = None  # bool/int/float/str, "choice", or None: not editable
    choices: Tuple[Any, ...] = ()
    text: str = ""  # what a non-editable field shows


def _kw_field(name: str, value: Any, given: bool, annotated: Optional[type], choices: Optional[Sequence]) -> _KwField:
    if choices is not None:
        choices = tuple(choices)
        if value not in choices:
            raise ConfigError(f"worker argument {name}={value!r} is not one of its choices {list(choices)}: pass one "
                              f"of them in kwargs={{{name!r}: ...}}")
        return _KwField(name, value, given, "choice", choices)
    kind = type(value) if type(value) in _EDITABLE else None
    if kind is int and annotated is float:  # ``lr: float = 1``: a float field, not an int one
        kind, value = float, float(value)
    return _KwField(name, value, given, kind, text="" if kind else short(value))


def _worker_fields(sig: Optional[WorkerSignature], kwargs: dict, choices: dict, where: str) -> List[_KwField]:
    """The form's fields: the signature's keyword parameters after ``ctx``, with ``kwargs`` applied.

    Raises:
        ConfigError: a parameter has no default and no value in ``kwargs``, or ``kwargs`` /
            ``choices`` name a parameter the function does not take.
    """
    params = {p.name: p for p in sig.params} if sig else {}
    for name in [*kwargs, *choices]:
        p = params.get(name)
        if sig and p is None and not sig.var_kwargs:
            raise ConfigError(f"{where} takes no parameter {name!r}; its keyword parameters: "
                              f"{', '.join(q.name for q in sig.params if q.keyword) or 'none'}")
        if p is not None and not p.keyword:
            raise ConfigError(f"{where}: parameter {name!r} is positional-only, so it cannot be passed in kwargs")
    fields = []
    for p in params.values():
        if not p.keyword and p.has_default:
            continue
        if p.name in kwargs:
            fields.append(_kw_field(p.name, kwargs[p.name], True, p.kind, choices.get(p.name, p.choices)))
        elif p.has_default and p.literal:
            fields.append(_kw_field(p.name, p.default, False, p.kind, choices.get(p.name, p.choices)))
        elif p.has_default:  # not a plain value: the worker keeps its own default
            fields.append(_KwField(p.name, None, False, text=f"{p.default_text}  (the function's default)"))
        else:
            raise ConfigError(f"{where} needs a value for its parameter {p.name!r}, which has no default: pass it "
                              f"with TrainingPanel(..., kwargs={{{p.name!r}: ...}})")
    for name in dict.fromkeys([*kwargs, *choices]):
        if name not in params:  # taken by **kwargs, or the signature could not be read
            value = kwargs[name] if name in kwargs else tuple(choices[name])[0]
            fields.append(_kw_field(name, value, True, None, choices.get(name)))
    return fields


def planned(kwargs: dict) -> Tuple[Optional[int], Optional[int]]:
    """A worker's planned ``(epochs, steps)`` from its ``epochs``/``steps`` arguments, for the progress bar."""
    return tuple(kwargs[k] if type(kwargs.get(k)) is int and kwargs[k] > 0 else None  # type: ignore[return-value]
                 for k in ("epochs", "steps"))


def _kw_widget(f: _KwField) -> W.Widget:
    if f.kind == "choice":
        return field(W.Dropdown, f.name, options=[(str(c), c) for c in f.choices], value=f.value, tooltip=f.name)
    cls = {bool: W.Checkbox, int: W.IntText, float: W.FloatText, str: W.Text}[f.kind]
    extra = {"indent": True} if f.kind is bool else {}
    return field(cls, f.name, value=f.value, tooltip=f.name, **extra)


class WorkerForm:
    """The form of a worker function's keyword arguments.

    Args:
        target: ``"file.py:fn"``, ``"package.module:fn"`` or a function object.
        kwargs: its starting keyword arguments.
        choices: ``{"opt": ["sgd", "adamw"]}``: the values an argument may take.

    Attributes:
        worker: the resolved target, as ``spawn_train`` takes it.
        label: how the panel names it.
        kwargs_inputs: the editable arguments, ``{name: widget}``.
        fixed_inputs: the greyed-out arguments, ``{name: widget}``.
        widgets: what a run in progress locks.
        parts: the form's boxes, top to bottom.

    Raises:
        ConfigError: no such file or function, a parameter without a default is missing from
            ``kwargs``, or ``kwargs``/``choices`` name an unknown one.
    """

    def __init__(self, target: Union[str, Callable[..., Any]], kwargs: Optional[dict],
                 choices: Optional[Dict[str, Sequence]]):
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(f"kwargs must be a dict of keyword arguments, not {type(kwargs).__name__}")
        if choices is not None and not isinstance(choices, dict):
            raise ConfigError("choices must be a dict such as {'opt': ['sgd', 'adamw']}, "
                              f"not {type(choices).__name__}")
        for key, values in (choices or {}).items():
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise ConfigError(f"choices[{key!r}] must be a non-empty list of values, e.g. ['sgd', 'adamw']")
        if is_cell_function(target):
            # Defined in a cell: launched by value, its parameters read from the function itself.
            self.worker, self.label = target, target.__qualname__
            self.signature = signature_from_inspect(inspect.signature(target), target.__qualname__)
        else:
            self.worker = resolve_target(target)  # file exists, function defined: nothing runs yet
            self.label = target if isinstance(target, str) else self.worker
            self.signature = worker_signature(self.worker)
        self.fields = _worker_fields(self.signature, dict(kwargs or {}), dict(choices or {}), f"worker {self.label}")
        self.kwargs_inputs = {f.name: _kw_widget(f) for f in self.fields if f.kind}
        self.fixed_inputs = {
            f.name: field(W.Text, f.name, value=f.text, disabled=True,
                          tooltip=f"{f.name}: {'passed as given' if f.given else 'the function keeps its default'}")
            for f in self.fields if not f.kind}
        self.widgets = list(self.kwargs_inputs.values())
        self.parts = self._parts()

    def _parts(self) -> List[W.Widget]:
        """Editable fields, then the greyed-out ones with the reason."""
        parts: List[W.Widget] = [W.HTML(f"<b>Arguments</b> <span style='{GREY}'>of {html.escape(self.label)} "
                                        "(ctx comes first)</span>")]
        if self.kwargs_inputs:
            parts.append(grid(list(self.kwargs_inputs.values()), 240))
        if not self.fields:
            parts.append(W.HTML(f"<i style='{GREY}'>it takes no keyword arguments</i>"))
        if self.fixed_inputs:
            parts += [W.HTML(f"<i style='{GREY}'>Greyed out: not a number, text, bool or choice. Given kwargs go "
                             "to the worker as they are; defaults stay the function's. Pass another value in "
                             "kwargs=.</i>"),
                      grid(list(self.fixed_inputs.values()), 240)]
        if self.signature is None:
            parts.append(W.HTML(f"<i style='{GREY}'>The signature could not be read (the name is not a plain def "
                                "in the file): the form shows the kwargs you passed.</i>"))
        return parts

    def values(self) -> dict:
        """The keyword arguments passed at Train: the form's values and the given fixed ones.

        A greyed-out argument that was not given is left out: the function keeps its default.
        """
        out = {}
        for f in self.fields:
            if not f.kind:
                if f.given:
                    out[f.name] = f.value
                continue
            value = self.kwargs_inputs[f.name].value
            out[f.name] = f.kind(value) if f.kind in _EDITABLE else value
        return out

    def set_busy(self, busy: bool) -> None:
        for w in self.widgets:
            w.disabled = busy


__all__ = ["WorkerForm", "planned", "short"]
