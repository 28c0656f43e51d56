"""nbddp: train PyTorch models with DistributedDataParallel from a Jupyter notebook.

Worker functions live in files and are started with the spawn method, one process per GPU
(nccl) or N CPU processes (gloo); the notebook gets live progress, one clear error when a rank
fails, and no process left behind when a cell is interrupted.
"""

from .config import TrainConfig
from .errors import ConfigError, DataError, NbddpError, TrainingInterrupted, WeightsError, WorkerError
from .gpus import GPUInfo, list_gpus
from .launch import RunHandle, TrainResult, spawn_train
from .runtime import Context

__version__ = "0.1.0"

__all__ = [
    "spawn_train",
    "TrainConfig",
    "TrainResult",
    "RunHandle",
    "Context",
    "list_gpus",
    "GPUInfo",
    "NbddpError",
    "ConfigError",
    "DataError",
    "WeightsError",
    "WorkerError",
    "TrainingInterrupted",
]
