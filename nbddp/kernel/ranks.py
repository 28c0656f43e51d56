"""One start of the ranks, owned in one place: :class:`RankGroup`, and :class:`Launches` that makes each.

A run's ranks may start more than once (a restart is a new start in the same run folder). Each
start is one :class:`RankGroup`: its processes, its meeting point (the store), its private
temporary folder and torch's per-rank error files in it. The group starts the processes, sees
them exit, signals and reaps them, and gives back each of its resources in :meth:`RankGroup.close`.
A restart is "close this one, start the next": :meth:`RankGroup.next` asks the run's
:class:`Launches` (what every start of one run shares) for the next group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch.multiprocessing as mp

from ..contract import debugging, rundir, statedir
from ..contract.plans import LaunchPlan
from ..contract.private import compile_cache_env
from ..contract.safe_path import starts_safely
from ..contract.protocol import (MAX_RESTARTS_ENV, RESTART_ENV, Heartbeat, LaunchSpec, adopt_torch_error_file,
                                 read_heartbeats, start_rank)
from ..contract.system import cpu_cores, kill_group_or_process, start_time
from .forkserver import server_pid, start_server
from . import interrupt
from .procs import MARKER_ENV, end_leftovers, end_recorded_tree, folder_id, launch_ticks, orphaned_group
from .rendezvous import Rendezvous, rendezvous_for
from .report import RankEnd
from .stacks import flight_recorder_env

#: How long what the ranks started gets after SIGTERM, once the ranks are gone, before SIGKILL.
_LEFTOVER_GRACE_S = 1.0


@contextlib.contextmanager
def patched_env(values: Dict[str, Optional[str]]):
    """Set environment variables for the children to inherit; restore them afterwards."""
    def apply(settings: Dict[str, Optional[str]]) -> None:
        for k, v in settings.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    old = {k: os.environ.get(k) for k in values}
    try:
        apply(values)
        yield
    finally:
        apply(old)


@contextlib.contextmanager
def bare_main():
    """Spawned children re-import the parent's ``__main__`` (pytest, a script, ipykernel).

    Workers load their function from a file, so they need none of it: a bare ``__main__``
    during the start keeps IPython out of the workers and saves a second of start-up.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@contextlib.contextmanager
def sigint_held(hold: bool):
    """While spawned ranks start, SIGINT is blocked in this thread, so they start with it blocked.

    A spawned rank is in the kernel's process group until its first line moves it to its own,
    and Jupyter's Interrupt goes to that whole group: during the seconds the rank imports torch
    it would raise a bare ``KeyboardInterrupt`` there and print its traceback into the cell. A
    blocked signal stays pending instead; the rank drops it and unblocks SIGINT once it is in its
    own group (:func:`nbddp.rank.interrupt.install`). An Interrupt meant for the kernel in this
    moment is delivered to it when the block ends, not lost.
    """
    if not hold:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def error_files_in(folder: str):
    """torch's per-rank error files (``pytorch-errorfile-*``) go to ``folder``, not the shared temp folder.

    Only torch's launcher module sees the change (its ``tempfile``), so no other thread of the
    kernel puts its temporary files there meanwhile.
    """
    spawn = sys.modules.get("torch.multiprocessing.spawn")
    if getattr(spawn, "tempfile", None) is not tempfile:  # another torch: the rank entry catches everything anyway
        yield
        return
    shim = types.SimpleNamespace(NamedTemporaryFile=functools.partial(tempfile.NamedTemporaryFile, dir=folder))
    spawn.tempfile = shim
    try:
        yield
    finally:
        spawn.tempfile = tempfile


def private_tmp(run_dir: Path) -> str:
    """A new folder for the ranks' temporary files (``TMPDIR``), mode 0700, in the system temp folder.

    torch's ``start_processes`` names each rank's error file in the temp folder and deletes the
    file before the rank writes it, so in a shared ``/tmp`` another user could plant a link
    there; the ranks' own temporary files are theirs too. ``mkdtemp`` creates the folder
    atomically, 0700; it stays short (Unix socket paths are limited) and off network file
    systems. The handle removes it when the run ends; it names its run (:data:`rundir.TMP_OWNER`)
    so that ``cleanup`` of another run folder, whose record names this folder, leaves it alone.
    """
    folder = tempfile.mkdtemp(prefix=rundir.TMP_PREFIX)
    rundir.claim_tmp(folder, run_dir)
    return folder


def start_helpers(start_method: str) -> None:
    """Start multiprocessing's resource tracker and the warm server before the launch's environment
    is set: they stay for later launches, and must carry no run's marker (``cleanup`` would take
    them for what a rank started) nor its ports."""
    from multiprocessing import resource_tracker

    with starts_safely():  # python -c in the notebook's folder: never importing from it first
        resource_tracker.ensure_running()
    if start_method == "forkserver":
        start_server()


def ranks_env(run_dir: Path, port: int, threads: int, visible_devices: Optional[str], warm: bool,
               env: Optional[Dict[str, str]], tmp_dir: Optional[str] = None) -> Dict[str, Optional[str]]:
    """The variables nbddp sets for the workers (``None`` removes one), the user's ``env`` on top."""
    child_env: Dict[str, Optional[str]] = {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
    }
    if tmp_dir is not None:
        child_env["TMPDIR"] = tmp_dir  # private to the run (see private_tmp)
        # Compiled code the ranks load (torch.compile, Triton, extensions): in the user's own
        # private cache, shared between runs, never torch's default in the shared /tmp.
        child_env.update(compile_cache_env(fallback=tmp_dir))
    if visible_devices is not None:
        child_env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=visible_devices)
        # NCCL's flight recorder: the last collectives of each rank, dumped into the run's private
        # folder when the watchdog times one out; the error then names each rank's last one.
        for var, value in flight_recorder_env(run_dir).items():
            if var not in os.environ:
                child_env[var] = value
    # Every rank is on this machine: gloo pairs and NCCL's bootstrap listen on loopback, never
    # on an address the server's network can reach (unless the user chose an interface).
    if os.path.exists("/sys/class/net/lo"):
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var not in os.environ:
                child_env[var] = "lo"
    child_env.update(env or {})
    if not warm:
        # The run's marker from the first instruction on, for cleanup to prove a spawned worker
        # is this run's even before it opens its log (forked workers show the server's birth
        # environment in /proc instead; their log on fd 1 marks them, see procs.carries_marker).
        child_env[MARKER_ENV] = str(Path(run_dir).absolute())
    return child_env


class Launches:
    """What every launch of one run shares, and how to start one: the first, then each restart.

    A restart (:mod:`nbddp.kernel.restarts`) is a new launch in the same run folder, with a new meeting
    point and temp folder, its number in ``NBDDP_RESTART_COUNT``, and the built-in worker's config
    set to resume the folder (with ``changes``, the halved batch of an out-of-memory restart).
    """

    def __init__(self, plan: LaunchPlan, run_dir: Path, threads_per_proc: Optional[int], start_method: str,
                 env: Optional[Dict[str, str]], all_values: bool, max_restarts: int, observe: Optional[dict] = None):
        # The plan is placed (nbddp.contract.plans.place_plan): its ranks, backend, GPUs and timeout.
        self.plan, self.world, self.backend, self.run_dir = plan, plan.world, plan.backend, run_dir
        self.start_method, self.env, self.all_values = start_method, env, all_values
        self.max_restarts = max_restarts
        self.visible_devices = plan.visible_devices
        self.timeout = plan.timeout
        self.threads = threads_per_proc or max(1, cpu_cores() // self.world)
        self.config = plan.config
        self.observe = observe  # what the ranks record beside the run (profile=, trackers=)

    def prepare(self, restart: int) -> Tuple[LaunchSpec, Rendezvous, Dict[str, Optional[str]], str]:
        """The spec, meeting point, environment and private temp folder of launch number ``restart``."""
        plan = self.plan
        # nbddp's own group meets in a FileStore only this user can open; env:// needs a TCP store.
        debugging.clear(self.run_dir)  # an earlier launch's prompts are not this one's
        tmp_dir = private_tmp(self.run_dir)
        try:
            meet = rendezvous_for(plan.call, plan.target, self.timeout, within=tmp_dir)
        except BaseException:
            remove_private_tmp(tmp_dir)
            raise
        try:
            warm = self.start_method == "forkserver"
            child_env = ranks_env(self.run_dir, meet.master_port, self.threads, self.visible_devices, warm, self.env,
                                  tmp_dir)
            child_env.update({RESTART_ENV: str(restart), MAX_RESTARTS_ENV: str(self.max_restarts)})
            # The kernel's whole environment as of this launch, with nbddp's variables on top: a
            # forkserver's children would otherwise see the server's environment from its start, and
            # miss what the user set since (NCCL_DEBUG=INFO in a cell, say).
            snapshot = {**os.environ, **{k: v for k, v in child_env.items() if v is not None}}
            args = (self.config,) if self.config is not None and restart else tuple(plan.args)
            state = statedir.pinned(self.run_dir)  # made by prepare_launch; the ranks open this very folder
            spec = LaunchSpec(target=plan.target, args=args, kwargs=plan.kwargs, world_size=self.world,
                              backend=self.backend, gpus=tuple(plan.gpus), store_host="127.0.0.1",
                              store_port=meet.store_port, store_path=meet.store_path, run_dir=str(self.run_dir),
                              parent_pid=None if warm else os.getpid(), threads=self.threads, timeout_s=self.timeout,
                              env=snapshot, kernel=(os.getpid(), start_time(os.getpid())),
                              all_values=self.all_values, call=plan.call, argv=plan.argv, payload=plan.payload,
                              cwd=os.getcwd(), master_port=meet.master_port, observe=self.observe,
                              state_id=state.identity if state is not None else None)
        except BaseException:
            meet.close()
            remove_private_tmp(tmp_dir)
            raise
        return spec, meet, child_env, tmp_dir

    def next(self, restart: int, changes: Dict[str, list]) -> "RankGroup":
        """Start restart number ``restart`` as a new :class:`RankGroup`.

        The built-in worker's config resumes the run folder, with ``changes`` applied and kept
        in its ``config.json``; a worker of your own finds its checkpoint with ``ctx.load_checkpoint()``.
        """
        if self.config is not None:
            self.config = self.config.replace(resume=str(self.run_dir), **{k: v[1] for k, v in changes.items()})
            self.config.save(rundir.config_path(self.run_dir))
        rundir.prepare_launch(self.run_dir, self.world, restart=True)
        spec, meet, child_env, tmp_dir = self.prepare(restart)
        return RankGroup.start(self, spec, meet, child_env, tmp_dir)



def remove_private_tmp(path: Optional[str]) -> None:
    """Remove the ranks' private temp folder (see :func:`private_tmp`); best effort."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _end_group(pid: int) -> None:
    """SIGTERM to the process group of a rank that just exited (it led it): what it started
    there goes with it (see :func:`nbddp.kernel.procs.orphaned_group`)."""
    if orphaned_group(pid):
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass


class RankGroup:
    """One start of a run's ranks and everything it holds until :meth:`close`.

    Attributes:
        spec: what the ranks were started with.
        pids: each rank's process id, in rank order.
        ends: how each rank that has ended ended (:class:`nbddp.kernel.report.RankEnd`).
        started_at: when this start began (heartbeats before it are an earlier start's).
        not_before: the same in /proc's start-time ticks: no process older is a descendant of its ranks.
        folder: the run folder as this start found it (device, inode): what its ranks left behind is
            looked for by that, never by where the folder's name leads at the end.
        server: the warm server the ranks forked from (none under spawn): they die with it.
    """

    def __init__(self, launches: Optional["Launches"], procs, spec: LaunchSpec, store, tmp_dir: Optional[str],
                 not_before: Optional[int] = None):
        self.launches, self.procs, self.spec, self.store, self.tmp_dir = launches, procs, spec, store, tmp_dir
        self.not_before = not_before
        self.run_dir, self.world_size = Path(spec.run_dir), spec.world_size
        self.pids = [p.pid for p in procs.processes]
        self.folder = folder_id(self.run_dir)
        self.ends: Dict[int, RankEnd] = {}
        self.started_at = time.time()
        self.server = server_pid() if spec.parent_pid is None else None
        self.closed = False

    @classmethod
    def start(cls, launches: Optional["Launches"], spec: LaunchSpec, store, child_env: Dict[str, Optional[str]],
              tmp_dir: str, start_method: Optional[str] = None) -> "RankGroup":
        """Start one process per rank, each running ``start_rank(local_rank, spec)``.

        What the start made (the store, the temp folder) is given back if it fails.
        """
        start_method = start_method or launches.start_method
        try:
            start_helpers(start_method)  # a launch server that died is started again
            store.open()  # env://'s store listens from here on: after a warm server's cold start, not during it
            not_before = launch_ticks()  # a process started just before, in the same tick, is not after it
            with patched_env(child_env), bare_main(), error_files_in(tmp_dir), sigint_held(start_method == "spawn"), \
                    starts_safely():
                procs = mp.start_processes(start_rank, args=(spec,), nprocs=spec.world_size, join=False,
                                           start_method=start_method)
        except BaseException:
            with contextlib.suppress(Exception):
                store.close()
            remove_private_tmp(tmp_dir)
            raise
        return cls(launches, procs, spec, store, tmp_dir, not_before)

    # -- the processes ---------------------------------------------------------------------
    def running(self) -> List[int]:
        """The ranks whose process has not ended."""
        return [r for r, p in enumerate(self.procs.processes) if r not in self.ends and p.exitcode is None]

    def see_exits(self, now: float, by_launcher: bool) -> None:
        """Note each rank that exited since the last look; what it left in its group goes with it."""
        for rank, p in enumerate(self.procs.processes):
            if rank not in self.ends and p.exitcode is not None:  # exitcode reaps the child
                self.ends[rank] = RankEnd(rank, p.pid, p.exitcode, now, by_launcher)
                _end_group(p.pid)
                if p.exitcode != 0:
                    self._adopt_torch_error_file(rank)

    @property
    def all_ended(self) -> bool:
        return len(self.ends) == self.world_size

    def failed(self) -> List[RankEnd]:
        """The ranks that ended with an error nbddp did not cause."""
        return [e for e in self.ends.values() if e.exitcode != 0 and not e.by_launcher]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every running rank's process group (its DataLoader workers included);
        SIGINT to the rank's process alone, and only once it has beaten (before, it has no
        KeyboardInterrupt handler: SIGTERM follows)."""
        if self.closed:
            return
        beats = self.beats() if sig == signal.SIGINT else {}
        for rank in self.running():
            if sig == signal.SIGINT and rank not in beats:
                continue
            interrupt.signal_rank(self.procs.processes[rank].pid, sig, kill_group_or_process)

    def end_ranks(self, ranks) -> None:
        """SIGTERM to these running ranks now (they have nothing to finish: still starting or meeting)."""
        if self.closed:
            return
        for rank in set(ranks) & set(self.running()):
            interrupt.signal_rank(self.procs.processes[rank].pid, signal.SIGTERM, kill_group_or_process)

    def reap(self) -> None:
        """Join every process (kill one still there); a rank not seen to end counts as ended by nbddp."""
        if self.closed:
            return
        now = time.time()
        for rank, p in enumerate(self.procs.processes):
            p.join(timeout=5)
            if p.exitcode is None:  # cannot happen after SIGKILL, but never leave one behind
                p.kill()
                p.join()
            if rank not in self.ends:
                self.ends[rank] = RankEnd(rank, p.pid, p.exitcode, now, True)

    def kill_started(self) -> None:
        """End and reap the processes of a start that failed before a handle took them over."""
        for p in self.procs.processes:
            kill_group_or_process(p.pid)
            p.join(timeout=10)

    # -- what the ranks say ------------------------------------------------------------------
    def beats(self) -> Dict[int, Heartbeat]:
        """This start's heartbeats: a resumed or restarted run's folder still holds the earlier ones.

        One written by this start's own process is this start's, whatever its time: from a warm
        server a rank beats within milliseconds, before ``started_at`` (noted once every process
        is started), and would otherwise count as silent until its next beat a second later."""
        return {r: b for r, b in read_heartbeats(self.run_dir, self.world_size).items()
                if (b.beat_time or 0.0) >= self.started_at or (b.pid is not None and b.pid == self.pids[r])}

    def answering(self) -> Dict[int, int]:
        """``{rank: pid}`` of the running ranks that can answer for their stack: those that have
        beaten in this start (a rank registers its stack signal before its first heartbeat; before
        that, the signal's default action would end it)."""
        beats = self.beats()
        return {r: self.procs.processes[r].pid for r in self.running() if r in beats}

    # -- torch's error files -----------------------------------------------------------------
    def _adopt_torch_error_file(self, rank: int) -> None:
        """A failure torch's spawn wrapper caught before nbddp's own handling becomes the rank's record."""
        files = self.error_files()
        adopt_torch_error_file(self.run_dir, rank, self.pids[rank], files[rank] if rank < len(files) else None)

    def error_files(self) -> List[Optional[str]]:
        return list(getattr(self.procs, "error_files", None) or [])

    def _remove_error_files(self) -> None:
        for path in self.error_files():
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Give back what this start holds once its ranks have ended: leftovers, torch's error files,
        the processes' handles, the meeting point and the temp folder (a run's GPU leases are not
        the group's: a restart uses them). Twice is harmless."""
        if self.closed:
            return
        self._remove_error_files()
        # Nothing a rank started outlives the run: its group, and marked processes that left it.
        end_leftovers(self.run_dir, groups=self.pids, grace_s=_LEFTOVER_GRACE_S, folder=self.folder)
        end_recorded_tree(self.run_dir, range(len(self.pids)), grace_s=_LEFTOVER_GRACE_S,  # a killed rank's
                          not_before=self.not_before)
        for p in self.procs.processes:
            with contextlib.suppress(Exception):
                p.close()
        self.close_store()
        remove_private_tmp(self.tmp_dir)
        self.tmp_dir = None
        self.closed = True

    def close_store(self) -> None:
        """Close the meeting point (its port or private folder freed); each start has its own."""
        store, self.store = self.store, None
        if store is not None and hasattr(store, "close"):
            with contextlib.suppress(Exception):
                store.close()

    def abandon(self) -> None:
        """Watching failed: kill and reap every process, then close."""
        self.signal(signal.SIGKILL)
        self.reap()
        self._remove_error_files()
        self.close_store()
        remove_private_tmp(self.tmp_dir)
        self.tmp_dir = None

    def next(self, number: int, changes: Dict[str, list]) -> "RankGroup":
        """Close this start and start restart ``number`` (``changes``: the config's, e.g. a halved batch)."""
        self.close()
        return self.launches.next(number, changes)


__all__ = ["RankGroup", "Launches", "private_tmp", "remove_private_tmp", "ranks_env", "start_helpers"]
