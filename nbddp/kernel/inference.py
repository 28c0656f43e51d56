"""Use trained weights in the kernel: rebuild the plain torchvision model and predict.

Runs in the kernel on the CPU by default, so it never holds a GPU the next training run needs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import torch

if TYPE_CHECKING:
    import PIL.Image

from ..contract import rundir
from ..contract.checkpoint import file_digest, load_state_dict_file
from ..contract.paths import PathLike
from ..contract.rundir import EXPORT_FILES, EXPORT_META, EXPORT_PTH, EXPORT_SAFETENSORS
from ..contract.errors import WeightsError



@dataclass(frozen=True)
class Prediction:
    """One image's prediction: the best class, its probability, and the top-k list."""

    label: str
    index: int
    probability: float
    top: Tuple[Tuple[str, float], ...]


def _export_folder(source: Path) -> Path:
    for cand in (rundir.export_dir(source), source):
        if rundir.class_indices_path(cand).exists() and (
                (cand / EXPORT_SAFETENSORS).exists() or (cand / EXPORT_PTH).exists()):
            return cand
    if source.is_file() and rundir.class_indices_path(source.parent).exists():
        return source.parent
    raise WeightsError(
        f"no exported weights at {source}: expected a run folder with export/, or a folder holding "
        "model.safetensors (or model.pth) and class_indices.json. Export a run with "
        "nbddp.export_run(run_dir, folder) first.")


_REEXPORT = ("Export the run again into a new folder: nbddp.export_run(run_dir, folder); files copied "
             "by hand from two exports cannot be mixed.")


def _check_files_belong_together(folder: Path, meta: dict, classes: List[str]) -> None:
    """Refuse an export folder whose files come from different exports.

    ``meta.json`` of an nbddp export lists the SHA-256 of every other file; an export written
    before that list existed is checked by its class count only (and by the weights' shapes).
    """
    def mixed(what: str) -> WeightsError:
        return WeightsError(f"the files of {folder} do not belong together: {what}. {_REEXPORT}")

    if "num_classes" in meta and meta["num_classes"] != len(classes):
        raise mixed(f"meta.json says {meta['num_classes']} classes, class_indices.json names {len(classes)}")
    listed = meta.get("files")
    if not isinstance(listed, dict):
        return
    for name in EXPORT_FILES:
        path = folder / name
        if name == EXPORT_META or not path.exists():
            continue
        if name not in listed:
            raise mixed(f"{name} is not one of the files meta.json lists ({', '.join(sorted(listed))})")
        if file_digest(path) != listed[name]:
            raise mixed(f"{name} is not the file that the export which wrote meta.json wrote "
                        "(its SHA-256 differs)")


def load_model(source: PathLike, device: Union[str, torch.device] = "cpu"):
    """Rebuild a trained classifier for inference.

    Args:
        source: a run folder, its ``export/`` folder, or a folder written by ``export_run``.
        device: where to put the model (default CPU: the kernel keeps no GPU memory).

    Returns:
        ``(model, classes)``: the plain torchvision model in eval mode, and the class names.
        ``model.nbddp_meta`` holds the model name and image size it was trained at.

    Raises:
        WeightsError: no export at ``source``, or its files do not belong together (files of two
            exports, weights that do not fit the classes of ``class_indices.json``).

    Example:
        >>> model, classes = load_model(result.run_dir)
        >>> predict(model, ["data/digits/3/0003.png"])[0].label
    """
    from ..tasks.classification.models import build_model

    folder = _export_folder(Path(source))
    classes = rundir.read_class_indices(folder)
    meta_path = folder / EXPORT_META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if "model" not in meta:
        cfg_path = rundir.config_path(folder.parent)
        if not cfg_path.exists():
            raise WeightsError(f"{folder} has no meta.json naming the model architecture; re-export the run")
        cfg = json.loads(cfg_path.read_text())
        meta = {"model": cfg["model"], "image_size": cfg["image_size"]}
    weights = folder / EXPORT_SAFETENSORS if (folder / EXPORT_SAFETENSORS).exists() else folder / EXPORT_PTH
    _check_files_belong_together(folder, meta, classes)
    model = build_model(meta["model"], len(classes))
    try:
        model.load_state_dict(load_state_dict_file(weights), strict=True)
    except RuntimeError as e:  # shapes or keys: weights of another model or class count
        detail = str(e).strip().splitlines()
        raise WeightsError(
            f"the files of {folder} do not belong together: {weights.name} does not fit a {meta['model']} "
            f"with the {len(classes)} classes of class_indices.json ({detail[-1].strip() if detail else e}). "
            f"{_REEXPORT}") from None
    model.eval().to(device)
    model.nbddp_meta = {"model": meta["model"], "image_size": meta.get("image_size", 224),
                        "classes": classes, "weights": str(weights)}
    return model, classes


@torch.no_grad()
def predict(model, images: Union[PathLike, "PIL.Image.Image", Sequence], classes: Optional[Sequence[str]] = None,
            image_size: Optional[int] = None, top_k: int = 3, batch_size: int = 64) -> List[Prediction]:
    """Classify images (paths or PIL images) with the validation transform of training.

    Args:
        model: a model from :func:`load_model` (or any classifier; then pass ``classes``), or a ``.onnx``
            file of :func:`nbddp.export_onnx`: run with ONNX Runtime on the CPU, the images prepared as its
            ``preprocessing.json`` says (the file is refused if the recipe does not describe it).
        images: one image or a list of paths / PIL images.
        classes: class names (default: those stored by ``load_model``).
        image_size: evaluation size (default: the training size stored by ``load_model``).
        top_k: how many (class, probability) pairs to keep per image.
        batch_size: images per forward pass.

    Returns:
        One :class:`Prediction` per image, in order.
    """
    from ..tasks.classification.data import build_transforms, load_rgb

    if isinstance(model, (str, os.PathLike)):
        return _predict_onnx(model, images, classes, image_size, top_k, batch_size)
    meta = getattr(model, "nbddp_meta", {})
    classes = list(classes or meta.get("classes") or [])
    if not classes:
        raise ValueError("predict() needs the class names: pass classes=... or a model from load_model()")
    image_size = image_size or meta.get("image_size", 224)
    _, val_tf = build_transforms(image_size)
    single = not isinstance(images, (list, tuple))
    items = [images] if single else list(images)
    device = next(model.parameters()).device
    model.eval()
    out: List[Prediction] = []
    for i in range(0, len(items), batch_size):
        batch = torch.stack([val_tf(load_rgb(x) if isinstance(x, (str, Path)) else x.convert("RGB"))
                             for x in items[i:i + batch_size]]).to(device)
        out += _predictions(model(batch).float().cpu(), classes, top_k)
    return out


def _predictions(logits: torch.Tensor, classes: Sequence[str], top_k: int) -> List[Prediction]:
    probs = torch.softmax(logits, dim=1)
    k = min(top_k, probs.shape[1])
    out = []
    for row in probs:
        p, idx = row.topk(k)
        top = tuple((classes[j], float(q)) for q, j in zip(p.tolist(), idx.tolist()))
        out.append(Prediction(top[0][0], int(idx[0]), top[0][1], top))
    return out


def _predict_onnx(path: PathLike, images, classes: Optional[Sequence[str]], image_size: Optional[int], top_k: int,
                  batch_size: int) -> List[Prediction]:
    """:func:`predict` with a ``.onnx`` file: its recipe prepares the images, ONNX Runtime runs it."""
    from ..contract.errors import ConfigError
    from ..tasks.classification.onnx_export import OnnxClassifier

    if Path(path).suffix != ".onnx":
        raise ConfigError(f"predict({os.fspath(path)!r}, ...): pass a model from nbddp.load_model(...) or a .onnx file "
                          "written by nbddp.export_onnx")
    onnx_model = OnnxClassifier(path)
    crop = onnx_model.record["preprocess"]["crop"]
    if image_size not in (None, crop):
        raise ConfigError(f"predict(image_size={image_size}): {path} takes {crop}x{crop} images, as its "
                          "preprocessing.json says; leave image_size out")
    classes = list(classes or onnx_model.classes)
    single = not isinstance(images, (list, tuple))
    items = [images] if single else list(images)
    out: List[Prediction] = []
    for i in range(0, len(items), batch_size):
        out += _predictions(torch.from_numpy(onnx_model.logits(items[i:i + batch_size])).float(), classes, top_k)
    return out
