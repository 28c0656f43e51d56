"""Generated cluster commands run nothing hidden: unsafe names are refused, every value is quoted.

The generated script and command are really run by bash, with stub ``srun``/``torchrun``
executables first on ``PATH`` that record the arguments they receive, one per line.
"""

import json
import os
import stat
import subprocess
import sys

import pytest

from nbddp import ConfigError, TrainConfig
from nbddp import cli

# Each stub writes its argv as a JSON list, so an argument that holds spaces or newlines is
# seen exactly as it arrived.
STUB = """#!{python}
import json, sys
with open({out!r}, "w") as f:
    json.dump(sys.argv[1:], f)
"""

# Values that run code if pasted into a shell line unquoted, or split into two arguments.
NASTY = "my runs/$(touch {marker}) `touch {marker}`; touch {marker} 'q\" \\"


def stub_bin(tmp_path, *names):
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name in names:
        exe = folder / name
        exe.write_text(STUB.format(python=sys.executable, out=str(tmp_path / f"{name}.args")))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


def run_bash(tmp_path, script: str, bin_dir, **env):
    path = tmp_path / "job.sh"
    path.write_text(script)
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(path)], cwd=tmp_path, env=full_env, capture_output=True, text=True,
                          timeout=60)


def flag_value(args, flag):
    """The value of ``--flag value`` or ``--flag=value`` in an argument list."""
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    raise AssertionError(f"{flag} not in {args}")


@pytest.mark.parametrize("name", ["exp$(touch PWNED)", "exp\ntouch PWNED", "a b", "exp;id", "-rf", ".hidden",
                                  "x" * 65, "tab\there", "é"])
def test_unsafe_run_names_are_refused(name):
    with pytest.raises(ConfigError, match=r"TrainConfig\.name=.*letters, digits"):
        TrainConfig(name=name)


def test_safe_run_names_are_accepted():
    for name in ("digits", "ft-syncbn", "resnet34_v2.1", "A", "x" * 64):
        assert TrainConfig(name=name).name == name


def test_unsafe_name_refused_in_config_json_and_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TrainConfig().to_dict(), "name": "exp$(touch PWNED)"}))
    with pytest.raises(ConfigError, match=r"(?s)config\.json.*TrainConfig\.name="):
        TrainConfig.load(path)
    assert cli.main(["train", "--name", "exp$(touch PWNED)", "--gpus", ""]) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.name=" in err and "Traceback" not in err
    assert not (tmp_path / "PWNED").exists()


def test_sbatch_script_runs_nothing_hidden_and_keeps_arguments_whole(tmp_path):
    marker = tmp_path / "PWNED"
    runs_dir = NASTY.format(marker=marker)
    data_path = "data/with space/$(touch {m})\nnext line".format(m=marker)
    cfg = TrainConfig(data_path=data_path, runs_dir=runs_dir, name="exp", epochs=3)
    script = cfg.sbatch_script(nodes=1, gpus_per_node=2, python=f"{sys.executable} -X dev")
    out = run_bash(tmp_path, script, stub_bin(tmp_path, "srun"), SLURM_JOB_ID="4242")
    assert out.returncode == 0, out.stderr
    assert not marker.exists()
    args = json.loads((tmp_path / "srun.args").read_text())
    assert args[0] == f"{sys.executable} -X dev"  # the interpreter stays one word, as given
    assert args[1:4] == ["-m", "nbddp", "train"]
    assert flag_value(args, "--data-path") == data_path
    assert flag_value(args, "--runs-dir") == runs_dir
    assert flag_value(args, "--run-dir") == f"{runs_dir}/exp-4242"
    assert flag_value(args, "--epochs") == "3"
    # the flags rebuild the same config on the other side
    ns = _train_parser().parse_args(args[4:] + ["--gpus", ""])
    assert cli.build_config(ns) == cfg


def test_sbatch_options_cannot_add_script_lines(tmp_path):
    cfg = TrainConfig()
    for bad in ({"partition": "gpu\ntouch PWNED"}, {"time": "1:00:00 ; touch PWNED"}, {"partition": ""}):
        with pytest.raises(ConfigError, match="sbatch_script"):
            cfg.sbatch_script(**bad)


def test_torchrun_command_runs_nothing_hidden_and_keeps_arguments_whole(tmp_path):
    marker = tmp_path / "PWNED"
    runs_dir = NASTY.format(marker=marker)
    cfg = TrainConfig(data_path="-data", runs_dir=runs_dir, name="exp", nprocs=2)
    for kwargs in ({}, {"config_path": f"{runs_dir}/config.json"}, {"run_dir": f"{runs_dir}/r"}):
        cmd = cfg.torchrun_command(rdzv_endpoint="gpu01:29400", **kwargs)
        out = run_bash(tmp_path, cmd + "\n", stub_bin(tmp_path, "torchrun"))
        assert out.returncode == 0, out.stderr
        assert not marker.exists()
        args = json.loads((tmp_path / "torchrun.args").read_text())
        assert flag_value(args, "--nproc-per-node") == "2"
        if "config_path" in kwargs:
            assert flag_value(args, "--config") == kwargs["config_path"]
        else:
            assert flag_value(args, "--data-path") == "-data"
            assert flag_value(args, "--runs-dir") == runs_dir
        assert flag_value(args, "--run-dir") == kwargs.get("run_dir", f"{runs_dir}/exp")
    args = json.loads((tmp_path / "torchrun.args").read_text())
    ns = _train_parser().parse_args(args[args.index("train") + 1:] + ["--nprocs", "2", "--gpus", ""])
    assert cli.build_config(ns) == cfg


def _train_parser():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--run-dir")
    cli._add_config_flags(parser)
    return parser
