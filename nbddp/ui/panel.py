"""``TrainingPanel``: choose GPUs (or CPU processes), set the config, train, watch, stop.

Two kinds of run: the built-in classifier (a :class:`TrainConfig`: model, data, SyncBN...) and
any worker function in a file (``"my_worker.py:train"``: a form of its keyword arguments, read
from its signature without running the file, and a chart of every scalar it logs).

Kernel side only. Two threads touch the panel, and each has its reason:

* The Train button's callback (and :meth:`TrainingPanel.run`) runs on the kernel's main thread,
  and that is where ``spawn_train`` must be called: the workers' parent-death signal is tied to
  the thread that started them, and the kernel's main thread lives as long as the kernel.
* The run's events (log lines, progress, metrics, the end) arrive on its monitor thread. They
  only set widget values, which ipykernel sends from any thread, and draw the chart on a bare
  Agg canvas into an ``Image`` widget (from a timer thread, at most about once a second: a
  worker may log every step). Nothing here prints or uses an ``Output`` widget's ``with``
  block, whose output would land in whichever cell happens to run.
"""

from __future__ import annotations

import html
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import ipywidgets as W

from ..config import OPTIMIZERS, TrainConfig
from ..errors import ConfigError, NbddpError, TrainingInterrupted, WorkerError
from ..forkserver import prewarm
from ..gpus import IDLE, IDLE_RULE, gpu_setup_problem, list_gpus, preselected_gpus
from ..handle import RunHandle, TrainResult
from ..launch import spawn_train
from ..system import cpu_cores
from ..targets import WorkerSignature, resolve_target, worker_signature
from .charts import scalar_charts_png, scalar_series, training_curves_png

COMMON_MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "mobilenet_v3_small", "mobilenet_v3_large",
                 "efficientnet_b0", "efficientnet_b1", "regnet_y_400mf", "convnext_tiny", "densenet121", "vgg16_bn")
FREEZE_REASON = "frozen BatchNorm layers keep their statistics: nothing to synchronise"
LOG_LINES = 200
CHART_EVERY_S = 1.0  # the chart is redrawn at most this often (or 3x its drawing time, if longer)
_EDITABLE = (bool, int, float, str)

_LABEL = {"description_width": "110px"}
# Full-width widgets get side margins of 0: ipywidgets gives every widget a 2px margin, and
# "width: 100%" plus margins overflows its box (clipped inputs, a horizontal scrollbar).
_FULL = dict(width="100%", margin="2px 0")
_COLORS = {"info": "var(--jp-ui-font-color1, #333)", "ok": "var(--jp-success-color1, #2e7d32)",
           "warn": "var(--jp-warn-color1, #e65100)", "error": "var(--jp-error-color1, #c62828)"}
# At most 180px: a short log stays short instead of sitting at the bottom of an empty box.
_LOG_BOX = ("max-height:180px;min-height:2.5em;overflow-y:auto;"
            "display:flex;flex-direction:column-reverse;"  # keeps the end in view
            "border:1px solid var(--jp-border-color2,#ddd);padding:4px 6px;background:var(--jp-layout-color1,#fff)")


def _gpu_choice(gpus: Any) -> Optional[set]:
    """The GPUs the caller chose (a set of ids), or None to pre-select the idle ones."""
    if gpus is None or gpus == IDLE or (not isinstance(gpus, str) and not tuple(gpus)):
        return None
    return set(gpus)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _field(widget_cls, description: str, **kw):
    return widget_cls(description=description, style=_LABEL, layout=W.Layout(**_FULL), **kw)


def _grid(children: list, min_px: int) -> W.GridBox:
    return W.GridBox(children, layout=W.Layout(grid_template_columns=f"repeat(auto-fit, minmax({min_px}px, 1fr))",
                                               grid_gap="4px 16px", width="100%"))


def _count(v: Any) -> Optional[int]:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def gpu_memory_text(record: dict) -> Optional[str]:
    """``"GPU memory 3.2 GiB peak, 4.0 reserved"`` from an epoch record's peaks, or None off the GPU."""
    alloc, reserved = record.get("gpu_mem_alloc_gib"), record.get("gpu_mem_reserved_gib")
    if not isinstance(alloc, (int, float)) or isinstance(alloc, bool) or not math.isfinite(alloc):
        return None
    more = f", {reserved:.1f} reserved" if isinstance(reserved, (int, float)) and math.isfinite(reserved) else ""
    return f"GPU memory {alloc:.1f} GiB peak{more}"


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ------------------------------------------------------------------------ a worker's keyword arguments
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
    return _KwField(name, value, given, kind, text="" if kind else _short(value))


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


def _planned(kwargs: dict) -> Tuple[Optional[int], Optional[int]]:
    """A worker's planned ``(epochs, steps)`` from its ``epochs``/``steps`` arguments, for the progress bar."""
    return tuple(kwargs[k] if type(kwargs.get(k)) is int and kwargs[k] > 0 else None  # type: ignore[return-value]
                 for k in ("epochs", "steps"))


def _kw_widget(f: _KwField) -> W.Widget:
    if f.kind == "choice":
        return _field(W.Dropdown, f.name, options=[(str(c), c) for c in f.choices], value=f.value, tooltip=f.name)
    cls = {bool: W.Checkbox, int: W.IntText, float: W.FloatText, str: W.Text}[f.kind]
    extra = {"indent": True} if f.kind is bool else {}
    return _field(cls, f.name, value=f.value, tooltip=f.name, **extra)


class TrainingPanel:
    """A widget panel that launches a run, shows it live, and stops it.

    Either the built-in classifier, set up by a :class:`TrainConfig` (model, data, SyncBN,
    freezing, weights...), or any worker function: ``"my_worker.py:train"``,
    ``"package.module:train"`` or a function object, as :func:`nbddp.spawn_train` accepts. A
    worker gets a form of its keyword arguments, from ``kwargs`` and the defaults in its
    signature: an ``int`` gives an integer field, a ``float`` a number field, a ``bool`` a
    checkbox, a ``str`` a text field, and a ``typing.Literal[...]`` annotation (or ``choices``)
    a drop-down. The signature is read from the file with ``ast``: the kernel never runs it.
    Any other value (``None``, a list, ``torch.device("cpu")``) is shown greyed out: a given
    kwarg is passed as it is, a default is left to the function. A live chart draws every
    scalar the worker reports with ``ctx.log(...)``, against ``step``, else ``epoch``.

    Args:
        target: a :class:`TrainConfig` (default: ``TrainConfig()``), or a worker target.
        kwargs: a worker's starting keyword arguments (not with a ``TrainConfig``).
        choices: ``{"opt": ["sgd", "adamw"]}``: the values a worker's argument may take.
        nprocs: a worker's starting number of CPU processes (default 2; a ``TrainConfig``
            brings its own).
        gpus: a worker's starting GPU choice (default: every GPU).
        runs_dir: where a worker's run folders go (default ``"runs"``).
        name: suffix of a worker's run folders (default: file and function name).
        config: the older name of ``target``, for a ``TrainConfig``.

    Attributes:
        handle: the :class:`RunHandle` of the current or last run (``None`` before the first).
        result: the last :class:`TrainResult` (``None`` before a run succeeded or was stopped).
        widget: the root ``VBox``; ``display(panel)`` or a cell ending in ``panel`` shows it.
        kwargs_inputs: a worker's editable arguments, ``{name: widget}`` (empty for a config).
        fixed_inputs: a worker's greyed-out arguments, ``{name: widget}``.
        chart_keys: the logged keys the worker chart draws (after a redraw).

    Raises:
        ConfigError: the worker cannot be launched (no such file or function), a parameter
            without a default is missing from ``kwargs``, or ``kwargs`` names an unknown one.

    Example:
        >>> panel = TrainingPanel(TrainConfig(data_path="data/digits", model="resnet18"))
        >>> panel                      # then click Train, or, in CI and scripts:
        >>> result = panel.run()       # same widgets, blocking, returns the TrainResult
        >>> TrainingPanel("my_worker.py:train", kwargs={"steps": 500, "lr": 0.01})
    """

    def __init__(self, target: Union[TrainConfig, str, Callable[..., Any], None] = None, *,
                 kwargs: Optional[dict] = None, choices: Optional[Dict[str, Sequence]] = None,
                 nprocs: Optional[int] = None, gpus: Optional[Sequence[int]] = None,
                 runs_dir: Optional[str] = None, name: Optional[str] = None, config: Optional[TrainConfig] = None):
        prewarm()  # the forkserver starts while the user fills in the panel (NBDDP_PREWARM=0: off)
        if config is not None:
            if target is not None:
                raise ConfigError("pass the TrainConfig once: TrainingPanel(cfg)")
            target = config
        self._worker: Optional[str] = None  # the worker's spec; None for the built-in classifier
        self._fields: List[_KwField] = []
        if target is None or isinstance(target, TrainConfig):
            if any(v is not None for v in (kwargs, choices, nprocs, gpus, runs_dir, name)):
                raise ConfigError("with a TrainConfig, put every setting in the config "
                                  "(cfg.replace(nprocs=2, runs_dir=...)); kwargs/choices are for worker functions")
            self._base = target if target is not None else TrainConfig()
            self._given = target is not None
            self._start_gpus, self._start_nprocs = _gpu_choice(self._base.gpus), self._base.nprocs if self._given else 2
            self._plan: Tuple[Optional[int], Optional[int]] = (self._base.epochs, None)
        else:
            self._setup_worker(target, kwargs, choices)
            self._start_gpus, self._start_nprocs = _gpu_choice(gpus), nprocs or 2
            self._runs_dir, self._name = runs_dir or "runs", name
            self._plan = _planned({f.name: f.value for f in self._fields})
        self.handle: Optional[RunHandle] = None
        self.result: Optional[TrainResult] = None
        self.chart_keys: List[str] = []
        self.kwargs_inputs: Dict[str, W.Widget] = {}
        self.fixed_inputs: Dict[str, W.Widget] = {}
        self._lock = threading.RLock()
        self._draw_lock = threading.Lock()
        self._lines: deque = deque(maxlen=LOG_LINES)
        self._log_timer: Optional[threading.Timer] = None
        self._chart_timer: Optional[threading.Timer] = None
        self._chart_next, self._chart_cost = 0.0, 0.0
        self._ended = threading.Event()
        self._ended.set()
        self._busy = False
        self._got_progress = False
        self._sync_saved: Optional[bool] = None  # SyncBN value from before freeze-layers was ticked
        self._gpus = list_gpus()  # NVML / nvidia-smi: the kernel never initialises CUDA
        self._build()

    def _setup_worker(self, target: Union[str, Callable[..., Any]], kwargs: Optional[dict],
                      choices: Optional[Dict[str, Sequence]]) -> None:
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(f"kwargs must be a dict of keyword arguments, not {type(kwargs).__name__}")
        if choices is not None and not isinstance(choices, dict):
            raise ConfigError("choices must be a dict such as {'opt': ['sgd', 'adamw']}, "
                              f"not {type(choices).__name__}")
        for key, values in (choices or {}).items():
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise ConfigError(f"choices[{key!r}] must be a non-empty list of values, e.g. ['sgd', 'adamw']")
        self._worker = resolve_target(target)  # file exists, function defined: nothing runs yet
        self._label = target if isinstance(target, str) else self._worker
        self._signature = worker_signature(self._worker)
        self._fields = _worker_fields(self._signature, dict(kwargs or {}), dict(choices or {}), f"worker {self._label}")

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        title = "nbddp · DistributedDataParallel training"
        if self._worker is not None:
            title += f" · <code>{html.escape(self._label)}</code>"
        self._form: List[W.Widget] = []  # what is locked while a run goes on
        devices = self._devices_box()
        form = self._config_form() if self._worker is None else self._kwargs_form()
        controls = self._controls()
        live = self._live_area()
        if self._worker is None:
            self._apply_freeze_rule()
        self.widget = W.VBox([W.HTML(f"<b style='font-size:1.1em'>{title}</b>"), devices, *form, *controls, *live],
                             layout=W.Layout(width="100%", max_width="1000px", padding="8px",
                                             border="1px solid var(--jp-border-color2, #ddd)"))

    def _devices_box(self) -> W.Box:
        """The GPU picker (one checkbox per GPU, with its memory and load), or the CPU process count."""
        self.gpu_checkboxes: List[W.Checkbox] = []
        self.nprocs_input: Optional[W.BoundedIntText] = None
        if self._gpus:
            # Chosen by the caller, else the idle ones only: a good colleague leaves busy GPUs alone.
            idle, note = preselected_gpus(self._gpus)
            chosen = self._start_gpus if self._start_gpus is not None else set(idle)
            self.gpu_checkboxes = [W.Checkbox(value=g.index in chosen, description=g.label(), indent=False,
                                              layout=W.Layout(width="auto")) for g in self._gpus]
            refresh = W.Button(description="Refresh", icon="refresh", tooltip="read memory and utilisation again",
                               layout=W.Layout(width="110px"))
            refresh.on_click(self._refresh_gpus)
            self.device_note = W.HTML("<b>GPUs</b> (one process each, nccl)")
            muted = "color:var(--jp-ui-font-color2,#666)"
            self.gpu_rule_note = W.HTML(
                f"<span style='{muted}'>Pre-selected: the idle GPUs ({html.escape(IDLE_RULE)})"
                f"{'. ' + html.escape(note) if note else ''}</span>")
            self._form += self.gpu_checkboxes
            return W.VBox([self.device_note, *self.gpu_checkboxes, self.gpu_rule_note, refresh])
        default = self._start_nprocs
        cores = cpu_cores()
        # 1..cores, unless the caller asks for more (oversubscribing works, slowly): keep its value.
        self.nprocs_input = W.BoundedIntText(value=default, min=1, max=max(cores, default), description="CPU processes",
                                             style=_LABEL, layout=W.Layout(width="220px"))
        # Several MIG instances in CUDA_VISIBLE_DEVICES list no GPU: say why, not just "none".
        problem = gpu_setup_problem()
        why = f" ({html.escape(problem)})" if problem else ""
        self.device_note = W.HTML(
            f"<span style='color:var(--jp-ui-font-color2,#666)'>No GPU found{why}: training runs on CPU "
            f"processes with gloo ({cores} cores here).</span>", layout=W.Layout(margin="0 0 0 12px"))
        self._form.append(self.nprocs_input)
        return W.HBox([self.nprocs_input, self.device_note], layout=W.Layout(align_items="center",
                                                                            flex_flow="row wrap"))

    def _config_form(self) -> List[W.Widget]:
        """The built-in classifier's settings: paths, numbers, then the SyncBN/freeze/AMP/data options."""
        b = self._base
        self.model_input = _field(W.Combobox, "Model", value=b.model, options=COMMON_MODELS, ensure_option=False,
                                  placeholder="torchvision name, e.g. resnet34")
        self.data_input = _field(W.Text, "Data folder", value=b.data_path, placeholder="root/<class>/<image>")
        self.weights_input = _field(W.Text, "Weights file", value=b.weights or "",
                                    placeholder="optional: .pth / .safetensors / run folder")
        self.epochs_input = _field(W.BoundedIntText, "Epochs", value=b.epochs, min=1, max=100_000)
        self.batch_size_input = _field(W.BoundedIntText, "Batch / process", value=b.batch_size, min=1, max=65_536)
        self.lr_input = _field(W.FloatText, "Learning rate", value=b.lr, step=0.0001)
        self.image_size_input = _field(W.BoundedIntText, "Image size", value=b.image_size, min=8, max=4096, step=32)
        paths = _grid([self.data_input, self.weights_input], 320)
        numbers = _grid([self.model_input, self.epochs_input, self.batch_size_input, self.lr_input,
                         self.image_size_input], 240)

        self.sync_bn_toggle = W.Checkbox(value=b.sync_bn, description="SyncBN (BatchNorm statistics over all processes)",
                                         indent=False, layout=W.Layout(width="auto"))
        self.sync_bn_reason = W.HTML("", layout=W.Layout(margin="0 0 0 10px"))
        self.freeze_toggle = W.Checkbox(value=b.freeze_layers, description="Freeze layers (train only the head)",
                                        indent=False, layout=W.Layout(width="auto"))
        self.amp_toggle = W.Checkbox(value=b.amp, description="AMP (mixed precision)", indent=False,
                                     layout=W.Layout(width="auto"))
        amp_note = W.HTML("<i style='color:var(--jp-ui-font-color2,#666)'>applies on GPU only"
                          f"{'; CPU runs ignore it' if not self._gpus else ''}</i>", layout=W.Layout(margin="0 0 0 10px"))
        self.tensor_toggle = W.Checkbox(value=b.data_pipeline == "tensor", indent=False, layout=W.Layout(width="auto"),
                                        description="Fast data (decode once, augment batches on the device)")
        self.freeze_toggle.observe(self._apply_freeze_rule, names="value")
        row = dict(align_items="center", flex_flow="row wrap")
        options = W.VBox([W.HBox([self.sync_bn_toggle, self.sync_bn_reason], layout=W.Layout(**row)),
                          self.freeze_toggle, W.HBox([self.amp_toggle, amp_note], layout=W.Layout(**row)),
                          self.tensor_toggle])
        self._form += [self.model_input, self.data_input, self.weights_input, self.epochs_input, self.batch_size_input,
                       self.lr_input, self.image_size_input, self.sync_bn_toggle, self.freeze_toggle, self.amp_toggle,
                       self.tensor_toggle]
        return [paths, numbers, options, self._advanced_form()]

    def _advanced_form(self) -> W.Accordion:
        """The training recipe, in a collapsed "Advanced" section: optimizer, accumulation, warm-up..."""
        b = self._base
        self.optimizer_input = _field(W.Dropdown, "Optimizer", options=list(OPTIMIZERS), value=b.optimizer)
        self.grad_accum_input = _field(W.BoundedIntText, "Accumulate", value=b.grad_accum_steps, min=1, max=4096,
                                       tooltip="batches per optimizer step (gradient accumulation)")
        self.warmup_input = _field(W.BoundedIntText, "Warm-up epochs", value=b.warmup_epochs, min=0, max=100_000,
                                   tooltip="epochs of linear learning-rate warm-up before the cosine schedule")
        self.label_smoothing_input = _field(W.BoundedFloatText, "Label smoothing", value=b.label_smoothing, min=0.0,
                                            max=0.99, step=0.05, tooltip="of the training loss, in [0, 1)")
        self.early_stop_input = _field(W.BoundedIntText, "Early stop after", value=b.early_stop_patience, min=0,
                                       max=100_000, tooltip="epochs without a better validation accuracy (0: off)")
        self.compile_toggle = W.Checkbox(value=b.compile, indent=False, layout=W.Layout(width="auto"),
                                         description="torch.compile (the first epoch reports the compile time)")
        grey = "color:var(--jp-ui-font-color2,#666)"
        note = W.HTML(f"<i style='{grey}'>Accumulate k: one optimizer step every k batches (k × the global batch). "
                      "Early stop after n: every process stops once validation accuracy has not improved for n "
                      "epochs (0: off); the export keeps the best epoch.</i>", layout=W.Layout(**_FULL))
        inputs = [self.optimizer_input, self.grad_accum_input, self.warmup_input, self.label_smoothing_input,
                  self.early_stop_input]
        self._form += inputs + [self.compile_toggle]
        self.advanced = W.Accordion(children=[W.VBox([_grid(inputs, 240), self.compile_toggle, note])],
                                    selected_index=None, layout=W.Layout(**_FULL))
        self.advanced.set_title(0, "Advanced")
        return self.advanced

    def _kwargs_form(self) -> List[W.Widget]:
        """A worker's keyword arguments: editable fields, then the greyed-out ones with the reason."""
        self.kwargs_inputs = {f.name: _kw_widget(f) for f in self._fields if f.kind}
        self.fixed_inputs = {
            f.name: _field(W.Text, f.name, value=f.text, disabled=True,
                           tooltip=f"{f.name}: {'passed as given' if f.given else 'the function keeps its default'}")
            for f in self._fields if not f.kind}
        self._form += list(self.kwargs_inputs.values())
        grey = "color:var(--jp-ui-font-color2,#666)"
        parts: List[W.Widget] = [W.HTML(f"<b>Arguments</b> <span style='{grey}'>of {html.escape(self._label)} "
                                        "(ctx comes first)</span>")]
        if self.kwargs_inputs:
            parts.append(_grid(list(self.kwargs_inputs.values()), 240))
        if not self._fields:
            parts.append(W.HTML(f"<i style='{grey}'>it takes no keyword arguments</i>"))
        if self.fixed_inputs:
            parts += [W.HTML(f"<i style='{grey}'>Greyed out: not a number, text, bool or choice. Given kwargs go "
                             "to the worker as they are; defaults stay the function's. Pass another value in "
                             "kwargs=.</i>"),
                      _grid(list(self.fixed_inputs.values()), 240)]
        if self._signature is None:
            parts.append(W.HTML(f"<i style='{grey}'>The signature could not be read (the name is not a plain def "
                                "in the file): the form shows the kwargs you passed.</i>"))
        return parts

    def _controls(self) -> List[W.Widget]:
        """Train and Stop, and the status line under them."""
        self.train_button = W.Button(description="Train", icon="play", button_style="primary",
                                     layout=W.Layout(width="120px"))
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True,
                                    layout=W.Layout(width="120px"))
        self.train_button.on_click(self._on_train)
        self.stop_button.on_click(lambda _b: self.stop())
        self.status = W.HTML("", layout=W.Layout(**_FULL))
        return [W.HBox([self.train_button, self.stop_button]), self.status]

    def _live_area(self) -> List[W.Widget]:
        """Progress bar and label, the chart, rank 0's log."""
        self.progress_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="35%", min_width="160px"))
        self.progress_label = W.HTML("not started", layout=W.Layout(flex="1 1 auto", margin="0 0 0 10px"))
        self.chart = W.Image(value=self._chart_png([]), format="png",
                             layout=W.Layout(max_width="960px", height="auto", **_FULL))
        self.log = W.HTML(self._log_html(), layout=W.Layout(**_FULL))
        return [W.HBox([self.progress_bar, self.progress_label], layout=W.Layout(align_items="center")),
                self.chart, W.HTML("<b>rank 0 log</b>"), self.log]

    def _refresh_gpus(self, _button=None) -> None:
        fresh = {g.index: g for g in list_gpus()}
        for box, g in zip(self.gpu_checkboxes, self._gpus):
            if g.index in fresh:
                box.description = fresh[g.index].label()

    def _apply_freeze_rule(self, _change=None) -> None:
        # TrainConfig refuses sync_bn with freeze_layers; the panel makes the pair impossible.
        if self.freeze_toggle.value:
            if self._sync_saved is None:
                self._sync_saved = self.sync_bn_toggle.value
            self.sync_bn_toggle.value = False
            self.sync_bn_toggle.disabled = True
            self.sync_bn_reason.value = f"<i style='color:var(--jp-ui-font-color2,#666)'>off: {FREEZE_REASON}</i>"
        else:
            if self._sync_saved is not None:
                self.sync_bn_toggle.value, self._sync_saved = self._sync_saved, None
            self.sync_bn_toggle.disabled = self._busy
            self.sync_bn_reason.value = ""

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # ------------------------------------------------------------------ the config
    @property
    def config(self) -> TrainConfig:
        """The :class:`TrainConfig` the widgets describe (validated).

        Raises:
            ConfigError: a value is invalid; the message names the field and the fix, or the
                panel runs a worker function (its settings are :attr:`worker_kwargs`).
        """
        if self._worker is not None:
            raise ConfigError(f"this panel runs the worker {self._label}: its settings are panel.worker_kwargs")
        data = self.data_input.value.strip()
        if not data:
            raise ConfigError("Data folder is empty: type the folder that holds one sub-folder per class")
        try:
            lr = float(self.lr_input.value)
        except (TypeError, ValueError):
            raise ConfigError(f"Learning rate {self.lr_input.value!r} is not a number") from None
        changes: dict = dict(
            model=self.model_input.value.strip(), data_path=data, weights=self.weights_input.value.strip() or None,
            epochs=int(self.epochs_input.value), batch_size=int(self.batch_size_input.value), lr=lr,
            image_size=int(self.image_size_input.value), freeze_layers=bool(self.freeze_toggle.value),
            sync_bn=bool(self.sync_bn_toggle.value) and not self.freeze_toggle.value, amp=bool(self.amp_toggle.value),
            data_pipeline="tensor" if self.tensor_toggle.value else "pil",
            optimizer=self.optimizer_input.value, grad_accum_steps=int(self.grad_accum_input.value),
            warmup_epochs=int(self.warmup_input.value), label_smoothing=float(self.label_smoothing_input.value),
            early_stop_patience=int(self.early_stop_input.value), compile=bool(self.compile_toggle.value))
        gpus, nprocs = self._chosen_devices()
        changes.update(gpus=gpus, **({} if gpus else {"nprocs": nprocs}))
        return self._base.replace(**changes)

    @property
    def worker_kwargs(self) -> dict:
        """The keyword arguments a worker panel passes at Train: the form's values and the given fixed ones.

        A greyed-out argument that was not given is left out: the function keeps its default.
        """
        if self._worker is None:
            raise ConfigError("this panel runs the built-in classifier: its settings are panel.config")
        out = {}
        for f in self._fields:
            if not f.kind:
                if f.given:
                    out[f.name] = f.value
                continue
            value = self.kwargs_inputs[f.name].value
            out[f.name] = f.kind(value) if f.kind in _EDITABLE else value
        return out

    def _chosen_devices(self) -> Tuple[Tuple[int, ...], Optional[int]]:
        """``(gpus, None)`` from the ticked GPUs, or ``((), nprocs)`` on a machine without one."""
        if not self._gpus:
            return (), int(self.nprocs_input.value)
        chosen = tuple(g.index for g, box in zip(self._gpus, self.gpu_checkboxes) if box.value)
        if not chosen:
            raise ConfigError("no GPU selected: tick at least one GPU in the panel")
        return chosen, None

    # ------------------------------------------------------------------ public actions
    @property
    def running(self) -> bool:
        """True from Train until the run's end has been shown."""
        return not self._ended.is_set()

    def run(self) -> TrainResult:
        """Train with the current settings and block until the end, updating the same widgets.

        Rank 0's log is also printed in the cell. This is how CI and scripts drive the notebook.

        Returns:
            The :class:`TrainResult`.

        Raises:
            ConfigError, DataError, WeightsError: invalid settings, found before any process starts.
            WorkerError: a worker failed (the message names the rank).
            TrainingInterrupted: the cell was interrupted; every worker was stopped and reaped.
        """
        self._start(echo=True)
        return self.wait()

    def wait(self, timeout: Optional[float] = None) -> TrainResult:
        """Block until the current run has ended and been shown; return its result or raise its error.

        An Interrupt (Jupyter's stop button, Ctrl-C) while waiting stops the run, waits until
        every worker is gone, and raises :class:`TrainingInterrupted`.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the run goes on).
        """
        handle = self.handle
        if handle is None:
            raise NbddpError("nothing to wait for: click Train or call panel.run() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._ended.wait(0.1):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run is still going after {timeout} s: {handle.run_dir}")
        except KeyboardInterrupt:
            # The monitor thread owns the processes: ask it for the staged shutdown, wait for it.
            handle.stop(wait=False)
            self._ended.wait()
            if isinstance(handle.outcome, BaseException):
                raise handle.outcome from None
            raise TrainingInterrupted.for_run("interrupted", handle.world_size, handle.run_dir) from None
        if isinstance(handle.outcome, BaseException):
            raise handle.outcome
        return handle.outcome

    def stop(self) -> None:
        """Ask the run to stop: workers finish their step and save; SIGTERM only if they stop beating (staged)."""
        handle = self.handle
        if handle is None or not handle.running:
            return
        handle.stop(wait=False)  # the monitor thread runs the staged shutdown and reaps
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        self._status("warn", "Stopping: workers leave at their next step, then save and export (SIGTERM if "
                             f"their heartbeat stops, or after {handle.stop_timeout_s:g} s)…")

    # ------------------------------------------------------------------ starting
    def _on_train(self, _button=None) -> None:
        try:
            self._start(echo=False)
        except Exception:  # noqa: BLE001 - already shown in the status area; never escape a callback
            pass

    def _start(self, echo: bool) -> RunHandle:
        if self.running:
            self._status("warn", "A run is in progress: stop it first.")
            raise NbddpError("a run is in progress: stop it first")
        try:
            target, launch, gpus, nprocs = self._launch_args()
        except ConfigError as exc:
            self._show_error(exc, "Invalid setting")
            raise
        self._reset_live()
        self._set_busy(True)
        where = f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}" if gpus \
            else f"{nprocs} CPU process{'es' if nprocs > 1 else ''}"
        self._status("info", f"Checking the data, then starting {where}…" if self._worker is None
                     else f"Starting {where}…")
        self.progress_label.value = f"starting {where} ({'nccl' if gpus else 'gloo'})…"
        self.progress_bar.bar_style = "info"
        try:
            handle = spawn_train(target, block=False, echo=echo, **launch)  # here, on the main thread: see module doc
        except BaseException as exc:
            self._set_busy(False)
            self.progress_label.value = "not started"
            self.progress_bar.bar_style = ""
            self._show_error(exc, "Not started")
            raise
        with self._lock:
            self.handle = handle
            self._ended.clear()
        handle.subscribe(self._on_event)
        self._status("info", f"Training on {where} · run folder <code>{html.escape(str(handle.run_dir))}</code>")
        # Anything the monitor thread read before the subscription is still on the handle.
        if handle.progress:
            self._on_progress(handle.progress)
        if handle.metrics:
            self._on_metrics()
        if not handle.running and handle.outcome is not None:
            self._on_end(handle.outcome)
        return handle

    def _launch_args(self) -> Tuple[Any, dict, Tuple[int, ...], Optional[int]]:
        """``(target, spawn_train keywords, gpus, nprocs)`` from the widgets; sets the run's plan."""
        if self._worker is None:
            cfg = self.config
            self._plan = (cfg.epochs, None)
            return cfg, {}, tuple(cfg.gpus), cfg.nprocs
        kwargs = self.worker_kwargs
        gpus, nprocs = self._chosen_devices()
        self._plan = _planned(kwargs)
        launch = dict(kwargs=kwargs, runs_dir=self._runs_dir, name=self._name)
        launch.update(gpus=list(gpus)) if gpus else launch.update(nprocs=nprocs)
        return self._worker, launch, gpus, nprocs

    def _reset_live(self) -> None:
        with self._lock:
            self._lines.clear()
        self.log.value = self._log_html()
        self.progress_bar.value = 0.0
        self._got_progress = False
        self.chart.value = self._chart_png([])
        self.result = None

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        for w in self._form:
            w.disabled = busy
        if self._worker is None:
            self._apply_freeze_rule()  # re-disables SyncBN while frozen
        self.train_button.disabled = busy
        self.stop_button.disabled = not busy
        self.stop_button.description = "Stop"

    # ------------------------------------------------------------------ events (monitor thread)
    def _on_event(self, kind: str, payload: Any) -> None:
        if kind == "line":
            self._on_line(payload)
        elif kind == "progress":
            self._on_progress(payload)
        elif kind == "metrics":
            self._on_metrics()
        elif kind == "end":
            self._on_end(payload)

    def _on_line(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            # Lines come in bursts: redraw at most ~4 times a second, and always soon after the last.
            if self._log_timer is None:
                self._log_timer = threading.Timer(0.25, self._flush_log)
                self._log_timer.daemon = True
                self._log_timer.start()

    def _flush_log(self) -> None:
        with self._lock:
            self._log_timer = None
            text = self._log_html()
        self.log.value = text

    def _log_html(self) -> str:
        body = html.escape("\n".join(self._lines)) or "<span style='color:#888'>rank 0's output appears here</span>"
        return (f"<div style='{_LOG_BOX}'><pre style='margin:0;white-space:pre-wrap;font-size:12px;"
                f"line-height:1.35'>{body}</pre></div>")

    def _on_progress(self, p: dict) -> None:
        self._got_progress = True
        epochs, planned_steps = self._plan
        epoch, step = _count(p.get("epoch")), _count(p.get("step"))
        per_epoch = _count(p.get("steps")) or _count(p.get("total"))  # the built-in's and a worker's word
        in_epoch = step / per_epoch if step is not None and per_epoch else 0
        if epochs and (epoch is not None or per_epoch):
            done: Optional[float] = ((epoch or 0) + in_epoch) / epochs
        elif step is not None and (per_epoch or planned_steps):
            done = step / (per_epoch or planned_steps)
        else:
            done = None  # nothing to measure against: the label still counts
        if done is not None:
            self.progress_bar.value = max(0.0, min(1.0, done))
        parts = []
        if epoch is not None:
            parts.append(f"epoch {epoch + 1}/{epochs}" if epochs else f"epoch {epoch + 1}")
        if step is not None:
            of = per_epoch or (planned_steps if epoch is None else None)
            parts.append(f"step {step}/{of}" if of else f"step {step}")
        if isinstance(p.get("loss"), (int, float)):
            parts.append(f"loss {p['loss']:.4f}")
        if isinstance(p.get("images_per_s"), (int, float)):
            parts.append(f"{p['images_per_s']:,.0f} img/s")
        if self.handle is not None:
            parts.append(f"{_duration(time.time() - self.handle.started_at)} elapsed")
            # The last finished epoch's peaks, max over the GPUs (the built-in worker's records).
            memory = gpu_memory_text(self.handle.metrics[-1]) if self.handle.metrics else None
            if memory:
                parts.append(memory)
        self.progress_label.value = " · ".join(parts)

    def _on_metrics(self) -> None:
        handle = self.handle
        metrics = list(handle.metrics) if handle is not None else []  # appended before the event
        with self._lock:  # redrawn at most every CHART_EVERY_S: a worker may log every step
            if self._chart_timer is None:
                self._chart_timer = threading.Timer(max(0.0, self._chart_next - time.monotonic()), self._redraw_chart)
                self._chart_timer.daemon = True
                self._chart_timer.start()
        if self._worker is not None:
            if metrics and handle is not None and not handle.progress:
                self._on_progress(metrics[-1])  # a worker that only logs: its records move the bar
            return
        accs = [(m["val_accuracy"], m["epoch"]) for m in metrics if isinstance(m.get("val_accuracy"), (int, float))]
        if accs and self.running and not self.stop_button.disabled:
            best, at = max(accs, key=lambda a: (a[0], -a[1]))
            last = metrics[-1]
            memory = gpu_memory_text(last)
            self._status("info", f"Training · epoch {last.get('epoch', 0) + 1}/{self._plan[0]} done · val accuracy "
                                 f"{last.get('val_accuracy', float('nan')):.4f} · best {best:.4f} (epoch {at + 1}) · "
                                 f"{html.escape(memory) + ' · ' if memory else ''}"
                                 f"run folder <code>{html.escape(str(handle.run_dir))}</code>")

    def _redraw_chart(self) -> None:
        with self._lock:
            self._chart_timer = None
            self._chart_next = time.monotonic() + max(CHART_EVERY_S, 3 * self._chart_cost)
        with self._draw_lock:  # the list is read inside: the last drawing has every record
            t0 = time.monotonic()
            handle = self.handle
            self.chart.value = self._chart_png(list(handle.metrics) if handle is not None else [])
            self._chart_cost = time.monotonic() - t0

    def _chart_png(self, metrics: List[dict]) -> bytes:
        if self._worker is None:
            return training_curves_png(metrics, self._plan[0])
        self.chart_keys = list(scalar_series(metrics))
        return scalar_charts_png(metrics)

    def _on_end(self, outcome: Any) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            timers, self._log_timer, self._chart_timer = (self._log_timer, self._chart_timer), None, None
        for timer in timers:
            if timer is not None:
                timer.cancel()
        self._flush_log()
        self._redraw_chart()  # every record, whatever the throttle held back
        handle = self.handle
        if isinstance(outcome, TrainResult):
            self.result = outcome
            self._show_result(outcome)
        elif isinstance(outcome, TrainingInterrupted):
            self.progress_bar.bar_style = "warning"
            self._status("warn", f"<b>Stopped.</b> {html.escape(str(outcome))}")
        else:
            self.progress_bar.bar_style = "danger"
            self._show_error(outcome, "Training failed")
        if handle is not None:
            ended = f"ended after {_duration(time.time() - handle.started_at)}"
            self.progress_label.value = (f"{self.progress_label.value} · {ended}" if self._got_progress
                                         else f"{ended}, before the first training step")
        self._set_busy(False)
        self._ended.set()

    # ------------------------------------------------------------------ status area
    def _status(self, level: str, text_html: str) -> None:
        # ipywidgets sets HTML widgets' line-height to one widget row (28px): a status that wraps
        # (run folder, weights path) reads better at normal text spacing; long paths may break anywhere.
        self.status.value = (f"<div style='color:{_COLORS[level]};white-space:normal;line-height:1.45;"
                             f"overflow-wrap:anywhere;padding:3px 0'>{text_html}</div>")

    def _show_result(self, r: TrainResult) -> None:
        unit = ("GPU" if r.backend == "nccl" else "CPU process") + ("" if r.world_size == 1 else
                                                                  "s" if r.backend == "nccl" else "es")
        n = len(r.metrics)
        on = f"in {_duration(r.seconds)} on {r.world_size} {unit} ({r.backend})"
        if self._worker is None:
            v = r.value if isinstance(r.value, dict) else {}
            facts = [f"{n} epoch{'' if n == 1 else 's'} completed {on}"]
            if v.get("early_stopped"):
                facts.append(f"stopped early: no better val accuracy for {v.get('early_stop_patience')} epochs")
            if isinstance(v.get("best_accuracy"), (int, float)) and v.get("best_epoch", -1) >= 0:
                facts.append(f"best val accuracy <b>{v['best_accuracy']:.4f}</b> (epoch {v['best_epoch'] + 1})")
            peaks = [m for m in r.metrics if gpu_memory_text(m)]
            if peaks:
                top = max(peaks, key=lambda m: m["gpu_mem_alloc_gib"])
                facts.append(html.escape(gpu_memory_text(top)) + f" (epoch {top.get('epoch', 0) + 1})")
        else:
            facts = [f"ran {on}", f"{n} record{'' if n == 1 else 's'} logged",
                     f"returned <code>{html.escape(_short(r.value))}</code>"]
        facts.append(f"run folder <code>{html.escape(str(r.run_dir))}</code>")
        if r.weights_path:
            facts.append(f"weights <code>{html.escape(str(r.weights_path))}</code>")
        if r.stopped:
            self.progress_bar.bar_style = "warning"
            self._status("warn", "<b>Stopped</b> at your request; every worker exited. " + " · ".join(facts))
        else:
            self.progress_bar.bar_style = "success"
            self.progress_bar.value = 1.0
            self._status("ok", "<b>Finished.</b> " + " · ".join(facts))

    def _show_error(self, exc: BaseException, title: str) -> None:
        text = str(exc) or type(exc).__name__
        head, _, rest = text.partition("\n")
        if isinstance(exc, WorkerError) and exc.rank is not None:
            title = f"{title} on rank {exc.rank}"
            head = head.removeprefix("Training failed: ")  # the title says it already
        elif not isinstance(exc, NbddpError):
            head = f"{type(exc).__name__}: {head}"  # unexpected: say what it was
        body = (f"<pre style='white-space:pre-wrap;max-height:260px;overflow-y:auto;margin:4px 0;font-size:12px'>"
                f"{html.escape(rest)}</pre>") if rest.strip() else ""
        self._status("error", f"<b>{html.escape(title)}</b> — {html.escape(head)}{body}")


__all__ = ["TrainingPanel"]
