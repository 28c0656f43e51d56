"""The notebook's end of a rank's debugger: shows what pdb prints, asks for each command.

A rank at a breakpoint (:mod:`nbddp.rank.debugger`) publishes its prompt in the run's state
folder (:mod:`nbddp.contract.debugging`). :class:`PromptRelay` shows the rank's pdb output in the
cell and asks for the next command with ``input()`` in the cell's thread, which IPython turns into
an input request on the kernel's stdin channel (Jupyter's input box), prompt ``(Pdb) [rank 1]``.

Where no one can answer (nbmake and nbclient run cells with stdin not allowed; a script without a
terminal), the relay answers ``c`` itself and says so in one line, so the run does not hang,
unless the launch said ``debug="always"``.

Kernel side.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Dict, Optional

from ..contract import debugging

#: The commands that end the run from the prompt (pdb's quit).
QUIT_COMMANDS = ("q", "quit", "exit")


class Headless(Exception):
    """No one can answer a prompt here (stdin not allowed, or no terminal)."""


def keep_cell_sources(run_dir: Path, target) -> None:
    """A notebook function's cell, kept in the run's state folder: pdb's ``l`` in a rank shows it.

    IPython compiles a cell under a file name that exists only in the kernel's ``linecache``."""
    code = getattr(target, "__code__", None)
    if code is None or os.path.exists(code.co_filename):
        return
    lines = linecache.getlines(code.co_filename)
    if lines:
        debugging.keep_sources(run_dir, {code.co_filename: "".join(lines)})


def can_prompt() -> bool:
    """True when ``input()`` in this thread reaches a person: a kernel cell that allows stdin, or a terminal.

    nbclient (nbmake, ``jupyter nbconvert --execute``) runs cells with ``allow_stdin=False``, where
    IPython's ``input()`` raises ``StdinNotImplementedError``; a script in CI has no terminal.
    """
    shell = _ipython()
    kernel = getattr(shell, "kernel", None) if shell is not None else None
    if kernel is not None:
        return bool(getattr(kernel, "_allow_stdin", False))
    stdin = sys.stdin
    try:
        return stdin is not None and stdin.isatty()
    except (ValueError, OSError):
        return False


def _ipython():
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except Exception:  # noqa: BLE001 - any failure means: not in a shell we can ask
        return None


def ask(prompt: str) -> Optional[str]:
    """One line typed at ``prompt``; None after an Interrupt. Raises :class:`Headless` when no one can answer.

    SIGINT is Python's own ``KeyboardInterrupt`` for the time of the question (the run's watch
    holds it as a flag otherwise), so Jupyter's Interrupt ends the input box at once.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
    try:
        return input(prompt)
    except KeyboardInterrupt:
        return None
    except EOFError:  # a closed stdin (a script fed from a pipe)
        raise Headless("stdin is closed") from None
    except Exception as exc:  # noqa: BLE001 - IPython's StdinNotImplementedError, without importing IPython
        if type(exc).__name__ == "StdinNotImplementedError":
            raise Headless(str(exc)) from None
        raise
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


class PromptRelay:
    """One launch's breakpoints, as the kernel sees them.

    Args:
        run_dir: the run's folder.
        world_size: its number of ranks.
    """

    def __init__(self, run_dir: Path, world_size: int):
        self.run_dir, self.world_size = Path(run_dir), world_size
        self._shown: Dict[int, int] = {}  # bytes of each rank's pdb output shown so far
        self._answered: Dict[int, int] = {}  # the last prompt answered, per rank
        self._told: Dict[int, int] = {}  # the last prompt said in a notice, per rank
        self.headless_told = 0  # the last prompt said to be unanswerable in this cell (debug="always")

    def waiting(self) -> Dict[int, debugging.DebugState]:
        """``{rank: state}`` of the ranks at a prompt nobody has answered yet."""
        return {r: st for r, st in debugging.ranks_at_prompt(self.run_dir, self.world_size).items()
                if st.seq > self._answered.get(r, 0)}

    def first_waiting_line(self) -> Optional[str]:
        """:func:`waiting_line` of the lowest rank at a prompt, or None."""
        waiting = self.waiting()
        if not waiting:
            return None
        rank, state = min(waiting.items())
        return waiting_line(rank, state.where)

    def new_stops(self) -> Dict[int, debugging.DebugState]:
        """The waiting ranks not told of yet (each prompt once)."""
        found = {r: st for r, st in self.waiting().items() if st.seq > self._told.get(r, 0)}
        for r, st in found.items():
            self._told[r] = st.seq
        return found

    def state(self, rank: int) -> Optional[debugging.DebugState]:
        return debugging.DebugState.read(self.run_dir, rank)

    def output(self, rank: int, upto: Optional[int] = None) -> str:
        """The rank's pdb output not shown yet (up to byte ``upto``)."""
        start = self._shown.get(rank, 0)
        try:
            with debugging.open_output(self.run_dir, rank) as f:  # checked, through the run's state folder
                f.seek(start)
                data = f.read() if upto is None else f.read(max(0, upto - start))
        except OSError:
            return ""
        self._shown[rank] = start + len(data)
        return data.decode("utf-8", "replace")

    def answer(self, rank: int, seq: int, line: str) -> None:
        """Send ``line`` as the rank's answer to prompt ``seq``."""
        self._answered[rank] = seq
        debugging.DebugAnswer(seq, line).write(self.run_dir, rank)

    def stepping(self, only: Optional[int] = None) -> bool:
        """True while a rank answered from here has yet to read its answer, or runs toward its next prompt (``n``)."""
        for rank, seq in self._answered.items():
            st = self.state(rank) if only in (None, rank) else None
            if st is not None and (st.state == "running" or (st.state == "prompt" and st.seq == seq)):
                return True
        return False

    @staticmethod
    def prompt(rank: int) -> str:
        return debugging.PROMPT.format(rank=rank)


def skipped_line(rank: int, where: str) -> str:
    """What the cell says for a breakpoint no one can answer."""
    return (f"nbddp: rank {rank} reached a breakpoint ({where}), skipped: no one can answer a prompt here "
            "(stdin is not allowed: nbmake, a script, CI). Launch with debug='always' to stop there anyway.")


def waiting_line(rank: int, where: str) -> str:
    """What the panel and a background run's handle say while a rank is at a prompt."""
    return f"rank {rank} is waiting at a breakpoint ({where}); handle.debug() opens its prompt here"


def _show(text: str) -> None:
    if text:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)


def serve_prompts(handle, only: Optional[int] = None, interrupted: Optional[list] = None) -> None:
    """Answer the ranks at a prompt from this cell, until none is at one or steps, or the run ends.

    Args:
        handle: the run's :class:`~nbddp.kernel.handle.RunHandle`: watched here when no monitor
            thread does (a blocking run), stopped on ``q``, ended on Interrupt (which raises).
        only: serve this rank's prompts only.
        interrupted: the flag list of :func:`~nbddp.kernel.handle.interrupts_held`: an Interrupt
            between two prompts (a rank stepping) returns at once, for the caller to end the run.
    """
    relay: PromptRelay = handle._relay
    while not handle._done.is_set() and not interrupted:
        if handle._thread is None:
            handle.poll()  # a blocking run: the cell's thread is the run's watch
        # A rank that has ended, or a run being stopped (a failure elsewhere), has no prompt to answer.
        waiting = {} if handle._shutdown is not None else {
            r: st for r, st in relay.waiting().items() if only in (None, r) and r not in handle._ends}
        if not waiting:
            if not _stepping(relay, only):
                return
            threading.Event().wait(0.05)
            continue
        rank, st = min(waiting.items())
        _show(relay.output(rank, st.out))
        try:
            line = ask(relay.prompt(rank))
        except Headless:
            if handle.debug_mode == "stop":  # debug="always": it waits, for a cell that can ask
                if relay.headless_told < st.seq:
                    print(waiting_line(rank, st.where) + " (this cell cannot ask for input; Stop or Interrupt "
                          "ends the run)", file=sys.stderr, flush=True)
                    relay.headless_told = st.seq
                return
            relay.answer(rank, st.seq, "c")
            print(skipped_line(rank, st.where), file=sys.stderr, flush=True)
            continue
        if line is None:  # Interrupt at the prompt: the run ends, every rank reaped; raises
            handle.end_interrupted()
        if line.strip() in QUIT_COMMANDS:  # before the rank quits: its end is a stop, not a failure
            with handle._lock:
                handle._begin_shutdown("interrupt")
        relay.answer(rank, st.seq, line)


def open_prompt(handle, rank: Optional[int], interrupts_held) -> None:
    """:meth:`RunHandle.debug <nbddp.kernel.handle.RunHandle.debug>`: a background run's prompts in this cell.

    ``interrupts_held`` is :func:`nbddp.kernel.handle.interrupts_held` (the handle imports this module).
    """
    if handle._done.is_set() or not handle._relay.waiting():
        print("nbddp: no rank is waiting at a breakpoint" + (" (the run has ended)" if handle._done.is_set() else ""))
        return
    with interrupts_held() as came:
        serve_prompts(handle, only=rank, interrupted=came)
    if came and not handle._done.is_set():
        handle.end_interrupted()  # an Interrupt while a rank stepped: the run ends, as at the prompt
    if handle._shutdown is not None:  # q ended the run: this cell raises TrainingInterrupted, as a blocking run's
        handle.wait()


def watch_breakpoints(handle) -> None:
    """A rank stopped at a breakpoint: skip it where no one can answer, else say where it waits.

    Args:
        handle: the run's :class:`~nbddp.kernel.handle.RunHandle`, from its watch (:meth:`poll`).
    """
    relay: PromptRelay = handle._relay
    for rank, state in relay.new_stops().items():
        if handle.debug_mode == "skip":
            relay.output(rank)  # pdb's banner is not shown: the prompt never is
            relay.answer(rank, state.seq, "c")
            handle._notice(skipped_line(rank, state.where))
        elif handle._thread is not None:  # a background run: the panel says it, handle.debug() answers
            handle._debug_told = waiting_line(rank, state.where)
            handle._emit("breakpoint", handle._debug_told)
    if handle._debug_told and not relay.waiting() and not relay.stepping():
        handle._debug_told = ""  # the debugger let the ranks go on
        handle._emit("breakpoint", "")


def _stepping(relay: PromptRelay, only: Optional[int]) -> bool:
    """True while a rank answered here is still on its way to its next prompt; shows the output of those done."""
    if relay.stepping(only):
        return True
    for rank in list(relay._answered):
        if only in (None, rank):
            _show(relay.output(rank))
    return False
