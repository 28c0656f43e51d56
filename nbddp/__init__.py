"""nbddp: train PyTorch models with DistributedDataParallel from a Jupyter notebook.

Worker functions live in files and start in fresh interpreters (a forkserver with torch
preloaded, or spawn; never a fork of the kernel), one process per GPU (nccl) or N CPU processes
(gloo); the notebook gets live progress, one clear error when a rank fails, and no process left
behind when a cell is interrupted.

The package has two sides, and a contract between them. The kernel side runs in the notebook
(or a script) and never initialises CUDA; the worker side runs in each rank. The worker side
imports nothing from the kernel side; both import the shared modules.

==========  ===================  ==============================================================
side        module               what it does
==========  ===================  ==============================================================
shared      ``config``           ``TrainConfig``: the built-in worker's settings, validated
shared      ``fieldspec``        what each ``TrainConfig`` field is: help, flag, check, widget
shared      ``cluster``          torchrun and sbatch commands, as text (``cfg.torchrun_command``)
shared      ``errors``           the exceptions users see
shared      ``rundir``           the run folder: every file name, the atomic writer, records
shared      ``paths``            what a path is (FIFO, /proc) before anything reads it
shared      ``system``           process identity (pid + start time), CPU cores, signalling
shared      ``targets``          ``"file.py:fn"`` / ``"pkg.mod:fn"``: checked (kernel), loaded (rank)
shared      ``gpus``             GPUs from NVML or nvidia-smi, never through CUDA
kernel      ``launch``           ``spawn_train``: plan, run folder, store, environment, start
kernel      ``forkserver``       the warm server workers fork from; pre-warmed in a kernel
kernel      ``handle``           ``RunHandle``: watch, stop, interrupt, reap; ``TrainResult``
kernel      ``report``           a failed run's root-cause rank and its one error
kernel      ``procs``            ``cleanup`` of an earlier launch's workers, proven by marker
kernel      ``cli``              ``python -m nbddp``
kernel      ``export``,          weights out of a run folder; prediction in the kernel
            ``inference``
kernel      ``ui``               ``TrainingPanel``, charts, TensorBoard in the notebook
worker      ``runtime``          a rank's entry: ``Context``, heartbeats, error records
worker      ``elastic``          the same rank under torchrun / srun
worker      ``dist``             process group and the collectives nbddp uses
worker      ``engine``           training and evaluation loops that stop every rank together
worker      ``data``,            class folders, samplers, transforms; the decoded tensor cache
            ``tensor_data``
worker      ``models``,          torchvision models, weights files, SyncBatchNorm
            ``checkpoint``,
            ``sync_bn``
task        ``tasks``            a config's ``LaunchPlan`` (kernel) and its worker function
                                 (``tasks.classification``: preflight, plan, ``train``)
==========  ===================  ==============================================================
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
