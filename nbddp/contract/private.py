"""Folders and files that are the user's alone on a shared server: checked, made, or moved aside.

Whatever nbddp unpickles, loads as code, or writes a rank's output into must be provably the
user's: a real folder or file (never a link), owned by this user, that no one else may write.
One check (:func:`problem`) decides that everywhere; the user id of a file is read in one
place (:func:`owner`), the seam a test uses to play another user without root.

- :func:`open_yours` is the one way to open what is the user's in a folder others may write: under
  the folder's descriptor, never following a link, checked on the descriptor it got, else moved
  aside (or refused); the others below, and the run's and state folder's openers, use it.
- :func:`private_folder` makes a folder 0700, or finds one that is the user's; one that is not
  (a link, a file, another user's folder) is refused or, where nbddp can make a new one without
  losing anything of the user's, moved aside and made anew, with a warning saying so.
- :func:`open_private_file` appends to a file of such a folder, checked on its open descriptor.
- :func:`open_private_below` opens a file to read (a checkpoint) only if it and every folder
  between it and a given top folder (the run folder) are the user's alone, checked on the
  descriptors it reads through.
- :func:`compile_cache_env` is where torch.compile, Triton, C++ extensions and CUDA's JIT keep
  the code they compile: the user's own default folders where they are private (what ``torchrun``
  built there is used), else the user's cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``) under
  ``nbddp/compile``; never torch's default ``/tmp/torchinductor_<user>``, a name any user of a
  shared ``/tmp`` can create first and fill with pickles and shared objects that then run as you.

Used on both sides (kernel and ranks): imports only the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import os
import re
import secrets
import stat
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional

PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600
#: The name a folder or file that was not the user's gets when it is moved aside.
ASIDE_MARK = ".not-yours-"
#: Torch's and its compilers' cache variables, each a sub-folder of the private compile cache.
COMPILE_CACHES = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",   # FX-graph, AOT-autograd, kernels (.so), autotuning
    "TRITON_CACHE_DIR": "triton",            # Triton's compiled kernels (inductor's and your own)
    "TORCH_EXTENSIONS_DIR": "torch_extensions",  # torch.utils.cpp_extension.load builds
    "PYTORCH_KERNEL_CACHE_PATH": "kernels",  # torch's NVRTC (jiterator) kernels
    "CUDA_CACHE_PATH": "cuda",               # the CUDA driver's PTX JIT cache
}


class NotPrivate(PermissionError):
    """A file nbddp would unpickle, run or write into is not provably the user's own (another owner, a link, a shared folder)."""


def owner(st: os.stat_result) -> int:
    """The user id owning a file (the single place nbddp reads it: tests play another user here)."""
    return st.st_uid


def problem(st: os.stat_result, kind: str, shared_ok: bool = False) -> Optional[str]:
    """Why a file or folder (``kind``: ``"file"``/``"folder"``) is not the user's alone, or None.

    Both must be the user's and writable by no one else (``shared_ok``: a folder of the user's
    about to be narrowed); a file must also be a regular file with one name (a hard link writes
    somewhere else). A file of the user's that others may write (``0664`` under umask 002, such as
    ``metrics.jsonl``) may hold anything a group member wrote, wherever it is moved to.
    """
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "folder" else stat.S_ISREG(st.st_mode)
    uid = owner(st)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not is_kind:
        return f"is not a regular {kind}"
    if uid != os.getuid():
        return f"is owned by uid {uid}, not by you (uid {os.getuid()})"
    if kind == "folder" and st.st_mode & 0o022 and not shared_ok:
        return "may be written by other users"
    if kind == "file" and st.st_nlink > 1:
        return "has other names (hard links)"
    if kind == "file" and st.st_mode & 0o022:
        return "may be written by other users"
    return None


def check(st: os.stat_result, path: Path, kind: str, why_private: str, shared_ok: bool = False) -> None:
    """Raise :class:`NotPrivate` naming ``path``, the problem and the fix, when :func:`problem` finds one."""
    found = problem(st, kind, shared_ok)
    if found:
        raise NotPrivate(f"{path} {found}: {why_private}. Remove {path} and launch again.")


def read_private(path: Path, why_private: str) -> bytes:
    """The bytes of ``path``, read only if the file and its folder are provably the user's.

    The folder is opened without following a link and checked (owned by this user, writable by
    no one else); the file is opened inside it with ``O_NOFOLLOW`` and checked on its open
    descriptor (a regular file of this user), so nothing can be swapped in between check and read.

    Raises:
        NotPrivate: the folder or file is a link, another user's, or the folder is writable by
            others; the message says why, and ``why_private``.
        FileNotFoundError: there is no such file.
    """
    path = Path(path)
    try:
        folder_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            check(os.lstat(path.parent), path.parent, "folder", why_private)
        raise
    try:
        check(os.fstat(folder_fd), path.parent, "folder", why_private)
        try:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                check(os.lstat(path), path, "file", why_private)
            raise
    finally:
        os.close(folder_fd)
    with os.fdopen(fd, "rb") as f:
        check(os.fstat(f.fileno()), path, "file", why_private)
        os.set_blocking(f.fileno(), True)
        return f.read()


def open_private_below(top: Path, relative: str, why_private: str) -> int:
    """A read descriptor of ``top/relative``, only if everything below ``top`` on the way is the user's alone.

    ``top`` (a run folder) must be the user's; others may write it (a run folder of a
    group-writable project folder: what they rename or put in it is checked below). Then each
    folder of ``relative`` is opened inside the last one without following a link and checked on
    its descriptor (:func:`problem`: the user's, writable by no one else), and so is the file (a
    regular file of the user's with one name, that no one else may write either: a file others
    can write may hold anything, whoever made it). A swap between a check and the read changes
    nothing: what is read is what was checked.

    Raises:
        NotPrivate: names the first folder or file that is not, why, ``why_private`` and what to do.
        FileNotFoundError: a part of the path is missing.
    """
    top, parts = Path(top), Path(relative).parts
    if not parts or any(part in ("..", ".") for part in parts) or Path(relative).is_absolute():
        raise ValueError(f"{relative!r} is not a path below {top}")
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _refuse(problem(os.fstat(fd), "folder", shared_ok=True), top, why_private, "folder")
        where = top
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = where / part
            flags = (os.O_NONBLOCK if last else os.O_DIRECTORY) | os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                inner = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link, or a file where a folder was
                    _refuse(problem(os.lstat(part, dir_fd=fd), "file" if last else "folder")
                            or "is not a folder", where, why_private, "folder")
                raise
            os.close(fd)
            fd = inner
            st = os.fstat(fd)
            found = problem(st, "file" if last else "folder")
            if last and found is None and st.st_mode & 0o022:
                found = f"may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
            _refuse(found, where, why_private, "file" if last else "folder")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refuse(found: Optional[str], path: Path, why_private: str, kind: str) -> None:
    """Raise :class:`NotPrivate` for ``path`` (a ``kind``) when :func:`problem` found something, with what to do."""
    if found is None:
        return
    if "other users" in found:  # the user's own: made before nbddp kept it private, or opened since
        chmod = "chmod -R go-w" if kind == "folder" else "chmod go-w"
        fix = (f"If you made it and trust what it holds, make it yours alone ({chmod} {path}); "
               f"else remove {path} and launch again")
    else:
        fix = f"Remove {path} (or move it away) and launch again"
    raise NotPrivate(f"{path} {found}: {why_private}. {fix}.")


def _aside(path: Path, dir_fd: Optional[int] = None) -> Path:
    """Rename ``path`` (a link, a file or a folder) to a unique ``<name>.not-yours-<time>-<token>`` beside it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}{ASIDE_MARK}{stamp}-{secrets.token_hex(3)}")
    os.rename(path.name if dir_fd is not None else path, aside.name if dir_fd is not None else aside,
              src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return aside


#: How :func:`open_yours` treats a file or folder of the user's whose mode lets others in:
#: ``"keep"`` leaves it (a run's ``metrics.jsonl``, 0644); ``"readers"`` narrows one others may only
#: read to ``mode``; ``"writers"`` narrows one others may write too (a folder whose contents are checked
#: one by one); ``"refuse"`` takes one others may open for not the user's (a cache: anything in it may
#: have been planted).
NARROW = ("keep", "readers", "writers", "refuse")


def open_yours(folder_fd: int, name: str, path: Path, what: str, kind: str = "file",
               flags: int = os.O_WRONLY | os.O_APPEND, mode: Optional[int] = None, replace: bool = True,
               narrow: str = "readers", usable: Optional[Callable[[int], Optional[str]]] = None) -> int:
    """A descriptor of ``name`` in the folder open as ``folder_fd``, made or found, provably the user's.

    The one way nbddp opens what is the user's in a folder others may write (a run folder, its state
    folder, a project folder): made there (a folder) or opened with ``O_CREAT`` (a file), always
    without following a link and without blocking on a FIFO, then checked on the descriptor it got
    (:func:`problem`, then ``usable`` where the caller knows more: a state folder must be this run
    folder's), so nothing swapped in between a check and a use is used. What is not the user's
    alone is moved aside unread to ``<name>.not-yours-...`` with a warning and made anew
    (``replace``), else refused.

    Args:
        folder_fd: the folder it is in, opened (the caller pins it: a run folder by descriptor).
        name: its name there; ``path`` names it in messages.
        what: what it holds, for messages ("the run's profiles").
        kind: ``"file"`` (opened with ``flags | O_CREAT``) or ``"folder"`` (made, then opened).
        mode: what a new one is made with, whatever the umask (0700 a folder, 0600 a file).
        narrow: what is done with one of the user's that others may open (:data:`NARROW`).
        usable: why the open descriptor is not the one wanted, or None.

    Raises:
        NotPrivate: it is not the user's and ``replace`` is off, or someone keeps replacing it.
    """
    folder = kind == "folder"
    mode = (PRIVATE_DIR_MODE if folder else PRIVATE_FILE_MODE) if mode is None else mode
    how = (os.O_RDONLY | os.O_DIRECTORY) if folder else (flags | os.O_CREAT | os.O_NONBLOCK)
    for _ in range(5):  # another rank, or another user, may change it between two calls
        if folder:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=folder_fd)  # the umask only takes bits away
        try:
            fd = os.open(name, how | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder_fd)
        except FileNotFoundError:
            if folder:
                continue  # removed between the mkdir and the open: again
            raise
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM):
                raise
            found = f"is not a {'folder' if folder else 'regular file'}"
            with contextlib.suppress(OSError):
                found = problem(os.lstat(name, dir_fd=folder_fd), kind) or found
        else:
            found = _not_yours(fd, kind, mode, narrow, usable)
            if found is None:
                return fd
            os.close(fd)
        if not replace:
            raise NotPrivate(f"{path} {found}: {what} must be yours alone. Remove {path} and launch again.")
        with contextlib.suppress(FileNotFoundError):
            aside = _aside(Path(path), folder_fd)
            warnings.warn(f"{path} {found}, so it was not used for {what}: it was moved to {aside.name} (nothing in it "
                          f"was read) and a private {kind} ({mode:o}) was made in its place.", stacklevel=3)
    raise NotPrivate(f"{path} keeps being replaced by something that is not yours: {what} cannot be kept private "
                     f"there. Use a folder only you may write.")


def _not_yours(fd: int, kind: str, mode: int, narrow: str, usable: Optional[Callable[[int], Optional[str]]]
               ) -> Optional[str]:
    """Why the open ``fd`` cannot be used, or None once it can (narrowed as ``narrow`` says)."""
    st = os.fstat(fd)
    found = problem(st, kind, shared_ok=narrow == "writers")
    if found is None and narrow == "refuse" and st.st_mode & 0o077:
        found = f"may be opened by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if found is None and usable is not None:
        found = usable(fd)
    if found is not None:
        return found
    if kind == "file":
        os.set_blocking(fd, True)
    if narrow != "keep" and stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)  # made by an older nbddp under the umask, or setgid from its folder
    return None


def private_folder(path: Path, what: str, replace: bool = False, narrow: bool = True) -> Path:
    """Make ``path`` a folder of the user's alone, 0700 whatever the umask; returns it.

    Args:
        path: the folder (its parent must exist).
        what: what it holds, for messages ("the run's logs").
        replace: a folder that is not the user's (a link, a file, another user's folder) is moved
            aside to ``<name>.not-yours-...`` and made anew, with a warning; otherwise refused.
        narrow: a folder of the user's that others may open is made 0700 (its contents can be
            trusted: files of others in it are refused one by one); else it counts as not
            private (a cache whose contents anyone may have planted).

    Raises:
        NotPrivate: it is not the user's and ``replace`` is off, or another user keeps replacing it.
    """
    path = Path(path)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(open_yours(parent, path.name, path, what, kind="folder", replace=replace,
                            narrow="writers" if narrow else "refuse"))
    finally:
        os.close(parent)
    return path


def open_private_file(path: Path, what: str, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """A descriptor of ``path`` (created 0600 whatever the umask), a regular file of the user's alone.

    Its folder is made private first (:func:`private_folder`'s rule, with ``replace``) and the file
    opened through that folder's descriptor (:func:`open_yours`): a file in its place that is not the
    user's (another owner, a link, a FIFO, a hard link) or that others may write is moved aside with
    a warning; a file of the user's that others may read is narrowed.
    """
    path = Path(path)
    top = os.open(path.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        folder = open_yours(top, path.parent.name, path.parent, what, kind="folder", narrow="writers")
    finally:
        os.close(top)
    try:
        return open_yours(folder, path.name, path, what, flags=flags)
    finally:
        os.close(folder)


# ---------------------------------------------------------------------------- the compile cache
def cache_home() -> Path:
    """``$XDG_CACHE_HOME`` when it is an absolute path (the XDG rule), else ``~/.cache``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"


def _make_cache_home(folder: Path) -> None:
    """The user's cache folder (``~/.cache``) made if missing: 0700, not under the umask (0775 under
    umask 002, which :func:`_unsafe_ancestor` would then refuse to use)."""
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, PRIVATE_DIR_MODE)


def _unsafe_ancestor(folder: Path) -> Optional[str]:
    """An ancestor of ``folder`` through which another user could swap it, and why; None if none.

    Each must be owned by the user or root and writable by no one else, unless it is sticky
    (like ``/tmp``: there only an entry's owner may rename it), as OpenSSH asks of ``~/.ssh``'s.
    """
    for parent in Path(os.path.realpath(folder)).parents:
        st = os.stat(parent)
        if owner(st) not in (0, os.getuid()):
            return f"{parent} belongs to uid {owner(st)}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{parent} may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def torch_default_cache() -> str:
    """torch.compile's default cache, ``<temp>/torchinductor_<user>``, named as torch names it
    (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``; importing it costs 2 s)."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _set_by_user(var: str) -> bool:
    """The user chose this cache folder. Not so when it is in torch's default cache: ``import
    torch._dynamo`` sets ``TORCHINDUCTOR_CACHE_DIR`` there in any process that imports it, and a
    compile sets ``TRITON_CACHE_DIR`` under it: the shared ``/tmp`` this module keeps caches out of."""
    value = os.environ.get(var)
    if value is None:
        return False
    default = torch_default_cache()
    return not (value == default or value.startswith(default + os.sep))


def user_default_caches() -> Dict[str, Path]:
    """Where Triton, torch's C++ extensions, torch's NVRTC kernels and CUDA keep their caches when
    their variable is not set: in the user's home or cache home, as ``python``/``torchrun`` use them.
    (torch.compile's default, ``<temp>/torchinductor_<user>``, is in the shared temp folder: never.)"""
    home = Path.home()
    triton_home = os.environ.get("TRITON_HOME", "")
    return {
        "TRITON_CACHE_DIR": (Path(triton_home) if os.path.isabs(triton_home) else home) / ".triton" / "cache",
        "TORCH_EXTENSIONS_DIR": cache_home() / "torch_extensions",  # torch adds py<ver>_<accelerator> below
        "PYTORCH_KERNEL_CACHE_PATH": cache_home() / "torch" / "kernels",
        "CUDA_CACHE_PATH": home / ".nv" / "ComputeCache",
    }


def _not_private(folder: Path) -> Optional[str]:
    """Why ``folder`` is not a cache of the user's alone (checked on its descriptor, and its
    ancestors), ``""`` when there is none yet, None when it is the user's alone."""
    real = os.path.realpath(folder)  # a link of the user's own (a home on another disk) is followed
    try:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return str(exc)
    try:
        found = problem(os.fstat(fd), "folder")
    finally:
        os.close(fd)
    try:
        return f"{real} {found}" if found else _unsafe_ancestor(Path(real))
    except OSError as exc:
        return str(exc)


def _users_own(wanted: Dict[str, str]) -> Dict[str, Optional[str]]:
    """The caches of ``wanted`` whose default folder exists and is the user's alone: ``None`` for each
    (the ranks use torch's default, and what ``torchrun`` built there: a DeepSpeed or ``cpp_extension``
    build is not made twice), taken out of ``wanted``. One that is not private is said once, with why."""
    own: Dict[str, Optional[str]] = {}
    for var, default in user_default_caches().items():
        if var not in wanted:
            continue
        why = _not_private(default)
        if why is None:
            own[var] = None
            del wanted[var]
        elif why:
            warnings.warn(f"{default} is not used for the ranks' builds ({var}): {why}. They build in nbddp's "
                          f"private cache instead, once more; if {default} is yours alone, `chmod -R go-w` it to "
                          "share the builds.", stacklevel=4)
    return own


def compile_cache_env(fallback: Optional[str] = None) -> Dict[str, Optional[str]]:
    """The compile caches' variables (:data:`COMPILE_CACHES`) for the ranks, those the user has not set.

    A cache whose default folder is the user's own and private (in the home, owned by them, not
    writable by others: ``~/.cache/torch_extensions``, ``~/.triton/cache``; see
    :func:`user_default_caches`) is used as ``torchrun`` uses it: its variable maps to ``None``
    (unset for the ranks). The others point into ``<cache home>/nbddp/compile``, a folder of the
    user's alone (0700, checked on every launch, and so are its ancestors), shared between runs so
    compiles stay warm. A cache folder that is not the user's or not private is moved aside (its
    contents may have been planted) and made anew, with a warning. Where the user's cache folder
    cannot be made private (an ancestor others may write), the caches go to ``fallback`` (the
    run's private temp folder: private, but compiled again by every launch), with a warning saying
    why and what to do.
    """
    wanted = {var: sub for var, sub in COMPILE_CACHES.items() if not _set_by_user(var)}
    own = _users_own(wanted)
    if not wanted:
        return own
    what = "torch.compile's and Triton's caches (compiled code nbddp's ranks load)"
    root = cache_home() / "nbddp"
    try:
        _make_cache_home(root.parent)
        unsafe = _unsafe_ancestor(root)
        if unsafe is None:
            folder = private_folder(private_folder(root, what, replace=True, narrow=False) / "compile", what,
                                    replace=True, narrow=False)
            return {**own, **{var: str(folder / sub) for var, sub in wanted.items()}}
    except OSError as exc:  # NotPrivate too: another user keeps replacing it
        unsafe = str(exc)
    if fallback is None:
        raise NotPrivate(f"{what} cannot be kept private in {root}: {unsafe}")
    warnings.warn(f"{what} are not kept between runs: {unsafe}, so {root} cannot be kept private. They go "
                  f"to the run's private temp folder instead. Make it private (`chmod go-w` the folder "
                  f"named) or set XDG_CACHE_HOME to a private folder of yours to keep compiles warm.",
                  stacklevel=3)
    return {**own, **{var: os.path.join(fallback, "compile", sub) for var, sub in wanted.items()}}


__all__ = ["NotPrivate", "open_yours", "private_folder", "open_private_file", "read_private", "open_private_below", "compile_cache_env",
           "PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE"]
