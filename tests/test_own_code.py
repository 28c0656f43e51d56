"""Code written for other launchers runs unchanged: torchrun scripts and modules, mp.spawn and
torchrun-style functions; mismatches are refused in the kernel with the fix; a stop reaches code
that never asks ``ctx.should_stop()``.

The scripts in ``tests/workers/own_code`` are written as the PyTorch tutorials write them: their
own ``init_process_group``, argparse, ``LOCAL_RANK``, a hard-coded ``MASTER_PORT``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import children_of, free_port, survivors, wait_for
from nbddp import spawn_train
from nbddp.contract.errors import ConfigError, TrainingInterrupted, WorkerError

OWN = Path(__file__).parent / "workers" / "own_code"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A copy of the scripts as a user's project folder, and the kernel's working directory there."""
    folder = tmp_path / "project"
    shutil.copytree(OWN, folder)
    monkeypatch.chdir(folder)
    return folder


def test_a_torchrun_script_runs_unchanged_and_trains_as_under_torchrun(project, tmp_path):
    argv = ["3", "1", "--batch_size", "8"]
    result = spawn_train("torchrun_train.py", nprocs=2, argv=argv, runs_dir=tmp_path / "runs", echo=False)
    report = json.loads((project / "report.json").read_text())
    assert result.value is None and (project / "snapshot.pt").is_file()
    assert report["argv"] == ["torchrun_train.py", *argv] and report["name"] == "__main__"
    assert report["cwd"] == str(project) and report["world"] == 2
    env = report["env"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "0", "2", "2")
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert env["TORCHELASTIC_RUN_ID"] == result.run_dir.name
    assert "[GPU1] epoch 2" in (result.run_dir / "logs" / "rank1.log").read_text()

    # The same file under torchrun itself ends with the same weights.
    out = tmp_path / "torchrun"
    out.mkdir()
    torchrun_itself(["torchrun_train.py", *argv, "--out", str(out)])
    assert json.loads((out / "report.json").read_text())["weight"] == report["weight"]


TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun_itself(args: list[str], tries: int = 3) -> None:
    """The reference: the script under plain torchrun, which must end cleanly.

    torch 2.14's gloo aborts a plain process now and then after ``destroy_process_group`` has
    returned, as the process tears down ("terminate called without an active exception",
    SIGABRT: 3 of 20 runs of this script on a loaded 2-core machine, with or without a barrier;
    0 of 25 with the model, optimizer and loss released before ``destroy_process_group``).
    nbddp's ranks leave with ``os._exit`` and never reach it; the reference is run again only
    for that abort, and any other failure fails the test.
    """
    for attempt in range(tries):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               "--master_port", str(free_port()), *args], timeout=180, capture_output=True, text=True,
                              errors="replace")
        if done.returncode == 0:
            return
        if TEARDOWN_ABORT not in done.stderr + done.stdout or attempt == tries - 1:
            raise AssertionError(f"plain torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def test_a_module_runs_as_python_m_does(project, tmp_path):
    spawn_train("-m", "pkg.train", nprocs=2, argv=["--steps", 3], runs_dir=tmp_path / "runs", echo=False)
    report = json.loads((project / "module_report.json").read_text())
    assert report == {"steps": 3, "argv0": "train.py", "name": "__main__", "world": 2}


def test_an_mp_spawn_function_makes_its_own_group_on_its_hard_coded_port(project, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("OWN_CODE_PORT", str(port))  # what the tutorial hard-codes as "12355"
    result = spawn_train("multigpu.py:main", 2, 3, 8, nprocs=2, call="mp.spawn", runs_dir=tmp_path / "runs",
                         echo=False, all_values=True)
    report = json.loads((project / "report.json").read_text())
    assert result.values == [0, 10] and report["world"] == 2 and report["port"] == str(port)


def test_a_torchrun_function_is_called_with_its_arguments_only(project, tmp_path):
    result = spawn_train("env_fn.py:train", 7, nprocs=2, call="torchrun", kwargs={"tag": "x"},
                         runs_dir=tmp_path / "runs", echo=False)
    assert result.value == "x:7:2:0"


@pytest.mark.parametrize("target, args, kwargs, call, words", [
    ("multigpu.py:main", (2, 3, 8), {}, "ctx", "looks like an mp.spawn function: .* call='mp.spawn'"),
    ("multigpu.py:main", (2, 3), {}, "mp.spawn", r"missing a required argument: 'batch_size'"),
    ("multigpu.py:main", (2, 3), {"total_epochs": 3}, "mp.spawn", "multiple values for argument 'total_epochs'"),
    ("env_fn.py:train", (), {}, "torchrun", "missing a required argument: 'total_epochs'"),
    ("torchrun_train.py", (1,), {}, "ctx", r"is a script: pass its command line as argv=\[...\]"),
    ("-m", ("no_such.module",), {}, "ctx", "no module 'no_such.module' can be imported"),
    ("-m", ("pkg train",), {}, "ctx", "give the module as python -m takes it"),
    ("env_fn.py:train", (1,), {}, "tcp", "call='tcp': use one of"),
])
def test_a_mismatch_is_refused_before_any_process_starts(project, tmp_path, target, args, kwargs, call, words):
    with pytest.raises(ConfigError, match=words):
        spawn_train(target, *args, kwargs=kwargs, call=call, nprocs=2, runs_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_ctx_function_that_makes_its_own_group_is_refused_from_its_source(project, tmp_path):
    (project / "own_group.py").write_text(
        "import torch.distributed as dist\n\ndef setup():\n    dist.init_process_group('gloo')\n\n"
        "def train(ctx):\n    setup()\n")
    with pytest.raises(ConfigError, match="calls torch.distributed.init_process_group itself.*call='torchrun'"):
        spawn_train("own_group.py:train", nprocs=2, runs_dir=tmp_path / "runs")


def test_a_second_group_at_run_time_gets_nbddp_s_message_and_argparse_s_exit_its_last_lines(project, tmp_path):
    (project / "hidden.py").write_text(
        "import torch.distributed as dist\n\ndef train(ctx):\n    getattr(dist, 'init_process_' + 'group')('gloo')\n")
    with pytest.raises(WorkerError) as err:
        spawn_train("hidden.py:train", nprocs=2, runs_dir=tmp_path / "runs", echo=False)
    assert "nbddp had made the process group before calling it (call='ctx')" in str(err.value)
    assert "trying to initialize the default process group twice" not in str(err.value).splitlines()[0]

    with pytest.raises(WorkerError) as err:
        spawn_train("torchrun_train.py", nprocs=2, argv=["3"], runs_dir=tmp_path / "runs", echo=False)
    headline = str(err.value).split("\n  before its first step")[0]
    assert "rank 0 exited with SystemExit(2); its last output:" in headline
    assert "error: the following arguments are required: save_every" in headline
    assert "at before" not in str(err.value)


SPAWNER = """
import os, sys, time
import torch.multiprocessing as mp


def work(rank, mode, out):
    open(os.path.join(out, f"started{rank}"), "w").close()
    print(f"process {rank} up", flush=True)
    try:
        if mode == "crash" and rank == 1:
            raise ValueError("process 1 cannot go on")
        time.sleep(120)
    finally:
        open(os.path.join(out, f"finally{rank}"), "w").close()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


def test_a_script_that_spawns_its_own_processes_runs_as_it_is(project, tmp_path, monkeypatch, capsys):
    """``python multigpu.py`` ending in ``mp.spawn``: one launcher runs it; its processes' output is
    live by rank, each keeps its log, and the function form it suggests is a call that runs."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("OWN_CODE_PORT", str(free_port()))  # what the tutorial hard-codes as "12355"
    with pytest.raises(ConfigError) as err:  # the script decides how many processes it starts
        spawn_train("multigpu.py", nprocs=2, argv=["2"], runs_dir=runs)
    assert "multigpu.py starts its own processes" in str(err.value) and "Drop nprocs=2" in str(err.value)
    assert not runs.exists()

    result = spawn_train("multigpu.py", argv=["2"], runs_dir=runs)
    out = capsys.readouterr().out
    report = json.loads((project / "report.json").read_text())
    assert result.value is None and report["world"] == 2 and report["port"] == os.environ["OWN_CODE_PORT"]
    logs = result.run_dir / "logs"
    for rank in (0, 1):
        assert f"[GPU{rank}] Epoch 4 | Batchsize: 32" in (logs / f"spawned{rank}.log").read_text()
        assert f"\n[rank{rank}] [GPU{rank}] Epoch 4 | Batchsize: 32" in out, out
    assert "[rank0] nbddp:" not in out  # the launcher's own lines stand bare, as in a terminal
    suggested = next(line.strip() for line in out.splitlines() if line.strip().startswith("spawn_train("))
    assert suggested == "spawn_train('multigpu.py:main', 2, 5, 32, nprocs=2, call='mp.spawn')", out
    (project / "report.json").unlink()
    again = eval(suggested[:-1] + ", runs_dir=runs, echo=False, all_values=True)",
                 {"spawn_train": spawn_train, "runs": runs})
    assert again.values == [0, 10] and json.loads((project / "report.json").read_text())["world"] == 2

    # ImageNet's --multiprocessing-distributed: the flag makes it a launcher too, its processes
    # joining with the ranks it computes; its arguments (a Namespace) are no call to copy.
    port = free_port()
    result = spawn_train("imagenet_style.py", argv=["--multiprocessing-distributed", "--dist-url",
                                                    f"tcp://127.0.0.1:{port}", "--world-size", "1", "--rank", "0"],
                         runs_dir=runs)
    out = capsys.readouterr().out
    assert "rank 1 of 2, local rank 1" in (result.run_dir / "logs" / "spawned1.log").read_text()
    assert "[rank1] rank 1 of 2, local rank 1" in out, out
    assert "argument 2 (Namespace) is not a plain value" in out, out


def test_a_crash_and_a_stop_reach_every_process_a_launcher_script_started(project, tmp_path):
    (project / "spawner.py").write_text(SPAWNER)
    runs, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    with pytest.raises(WorkerError) as err:
        spawn_train("spawner.py", argv=["crash", str(out)], runs_dir=runs, echo=False)
    msg = str(err.value)
    assert "ValueError: process 1 cannot go on" in msg, msg
    log = next(runs.iterdir()) / "logs" / "spawned1.log"
    # The headline names the process, what it raised and its log.
    assert msg.splitlines()[0] == "Training failed: process 1 of 2 (work) raised ValueError: process 1 cannot go on", msg
    assert f"log: {log}" in msg.splitlines()[1], msg
    assert "ValueError: process 1 cannot go on" in log.read_text()

    for f in out.iterdir():
        f.unlink()
    handle = spawn_train("spawner.py", argv=["wait", str(out)], runs_dir=runs, echo=False, block=False)
    wait_for(lambda: (out / "started0").exists() and (out / "started1").exists(), 60)
    pids = [*handle.pids, *(c for p in handle.pids for c in children_of(p))]
    t0 = time.time()
    handle.stop(wait=False)
    with pytest.raises(TrainingInterrupted):
        handle.wait(60)
    # An Interrupt, as Ctrl-C in a terminal would: every process's finally: ran, before any SIGTERM.
    assert (out / "finally0").exists() and (out / "finally1").exists()
    assert time.time() - t0 < handle.grace_s + 2
    assert len(pids) >= 3 and not survivors(pids), survivors(pids)

    # Two starts side by side, join=False, and a script that returns without joining either:
    # `python script.py` waits for them at its exit, and so does the launcher (nothing it started is
    # cut short); each process keeps a log of its own.
    for f in out.iterdir():
        f.unlink()
    (project / "two_groups.py").write_text(
        "import os, sys, time\nimport torch.multiprocessing as mp\n\n\ndef work(rank, tag, out):\n"
        "    try:\n        time.sleep(1.5)\n        print(f'{tag} process {rank}', flush=True)\n"
        "    finally:\n        open(os.path.join(out, f'finally-{tag}{rank}'), 'w').close()\n\n\n"
        "if __name__ == '__main__':\n    mp.start_processes(work, args=('first', sys.argv[1]), nprocs=2, join=False)\n"
        "    mp.start_processes(work, args=('second', sys.argv[1]), nprocs=2, join=False)\n")
    result = spawn_train("two_groups.py", argv=[str(out)], runs_dir=runs, echo=False)
    assert sorted(f.name for f in out.iterdir()) == [f"finally-{tag}{rank}" for tag in ("first", "second")
                                                      for rank in (0, 1)] and not result.stopped
    logs = result.run_dir / "logs"
    assert [(logs / f"spawned{i}.log").read_text().strip() for i in (0, 1)] == ["first process 0", "first process 1"]
    assert [(logs / f"spawned{i}-1.log").read_text().strip() for i in (0, 1)] == ["second process 0",
                                                                                    "second process 1"]
    assert "[group1.rank1] second process 1" in (logs / "rank0.log").read_text()


def test_a_spawn_a_rank_reaches_behind_a_condition_is_refused_once_at_the_users_line(project, tmp_path):
    runs = tmp_path / "runs"
    # Behind a condition the kernel cannot read (the environment): every rank refuses it, said once,
    # as the ConfigError it is, where the user's code called it (not runpy).
    (project / "spawn_on_env.py").write_text(
        "import os\nimport torch.multiprocessing as mp\n\n\ndef work(rank):\n    pass\n\n\n"
        "if os.environ.get('WORLD_SIZE'):\n    mp.spawn(work, nprocs=2)\n")
    with pytest.raises(ConfigError) as err:
        spawn_train("spawn_on_env.py", nprocs=2, runs_dir=runs, echo=False)
    msg = str(err.value)
    assert msg.count("the code called torch.multiprocessing.spawn on `work` inside an nbddp rank") == 1, msg
    # It names the ranks that refused it: both, unless one was still starting when the other's refusal
    # ended the run (a loaded machine) and so never reached the call.
    from nbddp.contract.protocol import read_error_records

    refused = sorted(r for r, rec in read_error_records(err.value.run_dir, 2).items() if rec.type == "ConfigError")
    named = f"ranks {', '.join(map(str, refused))}" if len(refused) > 1 else f"rank {refused[0]}"
    assert f"where: spawn_on_env.py:10, in <module> ({named} refused it;" in msg, (msg, refused)
    assert len(msg.splitlines()) == 2, msg
    # Without the flag imagenet_style.py is one rank of a torchrun job, and runs unchanged.
    result = spawn_train("imagenet_style.py", nprocs=2, runs_dir=runs, echo=False)
    assert "rank 1 of 2, local rank 1" in (result.run_dir / "logs" / "rank1.log").read_text()


def test_a_module_that_spawns_its_own_processes_runs_as_a_script_does(project, tmp_path, monkeypatch, capsys):
    """``python -m`` targets are read from their source too, found without importing the package."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("OWN_CODE_PORT", str(free_port()))
    (project / "pkg" / "multigpu.py").write_text((project / "multigpu.py").read_text())
    from nbddp.contract import plans

    assert plans.plan("-m", ("pkg.multigpu",), argv=["2"], place=False).call == "spawns"
    result = spawn_train("-m", "pkg.multigpu", argv=["2"], runs_dir=runs)
    out = capsys.readouterr().out
    assert "[rank1] [GPU1] Epoch 4" in out and result.value is None and result.run_dir.name.endswith("-multigpu")
    assert "spawn_train('pkg.multigpu:main', 2, 5, 32, nprocs=2, call='mp.spawn')" in out, out
    # A module that does not spawn passes the same reading (and pkg/__init__.py is not run for it).
    from nbddp.contract.plans import _module_source

    assert _module_source("pkg.train") == project / "pkg" / "train.py"
    app = project / "app"
    app.mkdir()
    (app / "__init__.py").write_text("raise RuntimeError('the kernel ran the package')\n")
    (app / "__main__.py").write_text("print('app')\n")
    assert _module_source("app") == app / "__main__.py" and _module_source("app.nothing") is None


TUTORIAL = """
import torch.multiprocessing as mp
def demo_basic(rank, world_size): ...
def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)
if __name__ == "__main__":
    run_demo(demo_basic, 2)
"""


@pytest.mark.parametrize("source, found", [
    (TUTORIAL, "line 5 calls torch.multiprocessing.spawn on `demo_basic`"),  # through run_demo's parameter
    ("from torch.multiprocessing import start_processes as sp\ndef f(r): ...\nwith open('x'):\n    sp(f)\n",
     "line 4 calls torch.multiprocessing.start_processes on `f`"),
    ("import torch\ndef f(r): ...\nif __name__ == '__main__':\n    torch.multiprocessing.spawn(f, nprocs=2)\n",
     "line 4 calls torch.multiprocessing.spawn on `f`"),
    ("import torch.multiprocessing as mp\ndef f(r): ...\nif __name__ == '__main__' and FLAG:\n    mp.spawn(f)\n", None),
    ("import torch.multiprocessing as mp\ndef f(r): ...\ndef main():\n    if FLAG:\n        mp.spawn(f)\nmain()\n", None),
    ("import multiprocessing as mp\ndef f(): ...\nmp.Process(target=f).start()\n", None),  # not torch's spawn
])
def test_a_spawn_every_run_reaches_is_read_from_the_source(source, found):
    import ast

    from nbddp.contract.conventions import script_spawns

    spawn = script_spawns(ast.parse(source))
    if found is None:
        assert spawn is None
        return
    assert spawn is not None and f"line {spawn.line} calls {spawn.spawner} on `{spawn.fn}`" == found


def test_a_script_that_ends_its_own_process_succeeds(project, tmp_path):
    """``os._exit(0)`` after training (scripts do it to skip a teardown that hangs) is a success."""
    result = spawn_train("endless.py", nprocs=2, argv=["0.5"], runs_dir=tmp_path / "runs", echo=False,
                         all_values=True)
    assert result.value is None and result.values == [None, None] and not result.stopped


@pytest.mark.parametrize("target, kwargs", [("endless.py:spin", {"call": "mp.spawn"}),
                                            ("endless.py", {"argv": ["120"]})])
def test_stop_reaches_code_that_never_checks_should_stop(project, tmp_path, target, kwargs):
    handle = spawn_train(target, nprocs=2, block=False, runs_dir=tmp_path / "runs", echo=False, **kwargs)
    logs = [handle.run_dir / "logs" / f"rank{r}.log" for r in (0, 1)]
    # Both in the code: a rank still meeting the others (in C++, its own init_process_group) when
    # the stop comes has nothing to finish and gets SIGTERM at once, by design, and under load one
    # rank can print before the other has left its init_process_group.
    assert wait_for(lambda: all("spinning" in (log.read_text() if log.exists() else "") for log in logs), 90)
    t0 = time.time()
    handle.stop(wait=False)
    with pytest.raises(TrainingInterrupted) as err:
        handle.wait(60)
    # Between two statements (out of time.sleep), not at the launcher's SIGTERM grace_s later.
    assert time.time() - t0 < handle.grace_s + 2
    assert "ranks 0-1: KeyboardInterrupt at the stop request" in str(err.value)
    assert "no checkpoint was written" in str(err.value) and "last checkpoint" not in str(err.value)


def test_the_command_line_takes_the_same_targets_and_under_torchrun_a_script_is_just_the_script(
        project, tmp_path, monkeypatch, capsys):
    from nbddp import cli

    assert cli.main(["run", "--nprocs", "2", "-m", "pkg.train", "--steps", "2"]) == 0
    assert json.loads((project / "module_report.json").read_text())["steps"] == 2
    assert cli.main(["run", "--call", "torchrun", "env_fn.py:train", "--kwargs", '{"total_epochs": 4}',
                     "--nprocs", "2"]) == 0
    assert "result: 'run:4:2:0'" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert cli.main(["run", "torchrun_train.py", "3", "1"]) == 2
    assert "run the script itself (torchrun --nproc_per_node=N train.py" in capsys.readouterr().err


def test_a_function_sees_a_command_line_of_its_own_not_the_kernels(tmp_path, monkeypatch):
    """Under spawn, multiprocessing hands the parent's ``sys.argv`` down: in a kernel that is
    ``ipykernel_launcher.py -f kernel.json``, and argparse in the function would refuse ``-f``."""
    worker = tmp_path / "uses_argparse.py"
    worker.write_text("import argparse, sys\n\ndef main(rank, world_size):\n"
                      "    args = argparse.ArgumentParser().parse_args()\n    return list(sys.argv)\n")
    monkeypatch.setattr(sys, "argv", ["ipykernel_launcher.py", "-f", "/tmp/kernel-1.json"])
    result = spawn_train(f"{worker}:main", 2, nprocs=2, call="mp.spawn", start_method="spawn",
                         runs_dir=tmp_path / "runs", echo=False)
    assert result.value == [str(worker)], result.value


def test_the_readme_call_for_the_tutorial_series_multigpu_fits_its_upstream_signature(tmp_path):
    """The mp.spawn row of docs/your-code.md launches the DDP tutorial series' multigpu.py as it is upstream."""
    import ast
    import re

    from conftest import ROOT
    from nbddp.contract.conventions import check_call

    call = re.search(r'`spawn_train\("multigpu\.py:main", ([^`]*?), nprocs=2, call="mp\.spawn"\)`',
                     (ROOT / "docs" / "your-code.md").read_text())
    assert call, "the mp.spawn row of docs/your-code.md"
    args = ast.literal_eval(f"({call.group(1)},)")
    upstream = tmp_path / "multigpu.py"
    upstream.write_text("def main(rank: int, world_size: int, save_every: int, total_epochs: int, batch_size: int):\n"
                        "    pass\n")
    check_call(f"{upstream}:main", "mp.spawn", args, {}, "multigpu.py:main")  # refused if it does not bind
