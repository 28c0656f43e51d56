"""What an Interrupt (Jupyter's button, Ctrl-C) does in the kernel, and what it says in the cell.

A run's Interrupt is a staged stop (:mod:`nbddp.kernel.shutdown`): the ranks are asked; a rank
that has not stopped when asked gets SIGINT, a ``KeyboardInterrupt`` between two statements
whatever its code is (its ``finally:`` blocks run); then SIGTERM, then SIGKILL. The cell shows a
short notice, a few lines, never a rank's traceback (that stays in the rank's log):

.. code-block:: text

    nbddp: Interrupt: stopping the 2 workers of runs/w-0003 (asked to stop; a KeyboardInterrupt in 3 s for code
    that does not check ctx.should_stop()); interrupt again to end them at once
    TrainingInterrupted: training interrupted: all 2 workers were stopped and reaped.
      how: ranks 0-1: KeyboardInterrupt at the interrupt
      where they were: ranks 0-1: w.py:5, train
      logs: runs/w-0003/logs (no checkpoint was written)

An Interrupt before any worker started (nbddp loading torch, planning the launch) raises a
``TrainingInterrupted`` saying nothing was started, never a bare ``KeyboardInterrupt``.

Kernel side.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

from ..contract import rundir
from ..contract.conventions import makes_own_group
from ..contract.errors import TrainingInterrupted, workers_were
from ..contract.protocol import read_checkpoint_note, where_words
from .report import ranks_alike
from .stacks import Stacks


class StoppedWaiting(KeyboardInterrupt):
    """An Interrupt ended a cell's wait on a run another process owns (a detached run's supervisor,
    another kernel): the run goes on; ``handle.stop()`` ends it."""


@contextlib.contextmanager
def before_start(what: str = "preparing the launch") -> Iterator[None]:
    """An Interrupt in the body (no worker started yet) becomes a ``TrainingInterrupted`` that says so."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if isinstance(exc, (TrainingInterrupted, StoppedWaiting)):
            raise
        raise TrainingInterrupted.before_start(what) from None


def raises_training_interrupted(fn):
    """Decorate a launching function: an Interrupt before its workers exist ends it with a
    ``TrainingInterrupted`` (the launch holds Interrupts from its first worker's start on)."""
    import functools

    @functools.wraps(fn)
    def launching(*args, **kwargs):
        try:
            with before_start():
                return fn(*args, **kwargs)
        except TrainingInterrupted as exc:
            # The cell shows the notice under the line that launched, not nbddp's own frames.
            raise exc.with_traceback(None) from None
    return launching


def signal_rank(pid: int, sig: int, kill_group) -> None:
    """Send ``sig`` to a rank: SIGINT to the rank's process alone (its DataLoader workers would
    print their own ``KeyboardInterrupt`` and die under it), any other signal to its whole group."""
    if sig != signal.SIGINT:
        kill_group(pid, sig)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def ranks_to_ask(answering: Callable[[], Dict[int, int]], running: int, tries: int = 5) -> Dict[int, int]:
    """``{rank: pid}`` of the ranks that can answer for their stack, looked at until every one of the
    ``running`` ranks is there or ``tries`` looks were made: a heartbeat being rewritten (a rank
    reporting progress every few milliseconds) reads as missing for a moment."""
    found: Dict[int, int] = {}
    for _ in range(tries):
        found.update(answering())
        if len(found) >= running:
            break
        time.sleep(0.02)
    return found


def checkpoints_through_nbddp(spec: Any, run_dir: Path) -> bool:
    """True for a worker known to checkpoint through nbddp: the built-in task (its config is the
    launch's argument) or one that noted a checkpoint in this run folder (``ctx.save_checkpoint``)."""
    from ..contract.plans import is_task_config

    if any(is_task_config(a) for a in (spec.args or ())):
        return True
    with contextlib.suppress(Exception):
        return read_checkpoint_note(run_dir) is not None
    return False


def stopping_line(spec: Any, run_dir: Path, grace_s: float, by: str = "Interrupt") -> str:
    """The one line the cell shows when an Interrupt (``by``: or a ``"Stop"``) reaches a running launch.

    Only the built-in task is known to finish its step and checkpoint (it checks the request every
    step); a worker of your own may not check ``ctx.should_stop()``, so it is told what then
    happens: a ``KeyboardInterrupt``, never inside a checkpoint nbddp writes (that ends first)."""
    from ..contract.plans import is_task_config

    if any(is_task_config(a) for a in (spec.args or ())):
        how = "they finish their step and checkpoint"
    elif isinstance(spec.target, str) and makes_own_group(spec.call, spec.target):
        how = "a KeyboardInterrupt in each rank, as Ctrl-C gives"
    else:
        how = f"asked to stop; a KeyboardInterrupt in {grace_s:g} s for code that does not check ctx.should_stop()"
        if checkpoints_through_nbddp(spec, run_dir):
            how += ", once a checkpoint being written is whole"
    workers = f"the {spec.world_size} workers" if spec.world_size != 1 else "the worker"
    again = "again " if by == "Interrupt" else ""
    return (f"nbddp: {by}: stopping {workers} of {_short(run_dir)} ({how}); "
            f"interrupt {again}to end {'them' if spec.world_size != 1 else 'it'} at once")


def where_line(stacks: Optional[Stacks], world_size: int = 0, beats: Optional[Dict[int, Any]] = None) -> str:
    """``"ranks 0-1: w.py:5, train"``: each rank's innermost frame of its own code, ranks alike together;
    a function from a notebook cell as IPython names its line, ``"Cell In[4], line 5, train"``.

    Every one of the ``world_size`` ranks is named: one that was not asked (no heartbeat of this
    start yet, or already ended) says so. A rank whose stack cannot be asked from here (a SLURM job's,
    on its node) is placed by its heartbeat (``beats``): what it last reported."""
    stacks, beats = stacks or Stacks(), beats or {}
    if not stacks and not beats:
        return ""
    places: Dict[str, list] = {}
    for r in range(max(world_size, max([*stacks, *beats]) + 1)):
        place = _place(stacks[r]) if r in stacks else _reported(beats[r]) if r in beats else _place(None)
        places.setdefault(place, []).append(r)
    return ranks_alike(places, " · ")


def _reported(beat: Any) -> str:
    """Where a rank was as its heartbeat says (its stack not asked): its state, the step it last reported."""
    if beat.state == "starting":
        return "starting (its code had not begun)"
    if beat.state in ("finishing", "done"):
        return "finishing (its code had returned)"
    reported = where_words(beat.epoch, beat.step)
    return f"last reported {reported}" if reported else "running (no step reported)"


def _place(stack) -> str:
    """Where one rank was, in words: its code's line; meeting the others; starting; never torch's
    or Python's own frames (``_create_gloo_process_group``, ``<string>:1``), which say nothing to its user."""
    if stack is None:
        return "gave no stack (starting, or already ended)"
    if not stack.threads:
        return "did not answer"
    frame = stack.code_frame
    if stack.meeting:
        return "meeting the other ranks (rendezvous)" + (f" at {frame.place()}, {frame.function}" if frame else "")
    if frame is not None:
        return f"{frame.place()}, {frame.function}"
    if stack.before_code:
        return "starting (its code had not begun)"
    if stack.state in ("finishing", "done"):
        return "finishing (its code had returned)"
    return f"{stack.main[0].place()}, {stack.main[0].function}" if stack.main else "has no Python frame"


def interrupted(world_size: int, run_dir: Path, how: str, stacks: Optional[Stacks],
                checkpoint: Optional[str], result: Any = None, ended_first: bool = False,
                what: str = "interrupted", beats: Optional[Dict[int, Any]] = None) -> TrainingInterrupted:
    """The error an interrupted run raises once every worker is gone: a few lines, the detail in the logs.

    Args:
        what: ``"interrupted"`` (Jupyter's Interrupt, Ctrl-C) or ``"stopped"`` (Stop, ``handle.stop()``).
        how: how the ranks ended (:func:`nbddp.kernel.report.how_ranks_stopped`).
        stacks: where each rank was when the Interrupt came.
        beats: the ranks' heartbeats then, for those whose stack was not asked (a SLURM job's).
        result: the run's ``TrainResult`` when every rank returned normally; kept as ``.result``.
        ended_first: every rank had returned before the Interrupt reached it.
    """
    if result is not None and ended_first:
        head = (f"the Interrupt came after the end: all {world_size} workers had returned. "
                "The result is kept: r = sys.last_value.result")
    elif result is not None:
        head = (f"training interrupted: all {world_size} workers stopped and returned. "
                "Their result is kept: r = sys.last_value.result")
    else:
        head = f"training {what}: {workers_were(world_size)} stopped and reaped."
    lines = [head]
    if how and not ended_first:
        lines.append(f"  how: {how}")
    where = where_line(stacks, world_size, beats)
    if where and not ended_first:
        lines.append(f"  where they were: {where}")
    kept = f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint was written"
    lines.append(f"  logs: {rundir_logs(run_dir)} ({kept})")
    return TrainingInterrupted("\n".join(lines), run_dir=run_dir, result=result)


def rundir_logs(run_dir: Path) -> str:
    return str(rundir.logs_dir(_short(run_dir)))


def _short(path: Path) -> str:
    """``path`` relative to the working folder when it is below it (what the user typed), else absolute."""
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    return str(path)

