"""The run's private state folder, ``<run>/.nbddp``: opened once per launch and pinned by descriptor.

The rule (docs/reliability.md, "What nbddp reads back"): everything nbddp reads back and acts on
is in a place only you can write, or checked to be yours and writable by no one else at the moment
it is read, through the descriptor it reads. A run folder may sit in a group-writable project
folder, where a group member can rename anything in it: ``.nbddp`` away, and a folder of the
run's she may write (``tensorboard/``) into its place. So the state folder is never found by its
name twice while a run uses it:

- the kernel opens it at each launch (:func:`fresh`) with ``O_DIRECTORY|O_NOFOLLOW`` and keeps the
  descriptor for the run's life. It must be a folder of the user's that no one else may write and
  that belongs to this run folder: a new one (0700) records the run folder's inode in it
  (:data:`OWNER`), and a folder renamed in from another run names that one. An earlier launch's
  records are removed unread; what must last between launches (tracker ids, the data record's
  digest) stays. Anything else in its place (a link, another user's, one others may write,
  another run's) is moved aside unread, with a warning, and a new folder made. Never narrowed:
  what was planted while others could write stays planted, whatever the mode becomes;
- the ranks get its identity (device, inode) in their launch spec, a channel from the kernel and
  not the folder, open ``.nbddp`` once and refuse it unless it is that very folder (:func:`pin`);
- in both, every read and write of state goes through that descriptor (``dir_fd=``): renaming
  ``.nbddp`` and putting another folder in its place, even a private one of another of the user's
  runs, changes nothing for the run. The kernel says so at the run's end;
- anywhere else (``nbddp.cleanup``, a finished run read from another kernel, ranks under torchrun)
  the folder is opened and checked for each access (:func:`opened`): the user's, not a link,
  writable by no one else, not another run folder's;
- a file is read only if, checked on its open descriptor, it is a regular file of the user's with
  one name that no one else may write (:func:`nbddp.contract.private.problem`).

Used on both sides (kernel and ranks): imports only the standard library and ``private``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import threading
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple, Union

from .private import PRIVATE_FILE_MODE, NotPrivate, check, open_yours

STATE_DIR = ".nbddp"
#: The temp files of atomic writes: ``.<name>.tmp-<pid>-<token>`` (``rundir.cleanup_temp_files`` knows them).
TMP_MARK = ".tmp-"
#: The file that says which run folder a state folder belongs to: the run folder's inode (a rename
#: keeps it; a folder moved in from another run names that one).
OWNER = "run-folder"
#: Why the state folder must be private, for messages.
WHY = "nbddp reads a run's state only from the private .nbddp folder its launch made"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Identity = Tuple[int, int]
PathLike = Union[str, "os.PathLike[str]"]


class StateDir:
    """One open state folder; every operation names a file in it and goes through its descriptor.

    Thread-safe: the descriptor is used under a lock, and after :meth:`close` an operation fails
    with an ``OSError`` (as a missing folder would) instead of reaching whatever reused the number.
    """

    def __init__(self, fd: int, path: str):
        st = os.fstat(fd)
        self.fd: Optional[int] = fd
        self.path = path
        self.identity: Identity = (st.st_dev, st.st_ino)
        self._lock = threading.RLock()

    def _dir(self) -> int:
        if self.fd is None:
            raise FileNotFoundError(errno.EBADF, "the run's state folder was released", self.path)
        return self.fd

    def _where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self, name: str, flags: int, mode: int = PRIVATE_FILE_MODE) -> int:
        """A descriptor of ``name`` opened in the folder (no link followed, non-blocking: a FIFO
        cannot hang it), checked as the file rule says (created ``mode``, 0600, whatever the umask)."""
        with self._lock:
            try:
                fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=self._dir())
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO, a folder: say which
                    check(os.lstat(name, dir_fd=self._dir()), Path(self._where(name)), "file", WHY)
                raise
        try:
            check(os.fstat(fd), Path(self._where(name)), "file", WHY)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, name: str) -> bytes:
        """The bytes of ``name``, checked on its descriptor.

        Raises:
            NotPrivate: it is a link, not a regular file, another user's, has other names, or
                others may write it.
            FileNotFoundError: there is none (or the folder was released).
        """
        with os.fdopen(self.open(name, os.O_RDONLY), "rb") as f:
            return f.read()

    def write(self, name: str, data: bytes, durable: bool = False) -> None:
        """Replace ``name`` with ``data`` atomically: a temp file in the folder (0600), then a rename."""
        with self._lock:
            folder = self._dir()
            for _ in range(100):
                tmp = f".{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 PRIVATE_FILE_MODE, dir_fd=folder)
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError(errno.EEXIST, "could not create a unique temporary file", self._where(name))
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if durable:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
            if durable:
                os.fsync(folder)

    def exists(self, name: str) -> bool:
        with self._lock:
            try:
                os.stat(name, dir_fd=self._dir(), follow_symlinks=False)
            except FileNotFoundError:
                return False
        return True

    def unlink(self, name: str) -> None:
        """Remove ``name``; one that is not there is no error."""
        with self._lock, contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir())

    def names(self) -> List[str]:
        with self._lock:
            return os.listdir(self._dir())

    def replaced(self, run_dir: PathLike) -> bool:
        """True when something else than this folder is at ``<run_dir>/.nbddp`` now (not followed);
        False while it is this one, or nothing is there (the run folder was removed)."""
        try:
            st = os.lstat(os.path.join(run_dir, STATE_DIR))
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self.identity

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


# ---------------------------------------------------------------------------- pinned folders
_pins: Dict[str, StateDir] = {}
_pins_lock = threading.Lock()


def _key(run_dir: PathLike) -> str:
    return os.path.abspath(os.fspath(run_dir))


def _reset_locks_in_child() -> None:
    # A process forked while another thread held a lock (a DataLoader worker of a rank) starts unlocked.
    global _pins_lock
    _pins_lock = threading.Lock()
    for state in _pins.values():
        state._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_in_child)


def pinned(run_dir: PathLike) -> Optional[StateDir]:
    """The state folder this process holds open for ``run_dir``, or None."""
    with _pins_lock:
        return _pins.get(_key(run_dir))


def _pin(run_dir: PathLike, state: StateDir) -> StateDir:
    with _pins_lock:
        old = _pins.get(_key(run_dir))
        _pins[_key(run_dir)] = state
    if old is not None and old is not state:
        old.close()
    return state


def _state_path(run_dir: PathLike) -> str:
    return os.path.join(os.fspath(run_dir), STATE_DIR)


def _owner(state: StateDir) -> Optional[int]:
    """The run folder's inode the state folder says it belongs to (None: it says none)."""
    try:
        value = json.loads(state.read(OWNER))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return -1  # unreadable, or not provably the user's: belongs to no run folder
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _bind(state: StateDir, run_ino: int) -> None:
    state.write(OWNER, json.dumps(run_ino).encode())


def _not_this_runs(owner: Optional[int]) -> str:
    return ("belongs to another run folder (it was moved here)" if owner is not None else
            "does not say which run folder it belongs to (moved here, or made by an older nbddp)")


def _open_new(run_dir: PathLike, launch: Optional[Callable[[str], bool]] = None, replace: bool = True) -> StateDir:
    """``<run_dir>/.nbddp`` made or found, a folder of the user's alone that belongs to ``run_dir``, opened.

    A new folder is 0700 and records the run folder it belongs to (its inode: a folder moved in
    from another run still names that one). For a launch (``launch``: which files are an
    earlier launch's, removed unread) the folder must say it is this run folder's; elsewhere an
    older one that says nothing is kept. Anything else in its place (a link, another user's,
    one others may write, another run's) is moved aside unread with a warning (``replace``),
    else refused.
    """
    os.makedirs(run_dir, exist_ok=True)
    path = _state_path(run_dir)
    parent = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        run_ino = os.fstat(parent).st_ino

        def usable(fd: int) -> Optional[str]:
            state = StateDir(fd, path)
            try:
                return _usable(state, run_ino, launch)
            finally:
                state.fd = None  # open_yours owns the descriptor

        # Never narrowed when others may write it: what was planted meanwhile stays planted.
        return StateDir(open_yours(parent, STATE_DIR, Path(path), "the run's state", kind="folder", replace=replace,
                                   usable=usable), path)
    finally:
        os.close(parent)


def _usable(state: StateDir, run_ino: int, launch: Optional[Callable[[str], bool]]) -> Optional[str]:
    """Why the open folder (the user's alone) cannot be ``run_ino``'s state folder, or None once it is
    (made so if new)."""
    names = state.names()
    owner = _owner(state) if OWNER in names else None
    if not names:
        _bind(state, run_ino)  # new (or empty): it is this run folder's from now on
    elif owner != run_ino and (launch is not None or owner is not None):
        return _not_this_runs(owner)
    elif launch is not None:
        for name in names:
            if launch(name) or TMP_MARK in name:
                state.unlink(name)  # an earlier launch's: never read
    return None


def fresh(run_dir: PathLike, per_launch: Callable[[str], bool]) -> StateDir:
    """The kernel's state folder for a launch in ``run_dir``, held open until :func:`release`.

    A folder of the user's alone that belongs to this run folder is kept, less the files
    ``per_launch`` names (an earlier launch's records, removed unread); anything else is moved
    aside unread, with a warning, and a new folder made.

    Raises:
        NotPrivate: another user keeps replacing ``.nbddp``.
    """
    release(run_dir)
    return _pin(run_dir, _open_new(run_dir, launch=per_launch))


def ensure(run_dir: PathLike) -> Path:
    """Make ``.nbddp`` a folder of the user's alone that belongs to ``run_dir`` (one that is not is moved
    aside, unread), keeping what it holds; for tools and tests (a launch uses :func:`fresh`)."""
    _open_new(run_dir).close()
    return Path(_state_path(run_dir))


def pin(run_dir: PathLike, identity: Optional[Identity]) -> StateDir:
    """A rank's state folder: ``.nbddp`` opened once, refused unless it is the folder ``identity`` names.

    ``identity`` is (device, inode) from the launch spec; the inode is compared (a rename keeps
    it, and it is the same on every machine of a cluster's shared file system, where device
    numbers differ). Without one (ranks under torchrun or srun, which share no kernel) a folder
    is made if there is none, and one that is not the user's alone, or another run folder's, is
    refused.

    Raises:
        NotPrivate: the folder is not the launch's (replaced since the kernel made it), or not private.
    """
    held = pinned(run_dir)
    if held is not None and (identity is None or held.identity[1] == identity[1]):
        return held
    if identity is None:
        return _pin(run_dir, _open_new(run_dir, replace=False))
    path = _state_path(run_dir)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise
        raise NotPrivate(_replaced(path, run_dir)) from None
    state = StateDir(fd, path)
    try:
        if state.identity[1] != identity[1]:  # the inode: a rename across file systems makes a new one
            raise NotPrivate(_replaced(path, run_dir))
        check(os.fstat(fd), Path(path), "folder", WHY)
    except BaseException:
        state.close()
        raise
    return _pin(run_dir, state)


def follow(run_dir: PathLike) -> StateDir:
    """The state folder of a run folder another process launched (``attach``), pinned for this process.

    The run folder is opened once, refused if its name is a link (it would lead to another run), and
    its ``.nbddp`` opened under that descriptor: the user's alone and recording this run folder
    (:func:`_open_checked`'s rule), or refused. From then on the follower reads and writes the run's
    state (its launch record, Stop) through this descriptor, whatever is renamed meanwhile.

    Raises:
        NotPrivate: the run folder's name is a link, or its state folder is not the user's or not its own.
        FileNotFoundError: there is no such run folder, or it has no state folder.
    """
    try:
        run = os.open(run_dir, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(run_dir):
            raise NotPrivate(f"{run_dir} is a symbolic link: a run folder is followed by its own name, never through a "
                             f"link (anyone who may write its folder can point one at another run). Give the run "
                             f"folder itself ({os.path.realpath(run_dir)} if that is yours).") from None
        raise
    try:
        state = _open_checked(run_dir, run)
    finally:
        os.close(run)
    return _pin(run_dir, state)


def _replaced(path: str, run_dir: PathLike) -> str:
    return (f"{path} is not the state folder the kernel made for this launch: it was renamed or removed and "
            f"something else put in its place (anyone who may write {run_dir} can), so nothing in it was used. "
            f"Launch again, into a runs folder only you may write if it happens again.")


def release(run_dir: PathLike, warn: bool = False) -> None:
    """Close the state folder this process holds for ``run_dir`` (the run has ended); twice is harmless.

    With ``warn``, say so when ``.nbddp`` is no longer the folder the run used: someone renamed it
    and put another in its place, which the run never read and the next launch moves aside.
    """
    with _pins_lock:
        state = _pins.pop(_key(run_dir), None)
    if state is None:
        return
    try:
        if warn and state.replaced(run_dir):
            warnings.warn(f"{state.path} was replaced during the run by another folder (anyone who may write "
                          f"{run_dir} can rename it): the run kept reading and writing its own state folder"
                          f"{_now_at(run_dir, state)} and used nothing of the other one. The next launch in this "
                          f"run folder moves it aside.", stacklevel=3)
    finally:
        state.close()


def _now_at(run_dir: PathLike, state: StateDir) -> str:
    with contextlib.suppress(OSError):
        for entry in os.scandir(run_dir):
            st = entry.stat(follow_symlinks=False)
            if (st.st_dev, st.st_ino) == state.identity:
                return f", now {entry.name}"
    return ""


# ---------------------------------------------------------------------------- one access
@contextlib.contextmanager
def opened(run_dir: PathLike, create: bool = False) -> Iterator[StateDir]:
    """The pinned state folder of ``run_dir``, else ``.nbddp`` opened and checked for this access.

    Args:
        create: make the folder (0700) when there is none (a writer), else a missing one raises
            ``FileNotFoundError``.

    Raises:
        NotPrivate: the folder is a link, not a folder, another user's, or others may write it.
    """
    state = pinned(run_dir)
    if state is not None:
        yield state
        return
    if create:
        state = _open_new(run_dir, replace=False)
    else:
        state = _open_checked(run_dir)
    try:
        yield state
    finally:
        state.close()


def _open_checked(run_dir: PathLike, run: Optional[int] = None) -> StateDir:
    """``.nbddp`` opened for one access: the user's, writable by no one else, and not another run folder's
    (``run``: the run folder, open: the state folder is opened under it, never through its name)."""
    path = _state_path(run_dir)
    name, where = (STATE_DIR, run) if run is not None else (path, None)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=where)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            check(os.lstat(name, dir_fd=where), Path(path), "folder", WHY)
        raise
    state = StateDir(fd, path)
    try:
        check(os.fstat(fd), Path(path), "folder", WHY)
        owner = _owner(state)
        if owner is not None and owner != (os.fstat(run) if run is not None else os.stat(run_dir)).st_ino:
            raise NotPrivate(f"{path} {_not_this_runs(owner)}: nothing in it is used. Remove {path}.")
    except BaseException:
        state.close()
        raise
    return state


def read(run_dir: PathLike, name: str) -> bytes:
    """The bytes of state file ``name``, checked (:meth:`StateDir.read`)."""
    with opened(run_dir) as state:
        return state.read(name)


def read_json(run_dir: PathLike, name: str) -> Optional[Any]:
    """The JSON of state file ``name``, or None if it is missing, not provably the user's, or invalid
    (caught mid-rewrite)."""
    try:
        return json.loads(read(run_dir, name))
    except (OSError, ValueError):
        return None


def write(run_dir: PathLike, name: str, data: bytes, durable: bool = False) -> None:
    """Replace state file ``name`` atomically (the folder made 0700 if there is none)."""
    with opened(run_dir, create=True) as state:
        state.write(name, data, durable)


def write_json(run_dir: PathLike, name: str, obj: Any, durable: bool = False) -> None:
    write(run_dir, name, json.dumps(obj).encode(), durable)


def exists(run_dir: PathLike, name: str) -> bool:
    try:
        with opened(run_dir) as state:
            return state.exists(name)
    except OSError:
        return False


def unlink(run_dir: PathLike, name: str) -> None:
    """Remove state file ``name``; a missing file or folder is no error."""
    try:
        with opened(run_dir) as state:
            state.unlink(name)
    except FileNotFoundError:
        pass


def names(run_dir: PathLike) -> List[str]:
    """The names in the state folder ([] when there is none, or it is not provably the user's)."""
    try:
        with opened(run_dir) as state:
            return state.names()
    except OSError:
        return []


def open_file(run_dir: PathLike, name: str, flags: int = os.O_RDONLY) -> BinaryIO:
    """State file ``name`` as a binary file object (``flags``: ``os.O_RDONLY``, or appending), checked."""
    with opened(run_dir, create=bool(flags & os.O_CREAT)) as state:
        fd = state.open(name, flags)
    return os.fdopen(fd, "rb" if flags & os.O_ACCMODE == os.O_RDONLY else "ab")


class Record:
    """A small JSON state record that readers poll, rewritten in place (heartbeats, live progress).

    The first write is atomic (temp file, rename), so the file never exists half-written; later
    writes are one ``pwrite`` over the whole record, padded with spaces to the longest record so
    far. A rename over an existing file costs ~1 ms on ext4 (it flushes the data first), and
    these records are written several times per training step. Readers that catch a torn read
    get invalid JSON and keep their previous value.
    """

    def __init__(self, run_dir: PathLike, name: str, size: int = 512):
        self.run_dir, self.name, self.size = run_dir, name, size
        self._fd: Optional[int] = None

    def write(self, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.size = max(self.size, len(data))
        data = data.ljust(self.size)
        if self._fd is None:
            with opened(self.run_dir, create=True) as state:
                state.write(self.name, data)
                self._fd = state.open(self.name, os.O_WRONLY)
        else:
            os.pwrite(self._fd, data, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["STATE_DIR", "StateDir", "fresh", "ensure", "pin", "follow", "pinned", "release", "opened", "read", "read_json",
           "write", "write_json", "exists", "unlink", "names", "open_file", "Record"]
