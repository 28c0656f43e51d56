"""One SLURM task of a submitted run: ``nbddp.rank.slurm_task FOLDER INODE``, one per rank.

The kernel (:mod:`nbddp.kernel.slurm`) pickles the launch's :class:`~nbddp.contract.protocol.LaunchSpec`
into ``FOLDER``, a private folder in the run's state folder on the shared runs file system, and
submits a batch script whose ``srun`` starts this module once per rank. The spec is read only from
there (:func:`nbddp.contract.private.read_private`: the folder and file provably the user's), never
from a place the user's group may write.

This process stays as the task's guardian while the rank runs in a child: the kernel cannot wait
for a process on another node, so the guardian records how its rank ended (``exit.<rank>``,
written beside the spec) and forwards what SLURM delivers (``scancel --signal``, the time limit's
warning) to the rank as the local starter would: SIGINT to the rank's process alone, the other
signals to its process group (its DataLoader workers too). The rank itself is the same as a
locally started one (:func:`nbddp.rank.runtime.entry`): heartbeats, logs, values and records go
to the run folder, which the kernel reads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

#: The spec's file name in the job's private folder.
SPEC_FILE = "spec.pkl"
#: The signals the kernel asks the guardians to deliver (a JSON list, appended to): ``scancel --signal``
#: would reach every process of the task, a rank's DataLoader workers too, where a local start
#: sends SIGINT to the rank alone.
SIGNALS_FILE = "signals"
#: The spec a requeued job starts from (the built-in worker's config resuming the run folder), if any.
REQUEUE_SPEC_FILE = "spec-requeue.pkl"
#: Why the spec must be the user's own: it is unpickled, so whoever writes it runs code as the user.
WHY_PRIVATE = "the launch of a SLURM run is read from it and unpickled, so only you may write it"


def exit_record_name(rank: int) -> str:
    """The name of the record of how rank ``rank`` ended, in the job's private folder."""
    return f"exit.{rank}"


def _restart_count() -> int:
    """How many times SLURM requeued the job (0 for its first start)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def preempted_marker(count: int) -> str:
    """Left by the guardians of the job's start ``count`` when a USR1 asked the ranks to stop and checkpoint."""
    return f"preempted.{count}"


def open_job_folder(path: str, inode: int):
    """The job's folder, opened once and held (a :class:`~nbddp.contract.statedir.StateDir`): refused
    unless it is the very folder the kernel made (``inode``, from the job's script) and the user's alone.

    Anyone of the group may rename ``.nbddp`` in a shared run folder and put another folder in its
    place; every file of the job (its launch, the kernel's signals, the exit records) is then read
    and written through this descriptor, never through the name again. Its parent, the run's state
    folder, is pinned too, by the same descriptor: a Stop written on SLURM's USR1 goes to this run.
    """
    from ..contract import statedir
    from ..contract.private import NotPrivate, check

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    job = statedir.StateDir(fd, path)
    try:
        if job.identity[1] != inode:
            raise NotPrivate(f"{path} is not the job folder nbddp made for this job: the run's .nbddp was renamed "
                             f"and another folder put in its place, so nothing in it was used. Submit the run again, "
                             f"into a runs folder only you may write.")
        check(os.fstat(fd), Path(path), "folder", WHY_PRIVATE)
    except BaseException:
        job.close()
        raise
    return job


def _pin_state(job, spec) -> None:
    """The run's state folder, reached from the job folder's descriptor and pinned for this process."""
    from ..contract import statedir

    fd = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=job.fd)
    state = statedir.StateDir(fd, os.path.join(spec.run_dir, statedir.STATE_DIR))
    if spec.state_id is not None and state.identity[1] != spec.state_id[1]:
        state.close()
        return  # not the state folder the kernel made: the rank's own pin refuses it, with its message
    statedir._pin(spec.run_dir, state)


def _read_spec(job):
    """The launch this start of the job runs: a requeued job resumes (its own spec, where the kernel wrote one)."""
    import pickle

    name = SPEC_FILE
    if _restart_count() and job.exists(REQUEUE_SPEC_FILE):
        name = REQUEUE_SPEC_FILE
    return pickle.loads(job.read(name))


def _preempt(job, run_dir: str) -> None:
    """SLURM's USR1 (the time limit near, a preemption): the stop request, as Stop writes it; the
    ranks checkpoint and return, and the batch script requeues the job (it sees the marker)."""
    from ..contract.protocol import write_stop_request

    job.write(preempted_marker(_restart_count()), b"")
    write_stop_request(run_dir, "stop")


def _resume_after_preemption(job, run_dir: str) -> None:
    """A requeued start: the stop request the preemption wrote is not for it."""
    count = _restart_count()
    if count and job.exists(preempted_marker(count - 1)):
        from ..contract.protocol import clear_stop_request, read_stop_request

        if read_stop_request(run_dir) == "stop":
            clear_stop_request(run_dir)


def _head_node() -> str:
    """The job's first node: where a TCP store (``env://``) is hosted, by rank 0's guardian."""
    return os.environ.get("NBDDP_SLURM_HEAD") or os.environ.get("SLURMD_NODENAME") or "127.0.0.1"


def _job_port() -> int:
    """The same port on every task, derived from the job id (as ``sbatch_script`` does)."""
    return 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000


def _rank_spec(job, rank: int, local_rank: int, tmp_dir: str):
    """The kernel's spec, with what only this task knows: its node's temp folder, GPUs and the job's head."""
    import dataclasses

    spec = _read_spec(job)
    if spec.world_size != int(os.environ.get("SLURM_NTASKS", spec.world_size)):
        raise SystemExit(f"nbddp: the job has {os.environ.get('SLURM_NTASKS')} tasks but the run "
                         f"{spec.world_size} ranks")
    env = dict(spec.env or {})
    env.update({k: v for k, v in os.environ.items() if k.startswith("SLURM")})
    env["TMPDIR"] = tmp_dir
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # the GPUs SLURM gave this node's tasks
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    head, port = _head_node(), _job_port()
    env.update(MASTER_ADDR=head, MASTER_PORT=str(port))
    # The ranks' FileStore, in the job folder this guardian holds (the rank, its fork, holds it too):
    # through the descriptor, never the folder's name, which anyone of the group may swap.
    store = (dict(store_host=head, store_port=port, master_port=port) if not spec.store_path else
             dict(store_path=f"/proc/self/fd/{job.fd}/{os.path.basename(spec.store_path)}"))
    return dataclasses.replace(spec, env=env, **store)


def _forward(child: int, job, run_dir: str):
    def handler(sig, _frame):
        try:
            if sig == signal.SIGUSR1:  # not the rank's: its default action would kill it
                _preempt(job, run_dir)
            elif sig == signal.SIGINT:
                os.kill(child, sig)  # a KeyboardInterrupt in the rank, as an Interrupt locally
            else:
                try:
                    os.killpg(child, sig)  # the rank leads its own group once it started
                except ProcessLookupError:
                    os.kill(child, sig)
        except ProcessLookupError:
            pass
    return handler


def _signal_requests(job) -> list:
    """The signals the kernel asked for, in order (``SIGNALS_FILE``, written only by the kernel, read if yours)."""
    try:
        found = json.loads(job.read(SIGNALS_FILE))
    except (OSError, ValueError):  # none yet, or not the user's (NotPrivate): no request
        return []
    return [int(s) for s in found if isinstance(s, int)] if isinstance(found, list) else []


def _deliver_requests(job, child: int, seen: int) -> int:
    """Deliver the kernel's new signal requests to the rank as the local starter would; how many are done."""
    asked = _signal_requests(job)
    for sig in asked[seen:]:
        try:
            if sig == signal.SIGINT:
                os.kill(child, sig)  # the rank alone: its DataLoader workers are its to end
            else:
                try:
                    os.killpg(child, sig)
                except ProcessLookupError:
                    os.kill(child, sig)
        except (ProcessLookupError, ValueError, OSError):
            pass
    return max(seen, len(asked))


def _host_store(job, world_size: int):
    """Rank 0's guardian hosts the TCP store an ``env://`` target dials (torchrun's agent does so)."""
    import datetime

    spec = _read_spec(job)
    if spec.store_path:
        return None
    import torch.distributed as dist

    return dist.TCPStore("0.0.0.0", _job_port(), world_size, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=spec.timeout_s))


def _write_exit(job, rank: int, pid: int, code: int) -> None:
    job.write(exit_record_name(rank), json.dumps({
        "rank": rank, "pid": pid, "exitcode": code, "time": time.time(), "node": os.environ.get("SLURMD_NODENAME"),
        "restart_count": _restart_count(), "preempted": job.exists(preempted_marker(_restart_count()))}).encode())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank, local_rank = int(os.environ["SLURM_PROCID"]), int(os.environ.get("SLURM_LOCALID", "0"))
    try:
        job = open_job_folder(argv[0], int(argv[1]))
    except (OSError, IndexError, ValueError) as exc:  # not the kernel's folder: nothing is read or written there
        print(f"nbddp: rank {rank} could not start: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        spec = _read_spec(job)
        run_dir = spec.run_dir
        _pin_state(job, spec)
        _resume_after_preemption(job, run_dir)
        store = _host_store(job, int(os.environ.get("SLURM_NTASKS", "1"))) if rank == 0 else None
    except Exception as exc:  # noqa: BLE001 - the spec is not readable (not yours, gone): say so, as a rank would
        print(f"nbddp: rank {rank} could not start: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        _write_exit(job, rank, os.getpid(), 1)
        return 1
    tmp_dir = tempfile.mkdtemp(prefix="nbddp-slurm-")  # the node's own, 0700: the rank's TMPDIR
    child = os.fork()
    if child == 0:
        code = 1
        try:
            # SLURM signals every process of the task: USR1 (the time limit near, a preemption) is the
            # guardian's to turn into the stop request; its default action would end the rank.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            spec = _rank_spec(job, rank, local_rank, tmp_dir)
            from .runtime import entry

            entry(local_rank, spec, rank=rank)  # never returns
        except BaseException as exc:  # noqa: BLE001 - the rank never started: say why in the task's output
            print(f"nbddp: rank {rank} could not start: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(code)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCONT):
        signal.signal(sig, _forward(child, job, run_dir))
    seen = len(_signal_requests(job)) if _restart_count() else 0  # a requeued job's are the earlier start's
    while True:
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            status = 1 << 8
            break
        if pid:
            break
        seen = _deliver_requests(job, child, seen)
        time.sleep(0.1)
    code = os.waitstatus_to_exitcode(status)  # -N for a signal, as multiprocessing says it
    _write_exit(job, rank, child, code)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    del store
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
