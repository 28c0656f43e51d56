"""Exact commands to run a notebook-designed run on a cluster: torchrun and SLURM.

Shared, text only: nothing here starts a process. ``TrainConfig.torchrun_command`` and
``sbatch_script`` import it at the call; it reads the config through its fields' declarations
(:mod:`nbddp.contract.fieldspec`) and never imports :mod:`nbddp.contract.config`. The commands run
``python -m nbddp``, which reads the launcher's environment (:mod:`nbddp.rank.elastic`), so the
worker, the config and the run folder layout stay the same as under ``spawn_train``.

The text is meant to be pasted into a shell or submitted to Slurm, so every value in it is
quoted with ``shlex`` (a path such as ``my runs`` stays one argument, ``$(...)`` stays text), values
are passed as ``--flag=value`` (a path starting with ``-`` is not taken for a flag), and the
few values that cannot be quoted (``#SBATCH`` lines are read by Slurm, not by the shell) are
checked against a safe set of characters.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any, List, Optional

from .errors import ConfigError
from .fieldspec import flag_name, specs
from .rundir import NAME_RULE, name_problem

# ``cfg`` below is a ``TrainConfig``, read through its fields' declarations (nbddp.contract.fieldspec):
# this module never imports nbddp.contract.config, whose methods call it.


def cli_flags(cfg: Any) -> List[str]:
    """``python -m nbddp train`` flags for every field that differs from the defaults.

    Fields the launcher decides (``FieldSpec.launch``: GPUs, process count, resume) are left out.
    """
    default = type(cfg)()
    flags: List[str] = []
    for f, spec in specs(cfg):
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        if spec.launch or v == d:
            continue
        flag = flag_name(f.name)
        if isinstance(v, bool):
            flags.append(flag if v else "--no-" + flag[2:])
        else:
            flags.append(f"{flag}={v}")
    return flags


def _train_args(cfg: Any, config_path, run_dir: Optional[str]) -> List[str]:
    args = ["-m", "nbddp", "train"] + ([f"--config={os.fspath(config_path)}"] if config_path else cli_flags(cfg))
    return args + ([f"--run-dir={run_dir}"] if run_dir else [])


def _check_int(where: str, name: str, value: Any, low: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where}({name}={value!r}): must be an integer >= {low}"
                          + (" (or None for the config's process count)" if none_ok else ""))


# What an ``#SBATCH`` value may hold: Slurm reads these lines itself, and a newline would start
# a line of shell script.
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9._:,+=@%/-]+\Z")


def _check_sbatch_value(name: str, value: Any) -> None:
    if not isinstance(value, str) or not _SBATCH_VALUE.match(value):
        raise ConfigError(f"sbatch_script({name}={value!r}): use letters, digits and ._:,+=@%/- only "
                          "(no spaces or line breaks: the value is written into an #SBATCH line)")


def torchrun_command(cfg: Any, nnodes: int = 1, nproc_per_node: Optional[int] = None,
                     rdzv_endpoint: str = "HEAD_NODE:29400", run_id: Optional[str] = None,
                     max_restarts: Optional[int] = None, config_path: Optional[str] = None,
                     run_dir: Optional[str] = None) -> str:
    """The ``torchrun`` command to run on every node (c10d rendezvous).

    Args:
        cfg: the run's config.
        nnodes: number of machines.
        nproc_per_node: processes (GPUs) per machine; default ``len(cfg.gpus)`` or ``cfg.nprocs``.
        rdzv_endpoint: ``host:port`` of one node that all can reach.
        run_id: rendezvous id; also names the run folder so restarts find their checkpoint.
        max_restarts: torchrun restarts of the whole group after a failure; each restart
            resumes from the last checkpoint (default: the config's ``max_restarts``).
        config_path: use ``--config path`` instead of flags (save it with ``cfg.save(path)``).
        run_dir: run folder on a shared filesystem (default ``runs/<name>``, or
            ``runs/<name>-<run_id>`` with a ``run_id``).

    Example:
        >>> print(cfg.torchrun_command(nnodes=2, nproc_per_node=4, rdzv_endpoint="gpu01:29400"))
    """
    _check_int("torchrun_command", "nnodes", nnodes, 1)
    _check_int("torchrun_command", "nproc_per_node", nproc_per_node, 1, none_ok=True)
    max_restarts = getattr(cfg, "max_restarts", 0) if max_restarts is None else max_restarts
    _check_int("torchrun_command", "max_restarts", max_restarts, 0)
    if not isinstance(rdzv_endpoint, str) or not rdzv_endpoint or any(c.isspace() for c in rdzv_endpoint):
        raise ConfigError(f"torchrun_command(rdzv_endpoint={rdzv_endpoint!r}): give host:port of one node "
                          "that every node can reach, e.g. 'gpu01:29400'")
    if run_id is not None and name_problem(run_id):
        raise ConfigError(f"torchrun_command(run_id={run_id!r}): {NAME_RULE.replace('it names', 'it is part of')}")
    nproc = nproc_per_node or cfg.world_size
    default_dir = f"{cfg.runs_dir}/{cfg.name}" + (f"-{run_id}" if run_id else "")
    run_id = run_id or cfg.name
    cmd = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={run_id}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += _train_args(cfg, config_path, os.fspath(run_dir) if run_dir else default_dir)
    return shlex.join(cmd)


def sbatch_script(cfg: Any, nodes: int = 1, gpus_per_node: Optional[int] = None,
                  time: str = "04:00:00", partition: Optional[str] = None, cpus_per_task: int = 8,
                  config_path: Optional[str] = None, python: str = "python") -> str:
    """An ``sbatch`` script: one ``srun`` task per GPU, each one rank of the job.

    nbddp reads ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` and the first host of the
    node list; the port is derived from the job id. Submit with ``sbatch train.sbatch``.
    """
    _check_int("sbatch_script", "nodes", nodes, 1)
    _check_int("sbatch_script", "gpus_per_node", gpus_per_node, 1, none_ok=True)
    _check_int("sbatch_script", "cpus_per_task", cpus_per_task, 1)
    _check_sbatch_value("time", time)
    if partition is not None:
        _check_sbatch_value("partition", partition)
    g = gpus_per_node or cfg.world_size
    # The run folder ends with the job id, which only the shell knows: the quoted prefix and
    # the quoted variable make one word.
    run_dir = f"--run-dir={cfg.runs_dir}/{cfg.name}-"
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
        "srun " + shlex.join([python] + _train_args(cfg, config_path, None)) + f" {shlex.quote(run_dir)}\"$SLURM_JOB_ID\"",
        "",
    ]
    return "\n".join(lines)
