"""An edited worker file runs as edited, even when its bytecode cache says otherwise.

Python trusts ``__pycache__`` on the source's mtime (whole seconds) and size. "Run All" with
``%%writefile`` rewrites a worker file within the same second, often with the same size, so a
cache written when the launching process imported the file would run the old code. The
development machine sets ``PYTHONDONTWRITEBYTECODE=1``, which hides this: these tests unset it
and import the file once in the launching process, as users do.
"""

import importlib
import os
import sys
from pathlib import Path

import pytest

from nbddp import spawn_train


def _write_same_size_same_time(path: Path, old: str, new: str) -> None:
    """Rewrite ``path`` replacing ``old`` by ``new`` (same length), keeping its mtime."""
    assert len(old) == len(new)
    st = path.stat()
    path.write_text(path.read_text().replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


def _import_once(monkeypatch, folder: Path, name: str) -> None:
    """Import ``name`` from ``folder`` in this process, which writes its ``__pycache__``."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    assert list((folder / "__pycache__").glob(f"{name}.*.pyc")), "the import wrote no bytecode cache"


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_worker_file_rewritten_with_the_same_size_in_the_same_second_runs_as_edited(
        tmp_path, monkeypatch, start_method):
    code = tmp_path / "code"
    code.mkdir()
    worker = code / f"same_size_{start_method}.py"
    worker.write_text("def train(ctx):\n    return 'old'\n")
    _import_once(monkeypatch, code, worker.stem)
    _write_same_size_same_time(worker, "'old'", "'new'")
    result = spawn_train(f"{worker}:train", nprocs=1, runs_dir=tmp_path / "runs", echo=False,
                         start_method=start_method)
    assert result.value == "new"


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_module_the_worker_file_imports_runs_as_edited(tmp_path, monkeypatch, start_method):
    """A sibling module of the worker file, edited the same way, is not stale either: the warm
    server never imports it (it imports only nbddp's preload), the rank compiles it from source."""
    code = tmp_path / "code"
    code.mkdir()
    helper = f"helper_{start_method}"
    (code / f"{helper}.py").write_text("VALUE = 'old'\n")
    worker = code / f"uses_{helper}.py"
    worker.write_text(f"import {helper}\n\ndef train(ctx):\n    return {helper}.VALUE\n")
    _import_once(monkeypatch, code, helper)
    _write_same_size_same_time(code / f"{helper}.py", "'old'", "'new'")
    result = spawn_train(f"{worker}:train", nprocs=1, runs_dir=tmp_path / "runs", echo=False,
                         start_method=start_method)
    assert result.value == "new"


def test_what_a_script_and_a_module_target_import_runs_as_edited(tmp_path, monkeypatch):
    """The same for the modules a torchrun script imports from its folder, and for a module
    target (``pkg.mod:fn``) found from the kernel's working directory: one launch of each."""
    code = tmp_path / "project"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "__init__.py").write_text("")
    (code / "settings.py").write_text("VALUE = 'old'\n")
    (code / "script.py").write_text("import pathlib, settings\npathlib.Path('seen.txt').write_text(settings.VALUE)\n")
    (code / "pkg" / "mod.py").write_text("import settings\n\ndef train(ctx):\n    return settings.VALUE\n")
    monkeypatch.chdir(code)
    _import_once(monkeypatch, code, "settings")
    _write_same_size_same_time(code / "settings.py", "'old'", "'new'")
    spawn_train("script.py", nprocs=1, runs_dir=tmp_path / "runs", echo=False)
    assert (code / "seen.txt").read_text() == "new"
    assert spawn_train("pkg.mod:train", nprocs=1, runs_dir=tmp_path / "runs", echo=False).value == "new"
