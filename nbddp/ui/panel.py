"""``TrainingPanel``: choose GPUs (or CPU processes), set the config, train, watch, stop.

Kernel side only. Two threads touch the panel, and each has its reason:

* The Train button's callback (and :meth:`TrainingPanel.run`) runs on the kernel's main thread,
  and that is where ``spawn_train`` must be called: the workers' parent-death signal is tied to
  the thread that started them, and the kernel's main thread lives as long as the kernel.
* The run's events (log lines, progress, metrics, the end) arrive on its monitor thread. They
  only set widget values, which ipykernel sends from any thread, and draw the chart on a bare
  Agg canvas into an ``Image`` widget. Nothing here prints or uses an ``Output`` widget's
  ``with`` block, whose output would land in whichever cell happens to run.
"""

from __future__ import annotations

import html
import threading
import time
from collections import deque
from typing import Any, List, Optional

import ipywidgets as W

from ..config import TrainConfig
from ..errors import ConfigError, NbddpError, TrainingInterrupted, WorkerError
from ..gpus import gpu_setup_problem, list_gpus
from ..handle import RunHandle, TrainResult
from ..launch import spawn_train
from ..procs import cpu_cores
from .charts import training_curves_png

COMMON_MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "mobilenet_v3_small", "mobilenet_v3_large",
                 "efficientnet_b0", "efficientnet_b1", "regnet_y_400mf", "convnext_tiny", "densenet121", "vgg16_bn")
FREEZE_REASON = "frozen BatchNorm layers keep their statistics: nothing to synchronise"
LOG_LINES = 200

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


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _field(widget_cls, description: str, **kw):
    return widget_cls(description=description, style=_LABEL, layout=W.Layout(**_FULL), **kw)


class TrainingPanel:
    """A widget panel that builds a :class:`TrainConfig`, launches it and shows the run live.

    Args:
        config: starting values; fields the panel does not show (``val_fraction``, ``seed``,
            ``runs_dir``, ``name``, ``resume``...) are taken from it as they are.

    Attributes:
        handle: the :class:`RunHandle` of the current or last run (``None`` before the first).
        result: the last :class:`TrainResult` (``None`` before a run succeeded or was stopped).
        widget: the root ``VBox``; ``display(panel)`` or a cell ending in ``panel`` shows it.

    Example:
        >>> panel = TrainingPanel(TrainConfig(data_path="data/digits", model="resnet18"))
        >>> panel                      # then click Train, or, in CI and scripts:
        >>> result = panel.run()       # same widgets, blocking, returns the TrainResult
    """

    def __init__(self, config: Optional[TrainConfig] = None):
        self._base = config if config is not None else TrainConfig()
        self._given = config is not None
        self.handle: Optional[RunHandle] = None
        self.result: Optional[TrainResult] = None
        self._cfg = self._base  # the config of the current run
        self._lock = threading.RLock()
        self._lines: deque = deque(maxlen=LOG_LINES)
        self._log_timer: Optional[threading.Timer] = None
        self._ended = threading.Event()
        self._ended.set()
        self._busy = False
        self._got_progress = False
        self._sync_saved: Optional[bool] = None  # SyncBN value from before freeze-layers was ticked
        self._gpus = list_gpus()  # NVML / nvidia-smi: the kernel never initialises CUDA
        self._build()

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        b = self._base
        self.gpu_checkboxes: List[W.Checkbox] = []
        self.nprocs_input: Optional[W.BoundedIntText] = None
        if self._gpus:
            chosen = set(b.gpus) or {g.index for g in self._gpus}
            self.gpu_checkboxes = [W.Checkbox(value=g.index in chosen, description=g.label(), indent=False,
                                              layout=W.Layout(width="auto")) for g in self._gpus]
            refresh = W.Button(description="Refresh", icon="refresh", tooltip="read memory and utilisation again",
                               layout=W.Layout(width="110px"))
            refresh.on_click(self._refresh_gpus)
            self.device_note = W.HTML("<b>GPUs</b> (one process each, nccl)")
            devices = W.VBox([self.device_note, *self.gpu_checkboxes, refresh])
        else:
            default = b.nprocs if self._given else 2
            cores = cpu_cores()
            # 1..cores, unless the config asks for more (oversubscribing works, slowly): keep its value.
            self.nprocs_input = W.BoundedIntText(value=default, min=1, max=max(cores, default), description="CPU processes",
                                                 style=_LABEL, layout=W.Layout(width="220px"))
            # Several MIG instances in CUDA_VISIBLE_DEVICES list no GPU: say why, not just "none".
            problem = gpu_setup_problem()
            why = f" ({html.escape(problem)})" if problem else ""
            self.device_note = W.HTML(
                f"<span style='color:var(--jp-ui-font-color2,#666)'>No GPU found{why}: training runs on CPU "
                f"processes with gloo ({cores} cores here).</span>", layout=W.Layout(margin="0 0 0 12px"))
            devices = W.HBox([self.nprocs_input, self.device_note], layout=W.Layout(align_items="center",
                                                                                   flex_flow="row wrap"))

        self.model_input = _field(W.Combobox, "Model", value=b.model, options=COMMON_MODELS, ensure_option=False,
                                  placeholder="torchvision name, e.g. resnet34")
        self.data_input = _field(W.Text, "Data folder", value=b.data_path, placeholder="root/<class>/<image>")
        self.weights_input = _field(W.Text, "Weights file", value=b.weights or "",
                                    placeholder="optional: .pth / .safetensors / run folder")
        self.epochs_input = _field(W.BoundedIntText, "Epochs", value=b.epochs, min=1, max=100_000)
        self.batch_size_input = _field(W.BoundedIntText, "Batch / process", value=b.batch_size, min=1, max=65_536)
        self.lr_input = _field(W.FloatText, "Learning rate", value=b.lr, step=0.0001)
        self.image_size_input = _field(W.BoundedIntText, "Image size", value=b.image_size, min=8, max=4096, step=32)
        grid = dict(grid_gap="4px 16px", width="100%")
        paths = W.GridBox([self.data_input, self.weights_input],
                          layout=W.Layout(grid_template_columns="repeat(auto-fit, minmax(320px, 1fr))", **grid))
        numbers = W.GridBox([self.model_input, self.epochs_input, self.batch_size_input, self.lr_input,
                             self.image_size_input],
                            layout=W.Layout(grid_template_columns="repeat(auto-fit, minmax(240px, 1fr))", **grid))

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

        self.train_button = W.Button(description="Train", icon="play", button_style="primary",
                                     layout=W.Layout(width="120px"))
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True,
                                    layout=W.Layout(width="120px"))
        self.train_button.on_click(self._on_train)
        self.stop_button.on_click(lambda _b: self.stop())
        self.status = W.HTML("", layout=W.Layout(**_FULL))

        self.progress_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="35%", min_width="160px"))
        self.progress_label = W.HTML("not started", layout=W.Layout(flex="1 1 auto", margin="0 0 0 10px"))
        self.chart = W.Image(value=training_curves_png([], b.epochs), format="png",
                             layout=W.Layout(max_width="960px", height="auto", **_FULL))
        self.log = W.HTML(self._log_html(), layout=W.Layout(**_FULL))

        self._form = [*self.gpu_checkboxes, self.model_input, self.data_input, self.weights_input, self.epochs_input,
                      self.batch_size_input, self.lr_input, self.image_size_input, self.sync_bn_toggle,
                      self.freeze_toggle, self.amp_toggle, self.tensor_toggle] + ([self.nprocs_input] if self.nprocs_input else [])
        self._apply_freeze_rule()
        self.widget = W.VBox([
            W.HTML("<b style='font-size:1.1em'>nbddp · DistributedDataParallel training</b>"),
            devices, paths, numbers, options,
            W.HBox([self.train_button, self.stop_button]),
            self.status,
            W.HBox([self.progress_bar, self.progress_label], layout=W.Layout(align_items="center")),
            self.chart,
            W.HTML("<b>rank 0 log</b>"), self.log,
        ], layout=W.Layout(width="100%", max_width="1000px", padding="8px",
                           border="1px solid var(--jp-border-color2, #ddd)"))

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
            ConfigError: a value is invalid; the message names the field and the fix.
        """
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
            data_pipeline="tensor" if self.tensor_toggle.value else "pil")
        if self._gpus:
            chosen = tuple(g.index for g, box in zip(self._gpus, self.gpu_checkboxes) if box.value)
            if not chosen:
                raise ConfigError("no GPU selected: tick at least one GPU in the panel")
            changes["gpus"] = chosen
        else:
            changes.update(gpus=(), nprocs=int(self.nprocs_input.value))
        return self._base.replace(**changes)

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
            cfg = self.config
        except ConfigError as exc:
            self._show_error(exc, "Invalid setting")
            raise
        self._cfg = cfg
        self._reset_live()
        self._set_busy(True)
        where = f"GPU{'s' if len(cfg.gpus) > 1 else ''} {', '.join(map(str, cfg.gpus))}" if cfg.gpus \
            else f"{cfg.nprocs} CPU process{'es' if cfg.nprocs > 1 else ''}"
        self._status("info", f"Checking the data, then starting {where}…")
        self.progress_label.value = f"starting {where} ({'nccl' if cfg.gpus else 'gloo'})…"
        self.progress_bar.bar_style = "info"
        try:
            handle = spawn_train(cfg, block=False, echo=echo)  # here, on the main thread: see module doc
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

    def _reset_live(self) -> None:
        with self._lock:
            self._lines.clear()
        self.log.value = self._log_html()
        self.progress_bar.value = 0.0
        self._got_progress = False
        self.chart.value = training_curves_png([], self._cfg.epochs)
        self.result = None

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        for w in self._form:
            w.disabled = busy
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
        total = self._cfg.epochs
        epoch, step, steps = p.get("epoch"), p.get("step"), p.get("steps")
        done = (epoch or 0) + (step / steps if step is not None and steps else 0)
        self.progress_bar.value = max(0.0, min(1.0, done / total))
        parts = []
        if epoch is not None:
            parts.append(f"epoch {epoch + 1}/{total}")
        if step is not None:
            parts.append(f"step {step}/{steps}" if steps else f"step {step}")
        if isinstance(p.get("loss"), (int, float)):
            parts.append(f"loss {p['loss']:.4f}")
        if isinstance(p.get("images_per_s"), (int, float)):
            parts.append(f"{p['images_per_s']:,.0f} img/s")
        if self.handle is not None:
            parts.append(f"{_duration(time.time() - self.handle.started_at)} elapsed")
        self.progress_label.value = " · ".join(parts)

    def _on_metrics(self) -> None:
        handle = self.handle
        metrics = list(handle.metrics) if handle is not None else []  # appended before the event
        self.chart.value = training_curves_png(metrics, self._cfg.epochs)
        accs = [(m["val_accuracy"], m["epoch"]) for m in metrics if isinstance(m.get("val_accuracy"), (int, float))]
        if accs and self.running and not self.stop_button.disabled:
            best, at = max(accs, key=lambda a: (a[0], -a[1]))
            last = metrics[-1]
            self._status("info", f"Training · epoch {last.get('epoch', 0) + 1}/{self._cfg.epochs} done · val accuracy "
                                 f"{last.get('val_accuracy', float('nan')):.4f} · best {best:.4f} (epoch {at + 1}) · "
                                 f"run folder <code>{html.escape(str(handle.run_dir))}</code>")

    def _on_end(self, outcome: Any) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            timer, self._log_timer = self._log_timer, None
        if timer is not None:
            timer.cancel()
        self._flush_log()
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
        v = r.value if isinstance(r.value, dict) else {}
        unit = ("GPU" if r.backend == "nccl" else "CPU process") + ("" if r.world_size == 1 else
                                                                  "s" if r.backend == "nccl" else "es")
        n = len(r.metrics)
        facts = [f"{n} epoch{'' if n == 1 else 's'} completed in {_duration(r.seconds)} on {r.world_size} {unit} "
                 f"({r.backend})"]
        if isinstance(v.get("best_accuracy"), (int, float)) and v.get("best_epoch", -1) >= 0:
            facts.append(f"best val accuracy <b>{v['best_accuracy']:.4f}</b> (epoch {v['best_epoch'] + 1})")
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
