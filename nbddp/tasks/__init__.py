"""Launch plans: what a launch runs, worked out once for every way of launching.

``spawn_train`` in a notebook, ``python -m nbddp`` in a shell and the same command as one rank
under torchrun or srun all call :func:`plan`: it checks every input it can before a process
starts (the worker target, data, weights, sizes) and decides the run's name, its runs folder,
its process-group timeout and the run folder it continues, if any. No launcher repeats any of it.

A built-in task is a module with ``plan(config) -> LaunchPlan`` that a config type selects; a new
one is a module here and one line in ``_TASKS``.

========================  ==============================================  ===================
config type               task module                                     worker function
========================  ==============================================  ===================
``TrainConfig``           ``nbddp.tasks.classification``                  ``train(ctx, cfg)``
========================  ==============================================  ===================
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from .. import rundir
from ..config import TrainConfig
from ..errors import ConfigError
from ..targets import resolve_target

#: Process-group timeout when none is given: a cold CUDA/NCCL start and a first cuDNN
#: benchmark on GPUs take minutes; CPU ranks meet in seconds.
DEFAULT_TIMEOUT_S = {"gpu": 600.0, "cpu": 120.0}


@dataclass(frozen=True)
class LaunchPlan:
    """What a launcher needs to run a target; every input was checked already."""

    target: str                 # "module:function" each rank calls as fn(ctx, *args, **kwargs)
    args: Tuple[Any, ...]       # positional arguments after ctx (picklable)
    gpus: Tuple[int, ...]       # GPU ids, one rank each; () for CPU processes
    nprocs: Optional[int]       # CPU processes when there are no GPUs
    name: str                   # run folder suffix
    runs_dir: str               # where new run folders go
    timeout_s: Optional[float]  # process-group timeout (None: see process_group_timeout)
    run_dir: Optional[Path] = None  # an existing run folder to continue; None for a new one
    config: Any = None          # saved as the run folder's config.json (has .save(path))
    kwargs: Dict[str, Any] = field(default_factory=dict)  # keyword arguments of the worker

    def process_group_timeout(self, on_gpu: Optional[bool] = None) -> float:
        """``timeout_s``, or the default for where the ranks run (GPUs when the plan names some)."""
        on_gpu = bool(self.gpus) if on_gpu is None else on_gpu
        return float(self.timeout_s or DEFAULT_TIMEOUT_S["gpu" if on_gpu else "cpu"])


_TASKS = {TrainConfig: "nbddp.tasks.classification"}


def is_task_config(obj: Any) -> bool:
    """True for a config object that a built-in task runs (``spawn_train(config)``)."""
    return type(obj) in _TASKS


def plan(target: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None, *,
         nprocs: Optional[int] = None, gpus: Optional[Sequence[int]] = None, name: Optional[str] = None,
         runs_dir: Union[str, os.PathLike, None] = None, timeout_s: Optional[float] = None,
         resume: Any = None) -> LaunchPlan:
    """The launch plan of a config (its task's plan) or of a worker function target.

    Args:
        target: a config object of a built-in task, or a worker target
            (``"file.py:fn"``, ``"pkg.mod:fn"``, a module-level function).
        args, kwargs: the worker function's arguments (a config takes none).
        nprocs, gpus: CPU processes, or GPU ids (a config carries its own).
        name: the run's name (default: the config's, or the target's file and function).
        runs_dir: where run folders go (default: the config's, or ``rundir.RUNS_DIR``).
        timeout_s: process-group timeout (default: the config's, or :data:`DEFAULT_TIMEOUT_S`).
        resume: a worker function's run to continue: a run folder, or ``True`` for the newest run
            of ``name`` that holds a checkpoint (a config says it in its own ``resume``).

    Raises:
        ConfigError / DataError / WeightsError: naming what is wrong and the fix.
    """
    kwargs = dict(kwargs or {})
    if is_task_config(target):
        config_type = type(target).__name__
        if args or kwargs:
            raise ConfigError(f"with a {config_type}, put every setting in the config (no args/kwargs)")
        if nprocs is not None or gpus is not None:
            raise ConfigError(f"with a {config_type}, set nprocs/gpus in the config: cfg.replace(gpus=[0, 1])")
        if resume not in (None, False):
            raise ConfigError(f"with a {config_type}, set resume in the config: cfg.replace(resume={resume!r})")
        if runs_dir is not None:
            target = target.replace(runs_dir=str(runs_dir))
        task_plan = importlib.import_module(_TASKS[type(target)]).plan(target)
        return dataclasses.replace(task_plan, name=name or task_plan.name,
                                   timeout_s=timeout_s or task_plan.timeout_s)
    spec = resolve_target(target)
    gpus = tuple(gpus or ())
    if gpus and nprocs not in (None, len(gpus)):
        raise ConfigError(f"nprocs={nprocs} but gpus={list(gpus)}: one process per GPU; drop nprocs")
    name = name or default_name(spec)
    runs_dir = str(runs_dir if runs_dir is not None else rundir.RUNS_DIR)
    return LaunchPlan(target=spec, args=tuple(args), kwargs=kwargs, gpus=gpus, nprocs=nprocs, name=name,
                      runs_dir=runs_dir, timeout_s=timeout_s, run_dir=run_to_resume(resume, runs_dir, name))


def run_to_resume(resume: Any, runs_dir: Union[str, os.PathLike], name: str, checkpoint: Optional[str] = None,
                  what: str = "resume") -> Optional[Path]:
    """The run folder that ``resume`` names, or None for a new run.

    Args:
        resume: ``None``/``False`` (a new run), ``True`` (the newest run named ``name`` in
            ``runs_dir`` that holds a checkpoint), or a run folder or a checkpoint file in one.
        checkpoint: with ``True``, the checkpoint the run must hold (None: any).
        what: how the user spelled the setting, for the messages (``TrainConfig.resume``).

    Raises:
        ConfigError: no such run, with the ways to name one.
    """
    if resume is None or resume is False:
        return None
    if resume is True:
        found = rundir.newest_run(runs_dir, name, checkpoint=checkpoint)
        if found is None:
            raise ConfigError(
                f"{what}=True but no run named {name!r} with a checkpoint is in {str(runs_dir)!r}; pass the "
                "run folder as resume='runs/<run>', give the name it ran under (name=...), or start without resume")
        return found.resolve()
    if not isinstance(resume, (str, os.PathLike)):
        raise ConfigError(f"{what}={resume!r}: pass True, a run folder, or None")
    folder = rundir.run_dir_of_checkpoint(resume)
    if not folder.is_dir():
        raise ConfigError(f"{what}={str(resume)!r}: no such run folder; pass TrainResult.run_dir or a folder under "
                          f"{str(runs_dir)!r}")
    return folder.resolve()


def default_name(spec: str) -> str:
    """A worker target's run name: its file's stem and its function (``"my_worker-train"``)."""
    where, _, qual = spec.rpartition(":")
    stem = Path(where).stem if where.endswith(".py") else ""
    return "-".join(x for x in (stem, qual) if x) or "run"


__all__ = ["LaunchPlan", "DEFAULT_TIMEOUT_S", "is_task_config", "plan", "run_to_resume", "default_name"]
