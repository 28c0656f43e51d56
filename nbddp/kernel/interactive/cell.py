"""A ``%%ranks`` cell in the kernel: the ranks' output live, each line ``[rankN] ``, and one outcome.

Each rank's output of the cell is read from its log from where the cell's output starts (the
rank says where, :data:`nbddp.contract.channel.BEGIN`) with ``spawn_train``'s reader and echo
(:mod:`nbddp.kernel.output`): lines prefixed after buffering, ``\\r`` bars (tqdm) rewritten in
place, a flood cut. Several ranks write into one cell: a rank's bar left mid-line is ended before
another rank's line is written.

The cell's outcome, once every rank answered or the Interrupt's wait is over: nothing (all
well); :class:`RankCellError` for ranks that raised (their tracebacks are in the output above,
once); ``TrainingInterrupted`` (a ``KeyboardInterrupt``) for an Interrupt, the ranks it could not
free named with where they wait; a ``WorkerError`` for ranks whose process ended.

Kernel side.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional

from ...contract import channel, rundir
from ...contract.errors import WorkerError
from ..output import UPDATE, CellEcho, OutputTail, rewrites_in_place
from ..stacks import collect
from .members import Members, RanksInterrupted, Reply


class RankCellError(WorkerError):
    """Code of a ``%%ranks`` cell raised on some ranks; their tracebacks are in the cell's output above.

    Attributes:
        errors: ``{rank: "ValueError: boom"}``.
    """

    def __init__(self, message: str, errors: Dict[int, str], **kwargs):
        super().__init__(message, **kwargs)
        self.errors = errors

    def _render_traceback_(self) -> List[str]:
        # The ranks' tracebacks were shown above, each once; nbddp's frames in the kernel say nothing.
        return [f"{type(self).__name__}: {self}"]


class _Stream:
    """Where one rank's echo writes: the cell's stdout, below another rank's bar left mid-line."""

    def __init__(self, echoes: "Echoes", rank: int):
        self.echoes, self.rank = echoes, rank

    def write(self, text: str) -> None:
        self.echoes.before_write(self.rank)
        sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


class Echoes:
    """Every rank's echo of one cell (see the module docstring).

    A cell's last line is the only one a stream can rewrite, so one rank's ``\\r`` bar is drawn in
    place at a time: the first rank that draws one, until its bar ends with a line (tqdm's last
    state); the other ranks' bar updates meanwhile are left to their logs, and their last states
    arrive as lines. Another rank's output written while the bar is open goes below it.
    """

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.tails: Dict[int, OutputTail] = {}
        self.echoes: Dict[int, CellEcho] = {}
        self._bar_rank: Optional[int] = None  # the rank whose bar is drawn in place
        self._last: Optional[int] = None  # the rank that wrote last

    def begin(self, rank: int, offset: int) -> None:
        log = rundir.rank_log(self.run_dir, rank)
        self.tails[rank] = OutputTail(log, start=offset)
        self.echoes[rank] = CellEcho(f"[rank{rank}] ", log=log, out=_Stream(self, rank),
                                     in_place=rewrites_in_place(sys.stdout))

    def before_write(self, rank: int) -> None:
        last = self.echoes.get(self._last) if self._last is not None else None
        if last is not None and self._last != rank and last.open_update:
            sys.stdout.write("\n")  # the other rank's bar stays as it was, on its own line
            last.open_update = False
        self._last = rank

    def poll(self, final: bool = False) -> None:
        order = sorted(self.tails, key=lambda r: (r != self._bar_rank, r))  # the bar's rank first: it may end it
        for rank in order:
            tail, echo = self.tails[rank], self.echoes[rank]
            for kind, text in (tail.rest() if final else tail.read()):
                if kind == UPDATE and self._bar_rank not in (None, rank):
                    continue  # another rank's bar is drawn: this one's states stay in its log
                echo.show(kind, text)
                if kind == UPDATE:
                    self._bar_rank = rank
                elif self._bar_rank == rank:
                    self._bar_rank = None  # its bar ended with a line
            echo.close() if final else echo.flush()


def outcome(members: Members, ranks: List[int], replies: Dict[int, Reply], label: str,
            cell: bool = True) -> Optional[BaseException]:
    """The exception that ends the cell, or None; see the module docstring. ``cell=False`` (a pull, a
    push): the ranks' own errors are the caller's to say (no traceback was printed)."""
    stuck = [r for r in ranks if r not in replies and r not in members.gone]
    gone = {r: members.gone[r] for r in ranks if r in members.gone and r not in replies}
    interrupted = [r for r, rep in replies.items() if rep.status == channel.INTERRUPTED]
    if stuck:
        stacks = collect(members.run_dir, {r: members.pid(r) for r in stuck})
        where = stacks.summary() if stacks else ", ".join(f"rank {r}" for r in stuck)
        collective = any(s.waiting_in for s in stacks.values())
        return RanksInterrupted(
            f"Interrupt could not free {_ranks(stuck)} of {label}: {where}"
            + (" — a collective the other ranks never joined" if collective else "")
            + ". The group refuses them new cells; r.restart() starts the group anew (its state is lost).",
            run_dir=members.run_dir, stuck=stuck)
    if gone:
        return WorkerError(
            "; ".join(f"rank {r} ended ({how})" for r, how in sorted(gone.items()))
            + f" during {label}. The group's other ranks keep their state, but collectives with the lost ranks "
            "fail: r.restart() starts the group anew (its state is lost); its logs are in "
            f"{members.run_dir / rundir.LOGS}",
            rank=min(gone), run_dir=members.run_dir, kind="signal")
    if interrupted:
        return RanksInterrupted(f"{label} interrupted on {_ranks(interrupted)} (KeyboardInterrupt in its code); "
                                   "the group and its state are kept", run_dir=members.run_dir)
    errors = {r: f"{rep.error_type}: {rep.error_line}" for r, rep in sorted(replies.items())
              if rep.status == channel.ERROR and cell}
    if errors:
        first = min(errors)
        return RankCellError(
            "; ".join(f"rank {r} raised {text}" for r, text in errors.items())
            + " (traceback above). The group and its state are kept.",
            errors, rank=first, exc_type=replies[first].error_type, run_dir=members.run_dir, kind="exception",
            log_path=rundir.rank_log(members.run_dir, first))
    return None


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


__all__ = ["RankCellError", "RanksInterrupted", "Echoes", "outcome"]
