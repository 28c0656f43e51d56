"""Use trained weights in the kernel: rebuild the plain torchvision model and predict.

Runs in the kernel on the CPU by default, so it never holds a GPU the next training run needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import torch

if TYPE_CHECKING:
    import PIL.Image

from .checkpoint import load_state_dict_file
from .errors import WeightsError

PathLike = Union[str, Path]


@dataclass(frozen=True)
class Prediction:
    """One image's prediction: the best class, its probability, and the top-k list."""

    label: str
    index: int
    probability: float
    top: Tuple[Tuple[str, float], ...]


def _export_folder(source: Path) -> Path:
    for cand in (source / "export", source):
        if (cand / "class_indices.json").exists() and ((cand / "model.safetensors").exists() or (cand / "model.pth").exists()):
            return cand
    if source.is_file() and (source.parent / "class_indices.json").exists():
        return source.parent
    raise WeightsError(
        f"no exported weights at {source}: expected a run folder with export/, or a folder holding "
        "model.safetensors (or model.pth) and class_indices.json. Export a run with "
        "nbddp.export_run(run_dir, folder) first.")


def load_model(source: PathLike, device: Union[str, torch.device] = "cpu"):
    """Rebuild a trained classifier for inference.

    Args:
        source: a run folder, its ``export/`` folder, or a folder written by ``export_run``.
        device: where to put the model (default CPU: the kernel keeps no GPU memory).

    Returns:
        ``(model, classes)``: the plain torchvision model in eval mode, and the class names.
        ``model.nbddp_meta`` holds the model name and image size it was trained at.

    Example:
        >>> model, classes = load_model(result.run_dir)
        >>> predict(model, ["data/digits/3/0003.png"])[0].label
    """
    from .models import build_model

    folder = _export_folder(Path(source))
    indices = json.loads((folder / "class_indices.json").read_text())
    classes = [indices[str(i)] for i in range(len(indices))]
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if "model" not in meta:
        cfg_path = folder.parent / "config.json"
        if not cfg_path.exists():
            raise WeightsError(f"{folder} has no meta.json naming the model architecture; re-export the run")
        cfg = json.loads(cfg_path.read_text())
        meta = {"model": cfg["model"], "image_size": cfg["image_size"]}
    weights = folder / "model.safetensors" if (folder / "model.safetensors").exists() else folder / "model.pth"
    model = build_model(meta["model"], len(classes))
    model.load_state_dict(load_state_dict_file(weights), strict=True)
    model.eval().to(device)
    model.nbddp_meta = {"model": meta["model"], "image_size": meta.get("image_size", 224),
                        "classes": classes, "weights": str(weights)}
    return model, classes


@torch.no_grad()
def predict(model, images: Union[PathLike, "PIL.Image.Image", Sequence], classes: Optional[Sequence[str]] = None,
            image_size: Optional[int] = None, top_k: int = 3, batch_size: int = 64) -> List[Prediction]:
    """Classify images (paths or PIL images) with the validation transform of training.

    Args:
        model: a model from :func:`load_model` (or any classifier; then pass ``classes``).
        images: one image or a list of paths / PIL images.
        classes: class names (default: those stored by ``load_model``).
        image_size: evaluation size (default: the training size stored by ``load_model``).
        top_k: how many (class, probability) pairs to keep per image.
        batch_size: images per forward pass.

    Returns:
        One :class:`Prediction` per image, in order.
    """
    from .data import build_transforms, load_rgb

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
        probs = torch.softmax(model(batch).float(), dim=1).cpu()
        k = min(top_k, probs.shape[1])
        for row in probs:
            p, idx = row.topk(k)
            top = tuple((classes[j], float(q)) for q, j in zip(p.tolist(), idx.tolist()))
            out.append(Prediction(top[0][0], int(idx[0]), top[0][1], top))
    return out
