"""Run as one rank of many under the launchers clusters already have: torchrun and SLURM's srun.

The notebook's ``spawn_train`` starts the processes itself. On a cluster, ``torchrun`` (c10d
rendezvous, elastic restarts) or ``srun`` starts them, and each runs ``python -m nbddp train``.
This module reads the launcher's environment, initialises the process group from it, agrees
on the run folder, and then runs exactly the same worker through :func:`runtime.run_rank`, so
logs, metrics, checkpoints and exports behave as under ``spawn_train``.

Worker side: never imports IPython or ipywidgets.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TextIO, Tuple

import torch
import torch.distributed as dist

from ..contract import rundir
from .dist import init_process_group
from ..contract.errors import ConfigError
from ..contract.config import STRATEGY_ENV
from ..contract.private import compile_cache_env, open_private_file
from ..contract.system import cpu_cores, start_time
from .process import run_rank_hook
from .runtime import Context, run_rank
from ..contract.plans import LaunchPlan
from ..contract.observe import check_trackers, tracker_plan


@dataclass(frozen=True)
class LauncherEnv:
    """Where this process sits in a job started by an external launcher."""

    kind: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    job_id: Optional[str]


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``."""
    m = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect() -> Optional[LauncherEnv]:
    """The launcher environment of this process, or ``None`` when started by hand.

    torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` (and
    ``TORCHELASTIC_*``); ``srun`` sets ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` and
    the node list, whose first host serves the rendezvous.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return LauncherEnv(
            "torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), env["MASTER_ADDR"], int(env.get("MASTER_PORT", 29500)),
            int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            env.get("TORCHELASTIC_RUN_ID") if env.get("TORCHELASTIC_RUN_ID") not in (None, "none") else None)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        job = env.get("SLURM_JOB_ID")
        # Every task derives the same port from the job id, so no extra coordination is needed.
        port = int(env.get("MASTER_PORT") or (20000 + int(job) % 20000 if job and job.isdigit() else 29500))
        ntasks = int(env["SLURM_NTASKS"])
        return LauncherEnv(
            "slurm", int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", 0)),
            int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or ntasks,
            env.get("MASTER_ADDR") or first_host(nodelist), port, int(env.get("SLURM_RESTART_COUNT", 0)), job)
    return None


class _Tee:
    """Writes to the launcher's console and to the rank's log file (as spawn_train keeps it)."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def init_from_env(le: LauncherEnv, timeout_s: float) -> torch.device:
    """Process group from the launcher's rendezvous address; one GPU per local rank if any."""
    if torch.cuda.is_available():
        torch.cuda.set_device(le.local_rank)
        device, backend = torch.device("cuda", le.local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        threads = os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else max(1, cpu_cores() // le.local_world_size))
    os.environ.update(RANK=str(le.rank), WORLD_SIZE=str(le.world_size), LOCAL_RANK=str(le.local_rank),
                      MASTER_ADDR=le.master_addr, MASTER_PORT=str(le.master_port))
    timeout = datetime.timedelta(seconds=timeout_s)
    # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; under srun rank 0 hosts it.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(le.master_addr, le.master_port, le.world_size, is_master=not agent and le.rank == 0,
                          timeout=timeout, multi_tenant=not agent)
    # One key space per attempt: after a restart, addresses published by the dead attempt's
    # ranks may still be in the store, and a rank that read one would dial a process that is
    # gone ("Connection refused") instead of its new peer.
    store = dist.PrefixStore(f"nbddp/attempt_{le.restart_count}", store)
    init_process_group(backend, store, le.rank, le.world_size, timeout_s, device)
    return device


def agree_run_dir(choose: Callable[[], Path]) -> Path:
    """Global rank 0 chooses the run folder; every rank gets the same path."""
    box = [str(choose()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _private_compile_caches() -> None:
    """Point torch.compile's and Triton's caches into the user's private cache folder, as spawn_train
    does (not torch's default in the shared /tmp); where that cannot be private, say so."""
    try:
        for var, value in compile_cache_env().items():
            if value is None:  # the user's own private cache: torch's default, as torchrun gives it
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    except OSError as exc:  # NotPrivate: an ancestor others may write
        print(f"nbddp: {exc}; torch's default cache folders are used", file=sys.stderr)


def _trackers_of(plan: LaunchPlan) -> Optional[dict]:
    """A config's ``trackers`` under torchrun/srun: rank 0 sends to them as under ``spawn_train``."""
    names = check_trackers(getattr(plan.config, "trackers", None) or None)
    if not names:
        return None
    params = {k: v for k, v in dataclasses.asdict(plan.config).items() if k not in ("resume", "trackers")}
    return {"trackers": tracker_plan(names, plan.name, plan.runs_dir, params), "by_optimizer": True}


def run_under_launcher(le: LauncherEnv, plan: LaunchPlan, choose_run_dir: Callable[[], Path]) -> tuple:
    """Run ``plan``'s target as rank ``le.rank``; returns ``(exit_code, value)`` like ``run_rank``.

    Args:
        le: the launcher environment (:func:`detect`).
        plan: what to run (:func:`nbddp.contract.plans.plan`, as ``spawn_train`` makes it).
        choose_run_dir: called on global rank 0 only, after the process group is up.
    """
    run_rank_hook(le.rank)  # first, as in a spawned rank
    _private_compile_caches()
    device = init_from_env(le, plan.process_group_timeout(on_gpu=torch.cuda.is_available()))
    run_dir = agree_run_dir(choose_run_dir)
    log_path = rundir.rank_log(run_dir, le.rank)
    # The user's alone, as under spawn_train: never into a logs folder or file another user put there.
    log = os.fdopen(open_private_file(log_path, rundir.RUN_LOGS), "a", buffering=1, encoding="utf-8")
    log.write(f"--- {le.kind} rank {le.rank}/{le.world_size} (restart {le.restart_count}) "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    strategy = getattr(plan.config, "strategy", None)
    if strategy:  # the built-in worker's config says it: ctx.strategy agrees
        os.environ[STRATEGY_ENV] = strategy
    ctx = Context(le.rank, le.local_rank, le.world_size, device, dist.get_backend(), run_dir)
    try:
        return run_rank(ctx, lambda: None, plan.target, plan.args, plan.kwargs, observe=_trackers_of(plan))
    finally:
        sys.stdout, sys.stderr = sys.stdout.stream, sys.stderr.stream
        log.close()

# ------------------------------------------------------------------------ the job's run folder
def refuse_script_under_launcher(le: LauncherEnv, call: str, argv: Optional[Any]) -> None:
    """A script, or a function that makes its own group, needs no nbddp under a launcher."""
    if call != "ctx" or argv is not None:
        raise ConfigError(
            f"under {le.kind}, a script or a function that makes its own process group needs no nbddp: run the "
            f"script itself (torchrun --nproc_per_node=N train.py ...; srun python train.py ...). "
            "python -m nbddp run under a launcher takes fn(ctx) workers")


def continue_or_start(cfg: Any, le: LauncherEnv, run_dir: Optional[Path]) -> Tuple[Any, Optional[Path]]:
    """The built-in worker's config and run folder for this rank of a job.

    The folder is ``run_dir``, else ``<runs_dir>/<name>-<job id>`` when the launcher names a job
    (srun requeues keep it), else a new one chosen later. A folder that holds checkpoints is
    continued (``resume`` set to it) by a launcher restart of the run or an explicit resume,
    and refused otherwise (:func:`check_may_continue`).
    """
    cfg = cfg.replace(gpus=(), nprocs=le.world_size)
    if run_dir is None and le.job_id:
        run_dir = Path(cfg.runs_dir) / f"{cfg.name}-{le.job_id}"
    if run_dir is not None and rundir.checkpoint_names(run_dir):
        check_may_continue(run_dir, cfg, le)
        cfg = cfg.replace(resume=str(run_dir))
    return cfg, run_dir


def run_job_rank(le: LauncherEnv, plan: LaunchPlan, run_dir: Optional[Path]) -> None:
    """Run ``plan`` as this rank of the job, print rank 0's result, and leave the process.

    It leaves without interpreter teardown, as spawned ranks do: after a failure the process
    group is still up, and gloo's destructor can deadlock at exit, holding up the launcher's
    restart. Everything was flushed and the records written before.
    """
    run_dir = plan.run_dir or run_dir

    def choose() -> Path:
        path = run_dir.resolve() if run_dir else rundir.new_run_dir(plan.runs_dir, plan.name)
        path.mkdir(parents=True, exist_ok=True)
        if plan.config is not None:
            plan.config.save(rundir.config_path(path))
        return path

    code, value = run_under_launcher(le, plan, choose)
    if le.rank == 0 and code == 0:
        if plan.config is not None and isinstance(value, dict):
            print(f"best val_accuracy {value['best_accuracy']:.4f}; exported weights: {value['weights_path']}")
        else:
            print(f"result: {value!r}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launcher_started() -> Optional[float]:
    """When the process that started this one (torchrun's agent) started, as a Unix time."""
    ticks = start_time(os.getppid())
    if ticks is None:
        return None
    try:
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def check_may_continue(run_dir: Path, cfg: Any, le: LauncherEnv) -> None:
    """Refuse to start over a run folder that holds checkpoints, unless this run continues it.

    It continues it when asked to (``--resume true``, or ``--resume`` naming this folder), or when
    this is a launcher restart of the same run. torchrun also restarts after a refusal, so a
    restart counts only if the checkpoint was written after this torchrun started; srun
    requeues keep the job id, which names the default run folder.
    """
    if cfg.resume is True:
        return
    if isinstance(cfg.resume, str):
        asked = Path(cfg.resume)
        asked = rundir.run_dir_of_checkpoint(asked)
        if asked.resolve() == run_dir.resolve():
            return
        raise ConfigError(f"--resume {cfg.resume} and --run-dir {run_dir} name two different runs, and {run_dir} "
                          "already holds checkpoints; give one of them")
    last = rundir.checkpoint_path(run_dir)
    if le.restart_count and le.kind == "torchrun":
        started = launcher_started()
        if started is None or not last.exists() or last.stat().st_mtime >= started:
            return
    elif le.restart_count:
        return
    found = ", ".join(rundir.checkpoint_names(run_dir))
    raise ConfigError(
        f"{run_dir} already holds checkpoints ({found}) of an earlier run; training again would start from "
        f"epoch 0 and overwrite them. To continue that run, add --resume true; to train anew, choose a new "
        "folder with --run-dir (or move the old one away).")
