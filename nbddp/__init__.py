"""nbddp: train PyTorch models with DistributedDataParallel from a Jupyter notebook.

Worker functions live in files and start in fresh interpreters (a forkserver with torch
preloaded, or spawn; never a fork of the kernel), one process per GPU (nccl) or N CPU processes
(gloo); the notebook gets live progress, one clear error when a rank fails, and no process left
behind when a cell is interrupted.
"""

from .config import TrainConfig
from .errors import ConfigError, DataError, NbddpError, RunAbandoned, TrainingInterrupted, WeightsError, WorkerError
from .export import export_run
from .gpus import GPUInfo, list_gpus
from .inference import Prediction, load_model, predict
from .handle import RunHandle, TrainResult
from .launch import spawn_train
from .procs import cleanup
from .runtime import Context
from .forkserver import prewarm_in_kernel as _prewarm_in_kernel

__version__ = "0.1.0"

__all__ = [
    "spawn_train",
    "TrainConfig",
    "TrainResult",
    "RunHandle",
    "Context",
    "load_model",
    "predict",
    "Prediction",
    "export_run",
    "TrainingPanel",
    "show_tensorboard",
    "list_gpus",
    "cleanup",
    "GPUInfo",
    "NbddpError",
    "ConfigError",
    "DataError",
    "WeightsError",
    "WorkerError",
    "TrainingInterrupted",
    "RunAbandoned",
]


_UI_NAMES = ("TrainingPanel", "show_tensorboard", "show_predictions", "plot_confusion_matrix")


def __getattr__(name):
    # The notebook UI (ipywidgets, matplotlib) loads on first use, so workers and scripts that
    # import nbddp never import it.
    if name in _UI_NAMES:
        from . import ui

        return getattr(ui, name)
    raise AttributeError(f"module 'nbddp' has no attribute {name!r}")


# In a Jupyter kernel, start the warm forkserver now (a daemon thread), so the first launch
# finds torch and DDP imported there; never in scripts or workers. NBDDP_PREWARM=0: off.
_prewarm_in_kernel()
