"""``pip install .`` (not editable) gives a working nbddp.

Every other test imports nbddp from this checkout; a user who installs the package gets only what the
wheel holds. So the wheel is built from this tree, installed with pip into a fresh environment, and used
from a folder outside the checkout: a function written in a cell (the script's ``__main__``), a file
worker and the built-in worker run, and every nbddp import of the notebooks resolves. The
dependencies (torch and the rest, several GB) are lent from this environment through a path file: the
slow edge, not the thing under test — the wheel's own files are.
"""

import ast
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from conftest import ROOT, make_tree


def _nbddp_imports():
    """Every ``nbddp`` module and name the notebooks import, as ``(module, name or None)``."""
    wanted = set()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "\n".join(line for line in "".join(cell["source"]).splitlines()
                               if not line.lstrip().startswith(("%", "!")))
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    wanted |= {(a.name, None) for a in node.names if a.name.split(".")[0] == "nbddp"}
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nbddp":
                    wanted |= {(node.module, a.name) for a in node.names}
    return sorted(wanted, key=str)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The python of a fresh environment with nbddp installed from its wheel."""
    root = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(root / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (root / "dist").glob("nbddp-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True, timeout=120)
    python = root / "env" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies of this environment, after the fresh one's own site-packages (where the wheel
    # goes); a path file of that folder adds it without running its own path files, so this checkout's
    # editable install stays out.
    with open(os.path.join(site, "_lent_dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return python, root


def test_the_wheel_runs_cells_files_and_the_builtin_worker(installed, tmp_path):
    python, root = installed
    work = tmp_path / "elsewhere"
    work.mkdir()
    make_tree(work / "data", per_class=6)
    (work / "my_worker.py").write_text(textwrap.dedent("""
        def train(ctx, scale):
            import torch
            t = torch.ones(1) * (ctx.rank + 1) * scale
            torch.distributed.all_reduce(t)
            return float(t)
    """))
    (work / "main.py").write_text(textwrap.dedent(f"""
        import importlib, os, sys
        import nbddp
        from nbddp import TrainConfig, spawn_train, load_model, predict

        # Installed, not this checkout: the package lives in the fresh environment's site-packages.
        print("FROM", nbddp.__file__)

        def in_a_cell(ctx, base):            # defined in __main__, as in a notebook cell
            return base + ctx.world_size

        imports = {_nbddp_imports()!r}
        for module, name in imports:
            mod = importlib.import_module(module)
            assert name is None or hasattr(mod, name) or importlib.util.find_spec(module + "." + name), (module, name)
        print("IMPORTS", len(imports))

        env = {{"OMP_NUM_THREADS": "1"}}
        r = spawn_train(in_a_cell, 40, nprocs=2, echo=False, runs_dir="runs", env=env)
        print("CELL", r.value)
        r = spawn_train("my_worker.py:train", 10, nprocs=2, echo=False, runs_dir="runs", env=env)
        print("FILE", r.value)
        cfg = TrainConfig(data_path="data", model="resnet18", image_size=16, epochs=1, batch_size=4,
                          nprocs=2, runs_dir="runs", name="wheel")
        r = spawn_train(cfg, echo=False)
        model, classes = load_model(r.run_dir)
        print("BUILTIN", sorted(classes), os.path.exists(r.weights_path))
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("NBDDP_")}
    done = subprocess.run([str(python), "main.py"], cwd=work, env=env, capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ")[0].isupper())
    assert said["FROM"].startswith(str(root / "env")), said["FROM"]
    assert int(said["IMPORTS"]) >= 5
    assert said["CELL"] == "42"
    assert said["FILE"] == "30.0"
    assert said["BUILTIN"] == "['a', 'b', 'c'] True"
