"""Exceptions nbddp raises in the notebook, and a rank's traceback as both sides show it.

Every error is user interface: the message says what happened, where, and what to do, once. A
rank prints its traceback from the code it ran on (:func:`shown_traceback`), and the cell shows a
``WorkerError`` under the line that launched, without nbddp's frames.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional


class NbddpError(Exception):
    """Base class of every error nbddp raises on purpose."""


class ConfigError(NbddpError, ValueError):
    """A launch argument or a ``TrainConfig`` field is invalid; raised before any process starts."""


class DataError(NbddpError):
    """The data folder cannot be used as it is (missing, empty class, unreadable image...)."""


class WeightsError(NbddpError):
    """A weights or checkpoint file cannot be used (missing, wrong shapes, not weights-only safe)."""


class ExportError(NbddpError):
    """A model cannot be exported for serving (ONNX), or the exported file does not predict what the model does."""


class _RankError(NbddpError):
    """An error raised in a worker that names the rank at its root (``rank``, kept when pickled)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):  # keep ``rank`` when pickled between processes
        return (type(self), (str(self), self.rank))


class NonFiniteLossError(_RankError, FloatingPointError):
    """The loss became NaN or infinite on at least one rank; every rank stops at the same step.

    Attributes:
        rank: the first rank that saw a non-finite loss (the root cause).
    """


class Retryable(Exception):
    """Raise it (or a subclass) in a worker for a failure that a restart can heal.

    A run launched with ``max_restarts=N`` restarts from its last checkpoint after a rank
    raised one; any other exception of the worker's own is taken to fail again the same way
    (see :mod:`nbddp.kernel.restarts` for the whole rule). An exception class of your own can say the
    same with a class attribute ``retryable = True``.

    Example:
        >>> raise nbddp.Retryable("the data server went away")
    """

    retryable = True


class WorkerError(NbddpError):
    """A worker process failed; the message names the root-cause rank and shows its traceback.

    Attributes:
        rank: the rank that caused the failure (not a rank that timed out waiting for it).
        exc_type: the original exception's type name, or ``None`` for a signal / exit code.
        signal: the signal name (``"SIGKILL"``) if the rank was killed by one.
        exitcode: the process exit code (negative for a signal).
        epoch: epoch the rank was in, if it reported one.
        step: step the rank was in, if it reported one.
        traceback: the worker's traceback text, if it raised.
        log_path: the rank's log file.
        run_dir: the run's folder.
        kind: what ended the root-cause rank: ``"exception"``, ``"exit"`` (SystemExit),
            ``"signal"``, ``"exit-code"`` (no Python exception), ``"hang"`` (no progress),
            ``"collective"`` (a collective failed or timed out), ``"watchdog"`` (NCCL's) or
            ``"server"`` (the launch server died).
        retryable: the rank's exception said a restart can heal it (:mod:`nbddp.kernel.restarts`).
        restarts: the restarts the run made before this failure (``nbddp.kernel.restarts.Restart``).
    """

    def __init__(self, message: str, *, rank=None, exc_type=None, signal=None, exitcode=None,
                 epoch=None, step=None, traceback=None, log_path=None, run_dir=None, kind=None,
                 retryable=False):
        super().__init__(message)
        self.rank, self.exc_type, self.signal, self.exitcode = rank, exc_type, signal, exitcode
        self.epoch, self.step, self.traceback = epoch, step, traceback
        self.log_path, self.run_dir = log_path, run_dir
        self.kind, self.retryable = kind, retryable
        self.restarts: list = []

    def _render_traceback_(self) -> List[str]:
        """What IPython shows for it: the frames of the code that launched, then the message.

        nbddp's own frames between the launching line and the ``raise`` (spawn_train, the run's
        handle) say nothing about a worker's failure and would be most of the cell's output: the
        rank's traceback is in the message. The exception keeps its whole traceback (``%debug``)."""
        shell = _ipython()
        tb = self.__traceback__
        if shell is None or tb is None:
            return [f"{type(self).__name__}: {self}"]
        return shell.InteractiveTB.structured_traceback(type(self), self, _outside_nbddp(tb))


def _ipython():
    """The running IPython shell, or None (nothing is imported: a rank never loads IPython)."""
    ipython = sys.modules.get("IPython")
    getter = getattr(ipython, "get_ipython", None) if ipython is not None else None
    return getter() if getter is not None else None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outside_nbddp(tb):
    """``tb``'s frames up to the first of nbddp's package, as a new traceback (the frames stay the same)."""
    import types

    kept = []
    while tb is not None and not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        kept.append(tb)
        tb = tb.tb_next
    if not kept:
        return tb
    chain = None
    for entry in reversed(kept):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


# ---------------------------------------------------------------------------- a rank's traceback
# The frames a rank's traceback starts with, before the code it ran: nbddp's way into a rank (its
# entry, the calling conventions, a cell's function loaded), Python's way into a script (runpy)
# and into a spawned process (multiprocessing, torch.multiprocessing). Under torchrun a script's
# traceback starts at the script; so does the one a rank prints.
_WAY_IN = ("/nbddp/contract/protocol.py", "/nbddp/rank/runtime.py", "/nbddp/rank/calls.py", "/nbddp/rank/process.py",
           "/nbddp/contract/cells.py", "/nbddp/rank/spawned.py", "/runpy.py", "/multiprocessing/",
           "<frozen runpy>")
_FRAME_LINE = r'^  File "(?P<file>.+)", line \d+, in .+$'  # compiled on first use: `import nbddp` loads no re


def shown_traceback(text: str) -> str:
    """A rank's formatted traceback without the frames that only led into its code (see ``_WAY_IN``).

    Each traceback of a chain loses its leading frames of nbddp's way into the rank and of
    ``runpy``/``multiprocessing``; frames after the first one of the code it ran are kept, nbddp's
    too (a ``ctx`` call that failed). A traceback of nothing but those frames is kept whole."""
    import re

    frame_line = re.compile(_FRAME_LINE)
    out: List[str] = []
    block: List[List[str]] = []  # the current traceback's frames, each its lines
    in_frames = False  # between a traceback's first line and its exception

    def flush():
        frames = block[:]
        way_in = 0
        while way_in < len(frames) and _is_way_in(frames[way_in][0]):
            way_in += 1
        for frame in frames[way_in if way_in < len(frames) else 0:]:
            out.extend(frame)
        block.clear()

    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            flush()
            out.append(line)
            in_frames = True
            continue
        if in_frames and frame_line.match(line):
            block.append([line])
            continue
        if in_frames and block and line.startswith("    "):  # the frame's source line, carets, "[Previous line...]"
            block[-1].append(line)
            continue
        flush()
        in_frames = False
        out.append(line)
    flush()
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _is_way_in(frame_line: str) -> bool:
    import re

    m = re.match(_FRAME_LINE, frame_line)
    path = m["file"].replace(os.sep, "/") if m else ""
    return any(part in path for part in _WAY_IN)


def workers_were(world_size: int) -> str:
    """``"all 4 workers were"``, or ``"the worker was"`` for a run of one."""
    return f"all {world_size} workers were" if world_size != 1 else "the worker was"


class TrainingInterrupted(NbddpError, KeyboardInterrupt):
    """Training was interrupted (Jupyter's Interrupt, Ctrl-C, or ``stop()``) and every worker is gone.

    A ``KeyboardInterrupt`` (what Python raises for an Interrupt: ``except KeyboardInterrupt``
    catches it) and an :class:`NbddpError`.

    Attributes:
        run_dir: the run's folder; its logs and last checkpoint are kept (``None`` when the
            Interrupt came before a run folder existed).
        result: the run's ``TrainResult`` when every rank had returned before the Interrupt
            reached it (nothing finished is lost), else ``None``.
    """

    def __init__(self, message: str, run_dir=None, result=None):
        super().__init__(message)
        self.run_dir = run_dir
        self.result = result

    def __reduce__(self):
        return (type(self), (str(self), self.run_dir, self.result))

    def _render_traceback_(self):
        """What IPython shows for it: the notice alone. An Interrupt is no bug of the code that
        launched; the frames of nbddp it passed through would be most of the cell's output."""
        return f"{type(self).__name__}: {self}".splitlines()

    @classmethod
    def for_run(cls, what: str, world_size: int, run_dir, how: str = "", checkpoint: Optional[str] = None
                ) -> "TrainingInterrupted":
        """The error for a run that was ``what`` (``"interrupted"``, ``"stopped"``) once every worker is gone.

        Args:
            how: how the ranks ended (``"rank 0: KeyboardInterrupt; rank 1: SIGTERM"``).
            checkpoint: the newest checkpoint the run folder holds, if any (never claimed otherwise).
        """
        kept = (f"Logs and the last checkpoint ({checkpoint}) are kept in {run_dir}" if checkpoint
                else f"Logs are kept in {run_dir} (no checkpoint was written)")
        ended = f" ({how})" if how else ""
        return cls(f"training {what}: {workers_were(world_size)} stopped and reaped{ended}. {kept}",
                   run_dir=run_dir)

    @classmethod
    def before_start(cls, what: str, run_dir=None) -> "TrainingInterrupted":
        """The error for an Interrupt that came while nbddp was ``what``, before any worker started."""
        kept = f" The run folder {run_dir} holds no run." if run_dir else ""
        return cls(f"interrupted while nbddp was {what}: no worker was started, nothing is left running.{kept}",
                   run_dir=run_dir)


class RunAbandoned(NbddpError):
    """nbddp could not go on watching a run (its folder vanished, say); every worker was ended."""

    def __init__(self, message: str, run_dir=None):
        super().__init__(message)
        self.run_dir = run_dir


class PeerError(_RankError):
    """Raised on the healthy ranks when another rank hit an error they all agreed to stop on.

    Attributes:
        rank: the rank that hit the error (the root cause).
    """
