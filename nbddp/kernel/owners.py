"""Who owns a local run, and how others reach it: the owner's records and the user's list of live runs.

A run on this server has one owner: the kernel that launched it, or the supervisor of a detached
run (:mod:`nbddp.kernel.supervisor`). The owner watches the ranks (staged stop, restarts, hangs,
reaping, leases); anyone else of the same user may *follow* it (:mod:`nbddp.kernel.follow`). What
passes between them is in the run's private state folder (:mod:`nbddp.contract.statedir`), never in
a file a group member could write:

- ``owner.json``: who owns the run (pid and start time), what it runs, when it started;
- ``owner-ask.json``: a follower's request (``stop``, ``interrupt``, ``kill``), which the owner
  reads as it polls and carries out as if its own kernel had asked;
- ``outcome.pkl``: the run's end as the owner saw it (its :class:`~nbddp.TrainResult` with the
  worker's value, or its error), written when the run is detached or followed.

``nbddp.runs()`` must list the user's runs and no one else's, and never a folder someone planted
in a group-writable runs folder. So it does not look through runs folders: each owner adds an
entry to a folder of the user's alone (``<cache home>/nbddp/live``, 0700) naming the run folder
and its state folder's identity, and removes it at the run's end. A listed run is read through
its state folder only when that folder is still the one the entry names and is the user's alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import socket
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..contract import statedir
from ..contract.errors import NbddpError
from ..contract.private import NotPrivate, cache_home, private_folder, read_private
from ..contract.system import is_same_process, start_time

OWNER = "owner.json"
ASK = "owner-ask.json"
OUTCOME = "outcome.pkl"
#: Written by a follower: the owner keeps the run's outcome for it at the end.
FOLLOWED = "followed"
#: What a follower may ask of the owner.
ASKS = ("stop", "interrupt", "kill")
#: How often the owner looks for a follower's request while it polls.
ASK_EVERY_S = 0.25
_WHY_LIVE = "nbddp lists your runs from this folder, and only you may write it"


# ---------------------------------------------------------------------------- the owner's side
class Ownership:
    """The owner's records of one run: made when its ranks have started, ended with the run."""

    def __init__(self, run_dir: Path, detached: bool):
        self.run_dir, self.detached = Path(run_dir), detached
        self.pid, self.start = os.getpid(), start_time(os.getpid())
        self._asked_at = 0.0
        self._entry: Optional[Path] = None

    @classmethod
    def announce(cls, handle: Any, detached: bool = False, name: str = "") -> Optional["Ownership"]:
        """Write the owner record and the user's list entry of a run whose ranks just started; never
        fails a launch (a state folder or cache folder that cannot be written leaves the run unlisted)."""
        own = cls(handle.run_dir, detached)
        spec = handle.spec
        record = {"pid": own.pid, "start": own.start, "detached": detached, "host": socket.gethostname(),
                  "uid": os.getuid(), "started": handle.started_at, "name": name or own.run_dir.name,
                  "world_size": spec.world_size, "backend": spec.backend, "gpus": list(spec.gpus),
                  "call": spec.call, "all_values": bool(spec.all_values), "target": spec.target,
                  "run_dir": str(own.run_dir.absolute())}
        try:
            with statedir.opened(own.run_dir) as state:
                for stale in (ASK, OUTCOME, FOLLOWED):  # an earlier launch's, never this one's
                    state.unlink(stale)
                state.write(OWNER, json.dumps(record).encode())
                identity = state.identity
        except OSError:
            return None
        own._entry = _register(own.run_dir, identity, own.pid, own.start)
        return own

    def asked(self, now: float) -> Optional[str]:
        """A follower's request since the last look (removed once read), at most every :data:`ASK_EVERY_S`."""
        if now - self._asked_at < ASK_EVERY_S:
            return None
        self._asked_at = now
        try:
            with statedir.opened(self.run_dir) as state:
                if not state.exists(ASK):
                    return None
                ask = json.loads(state.read(ASK))
                state.unlink(ASK)
        except (OSError, ValueError):
            return None
        reason = ask.get("reason") if isinstance(ask, dict) else None
        return reason if reason in ASKS else None

    def stopping(self, reason: str) -> None:
        """Say in the owner record that the run is being stopped (``nbddp.runs()`` shows it)."""
        self._note(stopping=reason)

    def _note(self, **fields: Any) -> None:
        try:
            with statedir.opened(self.run_dir) as state:
                record = json.loads(state.read(OWNER))
                state.write(OWNER, json.dumps({**record, **fields}).encode())
        except (OSError, ValueError):
            pass

    def end(self, outcome: Any) -> None:
        """The run has ended: its outcome kept for its followers (a detached run's always), its entry removed."""
        try:
            with statedir.opened(self.run_dir) as state:
                if self.detached or state.exists(FOLLOWED):
                    state.write(OUTCOME, _pickled(outcome))
                state.unlink(ASK)
        except OSError:
            pass
        self._note(ended=time.time())
        _unregister(self._entry)
        self._entry = None


def _pickled(outcome: Any) -> bytes:
    """The outcome as a follower can unpickle it; an error that does not survive the trip as its text."""
    try:
        data = pickle.dumps(outcome)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - an exception class that cannot be rebuilt, a value that cannot travel
        if isinstance(outcome, BaseException):
            return pickle.dumps(NbddpError(f"{type(outcome).__name__}: {outcome}"))
        raise


# ---------------------------------------------------------------------------- a follower's side
def owner_record(run_dir: Path) -> Optional[dict]:
    """The run's owner record, read through its state folder; None if the run has none.

    Raises:
        NotPrivate: the state folder or the record is not provably the user's alone.
    """
    try:
        record = json.loads(statedir.read(run_dir, OWNER))
    except FileNotFoundError:
        return None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def owner_alive(record: dict) -> bool:
    pid, start = record.get("pid"), record.get("start")
    return isinstance(pid, int) and pid > 0 and is_same_process(pid, start if isinstance(start, int) else None)


def ask(run_dir: Path, reason: str) -> None:
    """Ask the run's owner to ``stop``, ``interrupt`` or ``kill`` it (it reads the request as it polls)."""
    if reason not in ASKS:
        raise ValueError(f"reason={reason!r}: use one of {', '.join(ASKS)}")
    statedir.write_json(run_dir, ASK, {"reason": reason, "by": os.getpid(), "at": time.time()})


def asked_stop(run_dir: Path) -> bool:
    return statedir.exists(run_dir, ASK)


def follow_marker(run_dir: Path) -> None:
    """Say that someone follows the run, so that its owner keeps the outcome for them."""
    with contextlib.suppress(OSError):
        statedir.write(run_dir, FOLLOWED, str(os.getpid()).encode())


def outcome(run_dir: Path) -> Tuple[bool, Any]:
    """``(True, the outcome)`` once the owner kept it, else ``(False, None)``. Unpickled only from the
    run's private state folder, checked to be the user's alone (as a rank's result is)."""
    try:
        data = statedir.read(run_dir, OUTCOME)
    except FileNotFoundError:
        return False, None
    return True, pickle.loads(data)


# ---------------------------------------------------------------------------- the user's live runs
def live_folder() -> Optional[Path]:
    """``<cache home>/nbddp/live``, the user's alone (0700); None where it cannot be made so."""
    root = cache_home() / "nbddp"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        return private_folder(private_folder(root, "nbddp's caches", replace=True, narrow=False) / "live",
                              "the list of your live runs", replace=True)
    except (OSError, NotPrivate):
        return None


def _register(run_dir: Path, identity: tuple, pid: int, start: Optional[int]) -> Optional[Path]:
    folder = live_folder()
    if folder is None:
        return None
    entry = folder / f"{pid}-{start}-{secrets.token_hex(4)}.json"
    data = json.dumps({"run_dir": str(Path(run_dir).absolute()), "state": list(identity), "pid": pid,
                       "start": start}).encode()
    try:
        fd = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:
        return None
    return entry


def _unregister(entry: Optional[Path]) -> None:
    if entry is not None:
        with contextlib.suppress(OSError):
            os.unlink(entry)


def registered() -> List[dict]:
    """The user's live runs on this server, as their owners listed them; entries of owners that are
    gone are removed. Each: ``run_dir``, ``state`` (the state folder's identity), ``pid``, ``start``."""
    folder = live_folder()
    if folder is None:
        return []
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        path = folder / name
        try:
            entry = json.loads(read_private(path, _WHY_LIVE))
        except (OSError, ValueError):
            continue
        if not isinstance(entry, dict) or not owner_alive(entry):
            with contextlib.suppress(OSError):
                os.unlink(path)  # its owner ended without removing it (killed)
            continue
        out.append(entry)
    return out


__all__ = ["Ownership", "owner_record", "owner_alive", "ask", "follow_marker", "outcome", "registered",
           "live_folder", "OWNER", "ASK", "OUTCOME", "FOLLOWED"]
