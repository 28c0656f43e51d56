"""A user's own build caches are used as torchrun uses them, and a long first build says what it builds.

The ranks' C++ extensions (DeepSpeed's ops, ``torch.utils.cpp_extension.load``) are built into the
user's ``~/.cache/torch_extensions`` when that folder is theirs alone (so a build ``torchrun`` made
is not made again), and while a build takes long the notice names the extension and its folder.
The compiler is slowed by a wrapper that waits for the test's word, so the build is long but cheap.
"""

import os
import shutil
import stat
import sys

import pytest

from nbddp import spawn_train
from conftest import WORKERS, wait_for

pytestmark = pytest.mark.skipif(not (shutil.which("c++") and shutil.which("ninja")),
                                reason="building a C++ extension needs a C++ compiler and ninja")


def test_a_build_goes_to_the_users_own_cache_and_a_long_one_says_what_it_builds(tmp_path, monkeypatch, runs_dir):
    cache = tmp_path / "home" / ".cache"
    (cache / "torch_extensions").mkdir(parents=True, mode=0o700)  # made by an earlier torchrun: the user's alone
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    go = tmp_path / "go"
    slow = tmp_path / "slow-c++"
    slow.write_text(f"#!/bin/sh\ncase \" $* \" in *' -c '*) while [ ! -e {go} ]; do sleep 0.1; done;; esac\n"
                    f"exec {shutil.which('c++')} \"$@\"\n")
    slow.chmod(slow.stat().st_mode | stat.S_IXUSR)
    notices = []
    h = spawn_train(f"{WORKERS / 'building.py'}:build", str(tmp_path), nprocs=1, runs_dir=runs_dir, block=False,
                    echo=False, stall_timeout_s=1, env={"CXX": str(slow)},
                    on_event=lambda kind, payload: notices.append(payload) if kind == "notice" else None)
    try:
        assert wait_for(lambda: notices, 120), "no notice"
    finally:
        go.touch()
    built = h.wait(timeout=180).value
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert built.startswith(str(cache / "torch_extensions" / version)) and built.endswith("probe_ext"), built
    assert not (cache / "nbddp" / "compile" / "torch_extensions").exists()
    line = notices[0]
    assert f"rank 0 is building the C++ extension `probe_ext` (in {built})" in line, line
    assert "A first build takes minutes" in line, line


def test_a_cache_others_may_write_is_not_used_and_the_user_is_told(tmp_path, monkeypatch):
    from nbddp.contract import private

    cache = tmp_path / "home" / ".cache"
    shared = cache / "torch_extensions"
    shared.mkdir(parents=True)
    shared.chmod(0o775)  # made under umask 002: a group member may have put a build there
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for var in private.COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    with pytest.warns(UserWarning, match=rf"{shared} is not used .*may be written by other users.*chmod -R go-w"):
        env = private.compile_cache_env()
    assert env["TORCH_EXTENSIONS_DIR"] == str(cache / "nbddp" / "compile" / "torch_extensions")
    shared.chmod(0o700)  # the user's alone: used as torchrun uses it (the variable left unset for the ranks)
    assert private.compile_cache_env()["TORCH_EXTENSIONS_DIR"] is None
    (tmp_path / "home" / ".triton" / "cache").mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "home" / ".triton", 0o700)
    env = private.compile_cache_env()
    assert env["TRITON_CACHE_DIR"] is None and env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(cache / "nbddp"))
