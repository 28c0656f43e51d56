"""Looking inside a run: the profiler's settings and per-rank record, and the trackers' plan.

Both sides read these: the kernel checks ``spawn_train(profile=..., trackers=...)`` before any
process starts and reads what the ranks wrote; the ranks (:mod:`nbddp.rank.profiling`,
:mod:`nbddp.rank.trackers`) act on them.

    record           file                           writer                      reader
    ProfileRecord    profile/rank<r>.summary.json   rank r (profiling)          kernel (kernel.profiles)
    tracker ids      trackers.json                  rank 0 (trackers)           rank 0 of a restart / resume (checked), kernel
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import rundir, statedir
from .errors import ConfigError
from .private import open_yours, read_private

PathLike = Union[str, os.PathLike]

#: The profiler's settings a user may give, and their defaults (steps are the worker's reported
#: steps, or the built-in worker's optimizer steps). ``wait`` skips the first, slower steps.
PROFILE_DEFAULTS = dict(wait=5, warmup=2, active=5, repeat=1, record_shapes=False, with_stack=False,
                        memory=False, ranks=None)


@dataclass(frozen=True)
class ProfileOptions:
    """``spawn_train(profile=...)``, checked: ``torch.profiler.schedule``'s steps and what each step records.

    Attributes:
        wait / warmup / active / repeat: the schedule (``torch.profiler.schedule``); ``repeat`` windows.
        record_shapes / with_stack: recorded for every operator (more cost inside the window).
        memory: the CUDA allocator's history on every rank (GPU only); an out-of-memory error keeps
            its snapshot in the run folder.
        ranks: the ranks that profile (``None``: every rank).
    """

    wait: int = 5
    warmup: int = 2
    active: int = 5
    repeat: int = 1
    record_shapes: bool = False
    with_stack: bool = False
    memory: bool = False
    ranks: Optional[Tuple[int, ...]] = None

    def profiles(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def profile_options(value: Any, world_size: int, backend: str) -> Optional[ProfileOptions]:
    """``spawn_train(profile=value)`` checked, or ``None`` for no profiling.

    Raises:
        ConfigError: an unknown key, a bad count, a rank outside the world, or ``memory`` on CPU.
    """
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"profile={value!r}: pass True, or a dict with any of {sorted(PROFILE_DEFAULTS)}")
    unknown = sorted(set(value) - set(PROFILE_DEFAULTS))
    if unknown:
        raise ConfigError(f"profile: unknown key(s) {unknown}; the keys are {sorted(PROFILE_DEFAULTS)}")
    options = {**PROFILE_DEFAULTS, **value}
    for key, low in (("wait", 0), ("warmup", 0), ("active", 1), ("repeat", 1)):
        v = options[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"profile[{key!r}]={v!r}: an integer >= {low} (steps of the schedule)")
    for key in ("record_shapes", "with_stack", "memory"):
        if not isinstance(options[key], bool):
            raise ConfigError(f"profile[{key!r}]={options[key]!r}: True or False")
    options["ranks"] = _ranks(options["ranks"], world_size)
    if options["memory"] and backend != "nccl":
        raise ConfigError("profile={'memory': True} records the CUDA allocator's history: it needs GPUs "
                          "(gpus=[...]). On CPU, profile=True shows time per operator; drop 'memory'.")
    return ProfileOptions(**options)


def _ranks(value: Any, world_size: int) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    ranks = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(ranks, (list, tuple)) or not ranks
            or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size for r in ranks)):
        raise ConfigError(f"profile['ranks']={value!r}: a rank or a list of ranks in 0..{world_size - 1} "
                          "(None: every rank)")
    return tuple(sorted(set(ranks)))


@dataclass
class ProfileRecord:
    """One rank's profiled steps, summed over its windows (milliseconds).

    The four parts add up to ``wall_ms``: time a collective was in flight (``comm_ms``, on any
    thread or device stream), else time in the data loader (``data_ms``), else time in any other
    operator (``compute_ms``), else nothing recorded (``idle_ms``: Python between operators,
    waiting on a lock or on the GPU).
    """

    rank: int
    steps: int = 0
    wall_ms: float = 0.0
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    data_ms: float = 0.0
    idle_ms: float = 0.0
    device: str = "cpu"  # "cuda": the parts are read from the GPU's kernels, else from the CPU's operators
    top_ops: List[Dict[str, Any]] = field(default_factory=list)  # name, self_ms, calls (most time first)
    traces: List[str] = field(default_factory=list)  # trace files, relative to the run folder
    memory_snapshot: Optional[str] = None

    def write(self, folder: "statedir.StateDir") -> None:
        """Into the run's ``profile/`` folder, held open by the rank (:func:`open_profile_folder`): atomically, 0600."""
        folder.write(rundir.profile_summary_path("", self.rank).name, json.dumps(dataclasses.asdict(self)).encode())


#: Why the profile folder is the user's alone, for messages.
PROFILES = "the run's profiles (traces, their summaries, the CUDA allocator's snapshot)"


def open_profile_folder(run_dir: PathLike) -> "statedir.StateDir":
    """The run's ``profile/`` folder, the user's alone (0700, whatever the umask), opened and held.

    A rank writes its traces and its record through this descriptor, never through the folder's
    name again: anyone of the group may rename things in a shared run folder and put a link in
    their place, which would take a trace (a whole file, replaced) into any file of the user's.
    It is found in the run folder the launch uses (:func:`nbddp.contract.rundir.open_run_folder`).
    A ``profile`` that is not a folder of the user's that no one else may write (an older nbddp's,
    made under the umask, may hold links others put there) is moved aside, with a warning, and
    made anew: never narrowed.

    Raises:
        NotPrivate: another user keeps replacing it.
    """
    path = rundir.profile_dir(run_dir)
    run = rundir.open_run_folder(Path(run_dir))
    try:
        return statedir.StateDir(open_yours(run, rundir.PROFILE, path, PROFILES, kind="folder"), str(path))
    finally:
        os.close(run)


def read_profile_records(run_dir: PathLike, world_size: int) -> Dict[int, ProfileRecord]:
    """Every rank's :class:`ProfileRecord` that exists, read only from a ``profile/`` folder of the
    user's alone (:func:`nbddp.contract.private.read_private`): one a group member swapped in is not read."""
    out = {}
    names = {f.name for f in dataclasses.fields(ProfileRecord)}
    for rank in range(world_size):
        try:
            data = json.loads(read_private(rundir.profile_summary_path(run_dir, rank), PROFILES))
        except (OSError, ValueError):  # NotPrivate included
            continue
        if isinstance(data, dict) and data.get("rank") == rank:
            out[rank] = ProfileRecord(**{k: v for k, v in data.items() if k in names})
    return out


#: Tracker name -> (module that must import, the extra that installs it).
TRACKERS = {"mlflow": ("mlflow", "nbddp[mlflow]"), "wandb": ("wandb", "nbddp[wandb]")}
#: What MLflow's SQLite store needs beside ``mlflow`` (mlflow-skinny leaves them out).
SQL_MODULES = ("sqlalchemy", "alembic")


def check_trackers(value: Any, environ: Optional[Dict[str, str]] = None) -> Tuple[str, ...]:
    """``trackers=...`` as a tuple of known names whose package is installed.

    Raises:
        ConfigError: an unknown name, or a tracker whose package is missing (with the pip command).
    """
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"trackers={value!r}: a list of tracker names, e.g. ['mlflow'] or ['wandb']")
    out: List[str] = []
    for name in names:
        key = name.strip().lower()
        if key not in TRACKERS:
            raise ConfigError(f"trackers: unknown tracker {name!r}; nbddp logs to {sorted(TRACKERS)} "
                              "(TensorBoard always)")
        module, extra = TRACKERS[key]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"trackers: {key!r} needs the {module} package, which is not installed in this "
                              f"Python. Install it with:  pip install '{extra}'  (or pip install {module})")
        uri = (os.environ if environ is None else environ).get("MLFLOW_TRACKING_URI") or "sqlite:"
        missing = [m for m in SQL_MODULES if key == "mlflow" and uri.startswith("sqlite:")
                   and importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(f"trackers: MLflow's local SQLite store needs {' and '.join(missing)}, not installed "
                              f"in this Python. Install them with:  pip install '{extra}'  (or set "
                              "MLFLOW_TRACKING_URI to your MLflow server)")
        if key not in out:
            out.append(key)
    return tuple(out)


@dataclass(frozen=True)
class TrackerPlan:
    """What rank 0 sends to the trackers, decided in the kernel.

    Attributes:
        names: the trackers (``"mlflow"``, ``"wandb"``).
        experiment: the MLflow experiment / W&B project (the launch's name unless the user set one).
        params: the launch's settings (the config's fields, or the target and its arguments).
        mlflow_uri: MLflow's tracking URI (``MLFLOW_TRACKING_URI``, else SQLite in the runs folder).
        artifact_root: where a new MLflow experiment in the local store keeps its artifacts.
        wandb_mode: ``"offline"`` unless the user configured W&B (``WANDB_MODE``, ``WANDB_API_KEY``).
    """

    names: Tuple[str, ...]
    experiment: str
    params: Dict[str, str]
    mlflow_uri: Optional[str] = None
    artifact_root: Optional[str] = None
    wandb_mode: Optional[str] = None


def tracker_plan(names: Sequence[str], experiment: str, runs_dir: PathLike, params: Dict[str, Any],
                 environ: Optional[Dict[str, str]] = None) -> Optional[TrackerPlan]:
    """The plan for ``names`` (``None`` when there are none), with offline defaults."""
    if not names:
        return None
    environ = os.environ if environ is None else environ
    runs = Path(runs_dir).absolute()
    uri = environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{runs / 'mlflow.db'}"
    mode = environ.get("WANDB_MODE") or ("online" if environ.get("WANDB_API_KEY") else "offline")
    flat = {k: _param(v) for k, v in params.items()}
    return TrackerPlan(tuple(names), environ.get("MLFLOW_EXPERIMENT_NAME") or experiment, flat, uri,
                       str(runs / "mlartifacts"), mode)


def _param(value: Any) -> str:
    """A setting as the text a tracker shows (MLflow keeps parameters as strings of <= 6000 characters)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 500 else text[:497] + "..."


def read_tracker_ids(run_dir: PathLike) -> Dict[str, Dict[str, Any]]:
    """The tracker runs this run folder logs into: ``{"mlflow": {"run_id": ...}, "wandb": {"id": ...}}``.

    Anyone who may write the run folder may edit this file: rank 0 continues an MLflow run only
    when the run's tag names this folder, and a W&B run's id is the folder's own
    (:mod:`nbddp.rank.trackers`); the kernel shows what it says.
    """
    data = rundir.read_json(rundir.trackers_path(run_dir))
    return data if isinstance(data, dict) else {}


def write_tracker_ids(run_dir: PathLike, ids: Dict[str, Dict[str, Any]]) -> None:
    rundir.write_json_atomic(rundir.trackers_path(run_dir), ids, durable=True)


__all__ = ["ProfileOptions", "ProfileRecord", "TrackerPlan", "profile_options", "check_trackers", "tracker_plan",
           "open_profile_folder", "read_profile_records", "read_tracker_ids", "write_tracker_ids", "TRACKERS",
           "PROFILE_DEFAULTS"]
