"""The dev set-up resolves on every Python nbddp supports, and the set-up states one range.

``requirements-dev.txt`` pins exact versions; a pin that exists only for newer Pythons (numpy 2.3+
needs 3.11, pymdown-extensions 13 needs 3.11.5) broke ``bash dev.sh train`` on Ubuntu 22.04's 3.10 and
Debian 12's 3.11.2. So pip's own resolver (``pip install --dry-run``) runs the file with every
interpreter this machine has, side by side: the next pin that leaves one out fails here, naming it.
pip evaluates the file's environment markers with the interpreter it is given (``pip --python``), so
no interpreter needs pip of its own. The interpreter the tests run on needs no dry run: ``bash dev.sh
test`` installed the file with it before they started, and its environment has every pin that applies.
"""

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version as installed_version
from pathlib import Path

import pytest

from conftest import ROOT

#: The one statement of the supported range; environment.yml, README.md and dev.sh repeat it.
REQUIRES = ">=3.10.9,!=3.11.0"
#: A passed dry run is remembered in the test environment (``RECORD``) for ``RECORD_DAYS``, under the
#: hash of what decides it: the file, the interpreter and pip. Each costs ~40 s of CPU (pip weighs
#: every file of every version on the registry's pages), and only a change to one of those, or to the
#: registry (checked again weekly), can change its outcome; a new environment starts without them.
RECORD = Path(sys.prefix) / ".nbddp-dry-runs.json"
RECORD_DAYS = 7
#: pip's words when the registry could not be reached at all (then nothing was resolved).
OFFLINE = re.compile(r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution")


def _supported(version):
    return version >= (3, 10, 9) and version != (3, 11, 0)


def _interpreters():
    """Every CPython 3.x on this machine, one per full version: PATH, the system's, pyenv's."""
    names = {shutil.which(f"python3.{minor}") for minor in range(10, 16)} | {sys.executable}
    names |= set(glob.glob("/usr/bin/python3.[0-9]*")) | set(glob.glob("/usr/local/bin/python3.[0-9]*"))
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    names |= set(glob.glob(os.path.join(pyenv, "versions", "3.*", "bin", "python3")))
    found = {}
    for name in sorted(n for n in names if n and re.search(r"python3(\.\d+)?$", n) and os.access(n, os.X_OK)):
        try:
            said = subprocess.run([name, "-c", "import sys; print(*sys.version_info[:3])"],
                                  capture_output=True, text=True, timeout=30).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if len(said) == 3:
            found.setdefault(tuple(map(int, said)), name)
    return found


def test_one_python_range_everywhere():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'requires-python = "{REQUIRES}"' in pyproject
    assert "Programming Language :: Python :: 3.10" in pyproject
    assert "Programming Language :: Python :: 3.13" in pyproject
    assert f"python{REQUIRES}" in (ROOT / "environment.yml").read_text().replace(" ", "")
    assert "Python 3.10.9+ (not 3.11.0)" in (ROOT / "README.md").read_text()
    dev = (ROOT / "dev.sh").read_text()
    assert "(3, 10, 9)" in dev and "(3, 11, 0)" in dev, "dev.sh checks the interpreter before it sets up"


def _pins():
    """(requirement, its pinned version) of each line of requirements-dev.txt."""
    from packaging.requirements import Requirement  # pytest's own dependency

    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (pin,) = req.specifier
            assert pin.operator == "==", f"requirements-dev.txt pins exact versions, not {line!r}"
            yield req, pin.version


def test_the_tests_run_with_every_pin_that_applies_to_their_python():
    """The dev set-up of this interpreter (``bash dev.sh test`` runs it first) installed the file as it is."""
    def installed(name):
        try:
            return installed_version(name)
        except PackageNotFoundError:
            return None

    applies = [(req.name, pin) for req, pin in _pins() if req.marker is None or req.marker.evaluate()]
    assert len(applies) > 50
    wrong = [f"{name}: pinned {pin}, installed {installed(name)}" for name, pin in applies if installed(name) != pin]
    assert not wrong, (f"this environment is not requirements-dev.txt's for Python {sys.version.split()[0]} "
                       "(bash dev.sh setup installs it):\n" + "\n".join(wrong))


def _key(version, python) -> str:
    what = [(ROOT / "requirements-dev.txt").read_text(), "%d.%d.%d" % version, os.path.realpath(python),
            installed_version("pip")]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def _passed_before() -> dict:
    """``{key: when}`` of the dry runs that passed, from ``RECORD`` if it is this user's alone."""
    try:
        fd = os.open(RECORD, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return {}
        try:
            passed = json.load(f)
        except ValueError:
            return {}
    return {k: when for k, when in passed.items() if time.time() - when < RECORD_DAYS * 86400}


def test_dev_setup_resolves_on_every_supported_python(tmp_path):
    """pip's dry run of the file with every other supported interpreter found here (unless passed before)."""
    found = {v: p for v, p in _interpreters().items() if _supported(v) and v != sys.version_info[:3]}
    if not found:
        pytest.skip("no supported Python here besides the one the tests run on")
    passed = _passed_before()
    found = {v: p for v, p in found.items() if _key(v, p) not in passed}
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    runs = {}
    for version, python in found.items():
        # In a fresh venv of that interpreter, as a user sets up (Debian's own Python refuses pip outside
        # one: PEP 668); without pip of its own, it takes a tenth of a second.
        name = "%d.%d.%d" % version
        subprocess.run([python, "-m", "venv", "--without-pip", str(tmp_path / f"venv-{name}")], check=True, timeout=120)
        log = open(tmp_path / f"pip-{name}.log", "w+")
        runs[version] = (log, subprocess.Popen(
            [sys.executable, "-m", "pip", "--python", str(tmp_path / f"venv-{name}" / "bin" / "python"),
             "install", "--dry-run", "--ignore-installed",
             "--quiet", "-r", str(ROOT / "requirements-dev.txt")],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path))
    failed = {}
    for version, (log, proc) in runs.items():
        proc.wait(timeout=540)
        log.seek(0)
        said = [line for line in log.read().splitlines() if not line.startswith("WARNING: Location")]
        if proc.returncode != 0:
            if OFFLINE.search("\n".join(said)):
                pytest.skip("the package registry cannot be reached from here")
            failed["%d.%d.%d" % version] = "\n".join(said[-4:])
    assert not failed, "requirements-dev.txt does not resolve on: " + "\n\n".join(
        f"Python {v} ({found[tuple(map(int, v.split('.')))]}):\n{why}" for v, why in failed.items())
    if not found:
        return  # every dry run passed before: the record stands as it is
    passed.update({_key(v, p): time.time() for v, p in found.items()})
    tmp = RECORD.with_name(f"{RECORD.name}.{os.getpid()}")
    with contextlib.suppress(OSError):  # an environment it cannot write to checks again next time
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
            json.dump(passed, f)
        os.replace(tmp, RECORD)
