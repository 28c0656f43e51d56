"""The same run under torchrun (c10d rendezvous, elastic restarts) and SLURM, on loopback."""

import json
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from nbddp import spawn_train
from nbddp.contract.checkpoint import load_checkpoint
from nbddp.contract.cluster import cli_flags
from nbddp.rank.elastic import first_host
from conftest import WORKERS, fault_env, free_port, launcher_env, small_cfg

PY = sys.executable


def test_two_torchrun_nodes_match_spawn_train(small_run, tmp_path):
    cfg, reference = small_run  # the same config, on the same data
    port = free_port()
    run_dir = tmp_path / "torchrun-run"
    cmd = [PY, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes", "-m", "nbddp", "train",
           *cli_flags(cfg), "--run-dir", str(run_dir)]
    agents = [subprocess.Popen(cmd, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outs)
    a = load_checkpoint(reference.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # Only global rank 0 wrote the files; both ranks kept their logs; exports are alike.
    assert (run_dir / "export" / "model.safetensors").exists()
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"rank0.log", "rank1.log"}
    assert json.loads((run_dir / "config.json").read_text())["model"] == cfg.model


def test_fake_slurm_environment_initialises_two_ranks(tmp_path):
    port = free_port()
    procs = []
    for rank in range(2):
        env = launcher_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                        SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242", MASTER_PORT=str(port),
                        SLURM_NTASKS_PER_NODE="2")
        procs.append(subprocess.Popen(
            [PY, "-m", "nbddp", "run", f"{WORKERS / 'faulty.py'}:info", "--run-dir", str(tmp_path / "slurm-run")],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    assert "'world_size': 2" in outs[0] and "'backend': 'gloo'" in outs[0]
    assert f"'MASTER_PORT': '{port}'" in outs[0] and "'MASTER_ADDR': 'localhost'" in outs[0]
    assert (tmp_path / "slurm-run" / "logs" / "rank1.log").exists()


def test_first_host_of_slurm_node_lists():
    assert first_host("gpu[03-05,09],cpu1") == "gpu03"
    assert first_host("node7") == "node7"
    assert first_host("a-b[1,3]") == "a-b1"


def test_torchrun_restart_resumes_from_the_checkpoint(tree, runs_dir, tmp_path):
    cfg = small_cfg(tree, runs_dir, name="c", epochs=3)
    run_dir = tmp_path / "elastic"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
           "--max-restarts=1", "-m", "nbddp", "train", *cli_flags(cfg), "--run-dir", str(run_dir)]
    # rank 0 dies (SIGKILL) right after checkpointing epoch 0, on the first attempt only
    out = subprocess.run(cmd, env=launcher_env(**fault_env("epoch0:0:sigkill")), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "(restart 1)" in log and f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at epoch 1" in log
    ck = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert [m["epoch"] for m in ck["history"]] == [0, 1, 2]


def test_commands_for_the_cluster(tree, runs_dir):
    cfg = small_cfg(tree, runs_dir, name="c", sync_bn=True)
    cmd = cfg.torchrun_command(nnodes=2, nproc_per_node=4, rdzv_endpoint="gpu01:29400", max_restarts=3)
    assert cmd.startswith("torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=gpu01:29400")
    assert "--max-restarts=3" in cmd and "-m nbddp train" in cmd and "--sync-bn" in cmd
    assert cmd.endswith(f"--run-dir={runs_dir}/c")
    assert "--config=runs/x/config.json" in cfg.torchrun_command(config_path=Path("runs/x/config.json"))
    script = cfg.sbatch_script(nodes=2, gpus_per_node=4, partition="gpu")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=4" in script
    assert "srun python -m nbddp train" in script and "$SLURM_JOB_ID" in script
    # the flags rebuild the same config
    from nbddp.cli import build_config
    import argparse

    from nbddp import cli

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--run-dir")
    cli._add_config_flags(parser)
    ns = parser.parse_args(cli_flags(cfg) + ["--nprocs", "2", "--gpus", ""])
    assert build_config(ns) == cfg


def test_resume_across_launchers_notebook_torchrun_notebook(tree, runs_dir):
    from nbddp import WorkerError

    straight = spawn_train(small_cfg(tree, runs_dir, epochs=3, name="straight"), echo=False)
    cfg = small_cfg(tree, runs_dir, epochs=3, name="hop")
    with pytest.raises(WorkerError):  # the notebook run dies after epoch 0
        spawn_train(cfg, echo=False, env=fault_env("epoch0:0:exit3"))
    run_dir = next(runs_dir.glob("*-hop"))
    # torchrun continues it, and dies after epoch 1
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2", "-m", "nbddp",
           "train", "--config", str(run_dir / "config.json"), "--resume", str(run_dir)]
    out = subprocess.run(cmd, env=launcher_env(**fault_env("epoch1:0:exit3")), capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["epoch"] == 1
    # and the notebook finishes it
    done = spawn_train(cfg.replace(resume=str(run_dir)), echo=False)
    assert done.run_dir == run_dir.resolve()
    a = load_checkpoint(straight.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert [m["epoch"] for m in b["history"]] == [0, 1, 2]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
