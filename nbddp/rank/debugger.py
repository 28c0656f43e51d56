"""A rank's debugger, answered in the notebook: ``ctx.breakpoint(rank=r)`` and ``breakpoint()``.

A rank has no terminal: its output goes to its log and its stdin is empty. At a breakpoint it runs
:class:`RelayPdb`, a ``pdb.Pdb`` whose input and output are files in the run's private state
folder (:mod:`nbddp.contract.debugging`); the kernel shows what it prints in the cell and asks
for each command through the kernel's own ``input()`` (Jupyter's input box). Every pdb command
works as in a terminal.

While the rank is at the prompt its heartbeat says ``debugging``, so the kernel's stall detector
waits; with ``ctx.breakpoint`` the other ranks wait for it at the same call, polling a file (not
in a collective, which would time out), until the debugger continues (``c``) or quits (``q``).

Worker side.
"""

from __future__ import annotations

import io
import linecache
import os
import pdb
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from ..contract import debugging
from ..contract.protocol import read_stop_request

#: How often a waiting rank looks for its answer or its release (seconds).
POLL_S = 0.05

#: The process group's timeout in a ``debug=True`` launch: a day (see :func:`breakpoints_on`).
GROUP_TIMEOUT_S = 24 * 3600.0

_ctx = None  # the rank's Context, once run_rank has started (the heartbeat says "debugging" through it)
_seq = 0  # prompts so far in this process: the kernel answers each by its number


def breakpoints_on() -> bool:
    """True in a rank of a ``debug=True`` launch: ``breakpoint()`` calls :func:`set_trace`."""
    return os.environ.get("PYTHONBREAKPOINT") == debugging.BREAKPOINT_HOOK


def attach(ctx) -> None:
    """Let breakpoints in this process report through ``ctx``'s heartbeat (called by ``run_rank``)."""
    global _ctx
    _ctx = ctx


class _Output(io.TextIOBase):
    """pdb's output: appended to ``debug.rank<r>.out`` and flushed at once (the kernel reads it live)."""

    def __init__(self, run_dir: Path, rank: int):
        # Through the run's state folder this rank holds open (a swapped .nbddp is never written).
        self._file = io.TextIOWrapper(debugging.open_output(run_dir, rank, append=True), encoding="utf-8",
                                      errors="replace")

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._file.write(text)
        self._file.flush()
        return len(text)

    def size(self) -> int:
        self._file.flush()
        return os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        self._file.close()


_outputs: dict = {}  # one open output file per path for the process's life: a breakpoint in a loop opens none more


def _output(run_dir: Path, rank: int) -> _Output:
    key = (os.path.abspath(run_dir), rank)
    if key not in _outputs:
        _outputs[key] = _Output(run_dir, rank)
    return _outputs[key]


class _Input(io.TextIOBase):
    """pdb's input: each ``readline`` is one prompt, answered by the kernel."""

    def __init__(self, ask: Callable[[], str]):
        self._ask = ask

    def readable(self) -> bool:
        return True

    def readline(self, size: int = -1) -> str:
        return self._ask()


class RelayPdb(pdb.Pdb):
    """``pdb.Pdb`` driven through files: prompts go to the notebook, commands come from it.

    Args:
        run_dir: the run's folder.
        rank: this rank.
        on_leave: called once when the debugger lets the rank go on (``c``) or quits (``q``).
    """

    def __init__(self, run_dir: Path, rank: int, on_leave: Optional[Callable[[], None]] = None):
        self.run_dir, self.rank, self._on_leave = Path(run_dir), rank, on_leave
        self._out = _output(run_dir, rank)
        # nosigint: SIGINT is nbddp's stop request in a rank, never pdb's "break into the debugger".
        super().__init__(stdin=_Input(self._next_command), stdout=self._out, nosigint=True, readrc=False)
        self.use_rawinput = False
        self.prompt = ""  # the notebook shows its own, "(Pdb) [rank 1] "
        for name, text in debugging.read_sources(run_dir).items():  # a notebook cell's lines, for `l`
            linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)
        self._left = False
        self._state_before: Optional[str] = None

    def where(self) -> str:
        """``file.py:42``: the line the rank stopped at."""
        frame = self.curframe
        if frame is None:
            return ""
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"

    def _next_command(self) -> str:
        """Publish a prompt and wait for the notebook's command (a stop request quits)."""
        global _seq
        _seq += 1
        seq = _seq
        self._left = False  # stopped again (a breakpoint set with `b`): the next `c` leaves again
        _set_debugging(self, True)
        debugging.DebugState(self.rank, "prompt", seq, self.where(), self._out.size()).write(self.run_dir)
        while True:
            answer = debugging.DebugAnswer.read(self.run_dir, self.rank, seq)
            if answer is not None:
                debugging.DebugState(self.rank, "running", seq, self.where(), self._out.size()).write(self.run_dir)
                return answer.line.rstrip("\r\n") + "\n"
            if read_stop_request(self.run_dir) is not None:
                return "q\n"  # Stop, Interrupt or another rank's failure: leave the debugger, end the rank
            time.sleep(POLL_S)

    def set_continue(self) -> None:
        super().set_continue()
        self._leave()

    def set_quit(self) -> None:
        # The run ends (the kernel asked every rank to stop before sending `q`): the ranks that
        # wait at ctx.breakpoint are not let go into a collective with a rank about to exit.
        super().set_quit()
        self._leave(release=False)

    def _leave(self, release: bool = True) -> None:
        if self._left:
            return
        self._left = True
        debugging.DebugState(self.rank, "done", _seq, self.where(), self._out.size()).write(self.run_dir)
        _set_debugging(self, False)
        if release and self._on_leave is not None:
            self._on_leave()


def _set_debugging(holder, on: bool) -> None:
    """The heartbeat says ``debugging`` while ``on`` (the stall detector waits); after, fresh progress."""
    beat = getattr(_ctx, "_beat", None)
    if beat is None:
        return
    if on:
        if getattr(holder, "_state_before", None) is None:
            holder._state_before = beat.state
        beat.state = "debugging"
    else:
        beat.state = getattr(holder, "_state_before", None) or "running"
        holder._state_before = None
        _ctx._progress_time = time.time()  # the time at the prompt was not a hang
    beat.beat()


class _Waiter:
    _state_before: Optional[str] = None


def _relayed() -> Optional[Path]:
    """The run folder when a notebook relays this rank's debugger, else None."""
    run_dir = os.environ.get("NBDDP_RUN_DIR")
    if not os.environ.get(debugging.RELAY_ENV) or not run_dir:
        return None
    return Path(run_dir)


def _skip(frame, why: str) -> None:
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    print(f"nbddp: breakpoint at {where} skipped: {why}", file=sys.stderr, flush=True)


def _rank() -> int:
    if _ctx is not None:
        return _ctx.rank
    return int(os.environ.get("RANK") or 0)


def set_trace(*args, **kwargs) -> None:
    """``breakpoint()`` in a rank of a ``debug=True`` launch (``PYTHONBREAKPOINT`` names this).

    This rank stops at the line after the call, with the prompt in the notebook. The other ranks
    are not told: they go on to their next collective and wait there (in a launch whose group
    nbddp makes, ``debug=True`` lifts its timeout; the kernel's stall detector waits while a rank
    is at the prompt). Use ``ctx.breakpoint(rank=r)`` on every rank to hold them all at one point.
    """
    frame = sys._getframe(1)
    run_dir = _relayed()
    if run_dir is None:
        _skip(frame, "no notebook relays this rank's debugger (launch with spawn_train(..., debug=True))")
        return
    RelayPdb(run_dir, _rank()).set_trace(frame)


def breakpoint_at(ctx, rank: int, number: int, frame) -> None:
    """``ctx.breakpoint(rank=...)``: rank ``rank`` stops in ``frame``; the others wait for it here.

    Args:
        ctx: the rank's Context.
        rank: the rank that stops.
        number: which ``ctx.breakpoint`` call of the run this is (the same on every rank).
        frame: the caller's frame: the debugger stops at its next line.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ctx.world_size:
        raise ValueError(f"ctx.breakpoint(rank={rank!r}): rank must be an int from 0 to {ctx.world_size - 1} "
                         f"(this run has {ctx.world_size} ranks)")
    run_dir = _relayed()
    if run_dir is None:
        if ctx.rank == rank:
            _skip(frame, "no notebook relays this rank's debugger (the run was not launched by spawn_train)")
        return
    if ctx.rank == rank:
        RelayPdb(run_dir, rank, on_leave=lambda: debugging.mark_released(run_dir, number)).set_trace(frame)
        return
    waiter = _Waiter()
    _set_debugging(waiter, True)
    try:
        while True:
            if read_stop_request(run_dir) is not None:  # q, Interrupt, Stop, or a rank failed
                raise KeyboardInterrupt(f"nbddp: the run was stopped while rank {rank} was at a breakpoint")
            if debugging.is_released(run_dir, number):
                break
            time.sleep(POLL_S)
    finally:
        _set_debugging(waiter, False)
