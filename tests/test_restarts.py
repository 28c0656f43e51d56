"""Runs that heal: restarts from the last checkpoint, the rule of what is retried, out-of-memory halving."""

import json

import pytest

from nbddp import ConfigError, Retryable, WorkerError, spawn_train
from nbddp.contract import rundir
from nbddp.contract.errors import NonFiniteLossError
from nbddp.rank.rank_errors import is_retryable
from nbddp.kernel.restarts import backoff, check_policy, decide, split_batch
from conftest import WORKERS, wait_for

HEALING = WORKERS / "healing.py"


def _error(kind, exc_type=None, retryable=False):
    return WorkerError("Training failed: x", rank=1, kind=kind, exc_type=exc_type, retryable=retryable)


def test_the_rule_of_what_a_restart_heals():
    for kind in ("signal", "exit-code", "hang", "collective", "watchdog", "server"):
        assert decide(_error(kind), "fail", None)[0], kind
    assert not decide(_error("exception", "TypeError"), "fail", None)[0]
    assert not decide(_error("exit", "SystemExit"), "fail", None)[0]
    assert decide(_error("exception", "Retryable", retryable=True), "fail", None)[0]
    # Out of memory: only with oom="halve", only for the built-in worker's batch, never below 1.
    oom = _error("exception", "OutOfMemoryError")
    assert not decide(oom, "fail", 16)[0]
    assert decide(oom, "halve", 16)[0]
    assert not decide(oom, "halve", None)[0] and not decide(oom, "halve", 1)[0]
    # What the rank says about its own exception.
    import torch

    class Mine(Exception):
        retryable = True

    assert is_retryable(Retryable("x")) and is_retryable(Mine())
    assert is_retryable(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_retryable(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"))
    assert not is_retryable(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_retryable(torch.OutOfMemoryError("CUDA out of memory"))  # oom= decides
    for wrong in (TypeError("x"), ValueError("x"), KeyError("x"), ConfigError("x"), NonFiniteLossError("nan", rank=0)):
        assert not is_retryable(wrong), wrong
    assert [split_batch(b) for b in (16, 15, 7, 1)] == [2, 3, 7, None]
    assert [backoff(n, 1.0) for n in (1, 2, 3)] == [1.0, 2.0, 4.0] and backoff(20, 1.0) == 60.0
    for bad in (dict(max_restarts=-1), dict(max_restarts=True), dict(oom="double"), dict(backoff_s=-1)):
        args = {"max_restarts": 1, "oom": "fail", "backoff_s": 1.0, **bad}
        with pytest.raises(ConfigError):
            check_policy(**args)
    with pytest.raises(ConfigError, match="max_restarts=-1"):
        spawn_train(f"{HEALING}:counted", nprocs=2, max_restarts=-1)


def test_a_killed_rank_then_a_hung_one_are_restarted_from_the_last_checkpoint(runs_dir, capsys):
    result = spawn_train(f"{HEALING}:counted", nprocs=2, runs_dir=runs_dir, max_restarts=2, restart_backoff_s=0.2,
                         stall_timeout_s=3, timeout_s=30)
    # Eight steps of all_reduce(ones) on two ranks: w = 16 however many launches it took.
    assert result.value["w"] == [16.0, 16.0] and result.value["launch"] == 2
    first, second = result.restarts
    # Where rank 1 was, as its last heartbeat said (written at most every half second).
    assert (first.number, first.rank) == (1, 1) and first.step <= 3 and "SIGKILL" in first.cause
    assert first.resumed_from == "checkpoints/last.pt (epoch 0, step 2)" and first.backoff_s == 0.2
    assert (second.number, second.rank) == (2, 0) and "stopped making progress" in second.cause
    assert second.resumed_from == "checkpoints/last.pt (epoch 0, step 4)" and second.backoff_s == 0.4
    assert result.value["starts"] == 5  # the last launch continued after step 4
    err = capsys.readouterr().err
    assert "nbddp: restart 1/2: rank 1 was killed by SIGKILL" in err and "from checkpoints/last.pt (epoch 0, step 2)" in err
    record = json.loads(rundir.launch_record_path(result.run_dir).read_text())
    assert [r["cause"] for r in record["restarts"]] == [first.cause, second.cause]


def test_a_retryable_error_is_restarted_and_an_error_of_the_code_is_not(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{HEALING}:flaky_then_wrong", nprocs=2, runs_dir=runs_dir, max_restarts=3,
                    restart_backoff_s=0, echo=False)
    err = info.value
    assert err.exc_type == "TypeError" and err.rank == 1
    assert [r.cause for r in err.restarts] == ["rank 0 raised Retryable: the data server went away"] or \
        [r.cause for r in err.restarts] == ["rank 1 raised Retryable: the data server went away"]
    text = str(err)
    assert "The run was restarted 1 time before" in text
    assert "Not restarted: TypeError comes from the worker's code and would fail again the same way" in text
    # The logs' tails quote the last launch only: the first launch's traceback is in the logs, not here.
    tails = text[text.index("--- every rank ---"):]
    assert "--- rank 0: last 20 lines of rank0.log ---" in tails and "the data server went away" not in tails, tails


def test_a_stop_during_the_back_off_ends_the_run_without_a_restart(tmp_path, runs_dir):
    go = tmp_path / "go"
    h = spawn_train(f"{HEALING}:fails_then_waits", str(go), nprocs=2, runs_dir=runs_dir, max_restarts=2,
                    restart_backoff_s=30, block=False, echo=False)
    assert wait_for(lambda: len(h.restarts) == 1, 60), "the failure was not seen"
    pids = h.pids
    h.stop(wait=True, timeout=20)
    assert not h.running and len(h.restarts) == 1 and h.pids == pids, "a Stop is never retried"
    assert "stopped" in str(h.outcome)


def test_out_of_memory_restarts_with_half_the_batch_and_twice_the_accumulation(tree, runs_dir):
    from nbddp import TrainConfig
    from conftest import fault_env, small_cfg

    # oom="halve" alone (max_restarts=0): the batch bounds these restarts, not max_restarts.
    cfg = small_cfg(tree, runs_dir, name="oom", checkpoint_every_s=0.001, oom="halve")
    assert cfg.batch_size == 4 and cfg.grad_accum_steps == 1 and cfg.max_restarts == 0
    result = spawn_train(cfg, echo=False, env=fault_env("step0.2:1:oom"), restart_backoff_s=0)
    (restart,) = result.restarts
    assert "OutOfMemoryError" in restart.cause and restart.rank == 1
    assert restart.line(0).startswith("nbddp: restart 1 (out of memory, oom='halve'): "), restart.line(0)
    assert restart.changes == {"batch_size": [4, 2], "grad_accum_steps": [1, 2]}
    kept = TrainConfig.load(rundir.config_path(result.run_dir))
    assert (kept.batch_size, kept.grad_accum_steps, kept.resume) == (2, 2, str(result.run_dir))
    # Two steps of 4 were done: the restart continues with its step 5 of 2 images.
    assert "resuming from epoch 1 step 5" in rundir.rank_log(result.run_dir, 0).read_text()
    assert result.weights_path is not None and len(result.metrics) == cfg.epochs
    # Without oom="halve" the same error ends the run, saying why.
    with pytest.raises(WorkerError, match="out of memory fails again with the same batch"):
        spawn_train(cfg.replace(name="oom-fail", oom="fail", max_restarts=1), echo=False,
                    env=fault_env("step0.2:1:oom"))


def test_the_panel_and_the_cli_set_restarts(tree, runs_dir, no_gpu):
    from nbddp import TrainingPanel, cli
    from conftest import small_cfg

    panel = TrainingPanel(small_cfg(tree, runs_dir, max_restarts=2, oom="halve"))
    assert (panel.max_restarts_input.value, panel.oom_input.value) == (2, "halve")
    panel.max_restarts_input.value = 3
    assert panel.config.max_restarts == 3
    parser = cli.argparse.ArgumentParser()
    cli._add_config_flags(parser)
    ns = parser.parse_args(["--max-restarts", "4", "--oom", "halve", "--gpus", ""])
    ns.config = None
    cfg = cli.build_config(ns)
    assert (cfg.max_restarts, cfg.oom) == (4, "halve")
    assert "--max-restarts=4" in cfg.torchrun_command(nnodes=2)
