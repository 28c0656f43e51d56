"""One start of an interactive group's ranks: the processes (a :class:`~nbddp.kernel.ranks.RankGroup`), one
channel socket per rank, and the requests in flight.

The ranks start as ``spawn_train``'s do (:class:`~nbddp.kernel.ranks.Launches`: the warm server,
the private ``FileStore`` rendezvous, the private temporary folder, the run folder) with
:data:`nbddp.rank.interactive.ENTRY` as their function. The channel's socket is made in the
start's private temporary folder before the ranks start; each rank connects once its process
group is up, and is taken only if the socket's peer is one of the group's processes, of this
user (:func:`nbddp.contract.channel.peer`).

A request (a cell, a pull, a push) has a number; a rank's answers carry it. A rank that did not
answer (Interrupt could not free it) stays *busy* with that number until its late answer comes;
the group refuses it new requests meanwhile.

Kernel side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import time
from typing import Dict, List, Optional

from ...contract import channel, rundir, statedir
from ...contract.errors import NbddpError
from ...contract.system import start_time
from ..handle import interrupts_held
from ..ranks import Launches, RankGroup, remove_private_tmp
from ..report import RankEnd, build_worker_error, signal_name

#: Seconds the ranks get to leave their loop when asked, then to end after SIGTERM, before SIGKILL.
EXIT_GRACE_S, TERM_GRACE_S = 3.0, 2.0


def how_it_ended(end: RankEnd) -> str:
    """``"killed by SIGKILL, possibly out of memory"``, ``"killed by SIGTERM"``, ``"exit code 3"``."""
    name = signal_name(end.exitcode)
    if name == "SIGKILL":
        return "killed by SIGKILL, possibly out of memory"
    return f"killed by {name}" if name else f"exit code {end.exitcode}"


class RanksInterrupted(NbddpError, KeyboardInterrupt):
    """A ``%%ranks`` cell (or a pull, a push) was interrupted; unlike a run's Interrupt, the group stays up.

    A ``KeyboardInterrupt``: ``except KeyboardInterrupt`` catches it. The message says which ranks
    Interrupt could not free, and where they wait.
    """

    def __init__(self, message: str, run_dir=None, stuck=()):
        super().__init__(message)
        self.run_dir, self.stuck = run_dir, tuple(stuck)

    def _render_traceback_(self) -> List[str]:
        return f"{type(self).__name__}: {self}".splitlines()


@dataclasses.dataclass
class Reply:
    """A rank's answer to one request (see :data:`nbddp.contract.channel.DONE`)."""

    status: str
    error_type: Optional[str] = None
    error_line: Optional[str] = None
    data: Optional[bytes] = None


class Members:
    """One start of the group's ranks (see the module docstring); :meth:`close` ends it, twice harmless."""

    def __init__(self, launcher: Launches, restart: int, start_timeout_s: float):
        self.launcher = launcher
        self.run_dir = launcher.run_dir
        self.world_size = launcher.world
        self.socks: Dict[int, socket.socket] = {}
        self.busy: Dict[int, int] = {}  # rank -> the request it has not answered
        self.gone: Dict[int, str] = {}  # rank -> how its process ended
        self.closed = False
        self._next_request = 0
        spec, meet, child_env, tmp_dir = launcher.prepare(restart)
        try:
            listener, path = channel.listen(tmp_dir)
        except BaseException:
            meet.close()
            remove_private_tmp(tmp_dir)
            raise
        spec = dataclasses.replace(spec, kwargs={"channel_path": path})
        with listener, interrupts_held() as came:
            try:
                self.group = RankGroup.start(launcher, spec, meet, child_env, tmp_dir)
            except (EOFError, OSError) as exc:  # the warm server's connection broke: it died
                raise NbddpError(f"starting the ranks of {self.run_dir} failed ({exc}); start them again") from exc
            self.spec = spec
            try:
                rundir.update_launch_record(
                    self.run_dir, target=spec.target, world_size=spec.world_size, backend=spec.backend,
                    gpus=list(spec.gpus), pids=self.group.pids, start_times=[start_time(p) for p in self.group.pids],
                    parent_pid=os.getpid(), store=meet.kind, store_path=spec.store_path, started=time.time(),
                    tmp_dir=tmp_dir)  # for nbddp.cleanup, should the kernel die first
                self._accept(listener, start_timeout_s, came)
            except BaseException:
                self.close()
                raise
            finally:  # every rank is in (or the start failed): nothing listens any more, nor has a name
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # -- the start -----------------------------------------------------------------------------
    def _accept(self, listener: socket.socket, timeout_s: float, came: list) -> None:
        """Take one connection per rank, from the rank's own process; a rank that fails first is named."""
        deadline = time.monotonic() + timeout_s
        listener.settimeout(0.1)
        while True:
            if came:  # an Interrupt during the start, however late in it, is never lost
                raise RanksInterrupted(f"interrupted while the group's ranks started: they were ended, nothing is "
                                       f"left running; the run folder is {self.run_dir}", run_dir=self.run_dir)
            if len(self.socks) == self.world_size:
                return
            self.group.see_exits(time.time(), by_launcher=False)
            if self.group.ends:
                raise build_worker_error(self.run_dir, self.group.ends, self.world_size)
            if time.monotonic() > deadline:
                raise NbddpError(f"the ranks of {self.run_dir} did not reach the kernel within {timeout_s:g} s "
                                 f"(only ranks {sorted(self.socks)} did); their logs are in {self.run_dir}/logs")
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        who = channel.peer(conn)
        if who is None or who[1] != os.getuid() or who[0] not in self.group.pids:
            conn.close()  # not one of this group's processes: never a rank
            return
        conn.settimeout(10)
        try:
            kind, rank, pid = channel.receive(conn)[:3]
        except (EOFError, OSError, ValueError):
            conn.close()
            return
        if (kind != channel.HELLO or not isinstance(rank, int) or not 0 <= rank < self.world_size or pid != who[0]
                or self.group.pids[rank] != pid or rank in self.socks):
            conn.close()
            return
        conn.settimeout(None)
        self.socks[rank] = conn

    # -- the processes -------------------------------------------------------------------------
    def see_exits(self) -> Dict[int, str]:
        """Ranks whose process ended since the last look, with how (also kept in :attr:`gone`)."""
        if self.closed:
            return {}
        self.group.see_exits(time.time(), by_launcher=False)
        new = {r: how_it_ended(e) for r, e in self.group.ends.items() if r not in self.gone}
        self.gone.update(new)
        return new

    def pid(self, rank: int) -> int:
        return self.group.pids[rank]

    # -- requests ------------------------------------------------------------------------------
    def new_request(self) -> int:
        self._next_request += 1
        return self._next_request

    def send(self, ranks: List[int], message: tuple) -> None:
        for r in ranks:
            try:
                channel.send(self.socks[r], message)
            except OSError:  # its process ended: seen by the wait that follows
                pass

    def drain(self) -> None:
        """Read what came unasked (a busy rank's late answer; a rank's end) without waiting."""
        while True:
            socks = {self.socks[r]: r for r in self.socks if r not in self.gone}
            if not socks:
                return
            ready, _, _ = select.select(list(socks), [], [], 0)
            if not ready:
                return
            for s in ready:
                self._next(socks[s], s)

    def _next(self, rank: int, sock: socket.socket) -> Optional[tuple]:
        """The rank's next message (a busy rank's late answer frees it); None when its channel closed."""
        try:
            message = channel.receive(sock)
        except (EOFError, OSError):
            self._lost(rank)
            return None
        if message[0] == channel.DONE and self.busy.get(rank) == message[1]:
            del self.busy[rank]
        return message

    def _lost(self, rank: int) -> None:
        """Rank ``rank``'s end of the channel closed: its process is ending; wait a moment to say how."""
        deadline = time.monotonic() + 2.0
        while rank not in self.group.ends and time.monotonic() < deadline:
            self.group.see_exits(time.time(), by_launcher=False)
            time.sleep(0.02)
        self.see_exits()
        self.gone.setdefault(rank, "its channel closed")

    def wait(self, ranks: List[int], request: int, on_begin=None, on_poll=None, came: Optional[list] = None,
             interrupt_wait_s: float = 3.0) -> Dict[int, Reply]:
        """Wait for ``ranks``' answers to ``request``; an Interrupt (``came`` non-empty) sends SIGINT to those
        still at it and waits ``interrupt_wait_s`` more. Who never answered stays in :attr:`busy`.

        ``on_begin(rank, log_offset)``: a cell's output starts; ``on_poll()``: every 50 ms and at each message.
        """
        pending, replies = set(ranks), {}
        interrupted_at: Optional[float] = None
        while pending:
            if came and interrupted_at is None:
                interrupted_at = time.monotonic()
                came.clear()
                for r in pending:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(self.pid(r), signal.SIGINT)
            elif came or (interrupted_at is not None and time.monotonic() - interrupted_at > interrupt_wait_s):
                break  # a second Interrupt, or the first could not free them: the kernel never hangs
            socks = {self.socks[r]: r for r in pending}
            ready, _, _ = select.select(list(socks), [], [], 0.05)
            for s in ready:
                r = socks[s]
                message = self._next(r, s)
                if message is None:
                    pending.discard(r)
                    continue
                if message[1] != request:  # an earlier request's late answer
                    continue
                if message[0] == channel.BEGIN and on_begin is not None:
                    on_begin(r, message[2])
                elif message[0] == channel.DONE:
                    replies[r] = Reply(*message[2:6])
                    pending.discard(r)
            for r in self.see_exits():
                pending.discard(r)
            if on_poll is not None:
                on_poll()
        for r in pending:
            self.busy[r] = request
        return replies

    # -- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """End every rank (asked, then SIGTERM, then SIGKILL), reap them, give back what the start holds."""
        if self.closed:
            return
        self.send(list(self.socks), (channel.OP_EXIT,))
        self._wait_for_ends(EXIT_GRACE_S)
        if self.group.running():
            self.group.signal(signal.SIGTERM)
            self._wait_for_ends(TERM_GRACE_S)
        if self.group.running():
            self.group.signal(signal.SIGKILL)
        for s in self.socks.values():
            with contextlib.suppress(OSError):
                s.close()
        self.group.reap()
        self.group.close()  # leftovers ended, the meeting point and the private folder removed
        rundir.update_launch_record(self.run_dir, ended=time.time())
        self.closed = True

    def _wait_for_ends(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.group.running() and time.monotonic() < deadline:
            self.group.see_exits(time.time(), by_launcher=True)
            time.sleep(0.02)
        self.group.see_exits(time.time(), by_launcher=True)


def release_state(run_dir) -> None:
    """The run's state folder, held open since the first start, let go (at the group's end)."""
    statedir.release(run_dir)


__all__ = ["Members", "RanksInterrupted", "Reply", "how_it_ended", "release_state", "EXIT_GRACE_S", "TERM_GRACE_S"]
