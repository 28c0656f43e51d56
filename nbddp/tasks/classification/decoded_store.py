"""The tensor pipeline's decoded images, kept between launches in the user's private cache folder.

Worker side. :class:`~nbddp.tasks.classification.tensor_data.TensorCache` decodes every image of a
folder into one uint8 tensor; without this store every launch, and every rank of it, decodes the
whole folder again (2.35 s of a 9.6 s warm relaunch on one H100 for 3,670 JPEGs). With it:

- **One file per (image list, load size)** in ``<cache home>/nbddp/decoded/`` (``$XDG_CACHE_HOME``,
  else ``~/.cache``: the root of the compile caches, :func:`nbddp.contract.private.compile_cache_env`),
  a folder of the user's alone (0700) whose ancestors others cannot swap. Its name is the key: the
  sha256 of the format version, the load size, PIL's and torchvision's versions and, for every
  sample, its path, class index, size, mtime, ctime and inode. A photo edited, replaced or
  relabelled gives a new key, so a stale file is never read; it ages out.
- **Never a pickle**: a small header (magic, then JSON naming the key, count and size) and the raw
  uint8 bytes, read with ``readinto`` straight into the preallocated tensor (no mmap: a file
  truncated under a mapping kills the process with SIGBUS; a short read is just a miss).
- **Read only if safe**: the file is opened inside the folder's descriptor without following a
  link, and checked on its own descriptor (:func:`nbddp.contract.private.problem`: a regular file of
  the user's, one name, writable by no one else), and its header must name the same key and its
  length be exact. A file that is not the user's alone is not read, with a warning saying why; a
  stale or truncated one silently. Either way the images are decoded, and stored in its place
  where there is room.
- **Written atomically**: to a temporary name in the same folder (``O_EXCL``, 0600 whatever the
  umask), flushed, then renamed into place: a reader never sees half a file.
- **Ranks of one launch decode once between them**: the first to take the key's lock
  (``fcntl.flock`` on a private lock file beside it) decodes and writes; the others wait on the
  lock, then read the file. If the one that decoded could not store it (a full disk), the others
  decode side by side, as without the store, not one after another.
- **Disk**: nothing is written where the free space would fall under :func:`free_margin`, and the
  folder is kept under ``NBDDP_DECODED_CACHE_GB`` (20 by default; 0 turns the store off) by
  removing the least recently used files first (a read touches its file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import struct
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import torch

from ...contract import private

#: Bumped whenever the decoded pixels of the same files change (the resize, the crop, the layout).
FORMAT = 1
MAGIC = b"NBDDPU8\n"
#: The store's size cap in GiB (a float; 0 turns it off).
CAP_VAR = "NBDDP_DECODED_CACHE_GB"
DEFAULT_CAP_GB = 20.0
SUFFIX = ".u8"
_NAME = re.compile(r"^[0-9a-f]{64}\.u8$")
_TEMP = re.compile(r"^\.[0-9a-f]{64}\.[0-9a-f]+\.tmp$")
_LOCK = re.compile(r"^[0-9a-f]{64}\.lock$")
_STALE_TEMP_S = 3600.0  # a temporary file this old was left by a writer that died
_HEADER = struct.Struct("<8sI")  # magic, length of the JSON that follows
_CHUNK = 1 << 30  # one read or write call moves at most this (Linux caps a call at 2 GiB)

Decode = Callable[[torch.Tensor], None]
_SAID: set = set()


def cap_bytes() -> int:
    """The store's size cap from ``NBDDP_DECODED_CACHE_GB`` (default 20 GiB); 0 when it is turned off.

    Raises:
        ValueError: the variable is not a number of GiB, 0 or more (names it and the fix).
    """
    raw = os.environ.get(CAP_VAR, "").strip()
    if not raw:
        return int(DEFAULT_CAP_GB * 2**30)
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib >= 0 or gib == float("inf"):
        raise ValueError(f"{CAP_VAR}={raw!r} is not a size in GiB: set it to a number such as 20 (the default), "
                         f"or 0 to keep no decoded images between launches.")
    return int(gib * 2**30)


def free_margin(total_bytes: int) -> int:
    """Free space a write must leave on the cache's file system: 5 % of it, at least 1 GiB."""
    return max(1 << 30, total_bytes // 20)


def store_folder() -> Path:
    """``<cache home>/nbddp/decoded``, where the decoded images are kept."""
    return private.cache_home() / "nbddp" / "decoded"


def store_key(samples: Sequence[Tuple[str, int]], size: int) -> Optional[str]:
    """The key of decoded ``samples`` at load size ``size``; None if a file cannot be looked at.

    A file that cannot be stat'ed is left to the decoder, which names it in a ``DataError``.
    """
    import PIL
    import PIL.features
    import torchvision

    # The JPEG library's version too: two hosts sharing a home may build Pillow with another one.
    h = hashlib.sha256(json.dumps({"format": FORMAT, "size": int(size), "pil": PIL.__version__,
                                   "jpeg": PIL.features.version("jpg"),
                                   "torchvision": torchvision.__version__}).encode())
    for path, label in samples:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        # \0 ends every field: no path holds one, so no two sample lists give the same bytes.
        h.update(os.fsencode(os.path.abspath(path)) + b"\0")
        h.update(f"{int(label)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\0".encode())
    return h.hexdigest()


def fill(samples: Sequence[Tuple[str, int]], size: int, out: torch.Tensor, decode: Decode) -> bool:
    """Fill ``out`` (uint8 ``[N, 3, size, size]``, contiguous, on the CPU) with the decoded ``samples``.

    Reads them back from the store when it holds them; else calls ``decode(out)`` (once per
    launch for all its ranks: see the module's text) and stores the result.

    Returns:
        True when this call decoded the images, False when it read them back.

    Raises:
        ValueError: ``NBDDP_DECODED_CACHE_GB`` is not a size.
        DataError: from ``decode``, an image cannot be read.
    """
    cap = cap_bytes()
    key = store_key(samples, size) if cap and len(samples) else None
    folder_fd = _open_folder() if key else None
    if folder_fd is None:
        decode(out)
        return True
    try:
        store = _Entry(folder_fd, key, out)
        if store.read():
            return False
        lock = _open_lock(key)
        if lock is None:
            decode(out)
            if _make_room(folder_fd, key, store.nbytes, cap):
                store.write()
            return True
        with lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                first = True
            except BlockingIOError:  # another rank (or launch) is decoding these images
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                # Done: let the other waiters read beside this one, not one after another.
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
                first = False
            if store.read():
                return False
            if not first or not _make_room(folder_fd, key, store.nbytes, cap):
                # Not to be stored (no room), or the rank that held the lock could not store them:
                # decode side by side with the other ranks rather than one after another under the lock.
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
                decode(out)
                return True
            decode(out)
            store.write()
            # Now, not when the file closes: the decode's forked processes may still hold it open.
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
            return True
    finally:
        os.close(folder_fd)


class _Entry:
    """One stored file of the folder ``folder_fd``: read into ``out``, or written from it."""

    def __init__(self, folder_fd: int, key: str, out: torch.Tensor):
        self.folder_fd, self.key, self.out = folder_fd, key, out
        self.name = key + SUFFIX
        self.header = json.dumps({"format": FORMAT, "key": key, "count": int(out.shape[0]),
                                  "size": int(out.shape[-1])}).encode()
        self.nbytes = _HEADER.size + len(self.header) + out.numel()
        self.warned = False  # read twice (before and under the lock): said once

    def _bytes(self) -> memoryview:
        return memoryview(self.out.view(-1).numpy())

    def read(self) -> bool:
        """Fill ``out`` from the file; False (``out`` left to be decoded) when it is missing, stale or unsafe."""
        path = store_folder() / self.name
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.folder_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._not_used(path, "is a symbolic link" if exc.errno == errno.ELOOP
                           else f"cannot be opened ({exc.strerror})")
            return False
        with open(fd, "rb", buffering=0, closefd=True) as f:
            st = os.fstat(fd)
            found = private.problem(st, "file")
            if found:
                self._not_used(path, found)
                return False
            os.set_blocking(fd, True)
            head = f.read(_HEADER.size + len(self.header))
            if (st.st_size != self.nbytes or len(head) != _HEADER.size + len(self.header)
                    or _HEADER.unpack_from(head) != (MAGIC, len(self.header)) or head[_HEADER.size:] != self.header):
                return False  # another version, another key, or cut short: decoded again, stored anew
            view, done = self._bytes(), 0
            while done < len(view):
                got = f.readinto(view[done:done + _CHUNK])
                if not got:
                    return False  # truncated while read
                done += got
            with contextlib.suppress(OSError):
                os.utime(fd)  # the least recently used file goes first when the folder is full
            return True

    def _not_used(self, path: Path, why: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"{path} {why}, so the decoded images it may hold were not read: they are decoded "
                          f"again, and stored in its place as a private file of yours where there is room.", stacklevel=5)

    def write(self) -> bool:
        """Store ``out`` under its key: a temporary file of the user's alone, flushed, renamed into place."""
        temp = f".{self.key}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         private.PRIVATE_FILE_MODE, dir_fd=self.folder_fd)
        except OSError as exc:
            _not_stored(exc)
            return False
        try:
            os.fchmod(fd, private.PRIVATE_FILE_MODE)  # 0600 whatever the umask
            for part in (_HEADER.pack(MAGIC, len(self.header)) + self.header, self._bytes()):
                view = memoryview(part)
                while len(view):
                    view = view[os.write(fd, view[:_CHUNK]):]
            os.fsync(fd)  # the name never points at pixels a crash left unwritten
            os.rename(temp, self.name, src_dir_fd=self.folder_fd, dst_dir_fd=self.folder_fd)
            return True
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=self.folder_fd)
            _not_stored(exc)
            return False
        finally:
            os.close(fd)


def _open_folder() -> Optional[int]:
    """A descriptor of the store's folder, made the user's alone; None (with a warning) where it cannot be."""
    what = "the tensor pipeline's decoded images"
    root = private.cache_home() / "nbddp"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        unsafe = private._unsafe_ancestor(root)
        if unsafe is None:
            folder = private.private_folder(private.private_folder(root, what, replace=True, narrow=False) / "decoded",
                                            what, replace=True, narrow=False)
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            unsafe = private.problem(os.fstat(fd), "folder")
            if unsafe is None:
                return fd
            os.close(fd)
            unsafe = f"{folder} {unsafe}"
    except OSError as exc:  # NotPrivate too: another user keeps replacing it
        unsafe = str(exc)
    if unsafe not in _SAID:  # once per process, not once per cache built
        _SAID.add(unsafe)
        warnings.warn(f"{what} are not kept between launches: {unsafe}, so {root} cannot be kept private; every "
                      f"launch decodes the images again. Make it private (`chmod go-w` the folder named) or set "
                      f"XDG_CACHE_HOME to a private folder of yours.", stacklevel=4)
    return None


def _open_lock(key: str):
    """The key's lock file (``<key>.lock``, a private file of the user's), open; None if it cannot be had."""
    try:
        fd = private.open_private_file(store_folder() / f"{key}.lock", "the decoded images' lock",
                                       os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    return open(fd, "rb", buffering=0, closefd=True)


def _make_room(folder_fd: int, key: str, nbytes: int, cap: int) -> bool:
    """Remove the least recently used files until ``nbytes`` more (``key``'s) fit under ``cap``; False if they cannot.

    Also False when writing them would leave less than :func:`free_margin` free on the disk.
    Temporary files a dead writer left (older than an hour) go first.
    """
    if nbytes > cap:
        return False
    now, kept = time.time(), []
    for entry in os.scandir(folder_fd):
        with contextlib.suppress(OSError):
            st = entry.stat(follow_symlinks=False)
            if _TEMP.match(entry.name):
                if entry.name.startswith(f".{key}."):
                    continue  # another rank writing these very images: counted once, as nbytes
                if now - st.st_mtime > _STALE_TEMP_S:
                    os.unlink(entry.name, dir_fd=folder_fd)
                    continue
                kept.append((float("inf"), entry.name, st.st_size))  # being written: never removed
            elif _NAME.match(entry.name):
                kept.append((st.st_mtime, entry.name, st.st_size))
    kept.sort()
    total = sum(size for _, _, size in kept)
    for mtime, name, size in kept:
        if total + nbytes <= cap or mtime == float("inf"):
            break
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=folder_fd)
            total -= size
            _drop_lock(folder_fd, name[:-len(SUFFIX)] + ".lock")
    if total + nbytes > cap:
        return False
    fs = os.fstatvfs(folder_fd)
    return fs.f_bavail * fs.f_frsize - nbytes >= free_margin(fs.f_blocks * fs.f_frsize)


def _drop_lock(folder_fd: int, name: str) -> None:
    """Remove an evicted key's lock file, unless some process is using it."""
    if not _LOCK.match(name):
        return
    with contextlib.suppress(OSError):
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(name, dir_fd=folder_fd)
        finally:
            os.close(fd)


def _not_stored(exc: OSError) -> None:
    warnings.warn(f"the decoded images could not be kept for the next launch ({exc}); it decodes them again.",
                  stacklevel=4)


__all__ = ["CAP_VAR", "DEFAULT_CAP_GB", "cap_bytes", "fill", "free_margin", "store_folder", "store_key"]
