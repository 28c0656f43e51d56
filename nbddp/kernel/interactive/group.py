"""``nbddp.start_ranks``: a group of rank processes that lives across cells, driven by ``%%ranks``.

Kernel side.
"""

from __future__ import annotations

import ast
import atexit
import pickle
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

from ...contract import channel, plans, rundir
from ...contract.channel import ENTRY
from ...contract.errors import ConfigError, NbddpError
from ..handle import interrupts_held
from ..launch import _check_launch_args, _prepare_run_dir, _resolve_gpus
from ..forkserver import start_method
from ..ranks import Launches
from .cell import Echoes, outcome
from .members import Members, RanksInterrupted, release_state

#: Every group of this kernel by name, oldest first (the last is the one ``%%ranks`` drives).
_groups: "Dict[str, Ranks]" = {}
_lock = threading.Lock()


class Ranks:
    """A live group of rank processes: what ``%%ranks`` cells run in. Made by :func:`start_ranks`.

    Attributes:
        name: the group's name (``%%ranks --group NAME``).
        world_size: how many ranks.
        run_dir: its run folder (``runs/<time>-<name>/``): each rank's log holds every cell it ran
            and its output.
        gone: ``{rank: how it ended}`` for ranks whose process ended (:meth:`restart` starts anew).
    """

    def __init__(self, name: str, launcher: Launches, leases, start_timeout_s: float):
        self.name, self._launcher, self._leases = name, launcher, leases
        self.world_size, self.run_dir = launcher.world, launcher.run_dir
        self._start_timeout_s = start_timeout_s
        self._starts, self._released = 0, False
        self._members: Optional[Members] = None
        self._members = Members(launcher, 0, start_timeout_s)

    # -- state ----------------------------------------------------------------------------------
    @property
    def pids(self) -> List[int]:
        return list(self._members.group.pids) if self._members is not None else []

    @property
    def gone(self) -> Dict[int, str]:
        return dict(self._members.gone) if self._members is not None else {}

    @property
    def stopped(self) -> bool:
        return self._members is None

    def __repr__(self) -> str:
        if self._members is None:
            return f"<nbddp ranks {self.name!r}: stopped; logs in {self.run_dir}>"
        gone = f", gone: {self._members.gone}" if self._members.gone else ""
        return f"<nbddp ranks {self.name!r}: {self.world_size} ranks, pids {self.pids}{gone}; {self.run_dir}>"

    # -- what cells do --------------------------------------------------------------------------
    def run(self, source: str, ranks: Optional[Sequence[int]] = None, label: Optional[str] = None) -> None:
        """Run ``source`` on ``ranks`` (default every rank), their output live in the cell (what ``%%ranks`` does).

        Raises:
            SyntaxError: the code does not parse (found here, before any rank runs it).
            RankCellError: some ranks raised; their tracebacks are in the output, the group is kept.
            RanksInterrupted: Interrupt; the ranks it could not free are named with where they wait.
            WorkerError: a rank's process ended.
        """
        ast.parse(source, label or "<%%ranks>")  # a typo fails here once, not on every rank
        members, targets = self._ready(ranks)
        request = members.new_request()
        label = label or f"ranks-cell-{request}"
        echoes = Echoes(self.run_dir)
        with interrupts_held() as came:
            members.send(targets, (channel.OP_RUN, request, source, label))
            replies = members.wait(targets, request, on_begin=echoes.begin, on_poll=echoes.poll, came=came)
        echoes.poll(final=True)
        error = outcome(members, targets, replies, label)
        if error is not None:
            raise error

    def pull(self, name: str, ranks: Optional[Sequence[int]] = None) -> List[Any]:
        """Each rank's value of ``name`` (tensors moved to the CPU), in rank order.

        Example:
            >>> grads = r.pull("g")          # [g on rank 0, g on rank 1]
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"pull({name!r}): give the name of a variable of the ranks, as a string")
        replies, targets = self._ask(ranks, lambda request: (channel.OP_PULL, request, name), f"pull({name!r})")
        return [pickle.loads(replies[r].data) for r in targets]

    def push(self, ranks: Optional[Sequence[int]] = None, **values: Any) -> None:
        """Set variables on ``ranks`` (default every rank): ``r.push(lr=0.1, ranks=[1])``.

        The values are pickled here and sent over the group's private channel; a class defined in
        the notebook cannot be loaded in a rank (define it in a file both import, or with ``%%ranks``).
        """
        if not values:
            raise ConfigError("push(): name the values to set, as push(x=1, y=t)")
        try:
            data = pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - said with the names
            raise ConfigError(f"push({', '.join(values)}): cannot be sent to the ranks ({exc}); push plain "
                              "values, tensors, or objects of classes defined in a file") from exc
        self._ask(ranks, lambda request: (channel.OP_PUSH, request, data), f"push({', '.join(values)})")

    def _ask(self, ranks, message, what: str):
        members, targets = self._ready(ranks)
        request = members.new_request()
        with interrupts_held() as came:
            members.send(targets, message(request))
            replies = members.wait(targets, request, came=came)
        error = outcome(members, targets, replies, what, cell=False)
        if error is not None:
            raise error
        failed = {r: rep for r, rep in replies.items() if rep.status != channel.OK}
        if failed:
            raise NbddpError(f"{what}: " + "; ".join(f"rank {r}: {rep.error_type}: {rep.error_line}"
                                                     for r, rep in sorted(failed.items())))
        return replies, targets

    def _ready(self, ranks: Optional[Sequence[int]]):
        """The live start and the ranks to ask; refused (with the fix) when they cannot answer."""
        members = self._members
        if members is None:
            raise NbddpError(f"the group {self.name!r} was stopped: start one with nbddp.start_ranks(...), or "
                             "r.restart()")
        targets = _check_ranks(ranks, self.world_size)
        members.drain()
        members.see_exits()
        gone = {r: members.gone[r] for r in targets if r in members.gone}
        if gone:
            raise NbddpError("; ".join(f"rank {r} has ended ({how})" for r, how in sorted(gone.items()))
                             + ": r.restart() starts the group anew (its state is lost), or run on the others "
                               f"(%%ranks {','.join(str(r) for r in range(self.world_size) if r not in members.gone)})")
        busy = [r for r in targets if r in members.busy]
        if busy:
            which = f"rank {busy[0]} is" if len(busy) == 1 else f"ranks {', '.join(map(str, busy))} are"
            raise NbddpError(f"{which} still in an earlier cell that Interrupt could not end (waiting in a "
                             "collective, say): r.restart() starts the group anew (its state is lost)")
        return members, targets

    # -- the group's life -------------------------------------------------------------------------
    def restart(self) -> "Ranks":
        """End every rank and start the group anew, in the same run folder: the process group up again,
        every variable lost (said, as a warning)."""
        with interrupts_held():
            if self._members is not None:
                self._members.close()
                self._members = None
        self._starts += 1
        rundir.prepare_launch(self.run_dir, self.world_size, restart=True)
        self._members = Members(self._launcher, self._starts, self._start_timeout_s)
        warnings.warn(f"the group {self.name!r} was started anew: its ranks' variables are gone", stacklevel=2)
        return self

    def stop(self) -> None:
        """End every rank and what it started (asked, then SIGTERM, then SIGKILL), give back its GPUs'
        leases. The run folder keeps the logs. Twice is harmless."""
        with interrupts_held():
            members, self._members = self._members, None
            try:
                if members is not None:
                    members.close()
            finally:
                if not self._released:  # also after a restart that failed to start
                    self._released = True
                    self._leases.release()
                    release_state(self.run_dir)
            with _lock:
                if _groups.get(self.name) is self:
                    del _groups[self.name]

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _check_ranks(ranks: Optional[Sequence[int]], world_size: int) -> List[int]:
    if ranks is None:
        return list(range(world_size))
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    try:
        chosen = sorted(set(int(r) for r in ranks))
    except (TypeError, ValueError):
        raise ConfigError(f"ranks={ranks!r}: give rank numbers, as [0, 2]") from None
    wrong = [r for r in chosen if not 0 <= r < world_size]
    if wrong or not chosen:
        raise ConfigError(f"ranks={list(ranks)!r}: the group has ranks 0 to {world_size - 1}")
    return chosen


def start_ranks(nprocs: Optional[int] = None, gpus: Union[str, Sequence[int], None] = None, *,
                name: Optional[str] = None, runs_dir=None, timeout_s: Optional[float] = None,
                threads_per_proc: Optional[int] = None, env: Optional[Dict[str, str]] = None) -> Ranks:
    """Start a group of ranks that lives across cells: run code on them with ``%%ranks``.

    Each rank is a fresh process (from the warm server, as ``spawn_train``'s), its process group
    up (gloo on CPU, NCCL with one GPU per rank) and its device set; its namespace starts with
    ``rank``, ``world_size``, ``device``, ``dist`` (``torch.distributed``) and ``torch``, and
    keeps what cells define. ``%load_ext nbddp`` registers the magics (in IPython this call
    registers them too). The group ends with :meth:`Ranks.stop`, the kernel's end, or its death.

    Args:
        nprocs: CPU processes (gloo); 2 when neither ``nprocs`` nor ``gpus`` is given.
        gpus: GPU ids (``[0, 1]``) or ``"idle"``: one rank per GPU (NCCL), leased as ``spawn_train`` leases.
        name: the group's name (``%%ranks --group NAME``) and its run folder's; default ``"ranks"``.
        runs_dir: where its run folder goes (default ``runs``).
        timeout_s: the process group's timeout (a collective that waits longer fails).
        threads_per_proc: each rank's CPU threads (default: the cores shared out).
        env: environment variables for the ranks.

    Returns:
        The group (:class:`Ranks`): ``pull``, ``push``, ``restart``, ``stop``.

    Example:
        >>> r = nbddp.start_ranks(nprocs=2)
        >>> %load_ext nbddp
        >>> %%ranks
        ... x = torch.ones(2) * rank
        ... dist.all_reduce(x); x
        >>> r.pull("x")
    """
    if nprocs is None and gpus is None:
        nprocs = 2
    _check_launch_args(nprocs, timeout_s, name)
    name = name or "ranks"
    with _lock:
        old = _groups.get(name)
    if old is not None:
        old.stop()  # a second start under one name replaces the first (a notebook run again from the top)
    _, ids, leases = _resolve_gpus(ENTRY, gpus)
    run_dir = None
    try:
        plan = plans.plan(ENTRY, kwargs={"channel_path": ""}, nprocs=nprocs, gpus=ids, name=name,
                          runs_dir=runs_dir, timeout_s=timeout_s)
        run_dir = _prepare_run_dir(plan, plan.world)
        leases.note(str(run_dir))
        launcher = Launches(plan, run_dir, threads_per_proc, start_method("forkserver"), env, False, 0)
        group = Ranks(name, launcher, leases, start_timeout_s=plan.timeout + 30)
    except BaseException:
        leases.release()
        if run_dir is not None:
            release_state(run_dir)  # the state folder the run folder's preparation holds open
        raise
    with _lock:
        _groups[name] = group
    _register_magics()
    return group


def current(name: Optional[str] = None) -> Ranks:
    """The group ``%%ranks`` drives: ``name``'s, else the one started last."""
    with _lock:
        if name is not None:
            if name not in _groups:
                known = ", ".join(map(repr, _groups)) or "none"
                raise NbddpError(f"no group named {name!r} (running: {known}); start it with "
                                 f"nbddp.start_ranks(nprocs=2, name={name!r})")
            return _groups[name]
        if not _groups:
            raise NbddpError("no group of ranks is running: start one with r = nbddp.start_ranks(nprocs=2)")
        return list(_groups.values())[-1]


def stop_all() -> None:
    """Stop every group of this kernel (at its end)."""
    with _lock:
        groups = list(_groups.values())
    for group in groups:
        try:
            group.stop()
        except Exception:  # noqa: BLE001 - at exit: the next group must be stopped too
            pass


def _register_magics() -> None:
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is not None:
        from .magics import register

        register(shell, current)


atexit.register(stop_all)

__all__ = ["Ranks", "start_ranks", "current", "stop_all", "RanksInterrupted"]
