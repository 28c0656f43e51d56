"""Figures for the notebook: training curves, a grid of predictions, a confusion matrix.

Kernel side only. Two ways of drawing, on purpose:

* :func:`training_curves_png` (the built-in worker) and :func:`scalar_charts_png` (any worker's
  ``ctx.log`` scalars) are called by the panel off the main thread. They draw on
  a bare ``matplotlib.figure.Figure`` with the Agg canvas: pyplot keeps global state and is not
  thread-safe, and this way the user's own ``%matplotlib`` backend is never touched.
* :func:`show_predictions` and :func:`plot_confusion_matrix` are called by the user in a cell.
  They go through pyplot (which loads the notebook's inline backend, so a returned ``Figure``
  renders) and close the figure before returning it, so the notebook shows it exactly once:
  as the cell's value, not a second time when the cell ends.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..kernel.export import confusion_matrix, load_val_predictions, run_classes
from ..contract.paths import PathLike


_LOSS_KEYS = (("train_loss", "train loss"), ("val_loss", "val loss"), ("loss", "loss"))
_ACC_KEYS = (("val_accuracy", "val accuracy"), ("accuracy", "accuracy"))
_RIGHT, _WRONG = "#1b7f3b", "#c62828"
_AXIS_KEYS = ("step", "epoch")
_NOT_CHARTED = ("time", "step", "epoch")
MAX_CHARTS = 12


# ------------------------------------------------------------------------ training curves
def training_curves_png(metrics: Sequence[dict], epochs: Optional[int] = None,
                        width_px: int = 960, height_px: int = 300) -> bytes:
    """PNG of the loss curves (left) and the validation accuracy (right), one point per epoch.

    Safe to call from any thread (no pyplot). Epochs are shown 1-based, as in the log lines.

    Args:
        metrics: ``ctx.log`` records, e.g. ``RunHandle.metrics``; records without an epoch are
            numbered in order. Missing keys are skipped, so a user worker's records work too.
        epochs: planned number of epochs: the x axis spans all of them from the start.
        width_px: image width in pixels.
        height_px: image height in pixels.

    Returns:
        The PNG file's bytes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, PercentFormatter

    dpi = 100
    fig = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    xs = [int(m["epoch"]) + 1 if isinstance(m.get("epoch"), (int, float)) else i + 1 for i, m in enumerate(metrics)]
    last = max(xs + [epochs or 1])

    losses = []
    for key, label in _LOSS_KEYS:
        pts = [(x, m[key]) for x, m in zip(xs, metrics) if _finite(m.get(key))]
        if pts:
            ax_loss.plot(*zip(*pts), "o-", ms=4, label=label)
            losses += [y for _, y in pts]
    # A tiny or badly started run can have a validation loss 100x the training loss (BatchNorm
    # statistics of a few batches): a log scale keeps both curves readable.
    log_scale = bool(losses) and min(losses) > 0 and max(losses) / min(losses) > 50
    if log_scale:
        ax_loss.set_yscale("log")
        # Whole decades, labelled 0.1, 1, 10, 100: at least two labelled ticks, plain numbers.
        lo, hi = math.floor(math.log10(min(losses) / 1.2)), math.ceil(math.log10(max(losses) * 1.2))
        ax_loss.set_ylim(10.0 ** lo, 10.0 ** hi)
        ax_loss.yaxis.set_major_locator(LogLocator(base=10, numticks=12))
        ax_loss.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    acc = next(((k, lbl) for k, lbl in _ACC_KEYS if any(_finite(m.get(k)) for m in metrics)), None)
    if acc:
        pts = [(x, m[acc[0]]) for x, m in zip(xs, metrics) if _finite(m.get(acc[0]))]
        ax_acc.plot(*zip(*pts), "o-", ms=4, color="tab:green", label=acc[1])
        bx, by = max(pts, key=lambda p: (p[1], -p[0]))  # the first epoch with the best value
        ax_acc.plot([bx], [by], "*", ms=14, color="tab:orange", label=f"best {by:.1%} (epoch {bx})")
        ax_acc.legend(loc="best", fontsize=9)
    ax_acc.set_ylim(0, 1.02)
    ax_acc.yaxis.set_major_formatter(PercentFormatter(1.0))

    for ax, title in ((ax_loss, "loss (log scale)" if log_scale else "loss"), (ax_acc, "validation accuracy")):
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("epoch", fontsize=10)
        ax.set_xlim(0.5, last + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.3)
    if losses:
        ax_loss.legend(loc="best", fontsize=9)
    if not metrics:
        for ax in (ax_loss, ax_acc):
            ax.text(0.5, 0.5, "curves appear after the first epoch", ha="center", va="center",
                    transform=ax.transAxes, color="0.4", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ------------------------------------------------------------------------ any worker's scalars
def scalar_series(metrics: Sequence[dict]) -> Dict[str, Tuple[str, List[float], List[float]]]:
    """``{key: (x label, xs, ys)}`` for every numeric key of ``ctx.log`` records, in order of appearance.

    ``time``, ``step`` and ``epoch`` are not charted. The x axis of a key is ``step`` when every
    record holding the key has one, else ``epoch`` likewise, else the record's number (1-based).
    Non-finite values (a NaN loss) are left out of the line.
    """
    keys: Dict[str, None] = {}
    for m in metrics:
        for k, v in m.items():
            if k not in _NOT_CHARTED and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.setdefault(k)
    out = {}
    for key in keys:
        rows = [(i, m) for i, m in enumerate(metrics) if _finite(m.get(key))]
        axis = next((a for a in _AXIS_KEYS if rows and all(_finite(m.get(a)) for _, m in rows)), None)
        xs = [float(m[axis]) if axis else float(i + 1) for i, m in rows]
        out[key] = (axis or "record", xs, [float(m[key]) for _, m in rows])
    return out


def scalar_charts_png(metrics: Sequence[dict], width_px: int = 960, row_px: int = 210) -> bytes:
    """PNG of one small line chart per scalar a worker logged (see :func:`scalar_series`).

    Safe to call from any thread (no pyplot). At most ``MAX_CHARTS`` charts, three per row; the
    image grows by ``row_px`` per row.

    Args:
        metrics: ``ctx.log`` records, e.g. ``RunHandle.metrics``.
        width_px: image width in pixels.
        row_px: height of one row of charts in pixels.

    Returns:
        The PNG file's bytes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = scalar_series(metrics)
    shown = list(series.items())[:MAX_CHARTS]
    cols = max(1, min(3, len(shown)))
    rows = max(1, math.ceil(len(shown) / cols))
    dpi = 100
    fig = Figure(figsize=(width_px / dpi, row_px * rows / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    if not shown:
        ax = axes[0]
        ax.set_axis_off()
        ax.text(0.5, 0.5, "charts of the worker's ctx.log(...) scalars appear here", ha="center", va="center",
                transform=ax.transAxes, color="0.4", fontsize=10)
    for ax, (key, (axis, xs, ys)) in zip(axes, shown):
        ax.plot(xs, ys, "o-" if len(xs) <= 30 else "-", ms=3, lw=1.5)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(axis, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=all(x.is_integer() for x in xs)))
        if len(set(xs)) == 1:  # one point so far: a unit-wide axis, not ticks at +-0.04
            ax.set_xlim(xs[0] - 1, xs[0] + 1)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(shown):]:  # the rest of the last row
        ax.set_axis_off()
    if len(series) > len(shown):
        fig.suptitle(f"first {len(shown)} of {len(series)} logged keys", fontsize=9, color="0.4")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


# ------------------------------------------------------------------------ samples
def _records(samples: Union[PathLike, Sequence], classes: Optional[Sequence[str]]) -> List[Dict[str, Any]]:
    """``[{"path", "label", ("pred")}]`` from a run folder, a predictions JSON, or a list."""
    if isinstance(samples, (str, Path)):
        path = Path(samples)
        return load_val_predictions(path) if path.is_dir() else json.loads(path.read_text())
    out = []
    for s in samples:
        rec = dict(s) if isinstance(s, dict) else {"path": s[0], "label": s[1]}
        if isinstance(rec["label"], str):  # a class name instead of its index
            if not classes or rec["label"] not in classes:
                raise ValueError(f"label {rec['label']!r} of {rec['path']} is not one of the classes {list(classes or [])}")
            rec["label"] = list(classes).index(rec["label"])
        out.append(rec)
    return out


def _spread(items: list, n: int) -> list:
    # Evenly spaced picks over the (path-sorted, so class-grouped) list: every class shows up.
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else items[:1]


def show_predictions(model: Any, classes: Optional[Sequence[str]], samples: Union[PathLike, Sequence],
                     n: int = 16, cols: Optional[int] = None):
    """A grid of images with the predicted and the true class: green when right, red when wrong.

    Args:
        model: a classifier from :func:`nbddp.kernel.inference.load_model`, a run or export folder to
            load one from, or ``None`` to show the predictions recorded in ``samples`` (the
            ``pred`` of ``val_predictions.json``).
        classes: class names in index order; ``None`` takes them from the model or the run.
        samples: a run folder (its ``val_predictions.json``), a predictions JSON file, a list of
            ``(path, label)`` pairs (label: index or name), or a list of ``{"path", "label"}``.
        n: how many images to show, picked evenly over the samples so each class appears.
        cols: images per row (default: about the square root of ``n``).

    Returns:
        A ``matplotlib.figure.Figure`` (a cell's last expression displays it).

    Example:
        >>> model, classes = load_model(result.run_dir)
        >>> show_predictions(model, classes, result.run_dir, n=16)
    """
    import matplotlib.pyplot as plt

    from ..tasks.classification.data import load_rgb
    from ..kernel.inference import load_model, predict

    if isinstance(model, (str, Path)):
        model, loaded = load_model(model)
        classes = classes or loaded
    if classes is None and model is not None:
        classes = getattr(model, "nbddp_meta", {}).get("classes")
    if classes is None and isinstance(samples, (str, Path)) and Path(samples).is_dir():
        classes = run_classes(samples)
    if not classes:
        raise ValueError("show_predictions needs the class names: pass classes=[...] or a model from load_model()")
    chosen = _spread(_records(samples, classes), max(1, int(n)))
    if not chosen:
        raise ValueError("show_predictions: no samples to show")
    if model is not None:
        preds = [p.index for p in predict(model, [r["path"] for r in chosen], classes=list(classes))]
    elif all("pred" in r for r in chosen):
        preds = [int(r["pred"]) for r in chosen]
    else:
        raise ValueError("show_predictions: pass a model, or samples that carry recorded predictions ('pred')")

    cols = cols or min(len(chosen), max(1, math.ceil(math.sqrt(len(chosen)))))
    rows = math.ceil(len(chosen) / cols)
    fig = plt.figure(figsize=(2.2 * cols, 2.5 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    right = 0
    for ax, rec, pred in zip(axes.flat, chosen, preds):
        ok = pred == int(rec["label"])
        right += ok
        ax.imshow(load_rgb(rec["path"]))
        ax.set_title(f"pred: {classes[pred]}\ntrue: {classes[int(rec['label'])]}",
                     color=_RIGHT if ok else _WRONG, fontsize=9)
        for side in ax.spines.values():  # a coloured frame reads faster than the title
            side.set(color=_RIGHT if ok else _WRONG, linewidth=2)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.suptitle(f"{right}/{len(chosen)} right", fontsize=11)
    plt.close(fig)
    return fig


# ------------------------------------------------------------------------ confusion matrix
def plot_confusion_matrix(source: Any, classes: Optional[Sequence[str]] = None, normalize: bool = False):
    """The confusion matrix as a heat map: rows are true classes, columns predicted ones.

    Args:
        source: a run folder or a predictions JSON (``val_predictions.json``), a list of
            ``{"label", "pred"}`` records, or a square matrix from
            :func:`nbddp.kernel.export.confusion_matrix`.
        classes: class names in index order (default: the run's ``class_indices.json``, or
            ``0, 1, ...``).
        normalize: show each row as fractions of its true class (the diagonal is then the
            per-class accuracy) instead of counts.

    Returns:
        A ``matplotlib.figure.Figure``.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if isinstance(source, (str, Path)) and Path(source).is_dir() and classes is None:
        classes = run_classes(source)
    if isinstance(source, (str, Path)) or (isinstance(source, (list, tuple)) and source and isinstance(source[0], dict)):
        recs = _records(source, classes)
        k = len(classes) if classes else 1 + max(max(int(r["label"]), int(r["pred"])) for r in recs)
        matrix = confusion_matrix([r["label"] for r in recs], [r["pred"] for r in recs], k)
    else:
        matrix = np.asarray(source)
    k = matrix.shape[0]
    names = list(classes) if classes else [str(i) for i in range(k)]
    total = matrix.sum()
    acc = np.trace(matrix) / total if total else float("nan")
    shown = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1) if normalize else matrix

    side = max(3.5, 0.45 * k + 2.0)
    fig = plt.figure(figsize=(side + 1.0, side), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(shown, cmap="Blues", vmin=0, vmax=1 if normalize else max(1, shown.max()))
    bar = fig.colorbar(im, ax=ax, shrink=0.8)
    if not normalize:
        from matplotlib.ticker import MaxNLocator

        bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xticks(range(k), names, rotation=45 if k > 4 else 0, ha="right" if k > 4 else "center", fontsize=8)
    ax.set_yticks(range(k), names, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion matrix · accuracy {acc:.1%} of {int(total)} images", fontsize=10)
    if k <= 30:  # beyond that the numbers are unreadable; the colours still tell the story
        hi = (1 if normalize else shown.max()) / 2
        for i in range(k):
            for j in range(k):
                text = f"{shown[i, j]:.2f}" if normalize else f"{int(shown[i, j])}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7 if k > 12 else 9,
                        color="white" if shown[i, j] > hi else "black")
    plt.close(fig)
    return fig


__all__ = ["plot_confusion_matrix", "scalar_charts_png", "scalar_series", "show_predictions", "training_curves_png"]
