"""The command channel of an interactive group (``%%ranks``): the kernel and each rank, one Unix socket each.

The kernel listens on a Unix socket inside the group's private temporary folder (``mkdtemp``,
mode 0700, :func:`nbddp.kernel.ranks.private_tmp`), so no other user can reach it; it takes a
connection only from a process of its own user that is one of the group's ranks (the socket's
peer credentials, :func:`peer`). No TCP port: nothing on the network, and no local user, can
send code to the ranks or read what they answer. Both ends are the user's own processes, so the
messages are pickles: code to run, values to set, values pulled back.

A message is a tuple whose first item says what it is (the ``OP_*`` and ``REPLY_*`` names), sent
as an 8-byte length and the pickle. A message is pickled whole before a byte is written, so a
value that cannot be pickled fails there and the stream stays whole.

Contract: both sides read it.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from typing import Any, Optional, Tuple

#: What each rank of the group runs: named here, loaded by name in the rank (the kernel never imports it).
ENTRY = "nbddp.rank.interactive:serve"

#: The socket's file name inside the group's private folder.
SOCKET_NAME = "channel"

# kernel -> rank
OP_RUN = "run"  # (OP_RUN, request, source, label): run a cell's code
OP_PULL = "pull"  # (OP_PULL, request, name): send back a value
OP_PUSH = "push"  # (OP_PUSH, request, pickled dict): set values
OP_EXIT = "exit"  # (OP_EXIT,): leave the loop, end the rank

# rank -> kernel
HELLO = "hello"  # (HELLO, rank, pid): first message of a rank
BEGIN = "begin"  # (BEGIN, request, log offset): the cell's output starts there in the rank's log
DONE = "done"  # (DONE, request, status, error type, error line, value): a request answered

# a DONE's status
OK, ERROR, INTERRUPTED = "ok", "error", "interrupted"

_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, message: Tuple[Any, ...]) -> None:
    """Send one message whole (pickled first: a value that cannot be pickled raises before any byte goes)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end of the channel closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def receive(sock: socket.socket) -> Tuple[Any, ...]:
    """The next message; ``EOFError`` when the other end has gone."""
    (size,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    return pickle.loads(_exactly(sock, size))


def peer(sock: socket.socket) -> Optional[Tuple[int, int]]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (Linux ``SO_PEERCRED``), else None."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return pid, uid


def connect(path: str) -> socket.socket:
    """A rank's end: connected to the kernel's socket at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def listen(folder: str) -> Tuple[socket.socket, str]:
    """The kernel's end: a listening socket in ``folder`` (the group's 0700 folder), and its path."""
    path = os.path.join(folder, SOCKET_NAME)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)  # the folder keeps others out already; the socket says so too
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock, path


__all__ = ["ENTRY", "SOCKET_NAME", "OP_RUN", "OP_PULL", "OP_PUSH", "OP_EXIT", "HELLO", "BEGIN", "DONE", "OK", "ERROR",
           "INTERRUPTED", "send", "receive", "peer", "connect", "listen"]
