"""Exact commands to run a notebook-designed run on a cluster: torchrun and SLURM.

Kernel side, text only: nothing here starts a process. The commands run ``python -m nbddp``,
which reads the launcher's environment (:mod:`nbddp.elastic`), so the worker, the config and
the run folder layout stay the same as under ``spawn_train``.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import List, Optional

from .config import TrainConfig

_LAUNCH_FIELDS = {"gpus", "nprocs", "resume"}  # decided by the launcher, not the config


def cli_flags(cfg: TrainConfig) -> List[str]:
    """``python -m nbddp train`` flags for every field that differs from the defaults."""
    default = TrainConfig()
    flags: List[str] = []
    for f in dataclasses.fields(TrainConfig):
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        if f.name in _LAUNCH_FIELDS or v == d:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            flags.append(flag if v else "--no-" + f.name.replace("_", "-"))
        else:
            flags += [flag, str(v)]
    return flags


def _train_args(cfg: TrainConfig, config_path, run_dir: Optional[str]) -> List[str]:
    args = ["-m", "nbddp", "train"] + (["--config", os.fspath(config_path)] if config_path else cli_flags(cfg))
    return args + (["--run-dir", run_dir] if run_dir else [])


def torchrun_command(cfg: TrainConfig, nnodes: int = 1, nproc_per_node: Optional[int] = None,
                     rdzv_endpoint: str = "HEAD_NODE:29400", run_id: Optional[str] = None,
                     max_restarts: int = 0, config_path: Optional[str] = None,
                     run_dir: Optional[str] = None) -> str:
    """The ``torchrun`` command to run on every node (c10d rendezvous).

    Args:
        cfg: the run's config.
        nnodes: number of machines.
        nproc_per_node: processes (GPUs) per machine; default ``len(cfg.gpus)`` or ``cfg.nprocs``.
        rdzv_endpoint: ``host:port`` of one node that all can reach.
        run_id: rendezvous id; also names the run folder so restarts find their checkpoint.
        max_restarts: torchrun restarts of the whole group after a failure; each restart
            resumes from the last checkpoint.
        config_path: use ``--config path`` instead of flags (save it with ``cfg.save(path)``).
        run_dir: run folder on a shared filesystem (default ``runs/<name>``, or
            ``runs/<name>-<run_id>`` with a ``run_id``).

    Example:
        >>> print(cfg.torchrun_command(nnodes=2, nproc_per_node=4, rdzv_endpoint="gpu01:29400"))
    """
    nproc = nproc_per_node or cfg.world_size
    default_dir = f"{cfg.runs_dir}/{cfg.name}" + (f"-{run_id}" if run_id else "")
    run_id = run_id or cfg.name
    cmd = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={run_id}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += _train_args(cfg, config_path, os.fspath(run_dir) if run_dir else default_dir)
    return shlex.join(cmd)


def sbatch_script(cfg: TrainConfig, nodes: int = 1, gpus_per_node: Optional[int] = None,
                  time: str = "04:00:00", partition: Optional[str] = None, cpus_per_task: int = 8,
                  config_path: Optional[str] = None, python: str = "python") -> str:
    """An ``sbatch`` script: one ``srun`` task per GPU, each one rank of the job.

    nbddp reads ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` and the first host of the
    node list; the port is derived from the job id. Submit with ``sbatch train.sbatch``.
    """
    g = gpus_per_node or cfg.world_size
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={g}",
        f"#SBATCH --gpus-per-node={g}",
        f"#SBATCH --cpus-per-task={cpus_per_task}",
        f"#SBATCH --time={time}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        "#SBATCH --output=slurm-%j.out  # in the submit folder: Slurm opens it before the job runs",
        "",
        "# Every task derives the same rendezvous port from the job id.",
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        f"export OMP_NUM_THREADS={max(1, cpus_per_task // 2)}",
        "srun " + shlex.join([python] + _train_args(cfg, config_path, None)) + f" --run-dir {cfg.runs_dir}/{cfg.name}-$SLURM_JOB_ID",
        "",
    ]
    return "\n".join(lines)
