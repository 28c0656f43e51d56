"""A sweep's SQLite file: the user's alone, pinned while in use, and plain about locks and damage.

nbddp acts on what a study says: it ends the leftover processes of the runs it names and runs
the parameters queued in it. So ``<runs_dir>/sweeps/<name>/`` must be a folder of the user's that
no one else can write (made 0700 whatever the umask), and ``study.db`` in it a regular file of the
user's with one name (made 0600). Both are checked through descriptors opened without following
a link; a folder that others may write, or that is another user's, is refused with its name and
the fix, and nothing in it is read. A folder of the user's that others could only open (an older
nbddp's, under umask 022) is narrowed to 0700, and a file in it that others may write refused.

A runs folder is often group-writable, so a group member can still rename the sweep's folder
away and put another in its place. SQLite opens by path (and resolves links, so a
``/proc/self/fd/<fd>`` path does not pin a folder), so every connection, and every use of one,
first checks that the folder and the file at the path are the ones checked (device and inode),
and refuses them otherwise.

SQLite waits up to :data:`BUSY_TIMEOUT_S` for a lock another process holds (optuna-dashboard or a
notebook in the middle of a read, another kernel writing): after :data:`SAY_AFTER_S` of that, one
line names the file and the process holding it. A damaged file, or a wait that ran out, raises
:class:`StudyError` naming the file and what to do, not SQLAlchemy's ``DatabaseError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from ..contract import rundir
from ..contract.errors import NbddpError
from ..contract.private import NotPrivate, owner, problem

STUDY_DB = "study.db"
#: How long a statement waits for a lock another process holds (SQLite's busy timeout).
BUSY_TIMEOUT_S = 30.0
#: After this long waiting for a lock, one line says so.
SAY_AFTER_S = 1.0
_WHY = ("nbddp acts on what a sweep's study says (it ends the processes of the runs it names and runs the "
        "parameters queued in it), so the study must be a file only you can write")


class StudyError(NbddpError):
    """A sweep's study file cannot be used: damaged, or locked by another process for too long."""


class StudyFile:
    """``<runs_dir>/sweeps/<name>/study.db``, checked to be the user's alone, made if missing.

    Args:
        runs_dir: the runs folder.
        name: the sweep's name.
        make: ``make(path)`` gives a new, empty file at ``path`` its tables (Optuna's).

    Raises:
        NotPrivate: the folder or file is a link, another user's, or others may write it.
    """

    def __init__(self, runs_dir: os.PathLike, name: str, make: Callable[[Path], None]):
        parent = Path(os.path.realpath(Path(runs_dir) / rundir.SWEEPS))
        parent.mkdir(parents=True, exist_ok=True)  # shared by every sweep of the runs folder: the umask's
        self.folder, self.path = parent / name, parent / name / STUDY_DB
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.folder, 0o700)  # the umask only takes bits away
        try:
            dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise self._refused(self.folder, "is not a folder (a link or a file)") from None
            if exc.errno in (errno.EACCES, errno.EPERM):  # another user's, closed to you: say whose
                found = None
                with contextlib.suppress(OSError):
                    found = problem(os.lstat(self.folder), "folder")
                raise self._refused(self.folder, found or "cannot be opened (permission denied)") from None
            raise
        try:
            self._folder_id, narrowed = self._check_folder(dir_fd)
            self._file_id = self._check_file(dir_fd, make, narrowed)
        finally:
            os.close(dir_fd)

    # -- checks --------------------------------------------------------------------------
    def _refused(self, path: Path, why: str) -> NotPrivate:
        fix = (f"If only you have written to it, `chmod 700 {self.folder}` and call nbddp.sweep again; else move "
               f"{self.folder} aside and start the sweep anew (or give it another name=)"
               if path == self.folder and "written by other users" in why else
               f"Move {path} aside and start the sweep anew, or give it another name=")
        return NotPrivate(f"{path} {why}: {_WHY}. {fix}.")

    def _check_folder(self, dir_fd: int) -> Tuple[Tuple[int, int], bool]:
        st = os.fstat(dir_fd)
        found = problem(st, "folder")
        if found:
            raise self._refused(self.folder, found + (f" (mode {stat.S_IMODE(st.st_mode):o})"
                                                      if "written" in found else ""))
        narrowed = bool(st.st_mode & 0o077)
        if narrowed:  # an older nbddp's, that others could open but not write
            os.fchmod(dir_fd, 0o700)
        return (st.st_dev, st.st_ino), narrowed

    def _check_file(self, dir_fd: int, make: Callable[[Path], None], narrowed: bool) -> Tuple[int, int]:
        for _ in range(200):
            try:
                fd = os.open(STUDY_DB, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                self._make(dir_fd, make)
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._refused(self.path, "is a symbolic link") from None
                raise
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 2 and self._being_made():
                    time.sleep(0.02)  # another kernel links its new study into place: its scratch name goes next
                    continue
                found = _file_problem(st, narrowed)
                if found:
                    raise self._refused(self.path, found)
                if st.st_mode & 0o077:  # in a folder no one else could reach: the user's own file
                    os.fchmod(fd, 0o600)
                return st.st_dev, st.st_ino
            finally:
                os.close(fd)
        raise self._refused(self.path, "keeps having other names (hard links)")

    def _being_made(self) -> bool:
        return any(p.name.startswith(f".{STUDY_DB}{rundir.TMP_MARK}") for p in self.folder.iterdir())

    def _make(self, dir_fd: int, make: Callable[[Path], None]) -> None:
        # Made whole in a file of its own first: Optuna fails when two processes make the tables of
        # one new file at once (two kernels starting one sweep, a notebook reading it as it starts).
        if rundir.create_once(self.path, make, mode=0o600) or os.path.lexists(self.path):
            return
        with contextlib.suppress(FileExistsError):  # no hard links here: Optuna makes the tables in place
            os.close(os.open(STUDY_DB, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=dir_fd))

    def verify(self) -> None:
        """Refuse the folder or file at the path when they are no longer the ones checked.

        Raises:
            NotPrivate: one of them was removed, renamed away or replaced since.
        """
        for path, pinned in ((self.folder, self._folder_id), (self.path, self._file_id)):
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != pinned:
                raise NotPrivate(
                    f"{path} was removed or replaced while the sweep used it (renamed away, another put in its place): "
                    f"{_WHY}, so it is no longer read. Check {self.folder.parent} for what happened, then call "
                    f"nbddp.sweep again.")

    # -- connections ---------------------------------------------------------------------
    def connect(self) -> sqlite3.Connection:
        """A connection to the checked file (SQLAlchemy's ``creator``): checked before and after it opens."""
        self.verify()
        con = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, factory=_Watched, check_same_thread=False)
        con.study_file = self
        try:
            self.verify()  # a swap while SQLite opened it: that file is closed unread
        except BaseException:
            con.close()
            raise
        return con

    def engine_kwargs(self) -> dict:
        return {"creator": self.connect}

    def watch(self, engine) -> None:
        """Check the folder and file each time a pooled connection is taken (every storage call)."""
        from sqlalchemy import event

        event.listen(engine, "checkout", lambda *_: self.verify())

    # -- errors --------------------------------------------------------------------------
    def error(self, exc: BaseException) -> Optional[StudyError]:
        """A :class:`StudyError` naming the file for a database error ``exc`` (SQLAlchemy's, Optuna's), else None."""
        root = _sqlite_error(exc)
        if root is None:
            return None
        text = str(root)
        if isinstance(root, sqlite3.OperationalError) and ("locked" in text or "busy" in text):
            return StudyError(text if str(self.path) in text else _locked_message(self))
        return StudyError(
            f"{self.path} is not a readable Optuna study ({type(root).__name__}: {text}): it is damaged (cut short "
            f"by a full disk, copied while written, overwritten). Move it aside (mv {self.path} "
            f"{self.path}.damaged) and call nbddp.sweep again to start the study anew, or give the sweep another "
            f"name=; the trials' run folders are kept.")


def _file_problem(st: os.stat_result, narrowed: bool) -> Optional[str]:
    """Why ``study.db`` is not the user's alone, or None. Others' write bits count only where others
    could reach it: a folder narrowed just now (SQLite gives a file the umask's mode, 0664 under 002)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if owner(st) != os.getuid():
        return f"is owned by uid {owner(st)}, not by you (uid {os.getuid()})"
    if st.st_nlink > 1:
        return "has other names (hard links)"
    if narrowed and st.st_mode & 0o022:
        return f"may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _sqlite_error(exc: Optional[BaseException]) -> Optional[sqlite3.Error]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        orig = getattr(exc, "orig", None)  # SQLAlchemy's DBAPIError keeps the driver's error there
        if isinstance(orig, sqlite3.Error):
            return orig
        if isinstance(exc, sqlite3.Error):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


# ---------------------------------------------------------------------------- waiting for a lock
def lock_holders(path: Path) -> List[int]:
    """Pids of other processes holding a POSIX lock (SQLite's) on ``path``, from ``/proc/locks``."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->":
            continue  # a waiter, not a holder
        with contextlib.suppress(ValueError):
            major, minor, inode = parts[5].split(":")
            if int(inode) == st.st_ino and (int(major, 16), int(minor, 16)) == (os.major(st.st_dev),
                                                                                os.minor(st.st_dev)):
                pid = int(parts[4])
                if pid > 0 and pid != os.getpid() and pid not in pids:
                    pids.append(pid)
    return pids


def _describe(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return f"pid {pid}"
    import pwd

    with contextlib.suppress(KeyError):
        owner = pwd.getpwuid(owner).pw_name
    command = " ".join(a.decode("utf-8", "replace") for a in args if a)
    command = command if len(command) <= 80 else command[:77] + "..."
    return f"pid {pid} of {owner}: {command}"


def _holders_text(path: Path) -> str:
    pids = lock_holders(path)
    return ("held by " + "; ".join(_describe(p) for p in pids)) if pids else \
        "a notebook or optuna-dashboard in the middle of a read, or another kernel writing it"


def _locked_message(file: StudyFile) -> str:
    return (f"{file.path} stayed locked by another process for {BUSY_TIMEOUT_S:.0f} s "
            f"({_holders_text(file.path)}). Close or end what holds it, then call nbddp.sweep again: the study is "
            "kept.")


class _Waits:
    """Statements waiting on a study's lock, watched by one daemon thread that says so once each."""

    def __init__(self):
        self.now: dict = {}
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def begin(self, key: int, file: StudyFile) -> None:
        self.now[key] = [time.monotonic(), file, False]
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._watch, name="nbddp-study-locks", daemon=True)
                    self._thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            for wait in list(self.now.values()):
                began, file, said = wait
                if not said and time.monotonic() - began >= SAY_AFTER_S:
                    wait[2] = True
                    print(f"nbddp: waiting for {file.path}: another process holds a lock on it "
                          f"({_holders_text(file.path)}); waiting up to {BUSY_TIMEOUT_S:.0f} s", flush=True)


_WAITS = _Waits()


class _Waiting:
    """Around one statement or commit: watched while it runs; a lock that never came is named."""

    __slots__ = ("file", "key")

    def __init__(self, con: "_Watched"):
        self.file, self.key = getattr(con, "study_file", None), threading.get_ident()

    def __enter__(self):
        if self.file is not None:
            _WAITS.begin(self.key, self.file)

    def __exit__(self, kind, exc, tb):
        _WAITS.now.pop(self.key, None)
        if isinstance(exc, sqlite3.OperationalError) and self.file is not None and \
                ("locked" in str(exc) or "busy" in str(exc)):
            raise sqlite3.OperationalError(_locked_message(self.file)) from exc
        return False


class _Watched(sqlite3.Connection):
    """SQLite's connection, each statement and commit watched for a lock wait."""

    def cursor(self, factory=None):
        return super().cursor(factory or _WatchedCursor)

    def commit(self):
        with _Waiting(self):
            return super().commit()


class _WatchedCursor(sqlite3.Cursor):
    def execute(self, sql, parameters=()):
        with _Waiting(self.connection):
            return super().execute(sql, parameters)

    def executemany(self, sql, seq_of_parameters):
        with _Waiting(self.connection):
            return super().executemany(sql, seq_of_parameters)


__all__ = ["StudyFile", "StudyError", "STUDY_DB", "BUSY_TIMEOUT_S", "lock_holders"]
