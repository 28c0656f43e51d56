"""nbddp: train PyTorch models with DistributedDataParallel from a Jupyter notebook.

Your code as it is (a function in a file or a notebook cell, a torchrun script, an mp.spawn
function) or the built-in classifier starts in fresh interpreters (a forkserver with torch
preloaded, or spawn; never a fork of the kernel), one process per GPU (nccl) or N CPU processes
(gloo); the notebook gets live progress, one clear error when a rank fails, and no process left
behind when a cell is interrupted.

The package has two sides and the contract between them, one folder each. The kernel side
(``kernel/``, ``ui/``) runs in the notebook (or a script) and never initialises CUDA; the rank
side (``rank/``) runs in each rank; the contract (``contract/``) is what both read and write;
a built-in task (``tasks/<name>/``) is its plan, its worker and the model and image code both
use. A rank loads no kernel-side module: not when it imports the rank side, not when it starts
(spawned, forked from the warm server, or under torchrun/srun), and ``import nbddp`` itself
loads nothing until a name is used. :data:`SIDES` is the table below as data;
``tests/test_sides.py`` holds every rank to it and every folder to one side. ``cli`` is the
command line of both: a shell's launcher, or a rank under torchrun/srun (then it takes the rank
side only). ``docs/architecture.md`` draws the map and one launch's path through it.

========  ====================================  ==============================================================
side      module                                what it does
========  ====================================  ==============================================================
entry     ``cli``, ``__main__``                 ``python -m nbddp``: a shell's launcher, or one rank of torchrun/srun
contract  ``contract.config``                   ``TrainConfig``: the built-in worker's settings, validated
contract  ``contract.fieldspec``                what each ``TrainConfig`` field is: help, flag, check, widget
contract  ``contract.cluster``                  torchrun and sbatch commands, as text (``cfg.torchrun_command``)
contract  ``contract.errors``                   the exceptions users see
contract  ``contract.rundir``                   the run folder: every file name, the atomic writer, records
contract  ``contract.statedir``                 the run's private state folder, held by descriptor for the run's life
contract  ``contract.protocol``                 ``LaunchSpec``, the ranks' entry by name, every record between kernel and ranks
contract  ``contract.paths``                    what a path is (FIFO, /proc) before anything reads it
contract  ``contract.private``                  folders and files of the user's alone: checked, made 0700, moved aside; the compile caches
contract  ``contract.safe_path``                every Python process nbddp starts: never its start folder ahead of the standard library
contract  ``contract.system``                   process identity (pid + start time), CPU cores, signalling
contract  ``contract.targets``                  ``"file.py:fn"`` / ``"pkg.mod:fn"``: checked (kernel), loaded (rank)
contract  ``contract.cells``                    functions from notebook cells: checked and pickled by value (kernel), loaded (rank)
contract  ``contract.conventions``              the calling conventions (ctx, mp.spawn, torchrun, script) and a worker's, read from its source
contract  ``contract.gpus``                     GPUs from NVML or nvidia-smi, never through CUDA
contract  ``contract.leases``                   advisory per-GPU leases between kernels (taken by launch, shown by gpus)
contract  ``contract.plans``                    every launch's plan (``LaunchPlan``): target, world, name, resume
contract  ``contract.checkpoint``               atomic save, weights-only load, export files
contract  ``contract.debugging``                the files a rank's debugger and the notebook talk through
contract  ``contract.observe``                  ``profile=`` and ``trackers=`` checked; the profile record, the tracker ids
contract  ``contract.channel``                  the command channel of ``%%ranks``: a private Unix socket, its messages
contract  ``contract.throughput``               known GPUs' dense peak TFLOP/s (the MFU's denominator); a record's rates as text
contract  ``contract.onnx``                     a model as ONNX: the dynamo exporter (legacy where it fails), run and compared in ONNX Runtime
kernel    ``kernel.launch``                     ``spawn_train``: plan, run folder, store, environment, start
kernel    ``kernel.rendezvous``                 where the ranks meet: a private FileStore, or a TCP store for env://
kernel    ``kernel.forkserver``                 the warm server workers fork from; pre-warmed in a kernel
kernel    ``kernel.handle``                     ``RunHandle``: watch, stop, interrupt, reap; ``TrainResult``
kernel    ``kernel.shutdown``                   the staged stop: ask, SIGTERM, SIGKILL, as a small state machine
kernel    ``kernel.stall``                      from heartbeats: a hung rank (stop the run), a run where none moves (say where)
kernel    ``kernel.restarts``                   which failures a run heals by restarting (the rule), and each restart's record
kernel    ``kernel.stacks``                     where each rank is: every rank's Python stack, on demand and on a hang
kernel    ``kernel.output``                     rank 0's output in the cell as a terminal shows it (``\\r`` bars, long lines)
kernel    ``kernel.logline``                    rank 0's ``ctx.log`` values as the one line the cell shows under its output
kernel    ``kernel.report``                     a failed run's root-cause rank and its one error
kernel    ``kernel.rank_text``                  what a failed rank left, as its error says it: once, only what is known
kernel    ``kernel.debugger``                   a rank's pdb prompt in the cell (``input()``), or skipped headless
kernel    ``kernel.procs``                      ``cleanup`` of an earlier launch's workers, proven by marker
kernel    ``kernel.detach``,                    ``detach=True``: a run handed to a supervisor of its own, which owns it
          ``kernel.supervisor``                 as a kernel would and outlives the kernel
kernel    ``kernel.owners``,                    who owns a local run, asks and outcome for its followers, your live runs;
          ``kernel.follow``                     ``attach`` and ``runs()``: follow a run another process owns
kernel    ``kernel.export``,                    weights out of a run folder; prediction in the kernel
          ``kernel.inference``
kernel    ``kernel.profiles``                   ``result.profile``: the ranks' profiles side by side, who waits for whom
kernel    ``kernel.sweep``, ``kernel.slots``,   ``nbddp.sweep``: Optuna trials on every free GPU or CPU slot; the study
          ``kernel.study``, ``kernel.trials``   in SQLite in the runs folder; one trial's launch, pruning and end
kernel    ``kernel.study_file``                 a sweep's study file, the user's alone: checked by descriptor, re-checked per connection
kernel    ``kernel.interactive``                ``start_ranks`` and ``%%ranks``: a live group of ranks, its cells, pull and push
kernel    ``ui``                                ``TrainingPanel``, charts, TensorBoard, a sweep's live table
rank      ``rank.runtime``                      a rank's entry: ``Context``, heartbeats, error records
rank      ``rank.process``                      what makes a process a rank: parent-death signal, own group, subreaper, forks
rank      ``rank.calls``                        how a rank calls ctx, mp.spawn and torchrun functions, and scripts
rank      ``rank.spawned``                      a script that spawns its own processes: their logs, echo and end
rank      ``rank.logs``                         a process's output in its private log file
rank      ``rank.debugger``                     ``ctx.breakpoint`` and ``breakpoint()``: pdb driven through files, the others held
rank      ``rank.heartbeat``,                   the rank's heartbeat thread; which errors are another rank's fault
          ``rank.rank_errors``
rank      ``rank.elastic``                      the same rank under torchrun / srun
rank      ``rank.dist``                         process group and the collectives nbddp uses
rank      ``rank.reaper``,                      a rank as its children's subreaper: every descendant ended and reaped with it;
          ``rank.forkserver_reaper``            the warm server likewise for the ranks it forked
rank      ``rank.engine``                       training and evaluation loops that stop every rank together
rank      ``rank.readback``                     the one way a step's device values reach the host: a step late, never waiting
rank      ``rank.sync_bn``                      SyncBatchNorm that works on CPU (gloo) as on GPUs
rank      ``rank.profiling``                    torch.profiler on the worker's steps: traces and a per-rank record
rank      ``rank.trackers``                     rank 0's MLflow / W&B thread: metrics, settings, weights
rank      ``rank.interactive``                  a rank of ``%%ranks``: the loop that runs cells in one namespace
rank      ``rank.flops``                        ``count_flops`` (once, on the meta device); TFLOP/s, MFU, data wait of a rank
task      ``tasks.classification.planning``     the built-in worker's preflight and plan (run in the kernel)
task      ``tasks.classification.worker``       ``train(ctx, cfg)``: the built-in worker (run in each rank)
task      ``tasks.classification.pipelines``    its data in a rank: the split, and the loaders of the pil, decode, tensor pipelines
task      ``tasks.classification.data``,        class folders (scan, split, checks), transforms; reading images;
          ``tasks.classification.images``,      a rank's loader processes and samplers; the decoded tensor cache;
          ``tasks.classification.loading``,     file bytes decoded and augmented batch by batch on the device
          ``tasks.classification.tensor_data``,
          ``tasks.classification.decode_data``
task      ``tasks.classification.data_record``  the images and split a run was made from (``data.json``): a resume on changed data is refused
task      ``tasks.classification.models``       torchvision models, weights files (training and prediction)
task      ``tasks.classification.onnx_export``  ``model.onnx`` and its ``preprocessing.json``, checked on held-out images
task      ``tasks.classification.crops``,       the decode pipeline's crops drawn in the loader processes; batched resizes;
          ``tasks.classification.resize``,      a launch's fixed costs, one line each; the tensor pipeline's decoded
          ``tasks.classification.startup``,     images kept between launches (the user's private cache folder)
          ``tasks.classification.decoded_store``
========  ====================================  ==============================================================
"""

#: The side of each folder: every module in a folder is of that side (``""``: the package's face).
FOLDER_SIDES = {"": "entry", "kernel": "kernel", "ui": "kernel", "rank": "rank", "contract": "contract",
                "tasks": "task"}

#: Each module's side (the table above as data): ``kernel``, ``rank``, ``contract``, ``task`` or ``entry``.
SIDES = {
    "cli": "entry", "__main__": "entry",
    "contract": "contract", "contract.config": "contract", "contract.errors": "contract",
    "contract.rundir": "contract", "contract.paths": "contract", "contract.system": "contract",
    "contract.targets": "contract", "contract.protocol": "contract", "contract.cells": "contract",
    "contract.fieldspec": "contract", "contract.cluster": "contract", "contract.gpus": "contract",
    "contract.leases": "contract", "contract.private": "contract", "contract.plans": "contract", "contract.checkpoint": "contract",
    "contract.conventions": "contract", "contract.debugging": "contract", "contract.observe": "contract",
    "contract.statedir": "contract",
    "contract.throughput": "contract", "contract.onnx": "contract",
    "contract.safe_path": "contract",
    "kernel": "kernel", "kernel.launch": "kernel", "kernel.rendezvous": "kernel", "kernel.forkserver": "kernel",
    "kernel.handle": "kernel", "kernel.ranks": "kernel", "kernel.report": "kernel", "kernel.rank_text": "kernel", "kernel.procs": "kernel", "kernel.shutdown": "kernel",
    "kernel.stall": "kernel", "kernel.restarts": "kernel", "kernel.stacks": "kernel", "kernel.output": "kernel",
    "kernel.logline": "kernel",
    "kernel.export": "kernel", "kernel.inference": "kernel", "kernel.debugger": "kernel",
    "kernel.profiles": "kernel",
    "kernel.sweep": "kernel", "kernel.slots": "kernel", "kernel.study": "kernel", "kernel.trials": "kernel",
    "kernel.study_file": "kernel",
    "kernel.interrupt": "kernel",
    "kernel.refusals": "kernel",
    "kernel.slurm": "kernel", "kernel.slurm_group": "kernel", "kernel.slurm_attach": "kernel",
    "kernel.interactive": "kernel", "kernel.interactive.group": "kernel", "kernel.interactive.members": "kernel",
    "kernel.interactive.cell": "kernel", "kernel.interactive.magics": "kernel",
    "contract.channel": "contract", "rank.interactive": "rank",
    "kernel.detach": "kernel", "kernel.supervisor": "kernel", "kernel.owners": "kernel", "kernel.follow": "kernel",
    "ui": "kernel", "ui.panel": "kernel", "ui.charts": "kernel", "ui.tensorboard": "kernel",
    "ui.devices": "kernel", "ui.form": "kernel", "ui.layout": "kernel", "ui.run_view": "kernel",
    "ui.worker_form": "kernel", "ui.sweep_view": "kernel", "ui.cluster": "kernel",
    "rank": "rank", "rank.runtime": "rank", "rank.process": "rank", "rank.heartbeat": "rank", "rank.rank_errors": "rank",
    "rank.elastic": "rank", "rank.dist": "rank", "rank.engine": "rank", "rank.sync_bn": "rank",
    "rank.calls": "rank", "rank.spawned": "rank", "rank.logs": "rank", "rank.debugger": "rank", "rank.reaper": "rank", "rank.forkserver_reaper": "rank",
    "rank.profiling": "rank", "rank.trackers": "rank",
    "rank.sharding": "rank", "rank.sharded_checkpoint": "rank", "rank.readback": "rank",
    "rank.interrupt": "rank",
    "rank.slurm_task": "rank",
    "rank.flops": "rank",
    "tasks": "task", "tasks.classification": "task", "tasks.classification.planning": "task",
    "tasks.classification.worker": "task", "tasks.classification.data": "task",
    "tasks.classification.images": "task", "tasks.classification.loading": "task",
    "tasks.classification.pipelines": "task",
    "tasks.classification.tensor_data": "task", "tasks.classification.decode_data": "task",
    "tasks.classification.models": "task", "tasks.classification.data_record": "task",
    "tasks.classification.crops": "task", "tasks.classification.resize": "task",
    "tasks.classification.startup": "task", "tasks.classification.decoded_store": "task",
    "tasks.classification.onnx_export": "task",
}

#: Where each module of the package's first, flat layout lives now: ``import nbddp.dist`` still
#: works (the same module as ``nbddp.rank.dist``), with a DeprecationWarning naming the new path.
MOVED = {
    **{m: "kernel." + m for m in ("launch", "handle", "procs", "output", "stall", "stacks", "restarts", "shutdown",
                                  "rendezvous", "forkserver", "report", "export", "inference")},
    **{m: "rank." + m for m in ("runtime", "dist", "engine", "heartbeat", "sync_bn", "elastic", "calls",
                                "rank_errors")},
    **{m: "contract." + m for m in ("protocol", "rundir", "config", "fieldspec", "checkpoint", "errors", "targets",
                                    "cells", "conventions", "cluster", "gpus", "leases", "paths", "system")},
    **{m: "tasks.classification." + m for m in ("data", "tensor_data", "decode_data", "models")},
}

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported on first use (PEP 562), so that
#: ``import nbddp`` costs nothing in a rank and a script imports only what it uses.
_EXPORTS = {
    "spawn_train": "kernel.launch",
    "Slurm": "kernel.slurm",
    "attach": "kernel.follow",
    "runs": "kernel.follow",
    "sweep": "kernel.sweep",
    "TrainConfig": "contract.config",
    "TrainResult": "kernel.handle",
    "RunHandle": "kernel.handle",
    "Context": "rank.runtime",
    "count_flops": "rank.flops",
    "load_model": "kernel.inference",
    "predict": "kernel.inference",
    "Prediction": "kernel.inference",
    "export_run": "kernel.export",
    "export_onnx": "kernel.export",
    "TrainingPanel": "ui",
    "show_tensorboard": "ui",
    "show_predictions": "ui",
    "plot_confusion_matrix": "ui",
    "list_gpus": "contract.gpus",
    "GPUInfo": "contract.gpus",
    "cleanup": "kernel.procs",
    "NbddpError": "contract.errors",
    "ConfigError": "contract.errors",
    "DataError": "contract.errors",
    "WeightsError": "contract.errors",
    "ExportError": "contract.errors",
    "WorkerError": "contract.errors",
    "TrainingInterrupted": "contract.errors",
    "RunAbandoned": "contract.errors",
    "Retryable": "contract.errors",
    "StudyError": "kernel.study_file",
    "start_ranks": "kernel.interactive.group",
}

__all__ = [name for name in _EXPORTS if name not in ("show_predictions", "plot_confusion_matrix")]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        if name in MOVED:  # nbddp.dist after `import nbddp`: the old path, through _MovedFinder
            return _import_holding_interrupts(f"{__name__}.{name}")
        raise AttributeError(f"module 'nbddp' has no attribute {name!r}")
    value = getattr(_import_holding_interrupts(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def _import_holding_interrupts(module: str):
    """Import ``module``; an Interrupt that comes meanwhile is never lost, nor a bare ``KeyboardInterrupt``.

    The first ``nbddp.spawn_train`` of a kernel imports torch (seconds). A kernel-side name
    (``spawn_train``, ``TrainingPanel``) is imported in a helper thread while this one waits: an
    Interrupt ends the wait at once with a ``TrainingInterrupted`` saying that nothing was started
    (the import goes on in the background, as the pre-warm's does, for the next cell). Other names
    are imported here with the Interrupt held: torch swallows a KeyboardInterrupt raised while it
    imports numpy (it turns numpy support off and warns), so an Interrupt in that second would be
    lost; held, it reaches the handler the process had right after the import.
    """
    import importlib
    import signal
    import sys
    import threading

    if module in sys.modules or threading.current_thread() is not threading.main_thread():
        return importlib.import_module(module)
    if SIDES.get(module[len(__name__) + 1:]) == "kernel":
        return _import_in_helper_thread(module)
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


def _import_in_helper_thread(module: str):
    """Import ``module`` in a daemon thread; this (main) thread waits, and an Interrupt ends the wait."""
    import importlib
    import threading

    box: dict = {}

    def run():
        try:
            box["module"] = importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread below
            box["error"] = exc

    helper = threading.Thread(target=run, name="nbddp-import", daemon=True)
    helper.start()
    try:
        while helper.is_alive():
            helper.join(0.05)
    except KeyboardInterrupt as exc:
        if type(exc) is not KeyboardInterrupt:
            raise
        from .contract.errors import TrainingInterrupted

        raise TrainingInterrupted.before_start("loading torch and its launcher for their first use") from None
    if "error" in box:
        raise box["error"]
    return box["module"]


class _MovedFinder:
    """Finds ``nbddp.<old name>`` (:data:`MOVED`): the module at its new path, with a DeprecationWarning.

    ``import nbddp.config`` and ``from nbddp.config import X`` give the very module
    ``nbddp.contract.config`` (one module object under two names, so ``mock.patch`` on either
    patches both); nothing is imported until such a name is.
    """

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != __name__ or old not in MOVED:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _MovedLoader(f"{__name__}.{MOVED[old]}"))


class _MovedLoader:
    def __init__(self, new: str):
        self.new = new
        self.spec = None

    def create_module(self, spec):
        import importlib
        import warnings

        warnings.warn(f"{spec.name} moved to {self.new}: import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        # The module ran under its new name already. The import system gave it the old name's
        # __spec__, which its relative imports would read: give it back its own.
        module.__spec__ = self.spec


def _install_moved_finder() -> None:
    import sys

    # First in line: an old copy of the package elsewhere on the path (an editable install of
    # another checkout) must not answer for a name that moved.
    if not any(type(f).__name__ == "_MovedFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def load_ipython_extension(ipython) -> None:
    """``%load_ext nbddp``: registers ``%%ranks`` (a cell on a live group of ranks, :func:`start_ranks`)."""
    from .kernel.interactive.group import current
    from .kernel.interactive.magics import register

    register(ipython, current)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


def _prewarm_if_kernel() -> None:
    # In a Jupyter kernel, start the warm forkserver now (a daemon thread), so the first launch
    # finds torch and DDP imported there. A rank, the server and scripts have no ipykernel
    # loaded, so they never import the kernel side here. NBDDP_PREWARM=0: off.
    import sys

    if "ipykernel" in sys.modules:
        from .kernel.forkserver import prewarm_in_kernel

        prewarm_in_kernel()


_install_moved_finder()
_prewarm_if_kernel()
