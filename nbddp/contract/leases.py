"""Advisory GPU leases: kernels of one server (any user) never pick the same GPU at the same moment.

A GPU's memory and load show a run only once its workers have allocated memory, seconds after the
launch; two kernels launching with ``gpus="idle"`` within that window would both see the GPU idle.
So a launch leases its GPUs for the run's lifetime, and ``gpus="idle"`` skips leased GPUs; GPUs
chosen by hand are leased when free and warn when another kernel holds them. The listing
(:func:`nbddp.contract.gpus.list_gpus`, the panel) names the holder: user, pid and run.

Where. A folder every user shares, ``/tmp/nbddp-gpu-leases`` (the ``NBDDP_GPU_LEASES`` variable
names another), made ``1777`` like ``/tmp``: sticky, so only an entry's owner (and the folder's)
may remove or rename it. In it each user has a folder of their own (``u<uid>``, ``0755``: only
they write in it, everyone reads it), and in that a *claim* per lease: a small file naming the GPU,
the holder's process (pid and the start time ``/proc/<pid>/stat`` gives it, so a recycled pid
does not count) and a ticket. Nobody can take, remove or rewrite another user's claim: a folder
that holds files cannot be removed by anyone but its owner, not even by the owner of the shared
folder (who may only rename it; readers find folders by their owner, not their name). A folder or
entry someone else planted under your folder's name (a FIFO, a link, their own folder) is passed
over: nbddp makes you another one. Whatever is planted, nothing here waits on it: folders and files
are opened with ``O_NOFOLLOW | O_NONBLOCK``, and only real folders and regular files, owned by the
folder's owner (``fstat`` after ``open``), are read.

Who wins. A claim is live while its holder's process lives (however the kernel ends, killed or
not, its claim stops counting; the next launch of its user removes the file). Two launches racing
for a GPU decide as in Lamport's bakery: each makes its claim, then takes a ticket from the clock
every process shares (``CLOCK_MONOTONIC``), then reads the others' claims; a launch that sees an
earlier ticket (or a claim still choosing one, for longer than :data:`CHOOSING_S`) withdraws. A
launch that did not see the other's claim read before that claim existed, so the other sees its
earlier ticket: at most one of them keeps the GPU.

Leases are advisory: code that ignores them (plain scripts, other tools) is not kept off a GPU.
They hold between processes that see the same ``/proc`` (one server; where ``/proc`` hides other
users' processes, a holder that exists counts, without its start time). Never raises for a folder
that cannot be used: a launch then goes on without leases, and says why (:func:`attempt`).

Shared: the kernel takes leases; the listing reads them. Imports nothing from torch or nbddp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pwd
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

#: Names the lease folder (tests point it at a folder of their own).
LEASES_ENV = "NBDDP_GPU_LEASES"
DEFAULT_LEASES_DIR = "/tmp/nbddp-gpu-leases"
#: How long a launch waits for a rival claim to take its ticket (microseconds, unless its process
#: is descheduled) before counting it as earlier and withdrawing: never two holders, at worst none.
CHOOSING_S = 2.0
_MAX_INFO = 512  # bytes of a claim read back: a claim is a few fields, never a file's worth
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MINE = 0o755  # a user's folder: only they write in it, every user reads the claims in it


def leases_dir() -> Path:
    return Path(os.environ.get(LEASES_ENV) or DEFAULT_LEASES_DIR)


def lease_key(index: int, uuid: Optional[str]) -> str:
    """The name a GPU's claims start with: its UUID (stable across reboots and allocations), else its index."""
    word = uuid if uuid else f"index-{index}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", word)


def _my_uid() -> int:
    """Who this process is, for ownership checks (the one place tests may pretend to be another user)."""
    return os.geteuid()


# ------------------------------------------------------------------------------ folders
def _shared_folder(create: bool) -> Tuple[Optional[int], Optional[str]]:
    """``(fd, None)`` on the shared lease folder, a real folder; or ``(None, why not)``."""
    folder = leases_dir()
    if create:
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o1777)  # every user's kernels lease here; sticky: none renames another's folder
        except FileExistsError:
            pass
        except OSError as e:
            return None, f"{folder} cannot be made ({e.strerror})"
    try:
        fd = os.open(folder, _DIR)
    except OSError as e:
        if e.errno in (20, 40):  # ENOTDIR, ELOOP: a file, a FIFO or a link where the folder should be
            return None, f"{folder} is not a folder (a file or a link is there)"
        return None, f"{folder} cannot be opened ({e.strerror})"
    st = os.fstat(fd)
    if st.st_uid == _my_uid() and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)  # others write in it: sticky, as /tmp
    return fd, None


def _not_writable(shared: int) -> str:
    st = os.fstat(shared)
    return (f"{leases_dir()} is not writable by you (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; "
            "nbddp makes it 1777, as /tmp)")


def _own_folder(shared: int, name: str) -> Optional[int]:
    """An fd on ``name`` in the shared folder if it is a real folder of ours (made ``0755``), else None."""
    try:
        fd = os.open(name, _DIR, dir_fd=shared)
    except OSError:
        return None  # missing, or a FIFO, a link or a file someone planted: never waited on, never followed
    st = os.fstat(fd)
    if st.st_uid != _my_uid():
        os.close(fd)
        return None
    if stat.S_IMODE(st.st_mode) != _MINE:
        with contextlib.suppress(OSError):
            os.fchmod(fd, _MINE)  # the umask took read away, or someone loosened it
    return fd


def _my_folder(shared: int) -> Tuple[Optional[int], Optional[str]]:
    """``(fd, None)`` on this user's folder in the shared one, made if needed; or ``(None, why not)``.

    The usual name is ``u<uid>``; when another user's entry holds that name (planted), an older
    folder of ours under another name is used, else a new ``u<uid>-<random>`` is made.
    """
    uid = _my_uid()
    name = f"u{uid}"
    for tried in range(8):
        try:
            os.mkdir(name, 0o700, dir_fd=shared)
        except FileExistsError:
            pass
        except PermissionError:
            return None, _not_writable(shared)
        except OSError as e:
            return None, f"{leases_dir()}/{name} cannot be made ({e.strerror})"
        fd = _own_folder(shared, name)
        if fd is not None:
            return fd, None
        if tried == 0:
            for other in _entries(shared):
                if other.startswith(f"u{uid}-") and (fd := _own_folder(shared, other)) is not None:
                    return fd, None
        name = f"u{uid}-{secrets.token_hex(4)}"
    return None, f"{leases_dir()} holds other users' entries under every name nbddp tried for yours"


def _entries(fd: int, hidden: bool = False) -> List[str]:
    """Names in a folder; ``hidden``: with the dot-names (the shared folder's owner may rename any
    user's folder to one, so readers look at those too; in a user's folder they are half-made claims)."""
    try:
        return [name for name in os.listdir(fd) if hidden or not name.startswith(".")]
    except OSError:
        return []


# ------------------------------------------------------------------------------ claims
@dataclasses.dataclass(frozen=True)
class Claim:
    """One lease as its file says, owned by ``uid``; ``ticket`` None while its holder is choosing one."""

    name: str
    uid: int
    pid: int
    start: Optional[int]
    ticket: Optional[int]
    run: str = ""

    def order(self) -> Tuple[int, int, int, str]:
        return (self.ticket if self.ticket is not None else -1, self.uid, self.pid, self.name)

    def live(self) -> bool:
        return _alive(self.pid, self.start)


def _proc_start(pid: int) -> Optional[Tuple[str, int]]:
    """``(state, start time in clock ticks since boot)`` of a process from ``/proc``; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # the name before ")" may hold spaces
        return fields[0].decode(), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


_SELF: Dict[str, Optional[int]] = {}


def _my_start() -> Optional[int]:
    pid = os.getpid()
    if _SELF.get("pid") != pid:  # a forked child is another process
        got = _proc_start(pid)
        _SELF.update(pid=pid, start=got[1] if got else None)
    return _SELF["start"]


def _alive(pid: int, start: Optional[int]) -> bool:
    """Whether the process that wrote a claim still runs: same pid and same start time (a recycled pid,
    a zombie or a dead one do not count). Where ``/proc`` hides it (``hidepid``), a pid that exists counts."""
    got = _proc_start(pid)
    if got is not None:
        return got[0] not in ("Z", "X") and (start is None or got[1] == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def _read_claim(folder: int, name: str, owner: int) -> Optional[Claim]:
    """The claim in ``name`` if it is a regular file owned by the folder's owner; None for anything else."""
    try:
        fd = os.open(name, _READ, dir_fd=folder)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
            return None
        info = json.loads(os.read(fd, _MAX_INFO).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(info, dict):
        return None
    pid, start, ticket, run = (info.get(k) for k in ("pid", "start", "ticket", "run"))
    if not _is_int(pid) or pid <= 0 or not (start is None or _is_int(start)) or not (ticket is None or _is_int(ticket)):
        return None
    return Claim(name, owner, pid, start, ticket, run if isinstance(run, str) else "")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _user_folders(shared: int) -> Iterator[Tuple[int, int]]:
    """``(fd, owner uid)`` of every real folder in the shared one, whatever its name (renamed ones too)."""
    for name in _entries(shared, hidden=True):
        try:
            fd = os.open(name, _DIR, dir_fd=shared)
        except OSError:
            continue
        try:
            yield fd, os.fstat(fd).st_uid
        finally:
            os.close(fd)


def _claims(shared: int, keys: Sequence[str]) -> Dict[str, List[Claim]]:
    """The live claims on each GPU of ``keys``, every user's."""
    out: Dict[str, List[Claim]] = {key: [] for key in keys}
    for folder, owner in _user_folders(shared):
        for name in _entries(folder):
            key = name.partition("@")[0]
            if key in out and (claim := _read_claim(folder, name, owner)) is not None and claim.live():
                out[key].append(claim)
    return out


def _write_claim(folder: int, name: str, info: dict, replace: bool) -> None:
    """Write a claim whole, never seen half-written: a temporary file linked (a new claim: fails if the
    name exists) or renamed (an update) into place."""
    tmp = f".{name}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=folder)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
    try:
        os.fchmod(fd, 0o644)  # every user's kernels read it, whatever the umask
        os.write(fd, json.dumps(info).encode()[:_MAX_INFO])
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        else:
            os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder)


def _remove_dead(folder: int) -> None:
    """Remove this user's claims (and half-made temporary files) whose holder is gone."""
    for name in os.listdir(folder):
        claim = _read_claim(folder, name, _my_uid()) if "@" in name and not name.startswith(".") else None
        pid = name.partition("@")[2].partition("-")[0]
        gone = not claim.live() if claim is not None else (pid.isdigit() and not _alive(int(pid), None))
        if gone:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=folder)


# ------------------------------------------------------------------------------ leasing
class Lease:
    """One GPU held by this process until :meth:`release` (or until it ends, however it ends)."""

    def __init__(self, index: int, folder: int, name: str, info: dict):
        self.index, self.name = index, name
        self._folder: Optional[int] = folder
        self._info = info

    def note(self, run: str = "") -> None:
        """Write the run into the claim, for the listings of every kernel."""
        if self._folder is None:
            return
        self._info = dict(self._info, run=run)
        with contextlib.suppress(OSError):
            _write_claim(self._folder, self.name, self._info, replace=True)

    def release(self) -> None:
        if self._folder is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.name, dir_fd=self._folder)
        os.close(self._folder)
        self._folder = None

    def handoff(self) -> dict:
        """What another process of the user's needs to hold this lease on (:func:`adopt`)."""
        return {"index": self.index, "name": self.name, "info": dict(self._info)}

    def forget(self) -> None:
        """Stop holding the lease here without removing its claim: another process adopted it."""
        if self._folder is not None:
            os.close(self._folder)
            self._folder = None


def adopt(handoff: dict) -> Optional[Lease]:
    """Hold a lease another process of the user's took (a detached run's supervisor takes over its
    kernel's): the claim, same ticket, rewritten to name this process. None when it cannot be."""
    shared, _ = _shared_folder(create=False)
    if shared is None:
        return None
    try:
        folder, _ = _my_folder(shared)
    finally:
        os.close(shared)
    if folder is None:
        return None
    info = dict(handoff["info"], pid=os.getpid(), start=_my_start())
    try:
        _write_claim(folder, handoff["name"], info, replace=True)
    except OSError:
        os.close(folder)
        return None
    return Lease(int(handoff["index"]), folder, handoff["name"], info)


class Attempt(NamedTuple):
    """What leasing one GPU gave: the lease; or who holds the GPU; or why leases cannot be used."""

    lease: Optional[Lease] = None
    held_by: str = ""
    off: str = ""


def attempt(index: int, uuid: Optional[str], run: str = "") -> Attempt:
    """Lease a GPU now unless another launch holds it (waits at most :data:`CHOOSING_S` for a rival
    choosing its ticket); never raises."""
    shared, why = _shared_folder(create=True)
    if shared is None:
        return Attempt(off=why)
    try:
        folder, why = _my_folder(shared)
        if folder is None:
            return Attempt(off=why)
        try:
            return _contend(shared, folder, lease_key(index, uuid), index, run)
        except OSError as e:
            os.close(folder)
            return Attempt(off=f"no lease could be written in {leases_dir()} ({e.strerror})")
    finally:
        os.close(shared)


def _contend(shared: int, folder: int, key: str, index: int, run: str) -> Attempt:
    """Make this process's claim on ``key``, take a ticket, and keep the claim unless an earlier one lives."""
    _remove_dead(folder)
    name = f"{key}@{os.getpid()}-{secrets.token_hex(4)}"
    info = {"pid": os.getpid(), "start": _my_start(), "ticket": None, "run": run, "since": time.time()}
    _write_claim(folder, name, info, replace=False)  # seen by every rival from now on, still choosing
    try:
        info["ticket"] = time.monotonic_ns()  # after the claim is visible: the bakery's order
        _write_claim(folder, name, info, replace=True)
        winner = _earlier(shared, key, Claim(name, _my_uid(), os.getpid(), info["start"], info["ticket"], run))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=folder)  # a claim left by this live process would hold the GPU
        raise
    if winner is None:
        return Attempt(lease=Lease(index, folder, name, info))
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=folder)
    os.close(folder)
    return Attempt(held_by=_describe_claim(winner))


def _earlier(shared: int, key: str, mine: Claim) -> Optional[Claim]:
    """A live rival claim on ``key`` ordered before ``mine``, or None; waits for rivals choosing a ticket."""
    deadline = time.monotonic() + CHOOSING_S
    while True:
        rivals = [c for c in _claims(shared, [key])[key] if (c.uid, c.name) != (mine.uid, mine.name)]
        earlier = [c for c in rivals if c.ticket is not None and c.order() < mine.order()]
        if earlier:
            return min(earlier, key=Claim.order)
        choosing = [c for c in rivals if c.ticket is None]
        if not choosing:
            return None
        if time.monotonic() > deadline:
            return choosing[0]  # never two holders: a rival that stays undecided wins
        time.sleep(0.005)


def try_lease(index: int, uuid: Optional[str], run: str = "") -> Optional[Lease]:
    """Lease a GPU now if no other launch holds it; None if held or leases are unusable (:func:`attempt` says which)."""
    return attempt(index, uuid, run).lease


def unusable_reason() -> Optional[str]:
    """Why no lease can be taken in the lease folder (another user made ``/tmp/nbddp-gpu-leases``
    a file, a link or a folder only they can write), or None when leases work."""
    shared, why = _shared_folder(create=True)
    if shared is None:
        return why
    try:
        folder, why = _my_folder(shared)
        if folder is not None:
            os.close(folder)
        return why
    finally:
        os.close(shared)


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

    def handoff(self) -> List[dict]:
        return [lease.handoff() for lease in self.leases]

    def forget(self) -> None:
        for lease in self.leases:
            lease.forget()


# ------------------------------------------------------------------------------ listing
def holders(gpus: Sequence) -> Dict[int, str]:
    """``{GPU index: "leased by alice (pid 4242, run 20250101-120000-mnist)"}`` for the leased GPUs.

    Args:
        gpus: objects with ``index`` and ``uuid`` (:class:`nbddp.contract.gpus.GPUInfo`).
    """
    if not gpus:
        return {}
    shared, _ = _shared_folder(create=False)
    if shared is None:
        return {}
    try:
        keys = {g.index: lease_key(g.index, g.uuid) for g in gpus}
        claims = _claims(shared, sorted(set(keys.values())))
    finally:
        os.close(shared)
    # The holder is the earliest ticket; a claim still choosing one counts (it may win).
    return {i: _describe_claim(min(claims[k], key=Claim.order)) for i, k in keys.items() if claims[k]}


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):  # no name for this uid (a container): the number says it
        return str(uid)


def _describe_claim(claim: Claim) -> str:
    return describe({"user": _user_name(claim.uid), "pid": claim.pid, "run": claim.run})


def describe(info: dict) -> str:
    """A holder in words; anything odd in it (a claim's run is what its writer says) is left out."""
    def word(key: str) -> str:
        value = info.get(key)
        return re.sub(r"[^\w.@:/+-]", "?", value)[:80] if isinstance(value, str) else ""

    user, run, pid = word("user"), word("run"), info.get("pid")
    details = [f"pid {pid}" if _is_int(pid) else "",
               f"run {run.rstrip('/').rpartition('/')[2]}" if run else ""]
    details = [d for d in details if d]
    return f"leased by {user or 'another kernel'}" + (f" ({', '.join(details)})" if details else "")


__all__ = ["LEASES_ENV", "DEFAULT_LEASES_DIR", "CHOOSING_S", "Lease", "Leases", "Attempt", "Claim", "attempt",
           "try_lease", "adopt", "holders", "describe", "leases_dir", "lease_key", "unusable_reason"]
