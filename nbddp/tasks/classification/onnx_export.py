"""The built-in classifier as a deployable pair: ``model.onnx`` and the ``preprocessing.json`` it needs.

Used by rank 0 at the end of a ``TrainConfig(export_onnx=True)`` run and by the kernel
(``nbddp.export_onnx``, ``nbddp.predict`` on a ``.onnx`` file), as the model code is.

``preprocessing.json`` says what a service does to an image before the graph sees it: convert to RGB,
resize the shorter side to ``resize`` (bilinear, as PIL does it), crop ``crop`` x ``crop`` from the
centre, divide by 255, subtract ``mean`` and divide by ``std`` per channel, lay out ``NCHW`` float32.
:func:`preprocess` is exactly that, in numpy and PIL (no torch), and equals the validation transform of
training. The check after export runs ONNX Runtime on held-out images prepared *by the file's
recipe* and PyTorch on the same images prepared by training's own transform: a recipe that does not
match the model fails the check, as a wrong graph does.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...contract import onnx as ox
from ...contract.checkpoint import file_digest
from ...contract.errors import ConfigError, ExportError, WeightsError
from ...contract.paths import PathLike
from ...contract.rundir import EXPORT_ONNX, EXPORT_PREPROCESSING, atomic_write_text
from .data import IMAGENET_MEAN, IMAGENET_STD, build_transforms, resize_size
from .images import load_rgb

#: The version of ``preprocessing.json``'s layout.
FORMAT = 1
#: Held-out images the check runs on (spread over the validation split).
CHECK_IMAGES = 16
#: What ``preprocessing=`` may change: what a service does differently from training's transform.
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
OVERRIDABLE = ("resize", "crop", "interpolation", "mean", "std", "channel_order")


def recipe(image_size: int, **overrides: Any) -> Dict[str, Any]:
    """The ``preprocess`` section of ``preprocessing.json``: training's validation transform, as values.

    Raises:
        ConfigError: an override this recipe has no field for, or a value out of range.
    """
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ConfigError(f"preprocessing={overrides!r}: {', '.join(unknown)} is not a field of the recipe; "
                          f"it has {', '.join(OVERRIDABLE)}")
    steps = {"color": "RGB", "resize": resize_size(image_size), "interpolation": "bilinear", "crop": image_size,
             "divide_by": 255, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "channel_order": "RGB",
             "layout": "NCHW", "dtype": "float32"}
    steps.update({k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()})
    problem = _recipe_problem(steps)
    if problem:
        raise ConfigError(f"preprocessing: {problem}")
    return steps


def _recipe_problem(steps: Any) -> Optional[str]:
    def positive_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if not isinstance(steps, dict):
        return "the preprocess section is not an object"
    for key in ("resize", "crop", "divide_by"):
        if not positive_int(steps.get(key)):
            return f"{key}={steps.get(key)!r} must be a positive whole number of pixels (divide_by: 255)"
    if steps["resize"] < steps["crop"]:
        return f"resize={steps['resize']} is smaller than crop={steps['crop']}: the crop must fit in the resized image"
    if steps.get("interpolation") not in INTERPOLATIONS:
        return f"interpolation={steps.get('interpolation')!r}: one of {', '.join(INTERPOLATIONS)}"
    if steps.get("channel_order") not in ("RGB", "BGR"):
        return f"channel_order={steps.get('channel_order')!r}: 'RGB' or 'BGR'"
    for key in ("mean", "std"):
        v = steps.get(key)
        if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and math.isfinite(x) for x in v)):
            return f"{key}={v!r} must be three numbers, one per channel"
    if any(x <= 0 for x in steps["std"]):
        return f"std={steps['std']!r}: every value must be > 0"
    if (steps.get("color"), steps.get("layout"), steps.get("dtype")) != ("RGB", "NCHW", "float32"):
        return "color, layout and dtype must be 'RGB', 'NCHW' and 'float32'"
    return None


def preprocess(image, steps: Dict[str, Any]) -> np.ndarray:
    """One PIL image (any mode; RGB first) as the graph's input row, ``float32 [3, crop, crop]``."""
    from PIL import Image

    image = image if image.mode == "RGB" else image.convert("RGB")
    w, h = image.size
    size = steps["resize"]
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)  # torchvision's rounding, the training transform's
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        mode = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}[steps["interpolation"]]
        image = image.resize((new_w, new_h), mode)
    crop = steps["crop"]
    top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    image = image.crop((left, top, left + crop, top + crop))
    x = np.asarray(image, dtype=np.float32) / np.float32(steps["divide_by"])  # [H, W, 3]
    x = (x - np.asarray(steps["mean"], np.float32)) / np.asarray(steps["std"], np.float32)
    if steps["channel_order"] == "BGR":
        x = x[:, :, ::-1]
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def _images(items: Sequence[Any]) -> list:
    return [load_rgb(x) if isinstance(x, (str, os.PathLike)) else x.convert("RGB") for x in items]


def spread(paths: Sequence[Any], n: int = CHECK_IMAGES) -> list:
    """Up to ``n`` of ``paths`` spread evenly over them (a split sorted by class gives every class some)."""
    if len(paths) <= n:
        return list(paths)
    return [paths[round(i * (len(paths) - 1) / (n - 1))] for i in range(n)] if n > 1 else [paths[0]]


def random_images(n: int, size: int, seed: int = 0) -> list:
    """Noise images, for a check where no held-out image is at hand (the graph checked, not the data)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def export_classifier(model: torch.nn.Module, classes: Sequence[str], image_size: int, folder: PathLike,
                      images: Sequence[Any], *, model_name: str = "", opset: Optional[int] = None,
                      dynamic_batch: bool = True, preprocessing: Optional[dict] = None,
                      weights_file: Optional[Path] = None, on: str = "held-out images",
                      threads: Optional[int] = None) -> Tuple[Path, dict]:
    """Write ``model.onnx`` and ``preprocessing.json`` into ``folder``, then check them with ONNX Runtime.

    Args:
        model: the plain classifier (CPU, any mode: exported in eval mode).
        classes: class names in index order.
        image_size: the size it was trained at.
        folder: where the two files go (created if needed); files of another export there stay.
        images: paths or PIL images the check runs on.
        preprocessing: changes to the recipe (:data:`OVERRIDABLE`): what the service will do; the check
            then tells whether the model still predicts the same.
        weights_file: the weights the model was loaded from, recorded with their SHA-256.
        on: what ``images`` are, for the record and the error.
        threads: ONNX Runtime's threads for the check (default: its own choice).

    Returns:
        ``(model.onnx path, the preprocessing.json record)``.

    Raises:
        ExportError: the extra is missing; neither exporter takes the model; or the check failed (the
            files are kept, and ``preprocessing.json`` says the check failed).
        ConfigError: a bad ``preprocessing`` override.
    """
    ox.require("exporting to ONNX", ox.WRITE_MODULES)  # the check needs onnxruntime too: without it, a warning
    steps = recipe(image_size, **(preprocessing or {}))
    folder = Path(folder)
    path = folder / EXPORT_ONNX
    pil = _images(images)
    _, val_tf = build_transforms(image_size)
    reference = torch.stack([val_tf(im) for im in pil]) if pil else torch.zeros(2, 3, image_size, image_size)
    model = ox.plain_module(model)
    was_training = model.training
    model.eval()
    try:
        # A fixed batch is one image, what a service that answers one request at a time feeds.
        example = reference[:2] if dynamic_batch else reference[:1]
        written = ox.write(model, example, path, opset=opset, dynamic_batch=dynamic_batch)
        record = _record(written, steps, list(classes), model_name, "batch" if dynamic_batch else 1, weights_file)
        _save(folder, record)
        check = _check(model, pil, reference, steps, path, list(classes), on, threads)
        record["check"] = check.to_dict() if check is not None else None  # None: onnxruntime is missing
    finally:
        model.train(was_training)
    _save(folder, record)
    if check is not None and not check.passed:
        raise ExportError(
            f"{path} does not predict what the model predicts: checked with ONNX Runtime on {len(pil)} {on} "
            f"prepared as {folder / EXPORT_PREPROCESSING} says, {record['check']['what']}. The files are kept for "
            "a look (preprocessing.json records the failed check); do not serve them. A changed preprocessing "
            "recipe makes the model see other inputs than it was trained on.")
    return path, record


def _record(written: "ox.Written", steps: dict, classes: List[str], model_name: str, batch: Any,
            weights_file: Optional[Path]) -> dict:
    record = {
        "format": FORMAT,
        "model": model_name,
        "input": {"name": ox.INPUT_NAME, "shape": [batch, 3, steps["crop"], steps["crop"]], "dtype": "float32"},
        "output": {"name": ox.OUTPUT_NAME, "shape": [batch, len(classes)],
                   "meaning": "unnormalised class scores: softmax gives the probabilities"},
        "preprocess": steps,
        "classes": classes,
        "files": {p.name: file_digest(p) for p in written.files},
        "export": {"exporter": written.exporter, "opset": written.opset, "torch": torch.__version__,
                   "seconds": round(written.seconds, 3), "dynamo_failure": written.dynamo_failure},
        "check": None,
    }
    if weights_file is not None and Path(weights_file).is_file():
        record["weights"] = {"file": Path(weights_file).name, "sha256": file_digest(weights_file)}
    return record


def _save(folder: Path, record: dict) -> None:
    atomic_write_text(folder / EXPORT_PREPROCESSING, json.dumps(record, indent=2) + "\n")


def _check(model, pil: list, reference: torch.Tensor, steps: dict, path: Path, classes: List[str], on: str,
           threads: Optional[int]) -> Optional["ox.Check"]:
    """ONNX Runtime on the images as the recipe prepares them, against PyTorch on training's transform;
    ``None`` (and a warning) where onnxruntime is not installed."""
    if ox.missing_modules(ox.RUN_MODULES):
        import warnings

        warnings.warn(f"{path} was not checked: onnxruntime is not installed ({ox.EXTRA})", stacklevel=3)
        return None
    t0 = time.perf_counter()
    with torch.no_grad():
        expected = model(reference).float().numpy()
    batch = np.stack([preprocess(im, steps) for im in pil]) if pil else reference.numpy()
    sess = ox.session(path, threads)
    try:
        got = ox.run(sess, batch)
        passed, what, largest, top1 = ox.compare(got, expected, classes)
    except Exception as exc:  # noqa: BLE001 - ORT refuses the input (a crop of another size than the graph's)
        passed, what, largest, top1 = False, f"ONNX Runtime refused the input: {ox.reason(exc)}", float("inf"), False
    return ox.Check(len(batch), largest, ox.ATOL, ox.RTOL, top1, passed, round(time.perf_counter() - t0, 3), on, what)


def export_after_training(model_name: str, classes: Sequence[str], image_size: int, weights: Path,
                          held_out: Sequence[Any], threads: Optional[int] = None) -> str:
    """Rank 0 at the end of a ``TrainConfig(export_onnx=True)`` run: the pair beside the exported weights.

    The model is the plain one, on the CPU, loaded from the exported ``weights`` as ``nbddp.load_model``
    loads them (an FSDP run exports the consolidated weights, so it is the same model either way).
    Returns the line for the log.

    Raises:
        ExportError: as :func:`export_classifier`, saying that the weights are exported all the same.
    """
    from ...contract.checkpoint import load_state_dict_file
    from .models import build_model

    model = build_model(model_name, len(classes))
    model.load_state_dict(load_state_dict_file(weights), strict=True)
    try:
        path, record = export_classifier(model, classes, image_size, Path(weights).parent, spread(held_out),
                                         model_name=model_name, weights_file=Path(weights), threads=threads)
    except ExportError as exc:
        raise ExportError(f"{exc} The run's weights are exported all the same, in {Path(weights).parent}.") from None
    return f"ONNX: {path} ({summary(record)})"


def summary(record: dict) -> str:
    """What ``preprocessing.json`` says of the export and its check, in one line."""
    check, export = record.get("check"), record["export"]
    made = f"{export['exporter']} exporter, opset {export['opset']}, {export['seconds']:.1f} s"
    if not check:
        return f"{made}; not checked: onnxruntime is not installed"
    return (f"{made}; ONNX Runtime agrees with PyTorch on {check['images']} {check['on']} (largest logit difference "
            f"{check['max_abs_diff']:.2g}, {check['seconds']:.1f} s)")


# ---------------------------------------------------------------------------- reading it back
def read_record(folder: Path, onnx_file: Path) -> dict:
    """``preprocessing.json`` beside ``onnx_file``, checked: a file of a folder others may write is input.

    Raises:
        WeightsError: it is missing, not JSON, misses a field, does not describe this ``model.onnx`` (its
            SHA-256 differs), or records a failed check.
    """
    path = folder / EXPORT_PREPROCESSING
    again = "Export it again: nbddp.export_onnx(run_dir)"
    if not path.is_file():
        raise WeightsError(f"{onnx_file} has no {EXPORT_PREPROCESSING} beside it: nbddp.predict needs the recipe "
                           f"that prepares images for it. {again}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read {path} ({exc}). {again}") from None
    classes = record.get("classes") if isinstance(record, dict) else None
    problem = None if isinstance(record, dict) else "it is not a JSON object"
    problem = problem or _recipe_problem(record.get("preprocess"))
    if problem is None and not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        problem = "classes must be a list of class names"
    if problem:
        raise WeightsError(f"{path}: {problem}. {again}")
    digest = (record.get("files") or {}).get(onnx_file.name) if isinstance(record.get("files"), dict) else None
    if digest != file_digest(onnx_file):
        raise WeightsError(f"{path} does not describe {onnx_file} (it records another SHA-256 for it): the two "
                           f"files come from different exports. {again}")
    check = record.get("check")
    if isinstance(check, dict) and check.get("passed") is False:
        raise WeightsError(f"{onnx_file} failed its check at export ({check.get('what', 'logits differ')}); it is "
                           f"kept for a look, not for predictions. {again}")
    return record


class OnnxClassifier:
    """A ``model.onnx`` and its recipe, run with ONNX Runtime on the CPU (what ``nbddp.predict`` uses)."""

    def __init__(self, onnx_file: PathLike):
        ox.require("nbddp.predict on an ONNX file", ox.RUN_MODULES)
        self.path = Path(onnx_file)
        if not self.path.is_file():
            raise WeightsError(f"no ONNX file at {self.path}; write one with nbddp.export_onnx(run_dir)")
        self.record = read_record(self.path.parent, self.path)
        self.classes: List[str] = list(self.record["classes"])
        self.session = ox.session(self.path)

    def logits(self, images: Sequence[Any]) -> np.ndarray:
        batch = np.stack([preprocess(im, self.record["preprocess"]) for im in _images(images)])
        return ox.run(self.session, batch)


__all__ = ["CHECK_IMAGES", "OVERRIDABLE", "OnnxClassifier", "export_after_training", "export_classifier", "preprocess", "random_images",
           "read_record", "recipe", "spread", "summary"]
