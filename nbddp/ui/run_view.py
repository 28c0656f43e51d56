"""The run view: Train and Stop, the status line, progress, the live chart and rank 0's log.

It follows one :class:`RunHandle` at a time. Its events arrive on the run's monitor thread:
they only set widget values, which ipykernel sends from any thread, and draw the chart on a
bare Agg canvas into an ``Image`` widget (from a timer thread, at most about once a second: a
worker may log every step). Nothing here prints or uses an ``Output`` widget's ``with`` block,
whose output would land in whichever cell happens to run.
"""

from __future__ import annotations

import html
import os
import math
import threading
import time
from collections import deque
from typing import Any, Callable, List, Optional, Tuple

import ipywidgets as W

from ..contract.errors import NbddpError, TrainingInterrupted, WorkerError
from ..contract.throughput import rates_parts
from ..kernel.handle import RunHandle, TrainResult
from .charts import scalar_charts_png, scalar_series, training_curves_png
from .layout import FULL
from .worker_form import short as _short

LOG_LINES = 200
CHART_EVERY_S = 1.0  # the chart is redrawn at most this often (or 3x its drawing time, if longer)
_COLORS = {"info": "var(--jp-ui-font-color1, #333)", "ok": "var(--jp-success-color1, #2e7d32)",
           "warn": "var(--jp-warn-color1, #e65100)", "error": "var(--jp-error-color1, #c62828)"}
# At most 180px: a short log stays short instead of sitting at the bottom of an empty box.
_LOG_BOX = ("max-height:180px;min-height:2.5em;overflow-y:auto;"
            "display:flex;flex-direction:column-reverse;"  # keeps the end in view
            "border:1px solid var(--jp-border-color2,#ddd);padding:4px 6px;background:var(--jp-layout-color1,#fff)")


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


_duration = duration


def folder_text(path: Any) -> str:
    """A run folder as the panel shows it, HTML-escaped: relative to the notebook's working folder
    when it lies below it (``runs/20261127-101500-flowers``), else absolute."""
    try:
        shown = os.path.relpath(os.path.abspath(path))
    except ValueError:
        shown = str(path)
    if shown.startswith(os.pardir):
        shown = os.path.abspath(path)
    return f"<code>{html.escape(shown)}</code>"


def _count(v: Any) -> Optional[int]:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def gpu_memory_text(record: dict) -> Optional[str]:
    """``"GPU memory 3.2 GiB peak, 4.0 reserved"`` from an epoch record's peaks, or None off the GPU."""
    alloc, reserved = record.get("gpu_mem_alloc_gib"), record.get("gpu_mem_reserved_gib")
    if not isinstance(alloc, (int, float)) or isinstance(alloc, bool) or not math.isfinite(alloc):
        return None
    more = f", {reserved:.1f} reserved" if isinstance(reserved, (int, float)) and math.isfinite(reserved) else ""
    return f"GPU memory {alloc:.1f} GiB peak{more}"


class RunView:
    """What a run looks like while it goes and when it has ended.

    Args:
        worker: the view of a worker function (a chart per logged scalar, its return value)
            rather than of the built-in classifier (training curves, best accuracy).
        on_idle: called when a run has ended and been shown (the panel unlocks its form).

    Attributes:
        train_button, stop_button, status, progress_bar, progress_label, chart, log: the widgets.
        handle: the :class:`RunHandle` followed (``None`` before the first run).
        result: the last :class:`TrainResult` (``None`` before a run succeeded or was stopped).
        plan: the run's planned ``(epochs, steps)``, for the progress bar.
        chart_keys: the logged keys the worker chart draws (after a redraw).
    """

    def __init__(self, worker: bool, on_idle: Callable[[], None], plan: Tuple[Optional[int], Optional[int]]):
        self._worker = worker
        self._on_idle = on_idle
        self.plan = plan
        self.handle: Optional[RunHandle] = None
        self.result: Optional[TrainResult] = None
        self.chart_keys: List[str] = []
        self._lock = threading.RLock()
        self._draw_lock = threading.Lock()
        self._lines: deque = deque(maxlen=LOG_LINES)
        self._log_timer: Optional[threading.Timer] = None
        self._chart_timer: Optional[threading.Timer] = None
        self._chart_next, self._chart_cost = 0.0, 0.0
        self._ended = threading.Event()
        self._ended.set()
        self._got_progress = False
        self.train_button = W.Button(description="Train", icon="play", button_style="primary",
                                     layout=W.Layout(width="120px"))
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True,
                                    layout=W.Layout(width="120px"))
        self.where_button = W.Button(description="Where are they?", icon="search", disabled=True,
                                     tooltip="every rank's Python stack now: the function and line each one is in",
                                     layout=W.Layout(width="160px"))
        self.where_button.on_click(lambda _: self.show_stacks())
        # The built-in classifier's last run, as ONNX (nbddp.export_onnx): enabled once a run exported weights.
        self.export_button = W.Button(description="Export ONNX", icon="download", disabled=True,
                                      tooltip="model.onnx and preprocessing.json beside the run's weights, checked "
                                      "with ONNX Runtime on held-out images", layout=W.Layout(width="140px"))
        self.export_button.on_click(lambda _: self.export_onnx())
        self.export_note = W.HTML("", layout=W.Layout(**FULL))
        self.stacks = W.HTML("", layout=W.Layout(**FULL))
        self.status = W.HTML("", layout=W.Layout(**FULL))
        self.progress_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="35%", min_width="160px"))
        self.progress_label = W.HTML("not started", layout=W.Layout(flex="1 1 auto", margin="0 0 0 10px"))
        self.chart = W.Image(value=self._chart_png([]), format="png",
                             layout=W.Layout(max_width="960px", height="auto", **FULL))
        self.log = W.HTML(self._log_html(), layout=W.Layout(**FULL))
        buttons = [self.train_button, self.stop_button, self.where_button] + ([] if worker else [self.export_button])
        self.parts = [W.HBox(buttons), self.status, self.export_note, self.stacks,
                      W.HBox([self.progress_bar, self.progress_label], layout=W.Layout(align_items="center")),
                      self.chart, W.HTML("<b>rank 0 log</b>"), self.log]

    @property
    def running(self) -> bool:
        """True from Train until the run's end has been shown."""
        return not self._ended.is_set()

    def show_stacks(self) -> None:
        """The "Where are they?" button: every running rank's stack, summarised, under the status line."""
        handle = self.handle
        if handle is None or not handle.running:
            self.stacks.value = ""
            return
        self.stacks.value = "<i>asking every rank for its stack…</i>"
        stacks = handle.stacks()
        body = html.escape(str(stacks)) if stacks else "no rank answered (between two launches, or ending)"
        self.stacks.value = (f"<pre style='font-size:12px;line-height:1.3;white-space:pre-wrap;margin:0'>{body}\n"
                             f"full dumps: logs/rank&lt;r&gt;.stacks.log</pre>")

    def export_onnx(self) -> Optional[Any]:
        """The Export ONNX button: the last run's ``model.onnx`` beside its weights, checked; says how it went."""
        from ..kernel.export import export_onnx

        result = self.result
        if result is None or result.weights_path is None:
            self.export_note.value = "<i>no exported weights yet: train (or wait for the run's end) first</i>"
            return None
        self.export_button.disabled = True
        self.export_note.value = "<i>exporting to ONNX and checking it with ONNX Runtime…</i>"
        try:
            path = export_onnx(result.run_dir)
        except NbddpError as exc:
            self.export_note.value = (f"<div style='color:{_COLORS['error']};white-space:normal'><b>ONNX export "
                                      f"failed</b> — {html.escape(str(exc))}</div>")
            return None
        finally:
            self.export_button.disabled = False
        self.export_note.value = (f"<div style='color:{_COLORS['ok']}'>ONNX <code>{html.escape(str(path))}</code> "
                                  "and <code>preprocessing.json</code> beside it, checked with ONNX Runtime "
                                  "(<code>nbddp.predict(path, images)</code> runs it)</div>")
        return path

    def set_busy(self, busy: bool) -> None:
        self.train_button.disabled = busy
        self.export_button.disabled = busy or self.result is None or self.result.weights_path is None
        if busy:
            self.export_note.value = ""
        self.where_button.disabled = not busy
        if not busy:
            self.stacks.value = ""
        self.stop_button.disabled = not busy
        self.stop_button.description = "Stop"

    def starting(self, where: str, backend: str, checking: bool) -> None:
        """Clear the last run's view and say what starts."""
        self._reset_live()
        self._status("info", f"Checking the data, then starting {where}…" if checking else f"Starting {where}…")
        self.progress_label.value = f"starting {where} ({backend})…"
        self.progress_bar.bar_style = "info"

    def not_started(self, exc: BaseException) -> None:
        self.progress_label.value = "not started"
        self.progress_bar.bar_style = ""
        self._show_error(exc, "Not started")

    def follow(self, handle: RunHandle, where: str) -> None:
        """Show ``handle``'s run from now on, including what its monitor thread read already."""
        with self._lock:
            self.handle = handle
            self._ended.clear()
        handle.subscribe(self._on_event)
        self._status("info", f"Training on {where} · run folder {folder_text(handle.run_dir)}")
        # Anything the monitor thread read before the subscription is still on the handle.
        if handle.progress:
            self._on_progress(handle.progress)
        if handle.metrics:
            self._on_metrics()
        if not handle.running and handle.outcome is not None:
            self._on_end(handle.outcome)

    def stopping(self, handle: RunHandle) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        self._status("warn", "Stopping: workers leave at their next step, then save and export (SIGTERM if "
                             f"their heartbeat stops, or after {handle.stop_timeout_s:g} s)…")

    def _reset_live(self) -> None:
        with self._lock:
            self._lines.clear()
        self.log.value = self._log_html()
        self.progress_bar.value = 0.0
        self._got_progress = False
        self.chart.value = self._chart_png([])
        self.result = None


    # ------------------------------------------------------------------ events (monitor thread)
    def _on_event(self, kind: str, payload: Any) -> None:
        if kind == "line":
            self._on_line(payload)
        elif kind == "progress":
            self._on_progress(payload)
        elif kind == "metrics":
            self._on_metrics()
        elif kind == "restart":
            self._on_restart(payload)
        elif kind == "notice":  # no rank has made progress for long: where they are
            self._on_line(payload)
            self._status("warn", f"<b>No progress</b>: {html.escape(payload)}")
        elif kind == "breakpoint":  # a rank at a pdb prompt ("" once it went on): handle.debug() answers
            if payload:
                self._on_line(payload)
                self._status("warn", f"<b>At a breakpoint</b>: {html.escape(payload)}")
            else:
                self._status("info", "Training: the debugger let the ranks go on")
        elif kind == "end":
            self._on_end(payload)

    def _on_restart(self, restart: Any) -> None:
        """A failure a restart heals (``max_restarts``): say so while the run waits and relaunches."""
        self._on_line(restart.line(self.handle.max_restarts if self.handle is not None else restart.number))
        self._status("warn", f"<b>Restarting</b> (restart {restart.number}) after: {html.escape(restart.cause)} · from "
                     f"<code>{html.escape(restart.resumed_from or 'the start')}</code>")

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
        epochs, planned_steps = self.plan
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
            # The last finished epoch's TFLOP/s, MFU and data wait (rank 0's), where its record has them.
            parts += rates_parts(self.handle.metrics[-1]) if self.handle.metrics else []
        self.progress_label.value = " · ".join(parts)

    def _on_metrics(self) -> None:
        handle = self.handle
        metrics = list(handle.metrics) if handle is not None else []  # appended before the event
        if not self._worker:
            # The built-in worker's record is a finished epoch: the chart is drawn with it before the status
            # line says "epoch N done", so the two never disagree (a throttled redraw showed empty charts
            # under "epoch 1/2 done"). One record an epoch: nothing to throttle.
            self._redraw_chart()
        else:
            with self._lock:  # redrawn at most every CHART_EVERY_S: a worker may log every step
                if self._chart_timer is None:
                    self._chart_timer = threading.Timer(max(0.0, self._chart_next - time.monotonic()),
                                                        self._redraw_chart)
                    self._chart_timer.daemon = True
                    self._chart_timer.start()
        if self._worker:
            if metrics and handle is not None and not handle.progress:
                self._on_progress(metrics[-1])  # a worker that only logs: its records move the bar
            return
        accs = [(m["val_accuracy"], m["epoch"]) for m in metrics if isinstance(m.get("val_accuracy"), (int, float))]
        if accs and self.running and not self.stop_button.disabled:
            best, at = max(accs, key=lambda a: (a[0], -a[1]))
            last = metrics[-1]
            memory = gpu_memory_text(last)
            self._status("info", f"Training · epoch {last.get('epoch', 0) + 1}/{self.plan[0]} done · val accuracy "
                                 f"{last.get('val_accuracy', float('nan')):.4f} · best {best:.4f} (epoch {at + 1}) · "
                                 f"{html.escape(memory) + ' · ' if memory else ''}"
                                 f"run folder {folder_text(handle.run_dir)}")

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
        if not self._worker:
            return training_curves_png(metrics, self.plan[0])
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
        self._on_idle()
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
        if not self._worker:
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
        facts.append(f"run folder {folder_text(r.run_dir)}")
        if r.restarts:
            facts.append(f"{len(r.restarts)} restart{'s' if len(r.restarts) > 1 else ''} on the way")
        if r.weights_path:
            facts.append(f"weights <code>{html.escape(str(r.weights_path))}</code>")
        facts += [f"{name} run <code>{html.escape(str(ids.get('run_id') or ids.get('id')))}</code>"
                  for name, ids in sorted(r.trackers.items())]
        profile = r.profile
        if profile is not None:  # below the facts: the ranks side by side (spawn_train(profile=...))
            facts.append(profile._repr_html_())
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


__all__ = ["RunView", "duration", "gpu_memory_text"]
