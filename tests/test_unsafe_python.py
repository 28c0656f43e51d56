"""No warm server on interpreters whose forkserver any local user can reach (CVE-2022-42919).

Python 3.10.0-3.10.8 and 3.11.0 put the forkserver's socket in the abstract namespace, where
every local user can connect and have it run code as the kernel's user. ``pyproject.toml``
excludes them; should nbddp run on one anyway, it never pre-warms and launches with spawn.
"""

import re
import sys
import warnings

import pytest

from nbddp.kernel import forkserver
from conftest import ROOT

UNSAFE = [(3, 10, 0), (3, 10, 8), (3, 11, 0)]
SAFE = [(3, 10, 9), (3, 11, 1), (3, 12, 0)]


def _as(monkeypatch, version):
    monkeypatch.setattr(sys, "version_info", (*version, "final", 0))
    monkeypatch.setattr(forkserver, "_warned_unsafe", False)


@pytest.mark.parametrize("version", UNSAFE)
def test_no_prewarm_and_spawn_on_an_unsafe_interpreter(monkeypatch, version):
    _as(monkeypatch, version)
    assert forkserver.unsafe_here()
    assert not forkserver.enabled()
    assert forkserver.prewarm() is None
    with pytest.warns(UserWarning, match="CVE-2022-42919.*spawn"):
        assert forkserver.start_method("forkserver") == "spawn"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert forkserver.start_method("forkserver") == "spawn"
        assert forkserver.start_method("spawn") == "spawn"


@pytest.mark.parametrize("version", SAFE)
def test_forkserver_stays_on_a_safe_interpreter(monkeypatch, version):
    _as(monkeypatch, version)
    assert not forkserver.unsafe_here()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert forkserver.start_method("forkserver") == "forkserver"


def test_the_package_excludes_the_unsafe_interpreters():
    from packaging.specifiers import SpecifierSet

    found = re.search(r'^requires-python\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    spec = SpecifierSet(found.group(1))
    assert not any(spec.contains(".".join(map(str, v))) for v in UNSAFE)
    assert all(spec.contains(".".join(map(str, v))) for v in SAFE)
