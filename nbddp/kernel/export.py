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

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from ..contract import rundir
from ..contract.checkpoint import export_weights, load_checkpoint
from ..contract.errors import ConfigError, ExportError, WeightsError
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


def export_onnx(source: Any, path: Optional[PathLike] = None, opset: Optional[int] = None, dynamic_batch: bool = True,
                *, example_input: Optional[torch.Tensor] = None, images: Optional[Sequence[Any]] = None,
                preprocessing: Optional[dict] = None) -> Path:
    """Write a model as ONNX for serving, and check it with ONNX Runtime before calling it done.

    For a run (its folder, its ``export/`` folder, or a folder of :func:`export_run`): the exported
    weights, as :func:`nbddp.load_model` rebuilds them, become ``model.onnx`` (torch's dynamo exporter;
    the legacy TorchScript exporter only where that fails, with a warning that says why), beside them
    by default, with ``preprocessing.json``: the input's size, the resize, crop, mean, std, channel order
    and layout, the class names, the exporter, and the check. The check runs ONNX Runtime on held-out
    images (the run's validation images, up to 16, spread over the classes) prepared as
    ``preprocessing.json`` says, and PyTorch on the same images prepared by training's transform: the
    top-1 labels must be equal and every logit within ``1e-3 + 1e-3 * |logit|``. A model trained with
    ``strategy="fsdp"`` exports the same way: its export holds the consolidated weights.

    For a model of your own: ``export_onnx(model, "model.onnx", example_input=batch)`` writes the graph
    and checks it on ``example_input`` (no ``preprocessing.json``: the recipe is yours).

    Args:
        source: a run folder (``TrainResult.run_dir``), an export folder, or a ``torch.nn.Module``.
        path: where to write: a folder (``model.onnx`` goes in it) or, for a module, a ``.onnx`` file.
            Default: the folder of the run's exported weights (``run_dir/export/``).
        opset: the ONNX opset (default: the exporter's; 20 with torch 2.14).
        dynamic_batch: the graph takes any batch size (else one image at a time for a run; the example's
            batch for a module).
        example_input: a module's input batch, on the module's device or the CPU.
        images: paths or PIL images to check on, instead of the run's validation images.
        preprocessing: what the service will do differently from training's transform (``resize``,
            ``crop``, ``interpolation``, ``mean``, ``std``, ``channel_order``): written to
            ``preprocessing.json`` and checked, so a recipe that changes the predictions fails.

    Returns:
        The path of ``model.onnx``.

    Raises:
        ExportError: the ``onnx`` extra is missing (``pip install 'nbddp[onnx]'``); the model cannot be
            exported (each exporter's reason, one paragraph); or ONNX Runtime does not predict what the
            model does (the largest difference named; the files kept, ``preprocessing.json`` records it).
        WeightsError: no exported weights at ``source``.
        ConfigError: a module without ``example_input``, or a bad ``preprocessing`` value.

    Example:
        >>> onnx_file = nbddp.export_onnx(result.run_dir)             # runs/<run>/export/model.onnx
        >>> nbddp.predict(onnx_file, ["data/digits/3/0003.png"])[0].label
    """
    from ..contract import onnx as ox

    ox.require("nbddp.export_onnx", ox.WRITE_MODULES)  # and onnxruntime for the check: without it, a warning
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], torch.nn.Module):
        source, example_input = source
    if isinstance(source, torch.nn.Module):
        return _export_module(source, example_input, path, opset, dynamic_batch)
    from ..tasks.classification.onnx_export import CHECK_IMAGES, export_classifier, random_images, spread
    from .inference import load_model

    model, classes = load_model(source)
    meta = model.nbddp_meta
    weights = Path(meta["weights"])
    folder = weights.parent if path is None else Path(path)
    if folder.suffix == ".onnx":
        if folder.name != rundir.EXPORT_ONNX:
            raise ConfigError(f"export_onnx(path={os.fspath(path)!r}): a run's graph is {rundir.EXPORT_ONNX}, beside "
                              f"its {rundir.EXPORT_PREPROCESSING}; pass the folder for the two")
        folder = folder.parent
    on = "given images"
    if images is None:
        held_out = _held_out_images(Path(source), weights.parent)
        on = "held-out images" if held_out else "random images (no held-out image of the run was found)"
        images = spread(held_out) if held_out else random_images(CHECK_IMAGES, meta["image_size"])
    onnx_path, _ = export_classifier(model, classes, meta["image_size"], folder, list(images),
                                     model_name=meta["model"], opset=opset, dynamic_batch=dynamic_batch,
                                     preprocessing=preprocessing, weights_file=weights, on=on)
    return onnx_path


def _held_out_images(source: Path, export_folder: Path) -> List[str]:
    """The validation images of the run the export came from, those that still exist."""
    runs = [source, export_folder.parent]
    meta_path = export_folder / rundir.EXPORT_META
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, IndexError):
        runs.append(Path(json.loads(meta_path.read_text())["source"]).parents[1])  # <run>/checkpoints/best.pt
    for run in runs:
        if rundir.val_predictions_path(run).is_file():
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError, WeightsError):
                return [r["path"] for r in load_val_predictions(run) if Path(r["path"]).is_file()]
    return []


def _export_module(model: torch.nn.Module, example: Optional[torch.Tensor], path: Optional[PathLike],
                   opset: Optional[int], dynamic_batch: bool) -> Path:
    """A module of the user's: the graph, checked on the example input."""
    import copy

    from ..contract import onnx as ox

    if not isinstance(example, torch.Tensor):
        raise ConfigError("export_onnx(model): pass example_input=, a batch the model takes, e.g. "
                          "torch.randn(2, 3, 224, 224)")
    if path is None:
        raise ConfigError("export_onnx(model): pass path=, the .onnx file (or a folder) to write")
    path = Path(path)
    path = path if path.suffix == ".onnx" else path / rundir.EXPORT_ONNX
    model = ox.plain_module(model)
    if any(t.device.type != "cpu" for t in model.state_dict().values()):
        model = copy.deepcopy(model).cpu()  # the graph and the check on the CPU, as ONNX Runtime runs it here
    example = example.detach().cpu()
    was_training = model.training
    model.eval()
    try:
        ox.write(model, example, path, opset=opset, dynamic_batch=dynamic_batch)
        if ox.missing_modules(ox.RUN_MODULES):
            warnings.warn(f"{path} was not checked: onnxruntime is not installed ({ox.EXTRA})", stacklevel=3)
        else:
            with torch.no_grad():
                expected = model(example).float().numpy()
            passed, what, _, _ = ox.compare(ox.run(ox.session(path), example.float().numpy()), expected)
            if not passed:
                raise ExportError(f"{path} does not compute what the model computes: checked with ONNX Runtime on "
                                  f"example_input, {what}. The file is kept for a look; do not serve it.")
    finally:
        model.train(was_training)
    return path


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


__all__ = ["confusion_matrix", "export_onnx", "export_run", "load_val_predictions", "per_class_accuracy", "run_classes"]
