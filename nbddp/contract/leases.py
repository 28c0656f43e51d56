"""Advisory GPU leases: kernels of one server (any user) never pick the same GPU at the same moment.

A GPU's memory and load show a run only once its workers have allocated memory, seconds after the
launch; two kernels launching with ``gpus="idle"`` within that window would both see the GPU idle.
So a launch leases its GPUs: one lock file per GPU (named by its UUID, else its index) in a folder
every user shares, ``/tmp/nbddp-gpu-leases`` (sticky and world-writable, like ``/tmp``; the
``NBDDP_GPU_LEASES`` variable names another), locked with ``flock`` by the kernel for the run's
lifetime. The kernel releases it when the run ends; the operating system releases it when the
kernel dies, killed or not, so a lease never outlives its holder: a file left by a dead kernel is
simply free to lock again. ``gpus="idle"`` skips leased GPUs; GPUs chosen by hand are leased when
free and warn when another kernel holds them. The listing (:func:`nbddp.contract.gpus.list_gpus`, the
panel) names the holder: user, pid and run, as the holder wrote them into the file.

Leases are advisory: code that ignores them (plain scripts, other tools) is not kept off a GPU,
and what a holder writes about itself is informational only (its lock is what counts; whether a
file is locked is read from ``/proc/locks``, without touching the lock). Never raises for a folder
that cannot be used: a launch then goes on without leases.

Shared: the kernel takes leases; the listing reads them. Imports nothing from torch or nbddp.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

#: Names the lease folder (tests point it at a folder of their own).
LEASES_ENV = "NBDDP_GPU_LEASES"
DEFAULT_LEASES_DIR = "/tmp/nbddp-gpu-leases"
_MAX_INFO = 512  # bytes of a holder's note read back: a note is a few fields, never a file's worth


def leases_dir() -> Path:
    return Path(os.environ.get(LEASES_ENV) or DEFAULT_LEASES_DIR)


def lease_key(index: int, uuid: Optional[str]) -> str:
    """The lock file's name for a GPU: its UUID (stable across reboots and allocations), else its index."""
    word = uuid if uuid else f"index-{index}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", word) + ".lock"


def _folder(create: bool) -> Optional[Path]:
    """The lease folder, a real directory (never a link someone planted), or None."""
    folder = leases_dir()
    if create:
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o1777)  # every user's kernels lease here; sticky: none removes another's file
        except FileExistsError:
            pass
        except OSError:
            return None
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    return folder if stat.S_ISDIR(st.st_mode) else None


def unusable_reason() -> Optional[str]:
    """Why no lease can be taken in the lease folder (another user made ``/tmp/nbddp-gpu-leases``
    a file, a link or a folder only they can write), or None when leases work."""
    folder = leases_dir()
    if _folder(create=True) is None:
        return f"{folder} is not a folder (a file or a link is there)"
    try:
        st = os.stat(folder)
    except OSError as e:
        return f"{folder} cannot be read ({e.strerror})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return (f"{folder} is not writable by you (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; "
                "nbddp makes it 1777, as /tmp)")
    return None


def _open_lock(path: Path) -> Optional[int]:
    """An fd on the lock file, made if missing (writable by everyone: the next holder may be another user)."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # the umask took group and other write away
        return fd
    except FileExistsError:
        pass
    except OSError:
        return None
    for mode in (os.O_RDWR, os.O_RDONLY):  # read-only still locks; the note is then not ours to write
        try:
            fd = os.open(path, mode | flags)
        except OSError:
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        return None
    return None


class Lease:
    """One GPU held by this process until :meth:`release` (or until it ends, however it ends)."""

    def __init__(self, index: int, path: Path, fd: int):
        self.index, self.path, self._fd = index, path, fd

    def note(self, run: str = "") -> None:
        """Write who holds the GPU into the lock file, for the listings of every kernel."""
        info = {"user": _user(), "pid": os.getpid(), "run": run, "since": time.time()}
        with contextlib.suppress(OSError):
            data = json.dumps(info).encode()[:_MAX_INFO]
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # no note of a holder that is gone
        os.close(self._fd)  # closing the only descriptor drops the lock
        self._fd = None


def try_lease(index: int, uuid: Optional[str], run: str = "") -> Optional[Lease]:
    """Lease a GPU now if no other kernel holds it (never waits); None if held or leases are unusable."""
    folder = _folder(create=True)
    if folder is None:
        return None
    path = folder / lease_key(index, uuid)
    fd = _open_lock(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    lease = Lease(index, path, fd)
    lease.note(run)
    return lease


class Leases:
    """The GPU leases of one launch: noted with its run folder, released once at its end."""

    def __init__(self, leases: Sequence[Lease] = ()):
        self.leases: List[Lease] = list(leases)

    @property
    def indices(self) -> List[int]:
        return [lease.index for lease in self.leases]

    def note(self, run: str) -> None:
        for lease in self.leases:
            lease.note(run)

    def release(self) -> None:
        for lease in self.leases:
            lease.release()


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (a container): the number says it
        return str(os.getuid())


def _locked_inodes() -> Optional[set]:
    """``(major, minor, inode)`` of every file with a granted ``flock``, from ``/proc/locks``; None if unreadable."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    out = set()
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[2] != "->":  # "->": a waiter, not a holder
            with contextlib.suppress(ValueError):
                major, minor, inode = parts[5].split(":")
                out.add((int(major, 16), int(minor, 16), int(inode)))
    return out


def _is_locked(path: Path, st: os.stat_result, locked: Optional[set]) -> bool:
    if locked is not None:
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in locked
    # No /proc/locks: test with a shared lock, released at once (a leaser racing us may miss one try).
    fd = _open_lock(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def holders(gpus: Sequence) -> Dict[int, str]:
    """``{GPU index: "leased by alice (pid 4242, run 20250101-120000-mnist)"}`` for the leased GPUs.

    Args:
        gpus: objects with ``index`` and ``uuid`` (:class:`nbddp.contract.gpus.GPUInfo`).
    """
    folder = _folder(create=False)
    if folder is None or not gpus:
        return {}
    locked = _locked_inodes()
    out = {}
    for g in gpus:
        path = folder / lease_key(g.index, g.uuid)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and _is_locked(path, st, locked):
            out[g.index] = describe(_read_note(path))
    return out


def _read_note(path: Path) -> dict:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        info = json.loads(os.read(fd, _MAX_INFO).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return info if isinstance(info, dict) else {}


def describe(info: dict) -> str:
    """A holder's note in words; anything odd in it (the file is everyone's to write) is left out."""
    def word(key: str) -> str:
        value = info.get(key)
        return re.sub(r"[^\w.@:/+-]", "?", value)[:80] if isinstance(value, str) else ""

    user, run, pid = word("user"), word("run"), info.get("pid")
    details = [f"pid {pid}" if isinstance(pid, int) and not isinstance(pid, bool) else "",
               f"run {run.rstrip('/').rpartition('/')[2]}" if run else ""]
    details = [d for d in details if d]
    return f"leased by {user or 'another kernel'}" + (f" ({', '.join(details)})" if details else "")


__all__ = ["LEASES_ENV", "DEFAULT_LEASES_DIR", "Lease", "Leases", "try_lease", "holders", "describe",
           "leases_dir", "lease_key"]
