"""A refusal that only a rank could make (``mp.spawn`` behind a condition of the script's own), said once.

A spawn every run of the script reaches is read in the kernel before any process starts, and
the script then runs in one launcher whose processes nbddp watches
(:func:`nbddp.contract.conventions.script_spawns`); what only a rank sees (a branch taken on a
value the kernel cannot know) is refused there, by every rank alike. The notebook then gets
that refusal once, as the ``ConfigError`` it is, with where the user's code made the call (their
file and line, never ``runpy``'s), instead of a failure report that repeats it for every rank.

Kernel side.
"""

from __future__ import annotations

from pathlib import Path
from ..contract import rundir
from ..contract.errors import ConfigError, WorkerError
from ..contract.protocol import read_error_records
from .stacks import from_traceback


def said_once(error: BaseException, run_dir: Path, world_size: int) -> BaseException:
    """``error``, or the ``ConfigError`` its root-cause rank raised when that is what ended the run."""
    if not isinstance(error, WorkerError) or error.exc_type != "ConfigError" or error.rank is None:
        return error
    records = read_error_records(run_dir, world_size)
    root = records.get(error.rank)
    if root is None:
        return error
    frame = from_traceback(error.rank, root.traceback).code_frame
    where = f"{Path(frame.file).name}:{frame.line}, in {frame.function}" if frame else "see the rank's log"
    alike = sorted(r for r, rec in records.items() if rec.type == root.type and rec.message == root.message)
    ranks = f"ranks {', '.join(map(str, alike))}" if len(alike) > 1 else f"rank {error.rank}"
    refusal = ConfigError(f"{root.message}\n  where: {where} ({ranks} refused it; logs: {rundir.logs_dir(run_dir)})")
    refusal.run_dir = run_dir
    return refusal

