"""Where a launch's ranks meet: a store other users of the machine cannot reach, where possible.

The ranks of a launch exchange their addresses (gloo) or NCCL's unique id through a key-value
store before the first collective. Whoever can read and write that store can join the group,
read what it holds or derail the start. Two kinds, by who makes the process group:

- nbddp makes it (``call="ctx"``, the default, and the built-in worker): a ``FileStore`` in a
  folder of its own, mode ``0700``, made by the kernel for this launch and removed at its end.
  No port: other local users cannot reach it; only this user's processes can.
- the user's code makes it with ``init_process_group("env://")`` (a script, ``call="torchrun"``):
  ``env://`` can only dial a TCP store at ``MASTER_ADDR:MASTER_PORT``, so the kernel hosts a
  ``TCPStore`` on loopback, as torchrun's agent does. The network cannot reach it; every local
  user can (TCPStore has no authentication), as under torchrun itself: one who finds the port
  (``/proc/net/tcp`` lists it) can read the ranks' addresses and write keys that derail their
  start (a forged address record fails ``init_process_group`` with ``MemoryError:
  std::bad_alloc``). The exposure is kept as short as torch allows: the port is reserved (bound,
  refusing connections) when the launch is prepared and listens only when the ranks are about to
  start (:meth:`Rendezvous.open`), after a warm server's cold start. It cannot close once the ranks
  have joined: torch keeps using the store for the run (NCCL makes its communicators through it at
  the first collective, ``new_group`` and store barriers too). The kernel's error for a failed
  rendezvous names this exposure when a foreign key explains it (:func:`nbddp.kernel.report.foreign_key_note`).
- ``call="mp.spawn"``: the function's rank 0 hosts its own store at ``MASTER_PORT``, as it does
  under ``torch.multiprocessing.spawn``; the kernel hosts none.

Kernel side.
"""

from __future__ import annotations

import datetime
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..contract.conventions import MP_SPAWN, SPAWNS, makes_own_group

#: The store file inside the launch's private folder.
STORE_FILE = "store"


def reserve_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 that does not listen yet: the port is the
    launch's, and nobody can connect to it until :func:`listening_store`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
    except BaseException:
        sock.close()
        raise
    return sock


def listening_store(sock: socket.socket, timeout_s: float) -> dist.TCPStore:
    """The kernel's TCPStore on a socket of :func:`reserve_port`, listening from now on (the store owns the socket).

    ``TCPStore("127.0.0.1", 0, is_master=True)`` listens on every interface whatever the host
    says, so anyone on the server's network could write into a run's rendezvous. nbddp binds
    the socket itself and hands it over (``master_listen_fd``).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        sock.listen(128)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the listening socket when it goes
    return store


def free_tcp_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore owned by the kernel, listening on a free port of 127.0.0.1 only, now."""
    return listening_store(reserve_port(), timeout_s)


def free_port() -> int:
    """A port free now on loopback, for code that hosts its own rendezvous there (an mp.spawn
    function's rank 0); nothing of nbddp listens on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Rendezvous:
    """A launch's meeting point, held by the kernel until the run ends (:meth:`close`).

    Attributes:
        kind: ``"file"`` (private ``FileStore``), ``"tcp"`` (the kernel's ``TCPStore`` on
            loopback, for ``env://``) or ``"own"`` (the user's code hosts it: mp.spawn).
        store_path: the ``FileStore`` file the ranks open (``"file"`` only).
        store_port: the kernel's ``TCPStore`` port (``"tcp"`` only).
        master_port: ``MASTER_PORT`` the ranks see: the store's port under ``env://``, else a
            free port nothing of nbddp listens on.
    """

    def __init__(self, kind: str, timeout_s: float, within: Optional[str] = None):
        """``within``: the folder to make the ``FileStore``'s own folder in (the launch's private
        temp folder, so that one folder holds all a launch leaves in the temp folder); default
        the system temp folder."""
        self.kind = kind
        self._store: Optional[dist.TCPStore] = None
        self._folder: Optional[Path] = None
        self.store_path: Optional[str] = None
        self.store_port: Optional[int] = None
        if kind == "file":
            self._folder = Path(tempfile.mkdtemp(prefix="nbddp-rendezvous-", dir=within))  # 0700, ours, never reused
            self.store_path = str(self._folder / STORE_FILE)
        elif kind == "tcp":
            self._reserved: Optional[socket.socket] = reserve_port()
            self._timeout_s = timeout_s
            self.store_port = self._reserved.getsockname()[1]
        self.master_port = self.store_port if kind == "tcp" else free_port()

    def open(self) -> None:
        """Start listening (``"tcp"``): called just before the ranks start, so that the store is
        reachable no longer than they need it; idempotent, nothing to do for the other kinds."""
        if self.kind == "tcp" and self._store is None and self._reserved is not None:
            sock, self._reserved = self._reserved, None
            self._store = listening_store(sock, self._timeout_s)

    def close(self) -> None:
        """Stop the TCP store (freeing its port) or remove the private folder; idempotent."""
        self._store = None
        if getattr(self, "_reserved", None) is not None:
            self._reserved.close()
            self._reserved = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def rendezvous_for(call: str, target: str, timeout_s: float, within: Optional[str] = None) -> Rendezvous:
    """The meeting point a launch of ``target`` called as ``call`` needs (see the module's table);
    a private ``FileStore`` is made in ``within`` (the launch's private temp folder)."""
    if not makes_own_group(call, target):
        return Rendezvous("file", timeout_s, within)
    return Rendezvous("own" if call in (MP_SPAWN, SPAWNS) else "tcp", timeout_s)


__all__ = ["Rendezvous", "rendezvous_for", "free_tcp_store", "reserve_port", "listening_store", "free_port",
           "STORE_FILE"]
