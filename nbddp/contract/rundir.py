"""The run folder: what it holds, who writes it, and how every file in it is written.

Every run gets one folder, ``<runs_dir>/<YYYYmmdd-HHMMSS>-<name>`` (then ``-2``, ``-3``... for
runs of the same name started in the same second). This module is its contract: no other
module spells a file name of it. What is in a run folder, and who writes it::

    config.json              the TrainConfig (built-in worker)   kernel at launch; rank 0 under torchrun
    metrics.jsonl            one JSON line per ctx.log           rank 0 (runtime.Context.log)
    class_indices.json       {"0": class name, ...}              rank 0 of the built-in worker
    val_predictions.json     the final validation predictions    rank 0 of the built-in worker
    sweep.json               a sweep's trial: sweep, study, trial, params   the kernel (nbddp.sweep), at launch
    logs/rank<r>.log         stdout and stderr of rank r         rank r (rank.logs.redirect_output); 0600, logs/ 0700
    logs/spawned<i>.log      stdout and stderr of process i a    that process (rank.spawned); 0600
                             launcher script started itself
    checkpoints/<name>.pt    last.pt, best.pt (weights-only)     rank 0 (built-in worker, ctx.save_checkpoint)
    export/                  model.pth, model.safetensors,       export_weights (built-in worker, export_run)
                             class_indices.json, meta.json
    tensorboard/             TensorBoard event files             rank 0
    .nbddp/                  the launch's working state (0700, its files 0600; nbddp.contract.statedir):
        launch.json          pids, start times, store, temp folder ...  the kernel (launch, handle)
        rank<r>.json         heartbeat: state, epoch, step, progress    rank r, every second and per step
        tree-rank<r>.json    rank r's descendants: pid, start time      rank r (reaper.TreeRecorder)
        error.rank<r>.json   rank r's error: type, message, traceback   rank r (or the kernel, from torch's error file)
        progress.json        live progress for the notebook             rank 0, at most 5 times a second
        result.pkl           rank 0's return value (removed once read)  rank 0
        result.rank<r>.pkl   rank r's, with spawn_train(all_values=True) rank r
        stop                 the stop request                           the kernel (Stop, handle.stop())
        debug.*              a rank's debugger relay (contract.debugging) the rank and the kernel

Each launch opens ``.nbddp/`` once and both sides keep it open for the run's life: every state
file is read and written through that descriptor, never found by name again (a group member
may rename things in a shared run folder; :mod:`nbddp.contract.statedir` says how).

Every file is replaced atomically (a temp file in the same folder, then ``os.replace``), so a
reader sees the old file or the new one, never half of one. Files that must survive a power
cut (checkpoints, exports, config, class names) are also fsynced; state records that are
rewritten several times per step (heartbeats, progress) use :class:`RecordFile` instead.
This module owns the names; what the ``.nbddp/`` records hold, and their one writer and one
reader each, is :mod:`nbddp.contract.protocol`'s.

This module imports nothing from torch and nothing from the rest of nbddp but ``paths``:
both sides of a launch (the kernel and the workers) share it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import glob
import json
import os
import re
import secrets
import stat
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, Union

from . import statedir
from .paths import PathLike
from .private import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, NotPrivate, open_private_file, open_yours, private_folder
from .private import _aside, problem
from .private import read_private as _read_private
from .statedir import STATE_DIR, TMP_MARK

# ---------------------------------------------------------------------------- names
CONFIG = "config.json"
METRICS = "metrics.jsonl"
CLASS_INDICES = "class_indices.json"
VAL_PREDICTIONS = "val_predictions.json"
#: A trial of ``nbddp.sweep``: the sweep's name, its study file, the trial's number and params.
SWEEP = "sweep.json"
#: Where ``nbddp.sweep`` keeps its studies: ``<runs_dir>/sweeps/<name>/`` (``study.db``, ``tensorboard/``).
SWEEPS = "sweeps"
#: A function from a notebook cell, as source: what ran, readable and runnable as a file.
WORKER_SOURCE = "worker_source.py"
LOGS = "logs"
CHECKPOINTS = "checkpoints"
CHECKPOINT_SUFFIX = ".pt"
LAST, BEST = "last", "best"
#: Where run folders go unless a launch says otherwise (relative to the working directory).
RUNS_DIR = "runs"
EXPORT = "export"
TENSORBOARD = "tensorboard"
LAUNCH_RECORD = "launch.json"
PROGRESS = "progress.json"
RESULT = "result.pkl"
STOP = "stop"
PROFILE = "profile"  # Chrome traces and their summaries (spawn_train(profile=...))
TRACKERS = "trackers.json"  # the tracker runs this run folder logs into (spawn_train(trackers=...))

# The export folder (also used on its own, copied out of the run).
EXPORT_PTH = "model.pth"
EXPORT_SAFETENSORS = "model.safetensors"
EXPORT_META = "meta.json"
EXPORT_FILES = (EXPORT_PTH, EXPORT_SAFETENSORS, CLASS_INDICES, EXPORT_META)
#: The deployable pair beside them (``nbddp.export_onnx``): the graph, its weights beyond 2 GB, and the
#: recipe that prepares an image for it. Written after the weights, into the same folder; a new export
#: of the weights replaces the folder whole, so a graph of older weights never stays beside newer ones.
EXPORT_ONNX = "model.onnx"
EXPORT_PREPROCESSING = "preprocessing.json"
EXPORT_DEPLOY_FILES = (EXPORT_ONNX, EXPORT_ONNX + ".data", EXPORT_PREPROCESSING)

#: Run names go into folder names, ``#SBATCH --job-name`` lines and shell commands, so they are
#: kept to characters that mean nothing to a shell, a path or Slurm: ASCII letters, digits and
#: ``._-``, not starting with ``.`` (hidden) or ``-`` (read as an option).
NAME_MAX = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
NAME_RULE = (f"must be 1-{NAME_MAX} characters of ASCII letters, digits and ._- (not starting with "
             "'.' or '-'), since it names the run folder and goes into generated shell commands")

#: What the logs folder holds, for messages about it.
RUN_LOGS = "the run's logs (every rank's output)"
_RANK_LOG = re.compile(r"rank\d+\.log|spawned\d+(-\d+)?\.log")
#: Folder names given to runs: ``<YYYYmmdd-HHMMSS>-<name>``, then ``-2``, ``-3``...
_STAMPED_RUN = re.compile(r"(\d{8}-\d{6})-(.+?)(?:-(\d+))?\Z")


def name_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot name a run (see :data:`NAME_RULE`), or ``None`` when it can."""
    if not isinstance(name, str) or not 1 <= len(name) <= NAME_MAX or not _NAME_RE.match(name):
        return NAME_RULE
    return None


def config_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / CONFIG


def worker_source_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / WORKER_SOURCE


def sweep_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / SWEEP


def sweep_dir(runs_dir: PathLike, name: str) -> Path:
    """The folder of the sweep ``name``: its study (``study.db``) and its TensorBoard trials."""
    return Path(runs_dir) / SWEEPS / name


def metrics_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / METRICS


def class_indices_path(folder: PathLike) -> Path:
    """``class_indices.json`` in a run folder or an export folder."""
    return Path(folder) / CLASS_INDICES


def val_predictions_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / VAL_PREDICTIONS


def logs_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / LOGS


def rank_log(run_dir: PathLike, rank: int) -> Path:
    return logs_dir(run_dir) / f"rank{rank}.log"


def spawned_log(run_dir: PathLike, index: int, group: int = 0) -> Path:
    """The log of process ``index`` that a launcher script started itself (:mod:`nbddp.rank.spawned`);
    ``group`` numbers a start made while an earlier one still runs (``join=False``)."""
    return logs_dir(run_dir) / (f"spawned{index}.log" if group == 0 else f"spawned{index}-{group}.log")


def log_sizes(run_dir: PathLike, world_size: int) -> Dict[int, int]:
    """Each rank's log size now (0 for none): where a launch's own lines start in the appended logs."""
    sizes = {}
    for rank in range(world_size):
        try:
            sizes[rank] = rank_log(run_dir, rank).stat().st_size
        except OSError:
            sizes[rank] = 0
    return sizes


def stacks_log(run_dir: PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes its Python stacks when asked (``nbddp.kernel.stacks``)."""
    return logs_dir(run_dir) / f"rank{rank}.stacks.log"


def is_rank_log(path: PathLike, run_dir: PathLike) -> bool:
    """True if ``path`` is (textually) one of ``run_dir``'s rank logs (or of the processes a launcher script started)."""
    path = Path(path)
    return bool(_RANK_LOG.fullmatch(path.name)) and path.parent.name == LOGS and str(path.parent.parent) == str(run_dir)


def checkpoints_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_path(run_dir: PathLike, name: str = LAST) -> Path:
    """``checkpoints/<name>.pt``: ``last`` (the newest), ``best`` (the best epoch) or a worker's own name."""
    return checkpoints_dir(run_dir) / f"{name}{CHECKPOINT_SUFFIX}"


def checkpoint_names(run_dir: PathLike) -> List[str]:
    """Names of the checkpoints a run folder holds, sorted (empty if none): ``.pt`` files and the
    ``.dcp`` folders of checkpoints that hold modules and optimizers (sharded, one file per rank)."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted([p.name for p in folder.glob(f"*{CHECKPOINT_SUFFIX}")]
                  + [p.name for p in folder.glob("*.dcp") if p.is_dir() and not p.name.startswith(".")])


def run_dir_of_checkpoint(path: PathLike) -> Path:
    """The run folder of ``.../checkpoints/<name>.pt``, or ``path`` itself if it is not one."""
    path = Path(path)
    if path.suffix == CHECKPOINT_SUFFIX and path.parent.name == CHECKPOINTS:
        return path.parent.parent
    return path


def export_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / EXPORT


def tensorboard_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / TENSORBOARD


def profile_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / PROFILE


def profile_trace_path(run_dir: PathLike, rank: int, window: int = 0) -> Path:
    """Rank ``rank``'s Chrome trace of profiler window ``window`` (Perfetto, TensorBoard's profiler view)."""
    return profile_dir(run_dir) / (f"rank{rank}.pt.trace.json.gz" if not window else
                                   f"rank{rank}.{window}.pt.trace.json.gz")


def profile_summary_path(run_dir: PathLike, rank: int) -> Path:
    return profile_dir(run_dir) / f"rank{rank}.summary.json"


def memory_snapshot_path(run_dir: PathLike, rank: int) -> Path:
    """Rank ``rank``'s CUDA allocator history at an out-of-memory error (pytorch.org/memory_viz opens it)."""
    return profile_dir(run_dir) / f"rank{rank}.memory.pickle"


def trackers_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / TRACKERS


def state_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / STATE_DIR


def state_path(run_dir: PathLike, name: str) -> Path:
    return state_dir(run_dir) / name


def launch_record_path(run_dir: PathLike) -> Path:
    return state_path(run_dir, LAUNCH_RECORD)


def heartbeat_path(run_dir: PathLike, rank: int) -> Path:
    return state_path(run_dir, f"rank{rank}.json")


def tree_record_path(run_dir: PathLike, rank: int) -> Path:
    """Rank ``rank``'s descendants, ``{pid: start time}`` (:class:`nbddp.rank.reaper.TreeRecorder`)."""
    return state_path(run_dir, f"tree-rank{rank}.json")


def error_record_path(run_dir: PathLike, rank: int) -> Path:
    return state_path(run_dir, f"error.rank{rank}.json")


def spawned_error_path(run_dir: PathLike, index: int, group: int = 0) -> Path:
    """What process ``index`` that a launcher script started raised (:mod:`nbddp.rank.spawned`), for the launcher."""
    return state_path(run_dir, f"error.spawned{index}.json" if group == 0 else f"error.spawned{index}-{group}.json")


def progress_path(run_dir: PathLike) -> Path:
    return state_path(run_dir, PROGRESS)


def result_path(run_dir: PathLike, rank: int = 0) -> Path:
    """Rank 0's return value in ``result.pkl``; another rank's (``all_values``) in ``result.rank<r>.pkl``."""
    return state_path(run_dir, RESULT if rank == 0 else f"result.rank{rank}.pkl")


def stop_path(run_dir: PathLike) -> Path:
    return state_path(run_dir, STOP)


def checkpoint_note_path(run_dir: PathLike) -> Path:
    return state_path(run_dir, "checkpoint.json")


# ---------------------------------------------------------------------------- the private state folder
#: ``.nbddp/`` and its files are the user's alone, whatever the umask: results are unpickled
#: from there, and a run folder may sit in a group-writable project folder (see :mod:`nbddp.contract.statedir`).
_STATE_IS_PRIVATE = "nbddp reads its launch state only from a private .nbddp folder of your own"


def is_state_dir(folder: PathLike) -> bool:
    return Path(folder).name == STATE_DIR


def make_state_dir(run_dir: PathLike) -> Path:
    """Make ``.nbddp/`` a folder of the user's alone (0700), keeping what is in one that is; for tools
    and tests (a launch opens it and holds it, :func:`nbddp.contract.statedir.fresh`).

    One that is a link, not a folder, another user's or that others may write is never narrowed
    (what was planted stays planted): it is moved aside, unread, with a warning, and made anew.
    """
    return statedir.ensure(run_dir)


def read_private(path: PathLike) -> bytes:
    """The bytes of a file in ``.nbddp/`` (or a launch's temp folder), read only if the file and its
    folder are provably the user's (:mod:`nbddp.contract.statedir`, :func:`nbddp.contract.private.read_private`).

    Raises:
        NotPrivate: the folder or file is a link, another user's, or writable by others.
        FileNotFoundError: there is no such file.
    """
    path = Path(path)
    if is_state_dir(path.parent):  # through the run's pinned state folder, when this process holds one
        return statedir.read(path.parent.parent, path.name)
    return _read_private(path, _STATE_IS_PRIVATE)


# ---------------------------------------------------------------------------- the ranks' temp folder
#: A launch's private temp folder is ``<system temp>/nbddp-XXXXXXXX`` (mkdtemp: 0700), holding a
#: file that names the run folder it was made for: cleanup removes no other.
TMP_PREFIX, TMP_OWNER = "nbddp-", ".nbddp-run"


def claim_tmp(folder: PathLike, run_dir: PathLike) -> None:
    """Write into a new temp folder which run folder it belongs to (0600, never through a link)."""
    fd = os.open(Path(folder) / TMP_OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(os.path.realpath(run_dir))


def is_tmp_of(folder: PathLike, run_dir: PathLike) -> bool:
    """True when ``folder`` is a temp folder a launch of ``run_dir`` made: ``nbddp-*`` directly in the
    system temp folder, a private folder (0700) of the user's, whose own file names ``run_dir``."""
    import tempfile  # here: the ranks import this module and never need it

    folder = Path(folder)
    if not folder.name.startswith(TMP_PREFIX) or \
            os.path.realpath(folder.parent) != os.path.realpath(tempfile.gettempdir()):
        return False
    try:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o777 != PRIVATE_DIR_MODE:
            return False
        return read_private(folder / TMP_OWNER).decode("utf-8", "replace") == os.path.realpath(run_dir)
    except (OSError, NotPrivate):
        return False


# ---------------------------------------------------------------------------- atomic writes


def _open_temp(path: Path, mode: int = 0o666) -> tuple[int, Path]:
    """Create ``.<name>.tmp-<pid>-<token>`` next to ``path``; returns (fd, temp path)."""
    for _ in range(100):
        # The pid lets cleanup_temp_files tell a crashed writer's leftover from a live write;
        # the token keeps two threads of one process apart.
        tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            # O_EXCL: never write through a file (or symlink) someone else created; mode 0o666
            # minus the umask gives the same permissions as a plain open(), unlike mkstemp's 0o600,
            # except in the launch's private state folder, whose files are the user's alone.
            mode = PRIVATE_FILE_MODE if is_state_dir(path.parent) else mode
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "could not create a unique temporary file", str(path))


def fsync_dir(folder: Path) -> None:
    # The rename is only durable once the directory entry is on disk. Some platforms (Windows)
    # and file systems cannot open or fsync a directory: the file itself is already synced.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: PathLike, data: Union[bytes, Callable[[BinaryIO], None]], durable: bool = True,
                 mode: int = 0o666) -> Path:
    """Write ``data`` (bytes, or a function that writes to a binary file) to ``path`` atomically.

    The data goes to ``.<name>.tmp-<pid>-<token>`` in the same folder, then is renamed over
    ``path`` with ``os.replace``; with ``durable`` the file and the folder are fsynced too. On
    any exception (KeyboardInterrupt included) the temp file is removed, the exception
    propagates and the previous file at ``path`` is untouched. Missing parent folders are created.
    ``mode`` is the new file's, less the umask (``0o600``: the user's alone whatever the umask).
    """
    path = Path(path)
    if is_state_dir(path.parent) and not callable(data):  # through the run's pinned state folder
        statedir.write(path.parent.parent, path.name, data, durable)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _open_temp(path, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def create_once(path: PathLike, make: Callable[[Path], None], mode: int = 0o644) -> bool:
    """Make ``path`` if it is missing, never half made in place; True if this call made it.

    ``make`` builds the file at a temp path beside ``path`` (``.<name>.tmp-<pid>-<token>``, ``mode``
    less the umask, as SQLite makes its files), which is then hard-linked into place: the link
    fails if another process linked its own first, and then that file is kept and this one
    dropped. For databases whose tables the first opener makes (an Optuna study, MLflow's store):
    two processes making the tables of one new SQLite file at once fail, and can leave it
    unusable. Where the folder is missing, or its file system has no hard links (FAT, some FUSE
    and SMB mounts), nothing is made and False returned: the caller opens ``path`` as it would
    have. A dead writer's leftover temp file of ``path`` is removed first.
    """
    path = Path(path)
    if path.exists() or not path.parent.is_dir():
        return False
    for leftover in path.parent.glob(f".{glob.escape(path.name)}{TMP_MARK}*"):
        if not temp_writer_alive(leftover):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    fd, tmp = _open_temp(path, mode)
    os.close(fd)  # an empty file is an empty SQLite database
    try:
        make(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False  # another process made it first: its file is the one
        except OSError:
            return False  # no hard links here: the caller makes it in place, as it would have
        return True
    finally:
        for scratch in (tmp, tmp.with_name(tmp.name + "-journal")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(scratch)


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically and durably."""
    return atomic_write(path, text.encode("utf-8"))


def write_json_atomic(path: PathLike, obj: Any, durable: bool = False, mode: int = 0o666) -> Path:
    """``obj`` as JSON, replaced atomically (not fsynced unless ``durable``: state records)."""
    return atomic_write(path, json.dumps(obj).encode(), durable=durable, mode=mode)


#: The mode of a file of the run folder that nbddp reads back (``metrics.jsonl``), less the umask:
#: never group-writable, whatever the umask (a group member could otherwise write its records).
OWN_FILE_MODE = 0o644


def open_run_folder(run_dir: Path) -> int:
    """``run_dir`` opened: the parent of the state folder this process holds open for it, whatever the
    run folder is named now (a link put in place of its name leads elsewhere), else by its name."""
    state = statedir.pinned(run_dir)
    if state is not None and state.fd is not None:
        with contextlib.suppress(OSError):  # released meanwhile: by its name
            return os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=state.fd)
    return os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


#: The state record naming the ``metrics.jsonl`` this run's launches made (its inode): a file of the
#: user's moved to that name from another run is not this run's, however private it is.
METRICS_ID = "metrics-file.json"


def _made_here(path: Path) -> Optional[int]:
    """The inode of the file the run's launches made at ``path`` (``metrics.jsonl``), or None if none is recorded."""
    if path.name != METRICS:
        return None
    value = statedir.read_json(path.parent, METRICS_ID)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _this_one(want: Optional[int]) -> Callable[[int], Optional[str]]:
    def usable(fd: int) -> Optional[str]:
        if want is not None and os.fstat(fd).st_ino == want:
            return None
        return ("is not the file this run's ranks made (another was moved or made at its name since: anyone who "
                "may write the run folder can), so nothing in it is used")
    return usable


def _make_own(folder: int, path: Path, what: str) -> int:
    """``path`` made anew in the open run folder (``O_EXCL``, :data:`OWN_FILE_MODE`), what was at its name
    moved aside unread with a warning, and its inode recorded in the run's private state; the inode."""
    for _ in range(5):
        try:
            fd = os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, OWN_FILE_MODE,
                         dir_fd=folder)
        except FileExistsError:
            found = _not_made_here(folder, path.name, None)
            with contextlib.suppress(FileNotFoundError):
                aside = _aside(path, folder)
                warnings.warn(f"{path} {found}, so {what} were not written into it: it was moved to {aside.name} "
                              f"(nothing in it was read) and a new file was made in its place.", stacklevel=4)
            continue
        ino = os.fstat(fd).st_ino
        os.close(fd)
        statedir.write_json(path.parent, METRICS_ID, ino)
        return ino
    raise NotPrivate(f"{path} keeps being replaced by a file that is not yours alone: {what} cannot be written there.")


def _not_made_here(folder: int, name: str, want: Optional[int]) -> Optional[str]:
    """Why ``name`` in the open run folder is not the file the run's ranks made (inode ``want``), or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return "is gone"
        with contextlib.suppress(OSError):
            return problem(os.lstat(name, dir_fd=folder), "file") or "is not a regular file"
        return "is not a regular file"
    try:
        st = os.fstat(fd)
        if want is not None and st.st_ino == want:
            return problem(st, "file")
        return problem(st, "file") or "was not made by this run's ranks (no record of it in the run's private state)"
    finally:
        os.close(fd)


def open_own(path: PathLike, what: str) -> int:
    """An appending descriptor of ``path``, a file of the run folder that nbddp reads back (``metrics.jsonl``).

    The file is the one this run's ranks made: created ``O_EXCL`` (:data:`OWN_FILE_MODE`) in the run
    folder the launch uses (:func:`open_run_folder`), its inode recorded in the run's private state,
    and opened again (a resumed run appends) only while it is that very file, a regular file of the
    user's with one name that no one else may write, checked on the descriptor
    (:func:`nbddp.contract.private.open_yours`). A link a group member put at its name would take the
    writes into any file of the user's elsewhere, a file others may write may hold their records, and
    another run's file of the user's moved there would take this run's records and give its own:
    whatever else is there is moved aside, unread, with a warning, and a new file made.

    Raises:
        NotPrivate: another user keeps replacing it.
    """
    path = Path(path)
    want = _made_here(path)
    folder = open_run_folder(path.parent)
    try:
        if want is None or _not_made_here(folder, path.name, want) is not None:
            want = _make_own(folder, path, what)
        return open_yours(folder, path.name, path, what, flags=os.O_WRONLY | os.O_APPEND, mode=OWN_FILE_MODE,
                          narrow="keep", usable=_this_one(want), replace=False)
    finally:
        os.close(folder)


def read_own(path: PathLike) -> Optional[int]:
    """A read descriptor of ``path`` if it is, on that descriptor, a regular file of the user's with one
    name that no one else may write, and the very file the run's ranks made (:func:`open_own`: its inode
    recorded); None if it is missing, not recorded yet, or is not."""
    path = Path(path)
    usable = _this_one(_made_here(path))
    try:
        folder = open_run_folder(path.parent)
    except OSError:
        return None
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    finally:
        os.close(folder)
    if problem(os.fstat(fd), "file") is not None or usable(fd) is not None:
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd


def read_json(path: PathLike) -> Optional[Any]:
    """The JSON in ``path``, or None if it is missing, unreadable or (being rewritten) invalid."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def temp_writer_alive(tmp: Path) -> bool:
    """True when the pid in a temp file's name is a running process on this machine."""
    pid_text = tmp.name.rpartition(TMP_MARK)[2].split("-", 1)[0]
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return True  # another thread of this process may be writing it right now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # PermissionError: it exists but belongs to another user; leave it alone
    return True


def cleanup_temp_files(folder: PathLike, recursive: bool = True) -> List[Path]:
    """Remove ``.*.tmp-*`` files left by a writer that died between write and rename.

    Temp files whose writer pid is still running on this machine are kept: removing them would
    make that writer's ``os.replace`` fail.

    Args:
        folder: a run folder (or any folder); a missing folder is not an error.
        recursive: also look in sub-folders (``export/``...).

    Returns:
        The paths removed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    pattern = f".*{TMP_MARK}*"
    removed = []
    for tmp in sorted(folder.rglob(pattern) if recursive else folder.glob(pattern)):
        if not tmp.is_file() or temp_writer_alive(tmp):
            continue
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed


class RecordFile:
    """A small JSON record that readers poll, rewritten in place (heartbeats, live progress).

    The first write is atomic (temp file, rename), so the file never exists half-written; later
    writes are one ``pwrite`` over the whole record, padded with spaces to the longest record so
    far. A rename over an existing file costs ~1 ms on ext4 (it flushes the data first), and
    these records are written several times per training step. Readers that catch a torn read
    get invalid JSON and keep their previous value.
    """

    def __init__(self, path: Path, size: int = 512):
        self.path, self.size = Path(path), size
        self._fd: Optional[int] = None

    def write(self, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.size = max(self.size, len(data))
        data = data.ljust(self.size)
        if self._fd is None:
            atomic_write(self.path, data, durable=False)
            self._fd = os.open(self.path, os.O_WRONLY)
        else:
            os.pwrite(self._fd, data, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------- records
#: What an earlier launch of the run left in ``.nbddp/`` that is its own (heartbeats, process
#: records, errors, results, the stop request, the debugger's files, NCCL's flight-recorder dumps):
#: removed unread when the run is launched again. The launch record, the last checkpoint's note
#: and records that must last (tracker ids, the data record's digest) stay.
_PER_LAUNCH = re.compile(r"(rank|tree-rank|error\.rank)\d+\.json|error\.spawned\d+(-\d+)?\.json|progress\.json|result(\.rank\d+)?\.pkl|stop"
                         r"|debug\..*|cell-sources\.json|nccl_trace_rank_\d+")

def read_launch_record(run_dir: PathLike, strict: bool = False) -> Dict[str, Any]:
    """The launch record (pids, start times, port, temp folder, started/ended), or ``{}`` if there is none.

    Read through the run's state folder (:mod:`nbddp.contract.statedir`): pids to signal and
    folders to remove are taken from no one else's record, and from no state folder that belongs
    to another run folder (moved here). One that is not provably this run's own counts as none,
    or, with ``strict``, raises :class:`NotPrivate`.
    """
    try:
        record = json.loads(statedir.read(run_dir, LAUNCH_RECORD))
    except NotPrivate:
        if strict:
            raise
        return {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def update_launch_record(run_dir: PathLike, **fields: Any) -> None:
    """Merge ``fields`` into the launch record; best effort (a vanished folder is no error)."""
    record = read_launch_record(run_dir)
    record.update(fields)
    with contextlib.suppress(OSError):
        # 0600: it names the processes and the TCP store of a run (env:// launches), the user's alone.
        statedir.write_json(run_dir, LAUNCH_RECORD, record)


def prepare_launch(run_dir: PathLike, world_size: int, restart: bool = False) -> None:
    """Make the state folder and the logs folder a launch writes into.

    The first launch of a run opens its state folder (made, or found the run folder's own and
    private, less an earlier launch's records; else moved aside) and holds it open until the run
    ends (:func:`nbddp.contract.statedir.fresh`); a restart keeps it, less the last launch's end state.
    The logs folder is the user's alone (``0700``, whatever the umask): ranks print paths,
    hosts and whatever their libraries log there. A logs folder or a rank's log that is not the
    user's (another user replaced it in a group-writable run folder) is moved aside with a
    warning and made anew, so the warning shows in the cell before any rank writes.

    Raises:
        NotPrivate: another user keeps replacing the run's ``.nbddp`` folder.
    """
    if not restart or statedir.pinned(run_dir) is None:
        statedir.fresh(run_dir, lambda name: bool(_PER_LAUNCH.fullmatch(name)))
    else:
        for name in [STOP, PROGRESS, *[n for r in range(world_size) for n in (
                error_record_path(run_dir, r).name, result_path(run_dir, r).name)]]:
            with contextlib.suppress(OSError):
                statedir.unlink(run_dir, name)
    private_folder(logs_dir(run_dir), RUN_LOGS, replace=True)
    for log in (p for r in range(world_size) for p in (rank_log(run_dir, r), stacks_log(run_dir, r))):
        if os.path.lexists(log):  # a resumed run's: checked (and narrowed) before any rank appends
            os.close(open_private_file(log, RUN_LOGS))


def class_indices(classes: Sequence[str]) -> Dict[str, str]:
    """``{"0": name0, "1": name1, ...}``, the reference script's ``class_indices.json``."""
    return {str(i): name for i, name in enumerate(classes)}


def write_class_indices(folder: PathLike, classes: Sequence[str]) -> Path:
    """Write ``class_indices.json`` into a run or export folder, atomically."""
    return atomic_write_text(class_indices_path(folder), json.dumps(class_indices(classes), indent=4) + "\n")


def read_class_indices(folder: PathLike) -> Optional[List[str]]:
    """Class names in index order from ``folder``'s ``class_indices.json``; None if it has none.

    Raises:
        ValueError: the file is there but is not ``{"0": name, ...}`` with indices 0..n-1.
    """
    path = class_indices_path(folder)
    if not path.is_file():
        return None
    mapping = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(mapping, dict) or sorted(mapping, key=lambda k: int(k)) != [str(i) for i in range(len(mapping))]:
        raise ValueError(f"{path} is not {{\"0\": name, \"1\": name, ...}}")
    return [mapping[str(i)] for i in range(len(mapping))]


# ---------------------------------------------------------------------------- run folders
def new_run_dir(runs_dir: PathLike, name: str) -> Path:
    """Create ``runs_dir/<YYYYmmdd-HHMMSS>-<name>`` (``-2``, ``-3``... if taken) and return it, absolute."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(runs_dir).resolve() / f"{stamp}-{name}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def recorded_name(run_dir: PathLike) -> Optional[str]:
    """The ``name`` in the run's ``config.json``, or None."""
    config = read_json(config_path(run_dir))
    name = config.get("name") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def is_run_of(run_dir: Path, name: str) -> bool:
    """The run's own config names it ``name``; without a config, its folder name must match exactly."""
    recorded = recorded_name(run_dir)
    if recorded is not None:
        return recorded == name
    return re.fullmatch(r"\d{8}-\d{6}-" + re.escape(name) + r"(-\d+)?", run_dir.name) is not None


def run_started(run_dir: Path) -> tuple:
    """Sort key: when the run was last launched, from its own records, newest last.

    The launch record's ``started`` (spawn_train), else the time config.json was written (every
    launch writes it, torchrun/srun ones too), else the time stamp in the folder name; the
    same-second counter ``-N`` breaks ties. Folder times are not used: copying, exporting or
    writing a file into a run changes them.
    """
    m = _STAMPED_RUN.match(run_dir.name)
    counter = int(m.group(3)) if m and m.group(3) else 1
    with contextlib.suppress(ValueError, TypeError, KeyError):
        return (float(read_launch_record(run_dir)["started"]), counter, run_dir.name)
    with contextlib.suppress(OSError):
        return (config_path(run_dir).stat().st_mtime, counter, run_dir.name)
    if m:
        with contextlib.suppress(ValueError):
            return (datetime.datetime.strptime(m.group(1), "%Y%m%d-%H%M%S").timestamp(), counter, run_dir.name)
    with contextlib.suppress(OSError):
        return (checkpoint_path(run_dir).stat().st_mtime, counter, run_dir.name)
    return (0.0, counter, run_dir.name)


def _own_folder(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def newest_run(runs_dir: PathLike, name: str, checkpoint: Optional[str] = LAST) -> Optional[Path]:
    """The most recently launched run named ``name`` in ``runs_dir`` that holds ``checkpoints/<checkpoint>.pt``
    (any checkpoint when ``checkpoint`` is None); only folders the user owns are considered."""
    runs_dir = Path(runs_dir)

    def holds(p: Path) -> bool:
        return checkpoint_path(p, checkpoint).is_file() if checkpoint else bool(checkpoint_names(p))

    # Listing, not glob: a name is matched as text, never as a pattern. Only the user's own
    # folders (not links): a run another user planted in a shared runs folder is never resumed.
    folders = [p for p in runs_dir.iterdir() if _own_folder(p)] if runs_dir.is_dir() else []
    candidates = [p for p in folders if holds(p) and is_run_of(p, name)]
    return max(candidates, key=run_started) if candidates else None


__all__ = [
    "CONFIG", "METRICS", "SWEEP", "SWEEPS", "sweep_path", "sweep_dir", "CLASS_INDICES", "VAL_PREDICTIONS", "LOGS",
    "CHECKPOINTS", "LAST", "BEST", "EXPORT",
    "TENSORBOARD", "STATE_DIR", "RUNS_DIR", "EXPORT_FILES", "RecordFile", "atomic_write", "atomic_write_text",
    "write_json_atomic", "read_json", "cleanup_temp_files", "new_run_dir", "newest_run", "NotPrivate",
    "make_state_dir", "read_private",
]
