"""Take a finished (or stopped) run's weights out of its folder, and score its predictions.

Kernel side, plotting-free: ``import nbddp`` may import this module without pulling in
matplotlib (the figures live in :mod:`nbddp.ui.charts`). Checkpoints are read weights-only on
the CPU, so exporting never unpickles code and never initialises CUDA in the kernel.

Example:
    >>> paths = export_run(result.run_dir, "exported/digits")      # best epoch
    >>> model, classes = nbddp.kernel.inference.load_model("exported/digits")
    >>> recs = load_val_predictions(result.run_dir)
    >>> per_class_accuracy([r["label"] for r in recs], [r["pred"] for r in recs], classes)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..contract import rundir
from ..contract.checkpoint import export_weights, load_checkpoint
from ..contract.errors import ConfigError, WeightsError
from ..contract.paths import PathLike

CHECKPOINTS = (rundir.BEST, rundir.LAST)


def run_classes(run_dir: PathLike) -> List[str]:
    """Class names of a run, in index order, from its ``class_indices.json``.

    Raises:
        WeightsError: the run folder has no ``class_indices.json`` (nor ``export/`` copy).
    """
    run_dir = Path(run_dir)
    for folder in (run_dir, rundir.export_dir(run_dir)):
        classes = rundir.read_class_indices(folder)
        if classes is not None:
            return classes
    raise WeightsError(f"{run_dir} has no class_indices.json: is it an nbddp run folder?")


def _checkpoint_accuracy(ckpt: dict, which: str) -> Optional[float]:
    if which == "best" and ckpt.get("accuracy") is not None:
        return float(ckpt["accuracy"])
    # last.pt: the accuracy of its own epoch, from the history it carries.
    for rec in reversed(ckpt.get("history") or []):
        if rec.get("epoch") == ckpt.get("epoch") and rec.get("val_accuracy") is not None:
            return float(rec["val_accuracy"])
    return None


def export_run(run_dir: PathLike, out_dir: PathLike, which: str = "best") -> Dict[str, Path]:
    """Write a run's weights where you want them, ready for inference or fine-tuning.

    Files written in ``out_dir`` (as one whole folder that replaces any earlier export there, see
    :func:`nbddp.contract.checkpoint.export_weights`):
    ``model.pth`` (plain torchvision state_dict: no ``module.`` prefix, loads with
    ``strict=True``), ``model.safetensors`` (the same tensors), ``class_indices.json``
    (``{"0": "name", ...}``) and ``meta.json`` (model, num_classes, image_size, epoch (0-based),
    accuracy, which checkpoint). :func:`nbddp.kernel.inference.load_model` reads the folder back.

    Args:
        run_dir: the run's folder (``TrainResult.run_dir``).
        out_dir: destination folder, created if needed.
        which: ``"best"`` (the epoch with the best validation accuracy, ``checkpoints/best.pt``)
            or ``"last"`` (the newest epoch, ``checkpoints/last.pt``).

    Returns:
        ``{"pth", "safetensors", "class_indices", "meta"}`` -> the paths written.

    Raises:
        ConfigError: ``which`` is neither ``"best"`` nor ``"last"``, or ``out_dir`` holds files
            that are not part of an export.
        WeightsError: the run has no such checkpoint (it ended before finishing an epoch), or the
            checkpoint is unreadable or not weights-only safe.
    """
    if which not in CHECKPOINTS:
        raise ConfigError(f"export_run(which={which!r}): choose 'best' or 'last'")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise WeightsError(f"run folder not found: {run_dir}. Pass TrainResult.run_dir or a folder under runs/.")
    ckpt_path = rundir.checkpoint_path(run_dir, which)
    if not ckpt_path.is_file():
        have = rundir.checkpoint_names(run_dir)
        hint = (f"it has {', '.join(have)}: try which={'last' if which == 'best' else 'best'!r}" if have
                else "the run ended before it finished an epoch, so there is nothing to export")
        raise WeightsError(f"no checkpoint at {ckpt_path}: {hint}.")
    ckpt = load_checkpoint(ckpt_path)  # weights-only, on the CPU
    config = ckpt.get("config") or {}
    if not config and rundir.config_path(run_dir).is_file():
        config = json.loads(rundir.config_path(run_dir).read_text())
    classes = list(ckpt.get("classes") or run_classes(run_dir))
    if "model" not in config:
        raise WeightsError(f"{ckpt_path} does not say which model it holds (no config); cannot write meta.json")
    meta = {
        "model": config["model"],
        "num_classes": config.get("num_classes") or len(classes),
        "image_size": config.get("image_size", 224),
        "epoch": ckpt.get("epoch"),
        "val_accuracy": _checkpoint_accuracy(ckpt, which),
        "which": which,
        "source": str(ckpt_path.resolve()),
    }
    return export_weights(ckpt, out_dir, classes, extra=meta)


def load_val_predictions(run_dir: PathLike) -> List[dict]:
    """The best model's validation predictions, ``[{"path", "label", "pred"}]``.

    The built-in worker writes them to ``run_dir/val_predictions.json`` after its final pass.

    Raises:
        WeightsError: the file is missing (the run did not finish an epoch, or was stopped).
    """
    run_dir = Path(run_dir)
    path = rundir.val_predictions_path(run_dir)
    if not path.is_file():
        raise WeightsError(f"no {path}: it is written when training finishes with at least one epoch")
    records = json.loads(path.read_text())
    launch_dir = _launch_dir(run_dir)
    for rec in records:
        # Image paths are stored as the config gave them: relative ones start from the folder
        # training was launched in, which need not be today's working directory.
        p = Path(rec["path"])
        if not p.is_absolute() and not p.exists() and launch_dir is not None and (launch_dir / p).exists():
            rec["path"] = str(launch_dir / p)
    return records


def _launch_dir(run_dir: Path) -> Optional[Path]:
    """The working directory of the launch: ``run_dir`` is ``<cwd>/<runs_dir>/<run>``."""
    try:
        runs_dir = Path(json.loads(rundir.config_path(run_dir).read_text())["runs_dir"])
    except (OSError, ValueError, KeyError):
        return None
    if runs_dir.is_absolute():
        return None
    base = run_dir.resolve().parent
    parts = runs_dir.parts
    if any(part == ".." for part in parts) or tuple(base.parts[-len(parts):]) != parts:
        return None
    return base.parents[len(parts) - 1]


def confusion_matrix(labels: Sequence[int], preds: Sequence[int], num_classes: int) -> np.ndarray:
    """Counts of (true class, predicted class): ``m[t, p]``, an integer array ``(K, K)``.

    Raises:
        ValueError: lengths differ, or a label or prediction is outside ``0..num_classes-1``.
    """
    labels, preds = np.asarray(labels, dtype=np.int64), np.asarray(preds, dtype=np.int64)
    if labels.shape != preds.shape:
        raise ValueError(f"{labels.size} labels but {preds.size} predictions")
    if labels.size and (min(labels.min(), preds.min()) < 0 or max(labels.max(), preds.max()) >= num_classes):
        raise ValueError(f"labels and predictions must be in 0..{num_classes - 1}")
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, preds), 1)
    return matrix


def per_class_accuracy(labels: Sequence[int], preds: Sequence[int], classes: Sequence[str]) -> Dict[str, Optional[float]]:
    """Fraction of each class's images predicted right (recall); ``None`` for a class with none."""
    m = confusion_matrix(labels, preds, len(classes))
    totals = m.sum(axis=1)
    return {name: (float(m[i, i] / totals[i]) if totals[i] else None) for i, name in enumerate(classes)}


__all__ = ["confusion_matrix", "export_run", "load_val_predictions", "per_class_accuracy", "run_classes"]
