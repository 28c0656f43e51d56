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
    for loaded in [n for n in sys.modules if n == name.split(".")[0] or n.startswith(name.split(".")[0] + ".")]:
        del sys.modules[loaded]  # for good: a restored entry would stand in for the next test's module
    *package, stem = name.split(".")
    cache = folder.joinpath(*package, "__pycache__")
    assert list(cache.glob(f"{stem}.*.pyc")), "the import wrote no bytecode cache"


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


PACKAGE_FORMS = {  # how the launch names the code -> how it reports what it saw
    "worker file": "worker.py:train",
    "module target": "mypkg.job:train",
    "script": "script.py",
    "-m module": "-m mypkg.job",
}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_modules_of_a_package_run_as_edited_in_every_form_of_launch(tmp_path, monkeypatch, start_method):
    """A module inside a package (``mypkg.sub``) and a top-level module (``settings``), both
    imported by the launching process and then rewritten with the same size and mtime, run as
    edited whatever the launch names: a worker file that imports them, ``"mypkg.job:train"``,
    a script and ``-m mypkg.job``. A package's submodules are found through the package's
    ``__path__``, not ``sys.path``, so the rank must compile those from source too."""
    code = tmp_path / "project"
    (code / "mypkg").mkdir(parents=True)
    (code / "mypkg" / "__init__.py").write_text("")
    (code / "mypkg" / "sub.py").write_text("VALUE = 'old'\n")
    (code / "settings.py").write_text("VALUE = 'old'\n")
    seen = "import pathlib, settings\nfrom mypkg import sub\n\n" \
           "def train(ctx):\n    return settings.VALUE + '/' + sub.VALUE\n\n" \
           "if __name__ == '__main__':\n    pathlib.Path('seen.txt').write_text(train(None))\n"
    (code / "mypkg" / "job.py").write_text(seen)
    (code / "worker.py").write_text(seen)
    (code / "script.py").write_text(seen)
    monkeypatch.chdir(code)
    _import_once(monkeypatch, code, "settings")
    _import_once(monkeypatch, code, "mypkg.sub")
    _write_same_size_same_time(code / "settings.py", "'old'", "'new'")
    _write_same_size_same_time(code / "mypkg" / "sub.py", "'old'", "'new'")
    saw = {}
    try:
        for form, spec in PACKAGE_FORMS.items():
            result = spawn_train(spec, nprocs=1, runs_dir=tmp_path / "runs", echo=False, start_method=start_method)
            if spec.endswith(":train"):
                saw[form] = result.value
            else:
                saw[form] = (code / "seen.txt").read_text()
                (code / "seen.txt").unlink()
    finally:  # the module target was imported here to check it: not into the next test
        for name in ("settings", "mypkg", "mypkg.sub", "mypkg.job"):
            sys.modules.pop(name, None)
    assert saw == {form: "new/new" for form in PACKAGE_FORMS}
