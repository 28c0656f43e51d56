"""A debugger relayed between a rank and the notebook: the files that carry it, written and read here.

A rank at a breakpoint (:mod:`nbddp.rank.debugger`) runs ``pdb`` with its input and output bound
to files in the run's private state folder (``.nbddp/``, the user's alone, held open by the kernel
and the ranks for the run's life: every file below is read and written through that descriptor,
so renaming ``.nbddp`` and putting a folder of one's own in its place answers no prompt;
:mod:`nbddp.contract.statedir`):

- ``debug.rank<r>.out``: everything pdb prints, appended;
- ``debug.rank<r>.json``: the rank's :class:`DebugState`, rewritten atomically: at the prompt
  (with the prompt's number, where it stopped and how much output precedes it), stepping, or done;
- ``debug.rank<r>.in``: the kernel's answer to prompt number ``seq`` (:class:`DebugAnswer`);
- ``debug.release.<n>``: rank ``r`` left its ``n``-th ``ctx.breakpoint`` (``c`` or ``q``): the
  ranks that wait there go on.

Files work for every kind of target (a torchrun script has no nbddp store in its ranks), and no
rank ever waits in a collective for the person at the prompt.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from . import rundir, statedir

#: Set by ``spawn_train`` in the ranks: a kernel relays their breakpoints (else a breakpoint is skipped).
RELAY_ENV = "NBDDP_DEBUG_RELAY"
#: What ``breakpoint()`` calls in the ranks of a ``debug=True`` launch.
BREAKPOINT_HOOK = "nbddp.rank.debugger.set_trace"  # PYTHONBREAKPOINT names it with dots only
#: The prompt the notebook shows, ``(Pdb) [rank 1] ``.
PROMPT = "(Pdb) [rank {rank}] "


@dataclass
class DebugState:
    """Where a rank's debugger is.

    Attributes:
        rank: the rank.
        state: ``prompt`` (waiting for a command), ``running`` (stepping) or ``done`` (continued, quit).
        seq: the number of the prompt (counts up within the rank's life).
        where: ``file.py:42``, the line it stopped at.
        out: bytes of ``debug.rank<r>.out`` written before this prompt.
    """

    rank: int
    state: str
    seq: int = 0
    where: str = ""
    out: int = 0

    def write(self, run_dir: rundir.PathLike) -> None:
        statedir.write_json(run_dir, state_path(run_dir, self.rank).name, asdict(self))

    @classmethod
    def read(cls, run_dir: rundir.PathLike, rank: int) -> Optional["DebugState"]:
        obj = statedir.read_json(run_dir, state_path(run_dir, rank).name)
        if not isinstance(obj, dict):
            return None
        try:
            return cls(**{k: obj[k] for k in ("rank", "state", "seq", "where", "out") if k in obj})
        except TypeError:
            return None


@dataclass
class DebugAnswer:
    """The notebook's command for prompt ``seq`` of a rank (``c``, ``p x``, ...)."""

    seq: int
    line: str

    def write(self, run_dir: rundir.PathLike, rank: int) -> None:
        statedir.write_json(run_dir, answer_path(run_dir, rank).name, asdict(self))

    @classmethod
    def read(cls, run_dir: rundir.PathLike, rank: int, seq: int) -> Optional["DebugAnswer"]:
        """The answer to prompt ``seq``, or None while there is none (an older answer is not this one's)."""
        obj = statedir.read_json(run_dir, answer_path(run_dir, rank).name)
        if not isinstance(obj, dict) or obj.get("seq") != seq or not isinstance(obj.get("line"), str):
            return None
        return cls(seq, obj["line"])


def output_path(run_dir: rundir.PathLike, rank: int) -> Path:
    return rundir.state_path(run_dir, f"debug.rank{rank}.out")


def open_output(run_dir: rundir.PathLike, rank: int, append: bool = False):
    """The rank's pdb output file (binary), appended to (created 0600) by the rank or read by the kernel."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND if append else os.O_RDONLY
    return statedir.open_file(run_dir, output_path(run_dir, rank).name, flags)


def state_path(run_dir: rundir.PathLike, rank: int) -> Path:
    return rundir.state_path(run_dir, f"debug.rank{rank}.json")


def answer_path(run_dir: rundir.PathLike, rank: int) -> Path:
    return rundir.state_path(run_dir, f"debug.rank{rank}.in")


def sources_path(run_dir: rundir.PathLike) -> Path:
    """The source of notebook cells the run's code came from, for pdb's ``l`` in a rank (no cell is a file there)."""
    return rundir.state_path(run_dir, "cell-sources.json")


def keep_sources(run_dir: rundir.PathLike, sources: dict) -> None:
    """Write ``{file name: text}`` of cells (kernel side, at the launch of a cell's function)."""
    statedir.write_json(run_dir, sources_path(run_dir).name, sources)


def read_sources(run_dir: rundir.PathLike) -> dict:
    obj = statedir.read_json(run_dir, sources_path(run_dir).name)
    return {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(obj, dict) else {}


def release_path(run_dir: rundir.PathLike, number: int) -> Path:
    return rundir.state_path(run_dir, f"debug.release.{number}")


def mark_released(run_dir: rundir.PathLike, number: int) -> None:
    """Rank ``r`` left its ``number``-th ``ctx.breakpoint``: the ranks waiting there go on."""
    statedir.write_json(run_dir, release_path(run_dir, number).name, {"pid": os.getpid()})


def is_released(run_dir: rundir.PathLike, number: int) -> bool:
    return statedir.exists(run_dir, release_path(run_dir, number).name)


def ranks_at_prompt(run_dir: rundir.PathLike, world_size: int) -> dict:
    """``{rank: DebugState}`` of the ranks whose debugger waits for a command now."""
    found = {}
    for rank in range(world_size):
        st = DebugState.read(run_dir, rank)
        if st is not None and st.state == "prompt":
            found[rank] = st
    return found


def clear(run_dir: rundir.PathLike) -> None:
    """Remove a launch's debugger files (a restart or resume starts with none)."""
    for name in statedir.names(run_dir):
        if name.startswith("debug."):
            try:
                statedir.unlink(run_dir, name)
            except OSError:
                pass
