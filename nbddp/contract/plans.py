"""Launch plans: what a launch runs, worked out once for every way of launching.

``spawn_train`` in a notebook, ``python -m nbddp`` in a shell and the same command as one rank
under torchrun or srun all call :func:`plan`: it checks every input it can before a process
starts (the worker target, data, weights, sizes) and decides the run's name, its runs folder,
its process-group timeout and the run folder it continues, if any. No launcher repeats any of it.

A built-in task is a module with ``plan(config) -> LaunchPlan`` that a config type selects; a new
one is a folder in ``nbddp/tasks/`` and one line in ``_TASKS``.

========================  ==============================================  ===================
config type               task module                                     worker function
========================  ==============================================  ===================
``TrainConfig``           ``nbddp.tasks.classification.planning``             ``train(ctx, cfg)``
========================  ==============================================  ===================
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pickle
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import cells, conventions, rundir
from .config import TrainConfig
from .errors import ConfigError
from .gpus import cuda_visible_devices
from .targets import resolve_target

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
    call: str = conventions.CTX       # how each rank calls the target (nbddp.contract.conventions)
    argv: Tuple[str, ...] = ()  # a script's command-line arguments
    payload: Optional[bytes] = None  # a function from a notebook cell, pickled by value
    source: Optional[str] = None     # that function's source, kept in the run folder
    # Where it runs, decided with the rest of the plan (:func:`place`); a plan for a rank under
    # torchrun/srun leaves them unset, since its launcher decided them.
    world: int = 0                   # number of ranks: one per GPU, else nprocs
    backend: str = ""                # "nccl" with GPUs, else "gloo"
    visible_devices: Optional[str] = None  # CUDA_VISIBLE_DEVICES for the ranks (None without GPUs)
    timeout: float = 0.0             # the process-group timeout in seconds (process_group_timeout())

    def process_group_timeout(self, on_gpu: Optional[bool] = None) -> float:
        """``timeout_s``, or the default for where the ranks run (GPUs when the plan names some)."""
        on_gpu = bool(self.gpus) if on_gpu is None else on_gpu
        return float(self.timeout_s or DEFAULT_TIMEOUT_S["gpu" if on_gpu else "cpu"])


_TASKS = {TrainConfig: "nbddp.tasks.classification.planning"}


def is_task_config(obj: Any) -> bool:
    """True for a config object that a built-in task runs (``spawn_train(config)``)."""
    return type(obj) in _TASKS


def plan(target: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None, *,
         nprocs: Optional[int] = None, gpus: Optional[Sequence[int]] = None, name: Optional[str] = None,
         runs_dir: Union[str, os.PathLike, None] = None, timeout_s: Optional[float] = None,
         resume: Any = None, call: str = conventions.CTX, argv: Optional[Sequence[Any]] = None,
         place: bool = True) -> LaunchPlan:
    """The launch plan of a config (its task's plan) or of a worker function target.

    Args:
        target: a config object of a built-in task, a worker function (``"file.py:fn"``,
            ``"pkg.mod:fn"``, a function, one from a notebook cell included), or a script
            (``"train.py"``, ``"-m"`` with the module first in ``args``, or ``"-m pkg.train"``).
        args, kwargs: the worker function's arguments (a config and a script take none).
        call: how each rank calls a function: ``"ctx"``, ``"mp.spawn"`` or ``"torchrun"`` (:mod:`nbddp.rank.calls`).
        argv: a script's command line (``sys.argv[1:]``).
        nprocs, gpus: CPU processes, or GPU ids (a config carries its own).
        name: the run's name (default: the config's, or the target's file and function).
        runs_dir: where run folders go (default: the config's, or ``rundir.RUNS_DIR``).
        timeout_s: process-group timeout (default: the config's, or :data:`DEFAULT_TIMEOUT_S`).
        resume: a worker function's run to continue: a run folder, or ``True`` for the newest run
            of ``name`` that holds a checkpoint (a config says it in its own ``resume``).
        place: decide where it runs too (:func:`place`): the kernel's launch; a rank under
            torchrun/srun, whose launcher placed it, passes False.

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
        task_plan = dataclasses.replace(task_plan, name=name or task_plan.name,
                                        timeout_s=timeout_s or task_plan.timeout_s)
        return place_plan(task_plan) if place else task_plan
    what = _what_runs(target, args, kwargs, call, argv)
    gpus = tuple(gpus or ())
    if what["call"] == conventions.SPAWNS and nprocs not in (None, 1):
        raise ConfigError(
            f"{what['target']} starts its own processes (torch.multiprocessing.spawn in its main block): nbddp runs "
            f"it in one launcher process, as `python {what['target']}` does, and the script decides how many it "
            f"starts. Drop nprocs={nprocs!r} (the GPUs it may use: gpus=[...])")
    if gpus and nprocs not in (None, len(gpus)):
        raise ConfigError(f"nprocs={nprocs} but gpus={list(gpus)}: one process per GPU; drop nprocs")
    name = name or default_name(what["target"])
    runs_dir = str(runs_dir if runs_dir is not None else rundir.RUNS_DIR)
    found = LaunchPlan(gpus=gpus, nprocs=nprocs, name=name, runs_dir=runs_dir, timeout_s=timeout_s,
                       run_dir=run_to_resume(resume, runs_dir, name), **what)
    return place_plan(found) if place else found


def place_plan(p: LaunchPlan) -> LaunchPlan:
    """``p`` with where it runs: its number of ranks, backend, the ranks' ``CUDA_VISIBLE_DEVICES``
    and process-group timeout. Unknown or repeated GPU ids are refused here, listing the GPUs,
    before the run folder exists."""
    # A script that starts its own processes runs in one launcher, with every chosen GPU visible.
    world = 1 if p.call == conventions.SPAWNS else len(p.gpus) if p.gpus else (p.nprocs or 1)
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"nprocs={p.nprocs!r}: must be an integer >= 1")
    # The kernel's own words for the chosen GPUs (index, GPU-/MIG- UUID): never a bare index
    # that could escape an allocation.
    visible = cuda_visible_devices(p.gpus) if p.gpus else None
    return dataclasses.replace(p, world=world, backend="nccl" if p.gpus else "gloo", visible_devices=visible,
                               timeout=p.process_group_timeout())


def _what_runs(target: Any, args: Sequence[Any], kwargs: Dict[str, Any], call: str,
               argv: Optional[Sequence[Any]]) -> Dict[str, Any]:
    """The target as ranks load it, with its arguments, convention and, for a cell, its payload."""
    from .conventions import check_call

    if call not in conventions.CALLS:
        raise ConfigError(f"call={call!r}: use one of {', '.join(map(repr, conventions.CALLS))} (fn(ctx, ...), "
                          "fn(rank, ...) with its own process group, fn(...) with torchrun's environment)")
    if target == "-m" or isinstance(target, str) and conventions.is_script(target):
        spec, args, spawns = _script_spec(target, args, _argv(argv))
        if args or kwargs:
            raise ConfigError(f"{spec} is a script: pass its command line as argv=[...] (sys.argv[1:]), not "
                              "positional arguments or kwargs")
        if call == conventions.MP_SPAWN:
            raise ConfigError(f"{spec} is a script, run as __main__ with torchrun's environment; call='mp.spawn' "
                              "is for a function: 'file.py:main'")
        return dict(target=spec, args=(), argv=_argv(argv),
                    call=conventions.SPAWNS if spawns else conventions.TORCHRUN)
    if argv is not None:
        raise ConfigError("argv=[...] is for scripts ('train.py' or '-m', 'pkg.train'); a function takes its "
                          "arguments positionally and as kwargs={...}")
    check_picklable(args, kwargs)  # before anything reads the target: plain values cross, nothing else
    label = getattr(target, "__qualname__", None) or str(target).rpartition(":")[2]
    if cells.is_cell_function(target):
        check_call(target, call, args, kwargs, label)
        shipped = cells.ship(target)
        return dict(target=f"cell:{shipped.name}", args=tuple(args), kwargs=dict(kwargs), call=call,
                    payload=shipped.payload, source=shipped.source)
    spec = resolve_target(target)
    check_call(target if callable(target) else spec, call, args, kwargs, label)
    return dict(target=spec, args=tuple(args), kwargs=dict(kwargs), call=call)


def check_picklable(args: tuple, kwargs: dict) -> None:
    for label, obj in [(f"args[{i}]", a) for i, a in enumerate(args)] + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]:
        try:
            pickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(
                f"{label} ({type(obj).__name__}) cannot be sent to the worker processes: {exc}. "
                "Pass plain values (numbers, strings, paths, lists, dicts, CPU tensors) and build "
                "models, loaders and open files inside the worker function."
            ) from exc


def _script_spec(target: str, args: Sequence[Any], argv: Sequence[str] = ()) -> Tuple[str, Sequence[Any], Any]:
    """``("train.py" | "-m pkg.train", the rest of args, the spawn call it reaches or None)``, read
    without running it (:func:`nbddp.contract.conventions.script_spawns`)."""
    import ast
    import importlib.machinery

    from .conventions import script_spawns

    if target == "-m" or target.startswith(conventions.MODULE_PREFIX):
        module = target[len(conventions.MODULE_PREFIX):].strip() if target != "-m" else (args[0] if args else "")
        args = args if target != "-m" else args[1:]
        if not isinstance(module, str) or not all(p.isidentifier() for p in module.split(".")):
            raise ConfigError(f"spawn_train('-m', {module!r}): give the module as python -m takes it, "
                              "e.g. spawn_train('-m', 'pkg.train', argv=[...])")
        # Only the top-level package is looked up, never imported: the kernel runs none of the
        # user's code. The rank puts the working directory first on sys.path, as python -m does.
        top = module.split(".")[0]
        found = top in sys.modules or importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
        if not found:
            raise ConfigError(f"no module {module!r} can be imported from {os.getcwd()} (python -m {module} would "
                              "fail the same way); check the name and the working directory")
        source, spawns = _module_source(module), None
        if source is not None:  # one that spawns its own processes runs in a launcher, as a script does
            with contextlib.suppress(SyntaxError, OSError, UnicodeDecodeError):  # python -m will say it
                spawns = script_spawns(ast.parse(source.read_bytes(), filename=str(source)), argv)
        return conventions.MODULE_PREFIX + module, args, spawns
    path = Path(target).expanduser()
    if not path.is_file():
        raise ConfigError(f"script {target} does not exist (relative paths start at the kernel's working directory "
                          f"{os.getcwd()}); write it first, e.g. with %%writefile {Path(target).name}")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        raise ConfigError(f"script {target} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    return target, args, script_spawns(tree, argv)


def _module_source(module: str) -> Optional[Path]:
    """The file ``python -m module`` would run (a package's ``__main__.py``), found without importing
    anything: not even a package's ``__init__`` runs in the kernel. None when it is not a plain
    source file (a namespace package, a compiled or zipped module)."""
    import importlib.machinery

    parts, locations, spec = module.split("."), [os.getcwd(), *sys.path], None
    for i, part in enumerate(parts):
        spec = importlib.machinery.PathFinder.find_spec(part, locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
        if not locations and i < len(parts) - 1:  # a module where python -m wants a package
            return None
    if locations:  # a package: python -m runs its __main__
        spec = importlib.machinery.PathFinder.find_spec("__main__", locations)
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") and os.path.isfile(origin) else None


def _argv(argv: Optional[Sequence[Any]]) -> Tuple[str, ...]:
    if argv is None:
        return ()
    if isinstance(argv, (str, bytes)) or not isinstance(argv, (list, tuple)):
        raise ConfigError(f"argv={argv!r}: pass the command line as a list, argv=['10', '5', '--batch_size', '32']")
    bad = [a for a in argv if not isinstance(a, (str, int, float, os.PathLike)) or isinstance(a, bool)]
    if bad:
        raise ConfigError(f"argv holds {bad[0]!r} ({type(bad[0]).__name__}); a command line is words: strings, "
                          "numbers or paths")
    return tuple(os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv)


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
    """A target's run name: its file's stem and its function (``"my_worker-train"``), a cell
    function's name, a script's stem or a module's last part."""
    if spec.startswith(conventions.MODULE_PREFIX):  # "-m app" -> "app", "-m pkg.train" -> "train"
        return spec[len(conventions.MODULE_PREFIX):].strip().rpartition(".")[2] or "run"
    if conventions.is_script(spec):
        return Path(spec).stem or "run"
    where, _, qual = spec.rpartition(":")
    stem = Path(where).stem if where.endswith(".py") else ""
    name = "-".join(x for x in (stem, qual) if x)
    # A nested function or a lambda from a cell: "make.<locals>.train" -> "make-locals-.train".
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:rundir.NAME_MAX] or "run"


__all__ = ["LaunchPlan", "DEFAULT_TIMEOUT_S", "is_task_config", "plan", "run_to_resume", "default_name"]
