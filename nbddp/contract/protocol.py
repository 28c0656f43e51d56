"""What crosses between the kernel and the ranks: the launch contract and every record after it.

Each record is a typed dataclass with exactly one writer and one reader; :mod:`nbddp.contract.rundir`
owns where the files are, this module what they hold::

    record          file (.nbddp/)       written by                        read by
    LaunchSpec      (pickled to a rank)  the kernel (launch)               the rank (runtime.entry)
    Heartbeat       rank<r>.json         rank r: HeartbeatWriter           kernel: read_heartbeats
    Progress        progress.json        rank 0: ProgressWriter            kernel: read_progress
    stop request    stop                 kernel: write_stop_request        ranks: read_stop_request
    ErrorRecord     error.rank<r>.json   rank r: ErrorRecord.write         kernel: read_error_records
                                         (or the kernel, from torch's error file: adopt_torch_error_file)
    result          result[.rank<r>].pkl rank r: write_result              kernel: take_result (read, removed)

``.nbddp/`` is the user's alone (0700, files 0600), opened by each launch and held open by the
kernel and the ranks for the run's life: every record here is read and written through that
descriptor (:mod:`nbddp.contract.statedir`), and read only when, checked on its own descriptor,
it is the user's and no one else may write it. A rename of ``.nbddp`` in a shared run folder
changes nothing.

The JSON records' readers never raise on a record that is missing, being rewritten or from an
older nbddp: a missing record is ``None`` (or absent from the mapping) and a missing field takes
its default. Not here: ``metrics.jsonl``, free-form lines the worker logs (``Context.log``) and
the handle tails, and ``launch.json``, which only kernels read and write (:mod:`nbddp.contract.rundir`).

Shared by both sides: imports nothing of nbddp but ``rundir`` and ``paths``, and nothing of torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from . import rundir, statedir
from .paths import PathLike


# ---------------------------------------------------------------------------- the launch
@dataclass(frozen=True)
class LaunchSpec:
    """What each spawned process receives (picklable plain values)."""

    target: str
    args: tuple
    kwargs: dict
    world_size: int
    backend: str
    gpus: tuple
    store_host: str
    store_port: Optional[int]  # the kernel's TCPStore on loopback (env:// launches), else None
    run_dir: str
    parent_pid: Optional[int]  # None: started by a forkserver (the parent is the server)
    threads: int
    timeout_s: float
    env: dict = field(default_factory=dict)  # set in the child: a forkserver's children do not
                                             # inherit the kernel's environment of the moment
    kernel: Optional[tuple] = None  # (pid, start time) of the launching process, watched
    state_id: Optional[tuple] = None  # (device, inode) of the run's state folder the kernel made (statedir.pin)
    all_values: bool = False  # every rank stores its return value, not rank 0 alone
    call: str = "ctx"  # how the rank calls the target (nbddp.rank.calls): ctx, mp.spawn, torchrun
    argv: tuple = ()  # a script's command-line arguments (sys.argv[1:])
    payload: Optional[bytes] = None  # a function from a notebook cell, pickled by value
    cwd: Optional[str] = None  # the kernel's working directory at the launch
    master_port: Optional[int] = None  # MASTER_PORT the ranks see (the TCP store's, or a free port)
    store_path: Optional[str] = None  # the private FileStore nbddp's own group meets in (nbddp.kernel.rendezvous)
    # spawn_train(profile=..., trackers=...): {"profile": ProfileOptions, "trackers": TrackerPlan,
    # "by_optimizer": the schedule follows optimizer steps (the built-in worker)} (nbddp.contract.observe)
    observe: Optional[dict] = None


#: A rank's entry, named (``module:function``) so that the launcher hands it to the ranks
#: without importing the rank side into the kernel.
RANK_ENTRY = "nbddp.rank.runtime:entry"


def start_rank(local_rank: int, spec: LaunchSpec) -> None:
    """The function each started process runs: imports :data:`RANK_ENTRY` there and calls it.

    ``torch.multiprocessing`` pickles this function by name; the rank, not the kernel, imports
    the rank side (already in memory when the process forked from the warm server).
    """
    import importlib

    module, _, name = RANK_ENTRY.partition(":")
    getattr(importlib.import_module(module), name)(local_rank, spec)


def _from_json(cls, obj: Any, **defaults: Any):
    """An instance of dataclass ``cls`` from a JSON object: unknown keys ignored, missing ones defaulted."""
    if not isinstance(obj, dict):
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    values = {**defaults, **{k: v for k, v in obj.items() if k in names}}
    try:
        return cls(**values)
    except TypeError:  # a required field is missing: not a record of this kind
        return None


# ---------------------------------------------------------------------------- heartbeat
_PHASES = {"train": 0, "eval": 1, "eval-end": 2}


@dataclass
class Heartbeat:
    """Where one rank is and whether it is alive, rewritten per step and every second.

    Attributes:
        rank: the rank.
        pid: its process id.
        state: ``starting``, ``running``, ``finishing``, ``done`` or ``failed``.
        epoch, step, phase: where training is (``phase``: ``train``, ``eval``, ``eval-end``).
        waiting: about to wait for the other ranks in a collective.
        progress_time: when the rank last made progress (a hung rank's stays old).
        beat_time: when this record was written (the thread writes it even inside a collective).
        stopping: the rank has seen the stop request.
        writing: a checkpoint is being written in the background (a failure's shutdown lets it end).
    """

    rank: int
    pid: Optional[int] = None
    state: str = "starting"
    epoch: Optional[int] = None
    step: Optional[int] = None
    phase: Optional[str] = "train"
    waiting: bool = False
    progress_time: Optional[float] = None
    beat_time: Optional[float] = None
    stopping: bool = False
    writing: bool = False

    @property
    def position(self) -> tuple:
        """How far the rank got, comparable between ranks: (epoch, phase, step, waiting).

        Evaluation comes after the epoch's training steps, and its end (where ranks with shards
        of different sizes wait for each other) after every evaluation step; ``waiting`` (about
        to wait for the others in a collective) comes after the local work of the same step.
        """
        return (self.epoch if self.epoch is not None else -1, _PHASES.get(self.phase or "train", 0),
                self.step if self.step is not None else -1, bool(self.waiting))


def where_words(epoch: Optional[int], step: Optional[int]) -> str:
    """``"epoch 2, step 5"``, ``"step 5"``, ``"epoch 2"`` or ``""``: what a rank reported of where it is
    (a worker of one's own may report a step and no epoch)."""
    return ", ".join(f"{name} {value}" for name, value in (("epoch", epoch), ("step", step)) if value is not None)


class HeartbeatWriter:
    """Rank ``rank``'s heartbeat file (the one writer of :class:`Heartbeat`)."""

    def __init__(self, run_dir: PathLike, rank: int):
        self._file = statedir.Record(run_dir, rundir.heartbeat_path(run_dir, rank).name)

    def write(self, beat: Heartbeat) -> None:
        self._file.write(dataclasses.asdict(beat))

    def close(self) -> None:
        self._file.close()


def read_heartbeats(run_dir: PathLike, world_size: int) -> Dict[int, Heartbeat]:
    """Every rank's last heartbeat, by rank (ranks without a readable one are left out)."""
    return _per_rank(Heartbeat, rundir.heartbeat_path, run_dir, world_size)


def _per_rank(cls, path_of: Callable[[PathLike, int], Path], run_dir: PathLike, world_size: int) -> Dict[int, Any]:
    """Each rank's record of type ``cls`` from ``path_of(run_dir, rank)``; unreadable ones left out."""
    found = {}
    for r in range(world_size):
        record = _from_json(cls, statedir.read_json(run_dir, path_of(run_dir, r).name), rank=r)
        if record is not None:
            found[r] = record
    return found


# ---------------------------------------------------------------------------- restarts
#: Which restart of its run a rank belongs to (``"0"``: the first launch), and how many the run may make.
RESTART_ENV = "NBDDP_RESTART_COUNT"
MAX_RESTARTS_ENV = "NBDDP_MAX_RESTARTS"


# ---------------------------------------------------------------------------- stacks
#: The signal that makes a rank write every thread's Python stack to its ``rank<r>.stacks.log``
#: (``faulthandler``, in C: it answers even while the rank waits in a collective or native code).
STACK_SIGNAL = signal.SIGUSR2


# ---------------------------------------------------------------------------- checkpoints
@dataclass
class CheckpointNote:
    """The newest checkpoint the ranks agreed was written: where a restart continues from.

    Attributes:
        name: its file in the run folder (``"checkpoints/last.pt"``).
        epoch, step: where training was (``step`` ``None``: at the end of the epoch).
        time: when it was written.
    """

    name: str
    epoch: Optional[int] = None
    step: Optional[int] = None
    time: float = 0.0

    def write(self, run_dir: PathLike) -> None:
        """Rank 0 notes it; best effort (the checkpoint itself is what counts)."""
        with contextlib.suppress(OSError):
            statedir.write_json(run_dir, rundir.checkpoint_note_path(run_dir).name, dataclasses.asdict(self))

    def where(self) -> str:
        """``"checkpoints/last.pt (epoch 1, step 2)"``."""
        at = ", ".join(f"{k} {v}" for k, v in (("epoch", self.epoch), ("step", self.step)) if v is not None)
        return f"{self.name} ({at})" if at else self.name


def note_checkpoint(run_dir: PathLike, path: PathLike, epoch: Optional[int], step: Optional[int]) -> None:
    """Note that checkpoint ``path`` of the run was written at ``epoch``/``step``."""
    path = Path(path)
    CheckpointNote(f"{path.parent.name}/{path.name}", epoch, step, time.time()).write(run_dir)


def read_checkpoint_note(run_dir: PathLike) -> Optional[CheckpointNote]:
    return _from_json(CheckpointNote, statedir.read_json(run_dir, rundir.checkpoint_note_path(run_dir).name))


# ---------------------------------------------------------------------------- progress
@dataclass
class Progress:
    """Rank 0's live progress for the notebook: what the worker passed to ``ctx.progress``.

    Attributes:
        fields: the worker's own fields (epoch, step, total, loss...), JSON values.
        time: when it was reported.
    """

    fields: Dict[str, Any]
    time: float

    def as_dict(self) -> dict:
        """The fields and ``time`` in one flat dict: the file's form, and what the panel is given."""
        return {**self.fields, "time": round(self.time, 3)}


class ProgressWriter:
    """The run's progress file (the one writer of :class:`Progress`; rank 0 only)."""

    def __init__(self, run_dir: PathLike):
        self._file = statedir.Record(run_dir, rundir.PROGRESS)

    def write(self, progress: Progress) -> None:
        self._file.write(progress.as_dict())

    def close(self) -> None:
        self._file.close()


def read_progress(run_dir: PathLike) -> Optional[Progress]:
    """The last progress rank 0 reported, or None (none yet, or caught mid-rewrite)."""
    obj = statedir.read_json(run_dir, rundir.PROGRESS)
    if not isinstance(obj, dict) or not obj:
        return None
    fields = dict(obj)
    stamp = fields.pop("time", None)
    return Progress(fields, float(stamp) if isinstance(stamp, (int, float)) else 0.0)


# ---------------------------------------------------------------------------- stop request
#: Why the kernel asks the ranks to stop: the Stop button or ``handle.stop()``, Jupyter's
#: Interrupt, another rank's failure, or a sweep's pruner (``nbddp.sweep``: the trial is not promising).
STOP_REASONS = ("stop", "interrupt", "failure", "pruned")


def write_stop_request(run_dir: PathLike, reason: str) -> None:
    """Ask every rank to stop, for ``reason`` (one of :data:`STOP_REASONS`); best effort.

    Written atomically: a rank never reads a request without its reason.
    """
    if reason not in STOP_REASONS:
        raise ValueError(f"stop reason {reason!r}: use one of {', '.join(STOP_REASONS)}")
    with contextlib.suppress(OSError):
        statedir.write(run_dir, rundir.STOP, reason.encode())


def read_stop_request(run_dir: PathLike) -> Optional[str]:
    """The reason the kernel asked this run to stop, or None if it has not.

    A request whose reason is unreadable (written by hand, say) reads as ``"stop"``.
    """
    try:
        text = statedir.read(run_dir, rundir.STOP).decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except statedir.NotPrivate:
        return None  # not the kernel's: a request only it can write is one
    except (OSError, ValueError):
        return "stop"
    return text if text in STOP_REASONS else "stop"


def clear_stop_request(run_dir: PathLike) -> None:
    """Remove the request once the run has ended (the folder may be launched again: resume)."""
    with contextlib.suppress(OSError):
        statedir.unlink(run_dir, rundir.STOP)


# ---------------------------------------------------------------------------- error record
@dataclass
class ErrorRecord:
    """The exception that ended one rank, written before it exits.

    Attributes:
        rank, pid: the rank and its process.
        time: when it failed (the earliest primary error is the likeliest cause).
        type, message, traceback: the exception.
        epoch, step: where training was.
        secondary: a consequence of another rank's failure (its peer vanished, a timeout).
        root_rank: the rank the exception itself names as the cause (a NaN seen on another rank).
        retryable: a restart may heal it (``nbddp.rank.rank_errors.is_retryable``).
        process: the rank is a launcher script and one of the processes it started failed
            (:mod:`nbddp.rank.spawned`): ``{"name": "process 1 of 2 (work)", "log": "spawned1.log",
            "pid": 123}``; ``type``, ``message`` and ``traceback`` are then that process's.
    """

    rank: int
    pid: Optional[int] = None
    time: float = 0.0
    type: str = "Exception"
    message: str = ""
    traceback: str = ""
    epoch: Optional[int] = None
    step: Optional[int] = None
    secondary: bool = False
    root_rank: Optional[int] = None
    retryable: bool = False
    process: Optional[Dict[str, Any]] = None

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int, formatted: str, secondary: bool,
                       epoch: Optional[int] = None, step: Optional[int] = None,
                       retryable: bool = False) -> "ErrorRecord":
        """The record of ``exc`` (``formatted``: its traceback as text)."""
        root = getattr(exc, "rank", None)
        return cls(rank=rank, pid=os.getpid(), time=time.time(), type=type(exc).__name__, message=str(exc),
                   traceback=formatted, epoch=epoch, step=step, secondary=bool(secondary),
                   root_rank=root if isinstance(root, int) and not isinstance(root, bool) else None,
                   retryable=bool(retryable))

    @property
    def first_line(self) -> str:
        return self.message.splitlines()[0] if self.message else ""

    def write(self, run_dir: PathLike) -> None:
        """Store it as rank ``rank``'s error record; best effort (a full disk must not hide the error)."""
        with contextlib.suppress(OSError):
            statedir.write_json(run_dir, rundir.error_record_path(run_dir, self.rank).name, dataclasses.asdict(self))


def read_error_records(run_dir: PathLike, world_size: int) -> Dict[int, ErrorRecord]:
    """Every rank's error record, by rank (ranks that wrote none are left out)."""
    return _per_rank(ErrorRecord, rundir.error_record_path, run_dir, world_size)


class _StringsOnly(pickle.Unpickler):
    def find_class(self, module, name):  # a traceback is a plain str: no object is ever built
        raise pickle.UnpicklingError(f"refusing {module}.{name} in a torch error file")


def read_torch_traceback(path: str) -> Optional[str]:
    """The traceback string torch's spawn wrapper pickled, if the file is ours and holds one.

    The file sits in the launch's private temp folder (``nbddp.kernel.ranks.private_tmp``); even so,
    only a regular file owned by this user is read (opened without following a link, checked on
    its descriptor), and nothing but a string is unpickled.
    """
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return None
            text = _StringsOnly(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError):
        return None
    return text if isinstance(text, str) else None


def exception_from_traceback(text: str) -> tuple:
    """``(type name, message)`` from a formatted traceback's closing lines."""
    lines = text.rstrip().splitlines()
    last_frame = max((i for i, ln in enumerate(lines) if ln.startswith("  ")), default=-1)
    tail = "\n".join(lines[last_frame + 1:]) or (lines[-1] if lines else "")
    kind, sep, message = tail.partition(": ")
    if not sep or " " in kind.strip():
        return "Exception", tail.strip()
    return kind.strip().rpartition(".")[2], message.strip()


def adopt_torch_error_file(run_dir: PathLike, rank: int, pid: int, path: Optional[str]) -> None:
    """A failure before nbddp's own error handling (torch's ``_wrap`` caught it) becomes a record.

    torch writes such a traceback to a ``pytorch-errorfile-*.pickle`` in the temp folder, which
    only its own ``join()`` reads. It becomes the rank's error record unless the rank wrote one
    itself, so the notebook quotes the original exception.
    """
    if not path or statedir.exists(run_dir, rundir.error_record_path(run_dir, rank).name):
        return
    text = read_torch_traceback(path)
    if text is None:
        return
    kind, message = exception_from_traceback(text)
    ErrorRecord(rank=rank, pid=pid, time=time.time(), type=kind, message=message, traceback=text).write(run_dir)


# ---------------------------------------------------------------------------- result
def write_result(run_dir: PathLike, value: Any, rank: int = 0) -> None:
    """Store a rank's return value (pickled; read back only by the kernel that launched it)."""
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"rank {rank}'s return value ({type(value).__name__}) cannot be pickled: {exc}. "
            "Return plain values, tensors or dicts of them."
        ) from exc
    statedir.write(run_dir, rundir.result_path(run_dir, rank).name, data)


def has_result(run_dir: PathLike, rank: int = 0) -> bool:
    """The rank returned (and stored its value)."""
    return statedir.exists(run_dir, rundir.result_path(run_dir, rank).name)


def read_result(run_dir: PathLike, rank: int = 0) -> Any:
    """A rank's return value, as the launching kernel's own workers wrote it.

    Unpickling runs code, so the file is read only if it is provably the user's: a regular file
    (no link followed) of the user's with one name that no one else may write, in the run's
    private state folder (the one this process holds open for the run, else ``.nbddp`` checked:
    the user's, writable by no one else); see :mod:`nbddp.contract.statedir`.

    Raises:
        nbddp.contract.rundir.NotPrivate: the file or its folder is not provably the user's.
    """
    return pickle.loads(statedir.read(run_dir, rundir.result_path(run_dir, rank).name))


def take_result(run_dir: PathLike, rank: int = 0) -> Any:
    """:func:`read_result`, then the file removed: the value lives on in the kernel, and a large
    one (a model's weights, a dataset's predictions) would otherwise fill the run folder for good.
    A file that could not be read stays, for the user to look at."""
    value = read_result(run_dir, rank)
    statedir.unlink(run_dir, rundir.result_path(run_dir, rank).name)
    return value
