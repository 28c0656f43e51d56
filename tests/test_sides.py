"""The sides hold as a fact: a rank loads no kernel-side module, and no module imports in a circle.

``nbddp.SIDES`` says each module's side and ``nbddp.FOLDER_SIDES`` each folder's: every module of
a folder is of its side, and each side imports only what it may (the contract only the contract,
the kernel no rank module). The static checks read every ``import`` of the package with ``ast``,
function-level ones included (they run too, just later); the run-time checks look at
``sys.modules`` in a fresh interpreter, in real ranks started by ``spawn_train`` (spawned and
forked from the warm server, whose preload is part of it) and in a rank under a launcher.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nbddp
from conftest import free_port
from nbddp import spawn_train

PACKAGE = Path(nbddp.__file__).parent
WORKERS = Path(__file__).parent / "workers"
RANK_SIDES = ("rank", "contract", "task")
#: What each side's modules may import (the package's own face, "entry", may import any side).
MAY_IMPORT = {"contract": {"contract"}, "rank": {"rank", "contract"}, "task": {"task", "rank", "contract"},
              "kernel": {"kernel", "contract", "task"}}


def package_modules() -> dict:
    """Dotted name (relative to nbddp, "" for the package) -> source file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict) -> set:
    """The package modules that ``name`` imports anywhere in its file (function bodies included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                where = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "nbddp" or node.module.startswith("nbddp.")):
                where = node.module[len("nbddp."):] if node.module != "nbddp" else ""
            else:
                continue
            for alias in node.names:  # `from . import rundir` imports the module nbddp.contract.rundir
                sub = f"{where}.{alias.name}" if where else alias.name
                found.add(sub if sub in modules else where)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nbddp."):
                    found.add(alias.name[len("nbddp."):])
    found.discard(name)
    return {m for m in found if m in modules}


@pytest.fixture(scope="module")
def graph() -> dict:
    modules = package_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_side():
    missing = sorted(m for m in package_modules() if m and m not in nbddp.SIDES)
    assert not missing, f"add these modules to nbddp.SIDES (and the table in nbddp/__init__.py): {missing}"
    gone = sorted(m for m in nbddp.SIDES if m not in package_modules())
    assert not gone, f"nbddp.SIDES names modules that do not exist: {gone}"


def test_the_readme_layout_names_every_module_on_its_side():
    """The Layout (docs/development.md) lists each module in the row of its side (``ui/`` as a folder)."""
    from conftest import ROOT

    text = (ROOT / "docs" / "development.md").read_text()
    layout = text[text.index("## Layout"):text.index("## Tests")]
    rows = {side: next(row for row in layout.splitlines() if f"**{label}**" in row)
            for side, label in (("contract", "contract"), ("kernel", "kernel side"), ("rank", "rank side"),
                                ("task", "built-in task"), ("entry", "entry"))}
    modules = package_modules()
    for module, side in nbddp.SIDES.items():
        path = module.replace(".", "/")
        names = ("`ui/`",) if module.startswith("ui") else (
            f"`{path}/`" if modules[module].name == "__init__.py" else f"`{path}.py`",)
        assert any(n in rows[side] for n in names), f"the Layout (docs/development.md) lacks {module} in its {side} row"


def test_every_folder_holds_one_side_and_the_top_folder_only_the_face():
    sides = nbddp.SIDES
    for module in package_modules():
        if not module:
            continue
        folder = module.partition(".")[0] if "." in module or module in nbddp.FOLDER_SIDES else ""
        assert sides[module] == nbddp.FOLDER_SIDES[folder], \
            f"{module} is {sides[module]}-side but lives in the {folder or 'top'} folder ({nbddp.FOLDER_SIDES[folder]})"
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8 and "__init__.py" in top and "__main__.py" in top, top


def test_each_side_imports_only_what_it_may(graph):
    """The contract imports only the contract, the rank side no kernel module, the kernel no rank
    module (it names the ranks' entry as text: ``protocol.RANK_ENTRY``), a task no kernel module."""
    sides = nbddp.SIDES
    bad = sorted(f"{m} ({sides[m]}) imports {d} ({sides[d]})" for m, deps in graph.items() if m in sides
                 and sides[m] in MAY_IMPORT for d in deps if d and sides.get(d) not in MAY_IMPORT[sides[m]])
    assert not bad, "\n".join(bad)


def test_an_old_module_path_is_the_module_at_its_new_path_with_a_warning():
    code = ("import json, sys, warnings\n"
            "warnings.simplefilter('always')\n"
            "import nbddp\n"
            "torch_at_import = 'torch' in sys.modules\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import nbddp.config\n"
            "    from nbddp.dist import any_rank\n"
            "    from nbddp.tasks.classification import preflight\n"
            "    from nbddp.tasks import LaunchPlan\n"
            "same = [nbddp.config is sys.modules['nbddp.contract.config'], any_rank.__module__,\n"
            "        preflight.__module__, nbddp.rundir is sys.modules['nbddp.contract.rundir'],\n"
            "        nbddp.config.__spec__.name, LaunchPlan.__module__]\n"
            "from nbddp.contract.targets import resolve_target\n"
            "same.append(resolve_target('nbddp.tasks.classification:train'))  # the built-in worker's old name\n"
            "print(json.dumps([torch_at_import, same, [str(w.message) for w in caught]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    torch_at_import, same, messages = json.loads(out.stdout.splitlines()[-1])
    assert torch_at_import is False
    assert same == [True, "nbddp.rank.dist", "nbddp.tasks.classification.planning", True, "nbddp.contract.config",
                    "nbddp.contract.plans", "nbddp.tasks.classification:train"]
    assert any("nbddp.config moved to nbddp.contract.config" in m for m in messages), messages
    assert any("nbddp.dist moved to nbddp.rank.dist" in m for m in messages), messages
    assert any("nbddp.tasks.LaunchPlan moved to nbddp.contract.plans.LaunchPlan" in m for m in messages), messages
    assert set(nbddp.MOVED.values()) <= set(nbddp.SIDES)


def test_no_import_circle_at_any_level(graph):
    # Depth-first search for a back edge; the package's own __init__ is left out, since every
    # module imports its package first by Python's rules, not by a line anyone wrote.
    edges = {m: {d for d in deps if d} for m, deps in graph.items() if m}
    state, circles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(edges.get(m, ())):
            if state.get(d) == "open":
                circles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_rank_side_modules_never_import_the_kernel_side_even_in_functions(graph):
    sides = nbddp.SIDES
    reach = {}

    def closure(m):
        if m not in reach:
            reach[m] = set()
            for d in graph.get(m, ()):
                reach[m] |= {d} | closure(d)
        return reach[m]

    bad = {m: sorted(d for d in closure(m) if sides.get(d) == "kernel")
           for m in graph if sides.get(m) in RANK_SIDES}
    bad = {m: ds for m, ds in bad.items() if ds}
    assert not bad, f"rank, contract and task modules that reach kernel-side modules: {bad}"


def loaded_kernel_modules(names) -> list:
    return sorted(n for n in names if nbddp.SIDES.get(n.partition("nbddp.")[2]) == "kernel")


def test_importing_every_rank_side_module_loads_no_kernel_module():
    rank_side = [m for m, side in nbddp.SIDES.items() if side in RANK_SIDES]
    code = ("import json, sys\n"
            f"for m in {rank_side!r}: __import__('nbddp.' + m)\n"
            "import nbddp; nbddp.__version__\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nbddp'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert "nbddp.rank.runtime" in loaded and "nbddp.tasks.classification.worker" in loaded
    assert loaded_kernel_modules(loaded) == []


def test_import_nbddp_is_lazy_and_every_public_name_resolves():
    code = ("import json, sys, nbddp\n"
            "before = sorted(m for m in sys.modules if m.startswith('nbddp.'))\n"
            "names = {n: type(getattr(nbddp, n)).__name__ for n in nbddp.__all__}\n"
            "print(json.dumps([before, names]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, names = json.loads(out.stdout.splitlines()[-1])
    assert before == []
    assert set(names) == set(nbddp.__all__) and "spawn_train" in names and "TrainingPanel" in names


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_real_rank_holds_no_kernel_module(tmp_path, start_method):
    result = spawn_train(f"{WORKERS / 'sides.py'}:loaded_modules", nprocs=2, start_method=start_method,
                         runs_dir=tmp_path, echo=False, all_values=True)
    for rank, loaded in enumerate(result.values):
        assert "nbddp.rank.runtime" in loaded, rank
        assert loaded_kernel_modules(loaded) == [], f"rank {rank} ({start_method}) loaded kernel-side modules"


def test_a_rank_under_a_launcher_holds_no_kernel_module(tmp_path):
    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    out = subprocess.run([sys.executable, "-m", "nbddp", "run", f"{WORKERS / 'sides.py'}:loaded_modules",
                          "--run-dir", str(tmp_path / "run")], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("result: "))
    loaded = ast.literal_eval(line[len("result: "):])
    assert "nbddp.rank.elastic" in loaded
    assert loaded_kernel_modules(loaded) == []


def test_the_commands_that_only_look_never_import_torch(tmp_path):
    """``python -m nbddp runs`` and ``gpus`` read records and ask nvidia-smi: ~0.15 s of CPU, where
    importing torch (to tell whether they run under torchrun or srun, as train and run must) costs ~2."""
    code = ("import sys; from nbddp.cli import main\n"
            "codes = [main(['runs']), main(['gpus'])]\n"
            "print('RESULT', codes, 'torch' in sys.modules)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # an empty list of runs
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert "RESULT [0, 0] False" in out.stdout, out.stdout + out.stderr
