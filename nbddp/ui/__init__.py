"""Notebook front end: the training panel, TensorBoard embedding, result figures.

Kernel side only (never imported by a worker). Names load on first use, so
``from nbddp.ui import show_tensorboard`` does not import ipywidgets, and nothing here imports
matplotlib until a figure is drawn.

Example:
    >>> from nbddp.ui import TrainingPanel, show_tensorboard
    >>> panel = TrainingPanel(nbddp.TrainConfig(data_path="data/digits", model="resnet18"))
    >>> panel
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "TrainingPanel": ".panel",
    "show_tensorboard": ".tensorboard",
    "start_tensorboard": ".tensorboard",
    "stop_tensorboard": ".tensorboard",
    "tensorboard_url": ".tensorboard",
    "TensorBoardServer": ".tensorboard",
    "TensorBoardError": ".tensorboard",
    "show_predictions": ".charts",
    "plot_confusion_matrix": ".charts",
    "training_curves_png": ".charts",
    "scalar_charts_png": ".charts",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'nbddp.ui' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
