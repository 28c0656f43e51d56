"""Where is each rank? Every rank's Python stack, on demand and when a run hangs or fails.

Each rank registers ``faulthandler`` on :data:`~nbddp.contract.protocol.STACK_SIGNAL`, writing every
thread's stack to ``logs/rank<r>.stacks.log`` (``nbddp.rank.process.stacks_on_signal``). The kernel sends
the signal, reads what each file gained and names, per rank, the innermost frame of the code
that trains (the worker's own, or nbddp's engine for the built-in worker) and the collective it
waits in, if any: "rank 1 is in `load_batch` (my_worker.py:42); rank 0 is in `train`
(my_worker.py:30), waiting in `all_reduce`".

``faulthandler`` rather than py-spy: it is in the standard library (nothing to install on a GPU
server), needs no ptrace permission (often denied in containers and by Yama), answers from a C
signal handler even while the rank waits in a collective or native code, and costs nothing until
asked. py-spy would add native frames; the Python frames are what a user's fix needs.

Kernel side.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..contract import rundir, statedir
from ..contract.paths import PathLike
from ..contract.protocol import STACK_SIGNAL
from ..contract.system import parent_pids

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>.+)$')

#: The functions of torch (and nbddp's way to them) a rank is in while it meets the others.
_MEETING = {"init_process_group", "rendezvous", "_store_based_barrier", "_create_c10d_store",
            "_new_process_group_helper", "_create_gloo_process_group", "_env_rendezvous_handler",
            "_tcp_rendezvous_handler", "_file_rendezvous_handler", "init_device_mesh"}

#: torch.utils.cpp_extension's functions a rank is in while an extension is built.
_BUILDING = {"_jit_compile", "_write_ninja_file_and_build_library", "_run_ninja_build", "_build_extension_module"}

# nbddp's own plumbing between the launcher and the worker: never "where the rank is".
_PLUMBING = {"runtime.py", "calls.py", "heartbeat.py", "dist.py", "elastic.py", "cells.py", "protocol.py"}
_NBDDP_DIR = str(Path(__file__).resolve().parent.parent)  # the package, every folder
_LIBRARY_DIRS = tuple({os.path.realpath(p) for p in (sysconfig.get_paths().get("stdlib"),
                                                   sysconfig.get_paths().get("platstdlib"),
                                                   sysconfig.get_paths().get("purelib"),
                                                   sysconfig.get_paths().get("platlib")) if p})


def _cell_name(path: str) -> Optional[str]:
    """``"Cell In[5]"`` for the code file IPython made of a cell this kernel ran, else None.

    A cell's function keeps the file name IPython compiled it under (``/tmp/ipykernel_<pid>/<hash>.py``),
    which means nothing to its user; the kernel that reports knows which cell it was, as its
    own tracebacks show. Outside IPython nothing is imported and nothing changes."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    try:
        label = name_of(path) if name_of is not None else None
    except Exception:  # noqa: BLE001 - an IPython without this API: the plain file name
        return None
    return f"{label[0]} {label[1]}" if label else None


@dataclass(frozen=True)
class Frame:
    """One line of a stack: ``file``, ``line`` and ``function``."""

    file: str
    line: int
    function: str

    def short(self) -> str:
        """```load_batch` (my_worker.py:42)``; a function from a notebook cell as IPython names it,
        ```train` (Cell In[5], line 12)``."""
        return f"`{self.function}` ({self.place()})"

    def place(self) -> str:
        """``my_worker.py:42``; a line of a notebook cell as IPython names it, ``Cell In[5], line 12``."""
        cell = _cell_name(self.file)
        return f"{cell}, line {self.line}" if cell else f"{Path(self.file).name}:{self.line}"

    @property
    def in_library(self) -> bool:
        """Python's, torch's or another installed package's, or nbddp's plumbing: not the training code."""
        if self.file.startswith("<"):  # <string>, <frozen ...>: a launcher's -c code or the import system
            return _cell_name(self.file) is None  # terminal IPython names its cells <ipython-input-...>
        path = os.path.realpath(self.file)
        if path.startswith(_NBDDP_DIR + os.sep):
            return Path(path).name in _PLUMBING
        return ("site-packages" in path or "dist-packages" in path
                or any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS))


@dataclass
class RankStack:
    """One rank's stacks as ``faulthandler`` wrote them.

    Attributes:
        rank: the rank.
        threads: every thread's frames, innermost first (the rank's main thread is ``main``).
        text: what the rank wrote.
        raised: the frames are those of an exception the rank raised itself (its error record's),
            not of a rank waiting: it waits in no collective.
    """

    rank: int
    threads: List[List[Frame]] = field(default_factory=list)
    text: str = ""
    raised: bool = False
    state: Optional[str] = None  # its heartbeat's state when asked ("starting", "running"...), if read

    @property
    def meeting(self) -> bool:
        """The rank is making its process group: it waits for the other ranks (the rendezvous)."""
        return any(f.function in _MEETING and f.in_library for f in self.main)

    @property
    def building(self) -> bool:
        """The rank waits for a C++ extension's build (``torch.utils.cpp_extension.load``: DeepSpeed's
        ops, a custom kernel), which takes minutes the first time and a moment once it is cached."""
        return any(f.function in _BUILDING and f.file.replace(os.sep, "/").endswith("torch/utils/cpp_extension.py")
                   for f in self.main)

    @property
    def before_code(self) -> bool:
        """The rank has not reached the code it runs: nbddp's or Python's start of a process only."""
        if self.code_frame is not None:
            return False
        return self.state == "starting" or not any(f.function in ("entry", "run_rank") for f in self.main)

    @property
    def main(self) -> List[Frame]:
        """The thread that runs the worker: the one that entered nbddp's rank entry (else the oldest)."""
        for frames in self.threads:
            if any(f.function in ("entry", "run_rank") and Path(f.file).name == "runtime.py" for f in frames):
                return frames
        return self.threads[-1] if self.threads else []

    @property
    def code_frame(self) -> Optional[Frame]:
        """The innermost frame of the training code (the worker's, or nbddp's engine)."""
        return next((f for f in self.main if not f.in_library), None)

    @property
    def waiting_in(self) -> Optional[str]:
        """The ``torch.distributed`` operation the rank waits in (``"all_reduce"``), if any."""
        if self.raised:  # torch raised in its own code (a bad argument): no wait
            return None
        for f in self.main:
            if "torch/distributed" in f.file.replace(os.sep, "/") and f.function not in ("wrapper", "<lambda>"):
                return f.function
            if not f.in_library:
                return None
        return None

    def where(self) -> str:
        """``"rank 1 is in `load_batch` (my_worker.py:42), waiting in `all_reduce`"``; ``"rank 0 raised
        in `main` (train.py:30)"`` for a rank that raised."""
        return f"rank {self.rank} {self.where_words()}"

    def where_words(self) -> str:
        """:meth:`where` without the rank: ``"is in `load_batch` (my_worker.py:42)"``."""
        if not self.threads:
            return "did not answer"
        frame = self.code_frame or (self.main[0] if self.main else None)
        if frame is None:
            return "has no Python frame"
        waiting = self.waiting_in
        return f"{'raised in' if self.raised else 'is in'} {frame.short()}" + (
            f", waiting in `{waiting}`" if waiting else "")


class Stacks(Dict[int, RankStack]):
    """Every answering rank's :class:`RankStack`, by rank; printed, it says where each rank is."""

    def summary(self) -> str:
        """One line: where each rank is."""
        return "; ".join(self[r].where() for r in sorted(self))

    def __str__(self) -> str:
        parts = [self.summary()]
        for r in sorted(self):
            frames = self[r].main[:8]
            parts.append(f"rank {r}:" + "".join(f"\n    {f.short()}" for f in frames))
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"Stacks({self.summary()})"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython: the readable form
        p.text(str(self))


_TRACEBACK_FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+), in (?P<function>.+)$')


def from_traceback(rank: int, text: str, raised: bool = False) -> RankStack:
    """Rank ``rank``'s stack as a Python traceback left it (a rank that raised has no stack to
    ask for any more: its error record's traceback says where it was), innermost first.

    ``raised``: the rank raised an error of its own there (not one of a collective that failed or
    timed out while it waited): it is not said to wait in the ``torch.distributed`` call that raised."""
    frames = [Frame(m["file"], int(m["line"]), m["function"].strip())
              for m in map(_TRACEBACK_FRAME.match, text.splitlines()) if m]
    return RankStack(rank, [frames[::-1]] if frames else [], text, raised=raised)


def parse(text: str) -> List[List[Frame]]:
    """``faulthandler``'s dump as a list of threads, each a list of frames, innermost first."""
    threads: List[List[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
            continue
        m = _FRAME.match(line)
        if m and threads:
            threads[-1].append(Frame(m["file"], int(m["line"]), m["function"].strip()))
    return threads


def collect(run_dir: PathLike, pids: Dict[int, int], timeout: float = 3.0) -> Stacks:
    """Ask the ranks ``{rank: pid}`` for their stacks and read them (those that answer within ``timeout`` s)."""
    paths = {r: rundir.stacks_log(run_dir, r) for r in pids}
    start = {r: _size(p) for r, p in paths.items()}
    asked = {}
    for r, pid in pids.items():
        try:
            os.kill(pid, STACK_SIGNAL)
            asked[r] = pid
        except (ProcessLookupError, PermissionError):
            continue
    deadline, seen, settled_at = time.time() + timeout, dict(start), {}
    while asked and time.time() < deadline:
        time.sleep(0.05)
        for r in asked:
            size = _size(paths[r])
            if size != seen[r]:
                seen[r], settled_at[r] = size, time.time() + 0.15  # still writing: look again
        if all(r in settled_at and time.time() >= settled_at[r] for r in asked):
            break
    stacks = Stacks()
    for r in asked:
        text = _read_from(paths[r], start[r])
        stacks[r] = RankStack(r, parse(text), text)
    return stacks


def build_folders(pid: int) -> List[str]:
    """The folders ninja builds in among ``pid``'s descendants: one per C++ extension being built
    (``<extensions root>/<name>``, torch's layout), read from ``/proc`` (the user's own processes)."""
    parents = parent_pids()
    below, found = {pid}, []
    for _ in range(8):  # the rank, its shell or python, ninja, the compilers: a few levels
        below |= {child for child, parent in parents.items() if parent in below}
    for child in sorted(below - {pid}):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                program = os.path.basename(f.read().split(b"\0", 1)[0].decode(errors="replace"))
            if program == "ninja":
                found.append(os.readlink(f"/proc/{child}/cwd"))
        except OSError:
            continue
    return sorted(set(found))


def building_words(stacks: "Stacks", pids: Dict[int, int]) -> str:
    """``"rank 0 is building the C++ extension `cpu_adam` (in /home/u/.cache/torch_extensions/py311_cu124/cpu_adam)"``
    for the ranks that wait for a build, ranks alike together; ``""`` when none does."""
    parts = []
    for r in sorted(stacks):
        if not stacks[r].building:
            continue
        folders = build_folders(pids[r]) if r in pids else []
        what = ", ".join(f"`{Path(f).name}` (in {f})" for f in folders) or "its code loads (torch.utils.cpp_extension)"
        parts.append(f"rank {r} is building the C++ extension{'s' if len(folders) > 1 else ''} {what}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------- NCCL's flight recorder
#: Where each rank's dump goes: this prefix and the rank (``torch.distributed``'s naming).
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"


def flight_recorder_env(run_dir: PathLike) -> Dict[str, str]:
    """The variables that keep each NCCL rank's last collectives and dump them on a watchdog timeout,
    into the run's private folder (both names torch has used for the dump's path)."""
    prefix = str(rundir.state_dir(run_dir).absolute() / FLIGHT_RECORDER_PREFIX)
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


class _PlainOnly(pickle.Unpickler):
    def find_class(self, module, name):  # the dump is dicts, lists and strings: no object is ever built
        raise pickle.UnpicklingError(f"refusing {module}.{name} in a flight recorder dump")


def last_collectives(run_dir: PathLike, world_size: int) -> Dict[int, str]:
    """Each rank's last collective as NCCL's flight recorder dumped it: ``"all_reduce #12 (started)"``.

    Only a dump in the run's private state folder that is provably the user's is read, through the
    folder the kernel holds open (:mod:`nbddp.contract.statedir`), and nothing but plain containers is unpickled.
    """
    found = {}
    for r in range(world_size):
        try:
            dump = _PlainOnly(io.BytesIO(statedir.read(run_dir, f"{FLIGHT_RECORDER_PREFIX}{r}"))).load()
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):  # NotPrivate is an OSError
            continue
        entries = dump.get("entries") if isinstance(dump, dict) else None
        if not entries or not isinstance(entries[-1], dict):
            continue
        last = entries[-1]
        name = str(last.get("profiling_name") or last.get("frames") or "a collective").removeprefix("nccl:")
        seq = last.get("collective_seq_id")
        state = last.get("state")
        found[r] = f"{name}" + (f" #{seq}" if seq is not None else "") + (f" ({state})" if state else "")
    return found


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(256 * 1024).decode("utf-8", "replace")
    except OSError:
        return ""


__all__ = ["Frame", "RankStack", "Stacks", "parse", "from_traceback", "collect", "flight_recorder_env", "last_collectives",
           "build_folders", "building_words",
           "FLIGHT_RECORDER_PREFIX"]
