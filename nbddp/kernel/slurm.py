"""``spawn_train(..., cluster=Slurm(...))``: where a run's ranks start when a SLURM cluster runs them.

The local starter (:mod:`nbddp.kernel.ranks`) forks the ranks on this server; this one submits
one batch job whose ``srun`` starts one task per rank (:mod:`nbddp.rank.slurm_task`), each the
same rank entry the local starter runs, with the same contract: the run folder (on a file system
the nodes share), a rendezvous only the user can open (a ``FileStore`` in the run's private state
folder), the stop files. Nothing in ``nbddp.rank`` or ``nbddp.tasks`` learns where it runs. The
kernel follows the job through the run folder (:mod:`nbddp.kernel.slurm_group`), and asks
SLURM (``squeue``) only whether the job still waits, runs or has left.

``sbatch`` is called directly: nbddp already has what submitit adds (the pickled call, a
folder per job, results), and more (heartbeats, progress, stop files, restarts).

Everything that can be checked before a job is queued is checked here, each refusal a
:class:`~nbddp.contract.errors.ConfigError` naming the thing and the fix.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from ..contract.errors import ConfigError, NbddpError
from ..contract.safe_path import module_argv

#: How long one SLURM command may take before the controller counts as not answering.
COMMAND_TIMEOUT_S = 30.0
#: Folders that are each machine's own: a run folder there is not seen by the other nodes.
_NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run")
#: What an option in ``extra`` may hold (it is one argument of ``sbatch``, never shell text).
_EXTRA = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=[^\n\r]*)?\Z")


@dataclass(frozen=True)
class Slurm:
    """Run the ranks as one SLURM job: ``spawn_train(target, cluster=nbddp.Slurm(partition="gpu", nodes=2))``.

    Attributes:
        partition: the partition (``sinfo`` lists them); ``None``: the cluster's default.
        nodes: machines; each runs ``gpus_per_node`` ranks (NCCL), or ``nprocs`` CPU ranks (gloo).
        gpus_per_node: GPUs (one rank each) per machine; ``None`` trains on CPU processes.
        time_min: the job's time limit in minutes.
        account: the account charged (``--account``); ``None``: the user's default.
        extra: more ``sbatch`` options, each one argument such as ``"--qos=high"`` or
            ``"--constraint=a100"``.
        preempt_s: seconds before the time limit at which SLURM signals the ranks (``USR1``, as
            ``--signal=USR1@N`` says): they checkpoint and stop through nbddp's stop request, the
            job is requeued (``scontrol requeue``) and resumes from the run folder (the built-in
            worker with ``resume=`` the run folder; a worker of your own with ``ctx.load_checkpoint()``).
            ``None``: the job ends at its limit. A USR1 from ``scancel --signal=USR1`` (a
            preemption) does the same.
    """

    partition: Optional[str] = None
    nodes: int = 1
    gpus_per_node: Optional[int] = None
    time_min: int = 60
    account: Optional[str] = None
    extra: Tuple[str, ...] = ()
    preempt_s: Optional[int] = None

    def __post_init__(self) -> None:
        for name, low in (("nodes", 1), ("time_min", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"Slurm({name}={v!r}): must be an integer >= {low}")
        p = self.preempt_s
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 0 < p < self.time_min * 60):
            raise ConfigError(f"Slurm(preempt_s={p!r}): seconds before the time limit ({self.time_min * 60} s) at "
                              "which the ranks checkpoint and the job is requeued, between 1 and the limit; or None")
        g = self.gpus_per_node
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ConfigError(f"Slurm(gpus_per_node={g!r}): an integer >= 1, or None to train on CPU processes")
        for name in ("partition", "account"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", v)):
                raise ConfigError(f"Slurm({name}={v!r}): a {name} name as `sinfo`/`sacctmgr` list it "
                                  "(letters, digits, ._-), or None for the default")
        extra = (self.extra,) if isinstance(self.extra, str) else tuple(self.extra)
        bad = [e for e in extra if not isinstance(e, str) or not _EXTRA.match(e)]
        if bad:
            raise ConfigError(f"Slurm(extra={self.extra!r}): {bad[0]!r} is not one sbatch option; give each as one "
                              "string '--option=value', e.g. extra=('--qos=high', '--constraint=a100')")
        object.__setattr__(self, "extra", extra)

    def describe(self) -> str:
        """``SLURM partition debug, 2 nodes x 4 GPUs`` (for the cell and the panel)."""
        per = f"{self.gpus_per_node} GPU(s)" if self.gpus_per_node else "CPU processes"
        return f"SLURM partition {self.partition or '(default)'}, {self.nodes} node(s) x {per}"


def run_command(args: Sequence[str], what: str, input: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run one SLURM command (``input``: its standard input); one that is missing or hangs is a
    :class:`NbddpError` naming it."""
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              input=input, stdin=subprocess.DEVNULL if input is None else None)
    except FileNotFoundError:
        raise ConfigError(f"{what}: `{args[0]}` is not on the PATH; run from a machine with SLURM's commands "
                          "(a login node), or add their folder to PATH") from None
    except subprocess.TimeoutExpired:
        raise NbddpError(f"{what}: `{shlex.join(args)}` did not answer in {COMMAND_TIMEOUT_S:.0f} s; "
                         "is the SLURM controller up (`scontrol ping`)?") from None


def check_cluster(cluster: "Slurm", runs_dir: Path, ranks_per_node: int, gpus: object) -> None:
    """Refuse, before anything is queued, what the cluster would refuse or the run could not do there."""
    if not isinstance(cluster, Slurm):
        raise ConfigError(f"cluster={cluster!r}: give nbddp.Slurm(partition=..., nodes=..., gpus_per_node=...)")
    if gpus is not None:
        raise ConfigError(f"gpus={gpus!r} with cluster=Slurm(...): the job's GPUs are SLURM's to choose; "
                          "say how many with Slurm(gpus_per_node=N) and leave gpus out")
    for tool in ("sbatch", "squeue", "scancel", "sinfo"):
        if shutil.which(tool) is None:
            raise ConfigError(f"cluster=Slurm(...): `{tool}` is not on the PATH, so no job can be submitted from "
                              "here; run the notebook on a machine with SLURM's commands (a login node), or add "
                              "their folder to PATH")
    known = [p.rstrip("*") for p in run_command(["sinfo", "-h", "-o", "%P"], "sinfo").stdout.split()]
    if cluster.partition is not None and cluster.partition not in known:
        raise ConfigError(f"Slurm(partition={cluster.partition!r}): no such partition on this cluster; "
                          f"`sinfo` lists {', '.join(known) or 'none'}")
    part = ["-p", cluster.partition] if cluster.partition else []
    nodes = run_command(["sinfo", "-h", *part, "-o", "%D %G"], "sinfo").stdout.split("\n")
    total = sum(int(line.split()[0]) for line in nodes if line.strip() and line.split()[0].isdigit())
    if total and cluster.nodes > total:
        raise ConfigError(f"Slurm(nodes={cluster.nodes}): the partition {cluster.partition or '(default)'} has "
                          f"{total} node(s); ask for at most {total}")
    if cluster.gpus_per_node:
        most = max([_gpus_in(line) for line in nodes] or [0])
        if cluster.gpus_per_node > most:
            raise ConfigError(f"Slurm(gpus_per_node={cluster.gpus_per_node}): the partition "
                              f"{cluster.partition or '(default)'}'s nodes have at most {most} GPU(s) "
                              f"(`sinfo -o %G`); ask for at most {most} per node, or more nodes")
    where = node_local(runs_dir)
    if cluster.nodes > 1 and where:
        raise ConfigError(f"runs_dir={str(runs_dir)!r} is in {where}, each machine's own folder: the other nodes "
                          "would not see the run folder. Put runs_dir on a file system the nodes share (your home "
                          "or project folder)")
    test = run_command(["sbatch", "--test-only", *submit_options(cluster, ranks_per_node, 1, "nbddp-check"),
                        "--wrap=true"], "sbatch --test-only")
    if test.returncode != 0:
        said = (test.stderr or test.stdout).strip().replace("sbatch: error: ", "")
        raise ConfigError(f"cluster={cluster!r}: SLURM refuses the job before it is queued: {said}. Fix the named "
                          "setting (`sinfo`, `sacctmgr show assoc user=$USER` list what you may use)")


def cluster_ranks(cluster: Any, target: Any, nprocs: Optional[int], gpus: Any, runs_dir: Any) -> Tuple[Any, Optional[int]]:
    """``(target, ranks)`` of a run on ``cluster``: ``nodes`` x ``gpus_per_node`` (or x ``nprocs`` CPU
    processes); a built-in config comes back saying so. Checked against the cluster first (:func:`check_cluster`)."""
    from ..contract import plans

    is_config = plans.is_task_config(target)
    if is_config:
        if target.gpus not in ((), []):
            gpus = target.gpus
        per_node = target.nprocs
    else:
        per_node = 1 if nprocs is None else nprocs
    if not isinstance(cluster, Slurm):
        raise ConfigError(f"cluster={cluster!r}: give nbddp.Slurm(partition=..., nodes=..., gpus_per_node=...)")
    per_node = cluster.gpus_per_node or per_node
    runs = Path(runs_dir if runs_dir is not None else (target.runs_dir if is_config else "runs"))
    check_cluster(cluster, runs, per_node, gpus)
    ranks = cluster.nodes * per_node
    if is_config:  # a config says its own process count
        return target.replace(nprocs=ranks, gpus=()), None
    return target, ranks


def _gpus_in(sinfo_line: str) -> int:
    """GPUs per node of one ``sinfo -o "%D %G"`` line (``2 gpu:a100:4(S:0-1)`` -> 4)."""
    found = re.findall(r"gpu(?::[A-Za-z0-9_.-]+)?:(\d+)", sinfo_line)
    return max(map(int, found)) if found else 0


def node_local(path: Path) -> Optional[str]:
    """The node-local folder ``path`` is in (``/tmp``...), else None."""
    real = os.path.realpath(path)
    for top in _NODE_LOCAL:
        if real == top or real.startswith(top + "/"):
            return top
    return None


def submit_options(cluster: Slurm, ranks_per_node: int, cpus_per_task: int, name: str) -> List[str]:
    """``sbatch``'s options for the job: one task per rank; each option one argument, never shell text."""
    opts = [f"--job-name={name}", f"--nodes={cluster.nodes}", f"--ntasks-per-node={ranks_per_node}",
            f"--cpus-per-task={cpus_per_task}", f"--time={cluster.time_min}"]
    if cluster.partition:
        opts.append(f"--partition={cluster.partition}")
    if cluster.account:
        opts.append(f"--account={cluster.account}")
    if cluster.gpus_per_node:
        opts.append(f"--gpus-per-node={cluster.gpus_per_node}")
    if cluster.preempt_s:
        opts += [f"--signal=USR1@{cluster.preempt_s}", "--requeue"]
    return opts + list(cluster.extra)


#: The job's own output (srun's lines, the guardians'), in the job folder: the batch script sends it there.
JOB_OUTPUT = "job.out"


def batch_script(folder: Path, inode: int) -> str:
    """The job's script: every task starts its rank through :mod:`nbddp.rank.slurm_task`.

    It works in the job folder only once it has checked, from inside, that it is the very folder the
    kernel made (its inode, owner and mode): anyone of the group may rename ``.nbddp`` in a shared
    run folder and put another in its place, and SLURM opens an ``--output`` path by name, through
    any link. So its output goes to ``/dev/null`` until the script, in the checked folder (its
    working directory, held from then on), appends to ``job.out`` there (0600: umask 077).
    """
    where = shlex.quote(os.fspath(folder))
    task = shlex.join(module_argv("nbddp.rank.slurm_task", os.fspath(folder), str(inode)))
    return "\n".join([
        "#!/bin/bash",
        "# Written by nbddp: one srun task per rank; the run folder holds what they write.",
        "umask 077",
        f"cd -P -- {where} || exit 1",
        f'if [ "$(stat -c %i:%u:%a .)" != "{inode}:$(id -u):700" ]; then',
        f"  echo \"nbddp: {folder} is not the job folder nbddp made (it was replaced); nothing in it is used\" >&2",
        "  exit 1",
        "fi",
        f"exec >>{JOB_OUTPUT} 2>&1",
        # A USR1 meant for the ranks (the time limit's warning, a preemption) must not end this shell.
        "trap 'true' USR1",
        'export NBDDP_SLURM_HEAD="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        # A rank's failure ends the run through nbddp's own shutdown (stop request, grace), not srun's.
        f"srun --kill-on-bad-exit=0 --wait=0 {task}",
        # The ranks checkpointed and stopped on a USR1 (their guardians left the marker): run again.
        'if [ -e "preempted.${SLURM_RESTART_COUNT:-0}" ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        "",
    ])


def submit(cluster: Slurm, folder: Path, inode: int, ranks_per_node: int, cpus_per_task: int, name: str,
           cwd: str) -> str:
    """Submit the job (its files in the private job ``folder``, of inode ``inode``); returns the job id.

    The script goes to ``sbatch`` on its standard input, never as a file: a file named on its command
    line is read by name, and whoever can swap a folder on the way could hand it other lines.
    """
    args = ["sbatch", "--parsable", *submit_options(cluster, ranks_per_node, cpus_per_task, name),
            "--output=/dev/null", f"--chdir={cwd}"]
    done = run_command(args, "sbatch", input=batch_script(folder, inode))
    if done.returncode != 0:
        raise NbddpError(f"sbatch refused the job: {(done.stderr or done.stdout).strip()}")
    return done.stdout.strip().split(";")[0]


def job_state(job_id: str) -> Optional[Tuple[str, str]]:
    """``(state, reason)`` of a job ``squeue`` lists (``COMPLETED`` for a moment after its end), else None."""
    done = run_command(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], "squeue")
    line = done.stdout.strip().splitlines()
    if done.returncode != 0 or not line:
        return None
    state, _, reason = line[0].partition("|")
    return state, reason


def cancel(job_id: str, signal_name: Optional[str] = None) -> None:
    """``scancel``: the signal to every task (each forwards it to its rank), or, without one, the job's end."""
    args = ["scancel", *( [f"--signal={signal_name}"] if signal_name else []), job_id]
    run_command(args, "scancel")


__all__ = ["Slurm", "check_cluster", "cluster_ranks", "submit", "job_state", "cancel", "batch_script", "submit_options", "node_local"]
