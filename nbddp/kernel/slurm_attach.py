"""``nbddp.attach(run_dir)``: follow a submitted SLURM run again from its folder (after a kernel restart).

A run's ranks on a cluster outlive the kernel that submitted them (their spec names no kernel to
watch). Everything a handle needs is in the run folder: the job id in the run's launch record,
the job's spec in its private folder, and what the ranks write (heartbeats, logs, values,
progress, results). Both records are read only if they are provably the user's own
(:func:`nbddp.contract.rundir.read_launch_record` with ``strict``,
:func:`nbddp.contract.private.read_private`): the spec is unpickled, and the job id is cancelled
on a Stop. The attached handle follows the job to its end and gives its result, as the handle
``spawn_train`` returned would have; it makes no restarts of its own (``max_restarts`` was the
submitting kernel's), while a requeue after SLURM's signal goes on in the job.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..contract import private, rundir, statedir
from ..contract.errors import ConfigError
from .slurm import Slurm
from .slurm_group import JOB_FILES, SPEC_FILE, SlurmGroup, job_folder

#: Why the job's spec must be the user's own: it is unpickled.
WHY = "the run's launch is read from it and unpickled, so only you may write it"


def attach(run_dir: Union[str, "os.PathLike[str]"], block: bool = False, echo: bool = True,
           on_event: Optional[Callable[[str, Any], None]] = None, grace_s: float = 10.0) -> Any:
    """Follow a run submitted with ``spawn_train(..., cluster=nbddp.Slurm(...))`` again, from its folder.

    Args:
        run_dir: the run's folder (``handle.run_dir``, or the path the submission printed).
        block: wait for the run's end here and return its :class:`~nbddp.TrainResult` (or raise
            its error); by default a :class:`~nbddp.RunHandle` comes back at once, as with
            ``block=False``: ``handle.wait()`` gives the result, ``handle.stop()`` cancels the job.
        echo: show rank 0's new output in the cell.
        on_event: called with ``(kind, payload)`` as the run goes (as ``spawn_train``'s).
        grace_s: how long the ranks get between the steps of a Stop.

    Raises:
        ConfigError: the folder has no SLURM run of yours (no launch record, or a local run's).
        NotPrivate: the launch record or the job's spec is not provably yours (never read further).

    Example:
        >>> h = nbddp.attach("runs/run-20260101-120000")   # after a kernel restart
        >>> h.wait().value
    """
    from .handle import RunHandle

    run = Path(os.path.abspath(run_dir))
    if not run.is_dir():
        raise ConfigError(f"attach({str(run_dir)!r}): no such run folder; give the folder spawn_train printed "
                          "(handle.run_dir)")
    # The run folder is resolved once: its state folder pinned by descriptor (a link at its name is
    # refused), and the launch record, the job's folder and its spec read through it, never by name again.
    none = ConfigError(f"attach({str(run_dir)!r}): the folder holds no SLURM job's run (attach follows a run "
                       "submitted with spawn_train(..., cluster=nbddp.Slurm(...)); a run started on this server "
                       "ended with the kernel that started it)")
    try:
        state = statedir.follow(run)
    except FileNotFoundError:
        raise none from None
    try:
        record = rundir.read_launch_record(run, strict=True)
        job = record.get("slurm") if isinstance(record, dict) else None
        if not isinstance(job, dict) or not job.get("job"):
            raise none
        path = job_folder(run)
        with state._lock:
            folder = statedir.StateDir(private.open_yours(state._dir(), path.name, path, JOB_FILES, kind="folder",
                                                          flags=os.O_RDONLY, replace=False), os.fspath(path))
        spec = pickle.loads(folder.read(SPEC_FILE))
    except BaseException:
        statedir.release(run)
        raise
    if Path(spec.run_dir).resolve() != run.resolve():
        statedir.release(run)
        raise ConfigError(f"attach({str(run_dir)!r}): the job's launch names another run folder ({spec.run_dir}); "
                          "the folder was moved or copied: attach the run where it was submitted")
    cluster = Slurm(**{**job.get("cluster", {}), "extra": tuple(job.get("cluster", {}).get("extra", ()))})
    group = SlurmGroup(None, spec, cluster, str(job["job"]), folder, float(record.get("started") or time.time()))
    handle = RunHandle(group, echo=echo, grace_s=grace_s, log_starts=rundir.log_sizes(run, spec.world_size),
                       show_logs=False)
    group.notify = handle._notice
    if on_event is not None:
        handle.subscribe(on_event)
    handle._notice(f"nbddp: following SLURM job {group.job_id} of the run in {run}")
    if block:
        return handle.wait()
    handle.start_background()
    return handle


__all__ = ["attach"]
