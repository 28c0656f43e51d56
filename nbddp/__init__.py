"""nbddp: train PyTorch models with DistributedDataParallel from a Jupyter notebook.

Your code as it is (a function in a file or a notebook cell, a torchrun script, an mp.spawn
function) or the built-in classifier starts in fresh interpreters (a forkserver with torch
preloaded, or spawn; never a fork of the kernel), one process per GPU (nccl) or N CPU processes
(gloo); the notebook gets live progress, one clear error when a rank fails, and no process left
behind when a cell is interrupted.

The package has two sides and the shared modules between them. The kernel side runs in the
notebook (or a script) and never initialises CUDA; the worker side runs in each rank. A rank
loads no kernel-side module: not when it imports the worker side, not when it starts (spawned,
forked from the warm server, or under torchrun/srun), and ``import nbddp`` itself loads nothing
until a name is used. :data:`SIDES` is the table below as data; ``tests/test_sides.py`` holds
every rank to it. ``cli`` is the command line of both: a shell's launcher, or a rank under
torchrun/srun (then it takes the worker side only).

==========  ===================  ==============================================================
side        module               what it does
==========  ===================  ==============================================================
shared      ``config``           ``TrainConfig``: the built-in worker's settings, validated
shared      ``fieldspec``        what each ``TrainConfig`` field is: help, flag, check, widget
shared      ``cluster``          torchrun and sbatch commands, as text (``cfg.torchrun_command``)
shared      ``errors``           the exceptions users see
shared      ``rundir``           the run folder: every file name, the atomic writer, records
shared      ``protocol``         ``LaunchSpec`` and every record between kernel and ranks, typed
shared      ``paths``            what a path is (FIFO, /proc) before anything reads it
shared      ``system``           process identity (pid + start time), CPU cores, signalling
shared      ``targets``          ``"file.py:fn"`` / ``"pkg.mod:fn"``: checked (kernel), loaded (rank)
shared      ``cells``            functions from notebook cells: checked and pickled by value (kernel), loaded (rank)
shared      ``conventions``      a worker's convention and arguments, read from its signature and source
shared      ``gpus``             GPUs from NVML or nvidia-smi, never through CUDA
shared      ``leases``           advisory per-GPU leases between kernels (taken by launch, shown by gpus)
shared      ``tasks``            every launch's plan (``LaunchPlan``): target, world, name, resume
shared      ``checkpoint``       atomic save, weights-only load, export files
kernel      ``launch``           ``spawn_train``: plan, run folder, store, environment, start
kernel      ``rendezvous``       where the ranks meet: a private FileStore, or a TCP store for env://
kernel      ``forkserver``       the warm server workers fork from; pre-warmed in a kernel
kernel      ``handle``           ``RunHandle``: watch, stop, interrupt, reap; ``TrainResult``
kernel      ``shutdown``         the staged stop: ask, SIGTERM, SIGKILL, as a small state machine
kernel      ``stall``            from heartbeats: a hung rank (stop the run), a run where none moves (say where)
kernel      ``restarts``         which failures a run heals by restarting (the rule), and each restart's record
kernel      ``stacks``           where each rank is: every rank's Python stack, on demand and on a hang
kernel      ``output``           rank 0's output in the cell as a terminal shows it (``\\r`` bars, long lines)
kernel      ``report``           a failed run's root-cause rank and its one error
kernel      ``procs``            ``cleanup`` of an earlier launch's workers, proven by marker
kernel      ``export``,          weights out of a run folder; prediction in the kernel
            ``inference``
kernel      ``ui``               ``TrainingPanel``, charts, TensorBoard in the notebook
worker      ``runtime``          a rank's entry: ``Context``, heartbeats, error records
worker      ``calls``            how a rank calls ctx, mp.spawn and torchrun functions, and scripts
worker      ``heartbeat``,       the rank's heartbeat thread; which errors are another rank's fault
            ``rank_errors``
worker      ``elastic``          the same rank under torchrun / srun
worker      ``dist``             process group and the collectives nbddp uses
worker      ``engine``           training and evaluation loops that stop every rank together
worker      ``data``,            class folders, samplers, transforms; the decoded tensor cache;
            ``tensor_data``,     file bytes decoded and augmented batch by batch on the device
            ``decode_data``
worker      ``models``,          torchvision models, weights files, SyncBatchNorm
            ``sync_bn``
worker      ``tasks.``           the built-in worker: its preflight and plan (run in the
            ``classification``   kernel, from the shared side) and ``train(ctx, cfg)``
entry       ``cli``              ``python -m nbddp``: a shell's launcher, or one rank of torchrun/srun
==========  ===================  ==============================================================
"""

#: Each module's side (the table above as data): ``kernel``, ``worker``, ``shared`` or ``entry``.
SIDES = {
    "config": "shared", "errors": "shared", "rundir": "shared", "paths": "shared", "system": "shared",
    "targets": "shared", "protocol": "shared", "cells": "shared", "fieldspec": "shared", "cluster": "shared", "gpus": "shared", "leases": "shared", "tasks": "shared", "checkpoint": "shared",
    "launch": "kernel", "rendezvous": "kernel", "forkserver": "kernel", "handle": "kernel", "report": "kernel", "procs": "kernel", "shutdown": "kernel", "stall": "kernel", "restarts": "kernel", "stacks": "kernel", "output": "kernel",
    "export": "kernel", "inference": "kernel", "ui": "kernel", "ui.panel": "kernel",
    "ui.charts": "kernel", "ui.tensorboard": "kernel", "ui.devices": "kernel", "ui.form": "kernel",
    "ui.layout": "kernel", "ui.run_view": "kernel", "ui.worker_form": "kernel",
    "runtime": "worker", "heartbeat": "worker", "rank_errors": "worker", "elastic": "worker", "dist": "worker", "engine": "worker", "data": "worker",
    "tensor_data": "worker", "decode_data": "worker", "models": "worker", "sync_bn": "worker",
    "tasks.classification": "worker",
    "cli": "entry", "__main__": "entry", "calls": "worker", "conventions": "shared",
}

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported on first use (PEP 562), so that
#: ``import nbddp`` costs nothing in a rank and a script imports only what it uses.
_EXPORTS = {
    "spawn_train": "launch",
    "TrainConfig": "config",
    "TrainResult": "handle",
    "RunHandle": "handle",
    "Context": "runtime",
    "load_model": "inference",
    "predict": "inference",
    "Prediction": "inference",
    "export_run": "export",
    "TrainingPanel": "ui",
    "show_tensorboard": "ui",
    "show_predictions": "ui",
    "plot_confusion_matrix": "ui",
    "list_gpus": "gpus",
    "GPUInfo": "gpus",
    "cleanup": "procs",
    "NbddpError": "errors",
    "ConfigError": "errors",
    "DataError": "errors",
    "WeightsError": "errors",
    "WorkerError": "errors",
    "TrainingInterrupted": "errors",
    "RunAbandoned": "errors",
    "Retryable": "errors",
}

__all__ = [name for name in _EXPORTS if name not in ("show_predictions", "plot_confusion_matrix")]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nbddp' has no attribute {name!r}")
    value = getattr(_import_holding_interrupts(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def _import_holding_interrupts(module: str):
    """Import ``module``; an Interrupt that comes meanwhile is handled once the import is done.

    The first ``nbddp.spawn_train`` of a kernel imports torch. torch swallows a
    KeyboardInterrupt raised while it imports numpy (it turns numpy support off and warns), so
    an Interrupt in that second would be lost and the run would start. Held here, it reaches the
    handler the kernel had (a ``KeyboardInterrupt``) right after the import, before any run exists.
    """
    import importlib
    import signal
    import sys
    import threading

    if module in sys.modules or threading.current_thread() is not threading.main_thread():
        return importlib.import_module(module)
    came: list = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        loaded = importlib.import_module(module)
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if came:
        if callable(previous):
            previous(signal.SIGINT, sys._getframe())
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
    return loaded


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


def _prewarm_if_kernel() -> None:
    # In a Jupyter kernel, start the warm forkserver now (a daemon thread), so the first launch
    # finds torch and DDP imported there. A rank, the server and scripts have no ipykernel
    # loaded, so they never import the kernel side here. NBDDP_PREWARM=0: off.
    import sys

    if "ipykernel" in sys.modules:
        from .forkserver import prewarm_in_kernel

        prewarm_in_kernel()


_prewarm_if_kernel()
