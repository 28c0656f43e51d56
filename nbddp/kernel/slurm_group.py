"""One SLURM job of a run's ranks, as :class:`~nbddp.kernel.handle.RunHandle` follows it: :class:`SlurmGroup`.

It stands where :class:`nbddp.kernel.ranks.RankGroup` stands for a local start, with the same
methods: which ranks run and how each ended (the ranks' guardians write ``exit.<rank>`` into the
job's private folder, :mod:`nbddp.rank.slurm_task`; ``squeue`` says whether the job waits, runs or
has left), signals (``scancel --signal``, which each guardian forwards to its rank), reaping (the
job has left the queue) and closing. Everything else the handle reads (heartbeats, rank 0's log,
values, progress, error records, results) is in the run folder, as for a local run.

A restart (``max_restarts``) submits a new job in the same run folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..contract import private, rundir, statedir
from ..contract.protocol import Heartbeat, LaunchSpec, read_heartbeats
from .ranks import remove_private_tmp
from .report import RankEnd
from . import slurm
from .slurm import Slurm, cancel, job_state, submit

#: The names :mod:`nbddp.rank.slurm_task` reads and writes in the job's folder (named here as text:
#: the kernel never imports the rank side).
SPEC_FILE = "spec.pkl"
#: The spec a requeued job starts from: the built-in worker's config resuming the run folder.
REQUEUE_SPEC_FILE = "spec-requeue.pkl"
#: The signals the kernel asks the guardians to deliver to their ranks (a JSON list).
SIGNALS_FILE = "signals"
#: How much of the job's output (``job.out``: srun's and the guardians' own lines) an error quotes.
JOB_OUTPUT_LINES = 20


def exit_record_name(rank: int) -> str:
    return f"exit.{rank}"


#: How often ``squeue`` is asked while the handle polls (it polls every 50 ms).
QUERY_EVERY_S = 1.0
#: How long the ranks' exit records may lag behind the job's end (a network file system's cache).
EXIT_RECORD_LAG_S = 3.0
#: How long :meth:`SlurmGroup.reap` waits for the job to leave the queue before cancelling it.
LEAVE_TIMEOUT_S = 20.0
#: How long a job whose ranks stopped on SLURM's USR1 may be out of the queue (or seem ended) before it
#: counts as gone for good (a requeue that never came).
REQUEUE_WAIT_S = 120.0
#: SLURM's states of a job that has ended.
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")
#: Variables the local start sets for ranks on this server, which a node sets for itself.
_LOCAL_ONLY = ("TMPDIR", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def job_folder(run_dir: Path) -> Path:
    """The job's private folder (0700) in the run's state folder: the spec, the script, the exit records."""
    return Path(run_dir) / statedir.STATE_DIR / "slurm"


#: What the job's files are, for messages.
JOB_FILES = "the SLURM job's files (its launch, script output and the ranks' exit records)"
#: What an earlier start of the job left in its folder: never read by this one.
_EARLIER = ("exit.", "preempted.", ".exit.", ".signals.")


def _fresh_folder(run_dir: Path) -> statedir.StateDir:
    """The job's folder, made or found only through the launch's pinned state folder, and held open.

    Never found by its name: anyone of the group may rename ``.nbddp`` in a shared run folder. A
    ``slurm`` in the state folder that is not a private folder of the user's is refused (the state
    folder is the user's alone: only the user could have put it there), never narrowed and reused.
    """
    state = statedir.pinned(run_dir) or statedir.pin(run_dir, None)
    path = job_folder(run_dir)
    with state._lock:
        fd = private.open_yours(state._dir(), path.name, path, JOB_FILES, kind="folder", replace=False)
    folder = statedir.StateDir(fd, os.fspath(path))
    for name in folder.names():  # an earlier start's records and store are not this one's
        if name.startswith(_EARLIER) or name in ("store", slurm.JOB_OUTPUT, SIGNALS_FILE, SPEC_FILE,
                                                 REQUEUE_SPEC_FILE, "job.sbatch"):
            folder.unlink(name)
    return folder


def _job_spec(spec: LaunchSpec, cluster: Slurm, folder: statedir.StateDir) -> LaunchSpec:
    """The local start's spec, made for the nodes: the store in the private folder, nothing of this server's."""
    env = {k: v for k, v in (spec.env or {}).items() if k not in _LOCAL_ONLY}
    if cluster.nodes > 1:  # gloo and NCCL talk over the network, not loopback
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if env.get(var) == "lo" and os.environ.get(var) != "lo":
                env.pop(var)
    gpu = bool(cluster.gpus_per_node)
    return dataclasses.replace(
        spec, env=env, parent_pid=None, kernel=None,  # the ranks outlive the kernel: attach() follows them again
        store_path=os.path.join(folder.path, "store") if spec.store_path else None, store_host="",
        backend="nccl" if gpu else "gloo", gpus=tuple(range(cluster.gpus_per_node)) if gpu else ())


def submit_start(cluster: Slurm, launches: Any, spec: LaunchSpec, meet: Any, tmp_dir: Optional[str],
                 started_at: Optional[float] = None) -> "SlurmGroup":
    """Submit one start of the ranks: the job's spec written privately, the script queued."""
    meet.close()  # the local meeting point and temp folder: the nodes make their own
    remove_private_tmp(tmp_dir)
    run_dir = Path(spec.run_dir)
    folder = _fresh_folder(run_dir)
    job = _job_spec(spec, cluster, folder)
    folder.write(SPEC_FILE, pickle.dumps(job))
    if getattr(launches, "config", None) is not None:  # a requeued job resumes the run folder
        folder.write(REQUEUE_SPEC_FILE, pickle.dumps(dataclasses.replace(
            job, args=(launches.config.replace(resume=str(run_dir)),))))
    per_node = job.world_size // cluster.nodes
    started = time.time() if started_at is None else started_at
    job_id = submit(cluster, Path(folder.path), folder.identity[1], per_node, job.threads, f"nbddp-{run_dir.name}"[:64], job.cwd or os.getcwd())
    group = SlurmGroup(launches, job, cluster, job_id, folder, started)
    rundir.update_launch_record(run_dir, target=job.target, world_size=job.world_size, backend=job.backend,
                                gpus=list(job.gpus), pids=[], start_times=[], parent_pid=os.getpid(),
                                store="file" if job.store_path else "tcp", store_path=job.store_path,
                                host=socket.gethostname(), started=started, tmp_dir=None,
                                slurm={"job": job_id, "cluster": dataclasses.asdict(cluster)})
    return group


class SlurmGroup:
    """One SLURM job of a run's ranks, with :class:`~nbddp.kernel.ranks.RankGroup`'s methods.

    Attributes:
        job_id: SLURM's id of the job.
        state: the job's last ``(state, reason)`` from ``squeue``; None once it has left the queue.
        notify: where the queue's news go (the handle's notice line), set by the handle's maker.
    """

    def __init__(self, launches: Any, spec: LaunchSpec, cluster: Slurm, job_id: str, folder: statedir.StateDir,
                 started_at: float):
        self.launches, self.spec, self.cluster, self.job_id, self.folder = launches, spec, cluster, job_id, folder
        self.run_dir, self.world_size = Path(spec.run_dir), spec.world_size
        self.pids: List[int] = []  # on the nodes, not this server's: signals go through scancel
        self.ends: Dict[int, RankEnd] = {}
        self.started_at = started_at
        self.procs = self.server = self.tmp_dir = self.store = self.not_before = None
        self.closed = False
        self._output = ""  # the job's output as it was when the group closed (job_output)
        self.state: Optional[tuple] = ("PENDING", "")
        self.ran = False  # the job has started on its nodes
        self.notify: Optional[Callable[[str], None]] = None
        self._asked = 0.0
        self._left_at: Optional[float] = None
        self._told: Optional[tuple] = None
        self._requeues: set = set()  # the job's starts that SLURM's USR1 stopped
        self._signals: List[int] = []  # asked of the guardians so far (SIGNALS_FILE)
        self._requeue_since: Optional[float] = None  # a requeue is under way since then

    # -- the job -----------------------------------------------------------------------------
    def _ask(self, now: float, force: bool = False) -> None:
        if not force and now - self._asked < QUERY_EVERY_S or self.state is None:
            return
        self._asked = now
        self.state = job_state(self.job_id)
        if self._requeue_since is not None and (self.state is None or self.state[0] in ENDED):
            # Between the ranks' stop on SLURM's USR1 and the job's return (the requeue ends the
            # batch script: CANCELLED for a moment), unless it never comes back.
            if now - self._requeue_since < REQUEUE_WAIT_S:
                self.state = ("REQUEUED", "")
        elif self._requeue_since is not None:
            self._requeue_since = now  # queued again: the wait for its return starts over
        if self.state is not None and self.state[0] in ENDED:
            self.state = None
        if self.state is None:
            self._left_at = self._left_at or now
            return
        self.ran = self.state[0] in ("RUNNING", "COMPLETING")  # a requeued job waits again
        told = self.state if self.state[0] != "RUNNING" else ("RUNNING", "")
        if told != self._told and self.notify is not None:
            self._told = told
            state, reason = told
            why = f" ({reason})" if reason and reason != "None" else ""
            self.notify(f"nbddp: SLURM job {self.job_id} {state.lower()}{why}"
                        + (" - queued, waiting for its nodes" if state == "PENDING" else ""))

    def _preempted(self, count: int) -> None:
        if count in self._requeues:
            return
        self._requeues.add(count)
        self._requeue_since = time.time()
        if self.notify is not None:
            self.notify(f"nbddp: SLURM job {self.job_id} was signalled (time limit or preemption): the ranks "
                        "checkpointed and stopped; requeued, it resumes from the run folder")

    # -- the processes -----------------------------------------------------------------------
    def running(self) -> List[int]:
        return [r for r in range(self.world_size) if r not in self.ends]

    def see_exits(self, now: float, by_launcher: bool) -> None:
        """Note each rank whose guardian recorded its end; once the job has left, every rank has ended."""
        for rank in self.running():
            try:
                record = json.loads(self.folder.read(exit_record_name(rank)))
            except (OSError, ValueError):  # none yet (a NotPrivate one: not the guardian's, never read)
                continue
            count = int(record.get("restart_count") or 0)
            if record.get("preempted"):  # stopped on SLURM's USR1 and checkpointed: the job is requeued
                self._preempted(count)
                continue
            if self._requeues and count > max(self._requeues):
                self._requeue_since = None  # the requeued start has ended: SLURM's state is its end
            self.ends[rank] = RankEnd(rank, int(record.get("pid") or 0), record.get("exitcode"), now, by_launcher)
        if self.running():
            self._ask(now)
            if self.state is None and now - (self._left_at or now) >= EXIT_RECORD_LAG_S:
                for rank in self.running():  # the job ended without the rank's record: killed with its node or job
                    self.ends[rank] = RankEnd(rank, 0, -signal.SIGKILL, now, by_launcher)

    @property
    def all_ended(self) -> bool:
        return len(self.ends) == self.world_size

    def failed(self) -> List[RankEnd]:
        return [e for e in self.ends.values() if e.exitcode != 0 and not e.by_launcher]

    def signal(self, sig: int) -> None:
        """SIGINT, SIGTERM to every rank through its guardian, or the job's end (SIGKILL, or a job not running)."""
        if self.closed or self.state is None:
            return
        if sig == signal.SIGKILL or not self.ran:
            cancel(self.job_id)
            return
        # Through the guardians, which deliver it as the local start does (SIGINT to the rank alone):
        # `scancel --signal` would reach every process of each task, the DataLoader workers too.
        self._signals.append(int(sig))
        self.folder.write(SIGNALS_FILE, json.dumps(self._signals).encode())

    def reap(self) -> None:
        """Wait until the job has left the queue (cancel it if it lingers); a rank not seen to end counts as ended by nbddp."""
        deadline = time.time() + LEAVE_TIMEOUT_S
        cancelled = False
        while self.state is not None:
            self._ask(time.time(), force=True)
            if self.state is None:
                break
            if time.time() > deadline and not cancelled:
                cancel(self.job_id)
                cancelled, deadline = True, time.time() + LEAVE_TIMEOUT_S
            elif time.time() > deadline:
                break
            time.sleep(0.2)
        self.see_exits(time.time() + EXIT_RECORD_LAG_S, by_launcher=True)
        now = time.time()
        for rank in self.running():
            self.ends[rank] = RankEnd(rank, 0, None, now, True)

    def kill_started(self) -> None:
        cancel(self.job_id)
        self.reap()

    # -- what the ranks say --------------------------------------------------------------------
    def beats(self) -> Dict[int, Heartbeat]:
        return {r: b for r, b in read_heartbeats(self.run_dir, self.world_size).items()
                if (b.beat_time or 0.0) >= self.started_at}

    def answering(self) -> Dict[int, int]:
        return {}  # the ranks' processes are the nodes': their stacks are not asked from here

    def error_files(self) -> List[Optional[str]]:
        return []

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """The job gone from the queue, its store removed; the folder (its output, records) stays."""
        if self.closed:
            return
        if self.state is not None:
            self._ask(time.time(), force=True)
            if self.state is not None:
                cancel(self.job_id)
                self.reap()
        self.close_store()
        self._output = self.job_output()  # kept for the error: the folder's descriptor is given back
        self.folder.close()
        self.closed = True

    def close_store(self) -> None:
        if self.spec.store_path:
            with contextlib.suppress(OSError):
                self.folder.unlink(os.path.basename(self.spec.store_path))

    def abandon(self) -> None:
        with contextlib.suppress(Exception):
            cancel(self.job_id)
        self.reap()
        self.close_store()

    def next(self, number: int, changes: Dict[str, list]) -> "SlurmGroup":
        """Close this job and submit restart ``number`` as a new job in the same run folder."""
        self.close()
        launches = self.launches
        if launches.config is not None:
            launches.config = launches.config.replace(resume=str(self.run_dir), **{k: v[1] for k, v in changes.items()})
            launches.config.save(rundir.config_path(self.run_dir))
        rundir.prepare_launch(self.run_dir, self.world_size, restart=True)
        spec, meet, _env, tmp_dir = launches.prepare(number)
        return submit_start(self.cluster, launches, spec, meet, tmp_dir)

    def job_output(self) -> str:
        """The last lines SLURM itself wrote for the job (srun's errors, a rank that could not start)."""
        if self.folder.fd is None:
            return self._output
        with contextlib.suppress(OSError):
            lines = self.folder.read(slurm.JOB_OUTPUT).decode(errors="replace").splitlines()
            return "\n".join(lines[-JOB_OUTPUT_LINES:])
        return ""

    def explain(self, error: Exception) -> Exception:
        """A failed run's error, with the job's own output when a rank never started: what srun or the
        rank's guardian said is there (a bad option, an interpreter missing on the node), not in a rank log."""
        started = self.beats()
        if all(r in started for r in range(self.world_size)):
            return error
        state = statedir.pinned(self.run_dir)
        if state is not None and state.replaced(self.run_dir) and error.args:
            # The job's script checks its folder first, and refuses one put in place of .nbddp: the
            # ranks never started, which the ranks' missing records alone would blame on a kill.
            error.args = (f"the SLURM job {self.job_id} refused to start: {self.run_dir / statedir.STATE_DIR} was "
                          "replaced by another folder while the job waited (anyone who may write the run folder can "
                          "rename it), and the job uses only the folder nbddp made for it: nothing in the other was "
                          "read or run. Submit the run again, into a runs folder only you may write.",
                          ) + tuple(error.args[1:])
            return error
        out = self.job_output()
        if out and error.args:
            where = os.path.join(self.folder.path, slurm.JOB_OUTPUT)
            error.args = (f"{error.args[0]}\n--- last lines of the SLURM job's output ({where}) ---\n{out}",
                          ) + tuple(error.args[1:])
        return error


def start_job(cluster: Slurm, spec: LaunchSpec, meet: Any, leases: Any, launches: Any, tmp_dir: Optional[str],
              watch: dict, on_event: Optional[Callable[[str, Any], None]], block: bool) -> Any:
    """:func:`nbddp.kernel.launch.spawn_train`'s start when a SLURM job runs the ranks: submit, then follow."""
    from .handle import RunHandle, interrupts_held

    # An Interrupt during the submission is held until the handle knows the job, then ends it.
    with interrupts_held() as interrupted:
        group = submit_start(cluster, launches, spec, meet, tmp_dir)
        try:
            handle = RunHandle(group, leases=leases, **watch)
        except BaseException:
            group.kill_started()
            raise
        group.notify = handle._notice
        if on_event is not None:
            handle.subscribe(on_event)
        handle._notice(f"nbddp: submitted SLURM job {group.job_id} ({cluster.describe()}); run folder {spec.run_dir}")
        if not block and not interrupted:
            handle.start_background()
    if interrupted:
        handle.end_interrupted()
    return handle if not block else handle.wait()


__all__ = ["SlurmGroup", "submit_start", "start_job", "job_folder"]
