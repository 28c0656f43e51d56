"""Built-in tasks: what ``spawn_train(config)`` runs for a config object.

A task is a module with ``plan(config) -> LaunchPlan``: it checks every input it can before a
process starts (data, weights, sizes; the run folder to continue) and tells the launcher what to
run. The launcher (``launch.py``, ``cli.py``) knows tasks only through :func:`plan`; a new
built-in task is a module here and one line in ``_TASKS``.

========================  ==============================================  ===================
config type               task module                                     worker function
========================  ==============================================  ===================
``TrainConfig``           ``nbddp.tasks.classification``                  ``train(ctx, cfg)``
========================  ==============================================  ===================
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

from ..config import TrainConfig


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher needs to run a config; every input was checked already."""

    target: str                 # "module:function" each rank calls as fn(ctx, *args)
    args: Tuple[Any, ...]       # positional arguments after ctx (picklable)
    gpus: Tuple[int, ...]       # GPU ids, one rank each; () for CPU processes
    nprocs: Optional[int]       # CPU processes when there are no GPUs
    name: str                   # run folder suffix
    runs_dir: str               # where new run folders go
    timeout_s: Optional[float]  # process-group timeout (None: the launcher's default)
    run_dir: Optional[Path] = None  # an existing run folder to continue; None for a new one
    config: Any = None          # saved as the run folder's config.json (has .save(path))


_TASKS = {TrainConfig: "nbddp.tasks.classification"}


def is_task_config(obj: Any) -> bool:
    """True for a config object that a built-in task runs (``spawn_train(config)``)."""
    return type(obj) in _TASKS


def plan(config: Any) -> LaunchPlan:
    """The launch plan of ``config``'s task (raises the task's ConfigError/DataError/WeightsError)."""
    module = importlib.import_module(_TASKS[type(config)])
    return module.plan(config)


__all__ = ["LaunchPlan", "is_task_config", "plan"]
