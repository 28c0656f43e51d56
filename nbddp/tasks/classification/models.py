"""torchvision classifiers: build, find the head, freeze the backbone, load weights by shape.

Runs in the workers and, for inference and weights preflight, in the notebook kernel.
Pretrained weights are never downloaded: models are built with ``weights=None`` and weights
come from a local file through :func:`load_pretrained`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import torch
import torchvision
from torch import nn

from ...contract.checkpoint import PathLike, extract_state_dict, load_state_dict_file
from ...contract.errors import ConfigError, WeightsError

#: Attributes that hold the classifier head of torchvision classification models, in the order
#: they are looked for: ``fc`` (ResNet, ResNeXt, RegNet, ShuffleNet, GoogLeNet, Inception),
#: ``classifier`` (VGG, AlexNet, MobileNet, EfficientNet, DenseNet, ConvNeXt, MNASNet,
#: SqueezeNet, MaxViT; the whole module, not only its last Linear), ``heads`` (ViT),
#: ``head`` (Swin).
HEAD_ATTRIBUTES = ("fc", "classifier", "heads", "head")

# How many key names an error message shows before "...".
_SHOW_KEYS = 5


def classification_model_names() -> list[str]:
    """Every torchvision classification model name ``build_model`` accepts."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _unknown_model_error(name: str) -> ConfigError:
    names = classification_model_names()
    by_lower = {n.lower(): n for n in names}
    matches = difflib.get_close_matches(str(name).lower(), list(by_lower), n=5, cutoff=0.6)
    close = [by_lower[m] for m in matches]
    if name in torchvision.models.list_models():
        why = f"{name!r} is a torchvision model, but not an image classifier (detection, video...)"
    else:
        why = f"unknown model {name!r}"
    if close:
        hint = f"did you mean {', '.join(map(repr, close))}?"
    else:
        hint = "e.g. 'resnet34', 'resnet18', 'mobilenet_v3_small'."
    return ConfigError(
        f"TrainConfig.model: {why}; {hint} "
        f"nbddp.tasks.classification.models.classification_model_names() lists all {len(names)} classification models."
    )


def build_model(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
    """A randomly initialised torchvision classifier (``weights=None``: nothing is downloaded).

    Args:
        name: a name from :func:`classification_model_names`, e.g. ``"resnet34"``.
        num_classes: number of outputs of the head.
        **kwargs: passed on to the model, e.g. ``image_size=64`` for ViT.

    Raises:
        ConfigError: unknown name (with close matches), bad ``num_classes``, or a ``weights``
            argument (load local weights with :func:`load_pretrained` instead).
    """
    if not isinstance(name, str) or name not in classification_model_names():
        raise _unknown_model_error(name)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes={num_classes!r}: must be a positive integer")
    if "weights" in kwargs:
        raise ConfigError(
            "build_model never downloads weights; build with weights=None and call "
            "load_pretrained(model, path) with a local weights file"
        )
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)


def head_names(model: nn.Module) -> list[str]:
    """Parameter-name prefixes of the classifier head, e.g. ``["fc"]`` for a ResNet.

    Names are relative to ``model`` as passed (call it on the bare model, not on a DDP wrapper).

    Raises:
        ConfigError: none of :data:`HEAD_ATTRIBUTES` is a child module with parameters.
    """
    found = []
    for attr in HEAD_ATTRIBUTES:
        module = getattr(model, attr, None)
        if isinstance(module, nn.Module) and next(module.parameters(), None) is not None:
            found.append(attr)
    if not found:
        children = [n for n, _ in model.named_children()]
        raise ConfigError(
            f"cannot find the classifier head of {type(model).__name__}: none of "
            f"{', '.join(HEAD_ATTRIBUTES)} is a sub-module with parameters (its children: "
            f"{children}). freeze_layers works with torchvision classification models; turn it off."
        )
    return found


def freeze_except_head(model: nn.Module) -> list[str]:
    """Make only the classifier head trainable (``requires_grad=False`` everywhere else).

    Call it on the bare model, before ``DistributedDataParallel``. ``requires_grad=False``
    alone would let BatchNorm running statistics keep updating in ``train()`` mode (the
    reference script's behaviour); the training loop puts frozen BatchNorm layers in eval
    mode (:func:`nbddp.rank.engine.freeze_bn_statistics`), so they keep what was loaded.

    Returns:
        The names of the parameters left trainable.

    Raises:
        ConfigError: the model is already wrapped in DDP, or has no recognisable head.
    """
    # DDP reads requires_grad once, in its constructor: it builds gradient buckets and autograd
    # hooks only for the parameters that require grad then. Freezing afterwards leaves buckets
    # waiting for gradients that never come (a hang or "Expected to have finished reduction"),
    # and unfreezing afterwards is never all-reduced, so the ranks silently drift apart.
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ConfigError("freeze_except_head must run on the bare model, before wrapping it in DDP")
    heads = head_names(model)
    trainable = []
    for name, param in model.named_parameters():
        in_head = any(name == h or name.startswith(h + ".") for h in heads)
        param.requires_grad_(in_head)
        if in_head:
            trainable.append(name)
    return trainable


# ---------------------------------------------------------------------------- loading weights
Shape = tuple[int, ...]


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did with each tensor of a weights file.

    Attributes:
        loaded: keys copied into the model (same name and shape).
        skipped_shape: ``(key, file_shape, model_shape)`` for keys whose shapes differ, e.g. the
            head when the number of classes changed; the model keeps its initial values.
        missing: model keys absent from the file (left as initialised).
        unexpected: file keys the model does not have (ignored).
        source: the file (or "the given state_dict") the weights came from.
    """

    loaded: list[str] = field(default_factory=list)
    skipped_shape: list[tuple[str, Shape, Shape]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    source: str = ""

    def summary(self) -> str:
        """Human-readable lines: counts, then each shape-skipped key with both shapes."""
        total = len(self.loaded) + len(self.skipped_shape) + len(self.missing)
        lines = [f"loaded {len(self.loaded)} of {total} model tensors from {self.source or 'the weights'}"]
        if self.skipped_shape:
            lines.append(f"skipped {len(self.skipped_shape)} with a different shape (left as initialised):")
            lines += [f"  {k}: file {f} vs model {m}" for k, f, m in self.skipped_shape]
        for label, keys in (("missing from the file (left as initialised)", self.missing),
                            ("in the file but not in the model (ignored)", self.unexpected)):
            if keys:
                more = f", ... ({len(keys) - _SHOW_KEYS} more)" if len(keys) > _SHOW_KEYS else ""
                lines.append(f"{len(keys)} {label}: {', '.join(keys[:_SHOW_KEYS])}{more}")
        return "\n".join(lines)


def _match(model_shapes: Mapping[str, Shape], file_sd: Mapping[str, torch.Tensor], source: str) -> LoadReport:
    """Sort every key into loaded / skipped_shape / missing (model order) and unexpected (file order)."""
    # Model order, not file order: safetensors files list their keys alphabetically.
    report = LoadReport(source=source)
    for key, model_shape in model_shapes.items():
        if key not in file_sd:
            report.missing.append(key)
        elif tuple(file_sd[key].shape) != model_shape:
            report.skipped_shape.append((key, tuple(file_sd[key].shape), model_shape))
        else:
            report.loaded.append(key)
    report.unexpected = [k for k in file_sd if k not in model_shapes]
    return report


def _require_something_loaded(
    report: LoadReport, model_shapes: Mapping[str, Shape], file_keys: list[str], model_label: str
) -> None:
    """Raise ``WeightsError`` with the likely cause when no real tensor matched."""
    # BatchNorm's scalar num_batches_tracked matches in any two BN models: it does not count.
    if any(not k.endswith("num_batches_tracked") for k in report.loaded):
        return
    named = len(report.skipped_shape)
    if named == 0:
        cause = "no name matches: the file is most likely from a different architecture"
    else:
        key, f, m = report.skipped_shape[0]
        example = f"e.g. {key}: file {f} vs model {m}"
        if named < len(model_shapes) / 2:
            cause = (f"only {named} of {len(model_shapes)} names match and none has the same shape "
                     f"({example}): the file is most likely from a different architecture")
        else:
            cause = (f"the names match but every shape differs ({example}): the file is most likely "
                     "from another size of the same family (resnet18 vs resnet50...)")
    raise WeightsError(
        f"nothing in {report.source} fits {model_label}: {cause}. Model keys: "
        f"{list(model_shapes)[:_SHOW_KEYS]}...; file keys: {file_keys[:_SHOW_KEYS]}... "
        "Pass weights saved from the same model (TrainConfig.model), or weights=None to train from scratch."
    )


def _bare(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel and torch.compile wrappers (their keys have prefixes)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def load_pretrained(model: nn.Module, path_or_state_dict: Union[PathLike, Mapping[str, Any]]) -> LoadReport:
    """Copy every tensor whose name AND shape match into ``model``; report the rest.

    A head with another number of classes is skipped (and stays as initialised), so weights
    trained on 1000 classes start a 5-class model. Keys with ``module.`` / ``_orig_mod.``
    prefixes match, and a wrapped ``model`` is loaded through its bare module.

    Args:
        model: the model to fill in place.
        path_or_state_dict: a weights file or folder (see
            :func:`nbddp.contract.checkpoint.load_state_dict_file`), a state_dict, or a checkpoint dict
            holding it under ``"model"``.

    Returns:
        A :class:`LoadReport`; print ``report.summary()`` to show what was skipped.

    Raises:
        WeightsError: the file cannot be read safely, or not a single tensor fits the model.
    """
    if isinstance(path_or_state_dict, Mapping):
        source = "the given state_dict"
        file_sd = extract_state_dict(path_or_state_dict, source)
    else:
        file_sd, source = load_state_dict_file(path_or_state_dict), str(path_or_state_dict)
    bare = _bare(model)
    shapes = {k: tuple(v.shape) for k, v in bare.state_dict().items()}
    report = _match(shapes, file_sd, source)
    _require_something_loaded(report, shapes, list(file_sd), type(bare).__name__)
    # strict=False because skipped and missing keys are expected; shapes were filtered above
    # because strict=False still raises on a shape mismatch.
    bare.load_state_dict({k: file_sd[k] for k in report.loaded}, strict=False)
    return report


def _model_shapes(model_name: str, num_classes: int, **kwargs: Any) -> dict[str, Shape]:
    """State_dict shapes of a model, built on the meta device (no memory, no init time) if possible."""
    try:
        with torch.device("meta"):
            model = build_model(model_name, num_classes, **kwargs)
    except ConfigError:
        raise
    except Exception:
        # Some initialisers read values back (RegNet calls .item()), which meta tensors cannot do.
        model = build_model(model_name, num_classes, **kwargs)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_weights_file(path: PathLike, model_name: str, num_classes: int, **model_kwargs: Any) -> LoadReport:
    """Kernel-side preflight: would ``load_pretrained`` accept this file for this model?

    Builds the model without keeping it (on the meta device when possible) and matches the
    file's keys and shapes exactly as :func:`load_pretrained` does, so problems surface in the
    notebook before any worker starts.

    Args:
        path: weights file, run folder or export folder.
        model_name: torchvision model name (``TrainConfig.model``).
        num_classes: number of classes of the run.
        **model_kwargs: extra model arguments, e.g. ``image_size`` for ViT.

    Raises:
        ConfigError: unknown model name.
        WeightsError: missing file, unreadable or not weights-only safe, or nothing loadable.
    """
    shapes = _model_shapes(model_name, num_classes, **model_kwargs)
    file_sd = load_state_dict_file(path)
    report = _match(shapes, file_sd, str(path))
    _require_something_loaded(report, shapes, list(file_sd), model_name)
    return report


__all__ = [
    "HEAD_ATTRIBUTES",
    "LoadReport",
    "build_model",
    "check_weights_file",
    "classification_model_names",
    "freeze_except_head",
    "head_names",
    "load_pretrained",
]
