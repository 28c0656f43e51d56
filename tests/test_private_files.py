"""Another user of a shared server plants files: none is loaded as code, written into, or removed as ours.

Each test plays the other user (docs/reliability.md, "shared server"): as root it gives the
files to another uid; otherwise the single place nbddp reads an owner (``nbddp.contract.private.owner``)
says the planted ones are another user's.
"""

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

from nbddp import cleanup
from nbddp.contract import private, rundir
from nbddp.kernel.launch import _child_env, private_tmp
from nbddp.rank.logs import open_private_log

from conftest import OTHER_UID  # give_away: the fixture, from conftest


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def mine_and_private(path, kind=stat.S_ISDIR, want=0o700) -> bool:
    st = os.lstat(path)
    return kind(st.st_mode) and private.owner(st) == os.getuid() and stat.S_IMODE(st.st_mode) == want


# ---------------------------------------------------------------------------- 1. compile caches
@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A cache home of the test's own, and none of the compile caches' variables set by the user."""
    home = tmp_path / "cache"
    home.mkdir(mode=0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no default cache of the user's own there
    monkeypatch.delenv("TRITON_HOME", raising=False)
    for var in private.COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    return home


def test_the_ranks_compile_caches_are_in_a_private_folder_of_the_users_cache(cache_home, tmp_path):
    # torch's default, <temp>/torchinductor_<user>, is a name anyone can create first in /tmp
    env = _child_env(tmp_path / "run", 29500, 1, None, True, None, tmp_dir=str(tmp_path / "tmp"))
    folder = cache_home / "nbddp" / "compile"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert env["TORCH_EXTENSIONS_DIR"] == str(folder / "torch_extensions")
    assert mine_and_private(folder) and mine_and_private(folder.parent)
    # the same folder for the next launch: compiles stay warm
    assert _child_env(tmp_path / "run2", 29501, 1, None, True, None, tmp_dir=str(tmp_path / "t2"))[
        "TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"]


def test_torchs_own_setting_of_its_default_cache_is_not_taken_for_the_users(cache_home, monkeypatch):
    # `import torch._dynamo` sets TORCHINDUCTOR_CACHE_DIR to /tmp/torchinductor_<user> in the kernel,
    # and a compile there sets TRITON_CACHE_DIR under it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", private.torch_default_cache())
    monkeypatch.setenv("TRITON_CACHE_DIR", os.path.join(private.torch_default_cache(), "triton", "0"))
    env = private.compile_cache_env()
    folder = cache_home / "nbddp" / "compile"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(folder / "triton")


def test_a_cache_folder_set_by_the_user_is_kept(cache_home, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")
    env = private.compile_cache_env()
    assert "TORCHINDUCTOR_CACHE_DIR" not in env and "TRITON_CACHE_DIR" in env


@pytest.mark.parametrize("planted_at", ["nbddp", "nbddp/compile"])
def test_another_users_compile_cache_is_moved_aside_and_never_used(cache_home, give_away, planted_at):
    theirs = cache_home / planted_at
    theirs.parent.mkdir(mode=0o700, exist_ok=True)
    (theirs / "inductor" / "fxgraph").mkdir(parents=True)
    pickle = theirs / "inductor" / "fxgraph" / "entry"
    pickle.write_bytes(b"cos\nsystem\n(S'id'\ntR.")
    for p in (theirs, theirs / "inductor", theirs / "inductor" / "fxgraph", pickle):
        p.chmod(0o777)
        give_away(p)
    with pytest.warns(UserWarning, match=rf"{theirs} is owned by uid {OTHER_UID}.*moved to .*not-yours"):
        env = private.compile_cache_env()
    folder = cache_home / "nbddp" / "compile"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert mine_and_private(folder) and not (folder / "inductor" / "fxgraph" / "entry").exists()
    assert pickle.parent.name == "fxgraph" and any(p.name.startswith(f"{theirs.name}.not-yours-")
                                                   for p in theirs.parent.iterdir())


def test_a_linked_or_open_cache_folder_is_replaced(cache_home, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (cache_home / "nbddp").mkdir(mode=0o700)
    (cache_home / "nbddp" / "compile").symlink_to(elsewhere)
    with pytest.warns(UserWarning, match="is a symbolic link"):
        private.compile_cache_env()
    folder = cache_home / "nbddp" / "compile"
    assert mine_and_private(folder) and elsewhere.is_dir()
    folder.chmod(0o755)  # the user's own, but others may have read or planted what is inside
    (folder / "planted").write_text("x")
    with pytest.warns(UserWarning, match=r"may be opened by other users \(mode 755\)"):
        private.compile_cache_env()
    assert mine_and_private(folder) and not (folder / "planted").exists()


def test_a_cache_home_others_may_write_keeps_compiles_in_the_runs_private_folder(cache_home, tmp_path):
    cache_home.chmod(0o777)  # another user could swap nbddp/ for a folder of hers
    with pytest.warns(UserWarning, match=rf"not kept between runs: {cache_home} may be written by other users"):
        env = private.compile_cache_env(fallback=str(tmp_path / "run-tmp"))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "run-tmp" / "compile" / "inductor")
    with pytest.raises(private.NotPrivate, match="cannot be kept private"):
        private.compile_cache_env()  # under torchrun: no run folder of its own to fall back on


# ---------------------------------------------------------------------------- 2. logs
@pytest.fixture
def run(tmp_path):
    """A run folder in a group-writable project folder, as a group member can change it."""
    folder = tmp_path / "runs" / "20250101-120000-t"
    rundir.prepare_launch(folder, 2)
    folder.chmod(0o2775)
    rundir.rank_log(folder, 0).write_text("first launch\n")
    return folder


def test_a_logs_folder_another_user_put_in_its_place_is_moved_aside(run, give_away):
    logs = rundir.logs_dir(run)
    logs.rename(run / "mine-before")
    logs.mkdir()
    theirs = rundir.rank_log(run, 0)
    theirs.write_text("")
    for p in (logs, theirs):
        p.chmod(0o777)
        give_away(p)
    with pytest.warns(UserWarning, match=rf"{logs} is owned by uid {OTHER_UID}.*moved to logs.not-yours-"):
        rundir.prepare_launch(run, 2)  # a resume
    assert mine_and_private(logs)
    aside = next(p for p in run.iterdir() if p.name.startswith("logs.not-yours-"))
    fd = open_private_log(rundir.rank_log(run, 0))  # what rank 0 does next
    os.write(fd, b"token=secret\n")
    os.close(fd)
    assert (aside / "rank0.log").read_text() == ""
    assert rundir.rank_log(run, 0).read_text() == "token=secret\n"
    assert mine_and_private(rundir.rank_log(run, 0), stat.S_ISREG, 0o600)


def test_log_files_that_are_not_the_users_are_moved_aside(run, tmp_path, give_away):
    logs = rundir.logs_dir(run)
    foreign, linked, hard = rundir.rank_log(run, 1), rundir.stacks_log(run, 0), rundir.stacks_log(run, 1)
    foreign.write_text("")
    foreign.chmod(0o666)
    give_away(foreign)
    target = tmp_path / "bashrc"  # a file of the user's a rank must never append to
    target.write_text("safe\n")
    linked.symlink_to(target)
    os.link(target, hard)
    writable = rundir.rank_log(run, 2)  # the user's own, but others may write it (or hold it open)
    writable.write_text("")
    writable.chmod(0o666)
    rundir.rank_log(run, 0).chmod(0o644)  # the user's own, made wider by an older nbddp: narrowed
    with pytest.warns(UserWarning) as caught:
        rundir.prepare_launch(run, 3)
    said = " ".join(str(w.message) for w in caught)
    assert f"{foreign} is owned by uid {OTHER_UID}" in said and f"{linked} is a symbolic link" in said
    assert f"{hard} has other names (hard links)" in said and f"{writable} may be written by other users" in said
    for log in (rundir.rank_log(run, 0), rundir.rank_log(run, 1), linked, hard, writable):
        if os.path.lexists(log):
            assert mine_and_private(log, stat.S_ISREG, 0o600), log
    for r in (0, 1):
        fd = open_private_log(rundir.stacks_log(run, r))
        os.write(fd, b"stack\n")
        os.close(fd)
    assert target.read_text() == "safe\n"
    assert len([p for p in logs.iterdir() if private.ASIDE_MARK in p.name]) == 4


def test_a_rank_refuses_logs_swapped_after_the_kernel_checked(run, give_away):
    logs = rundir.logs_dir(run)
    logs.rename(run / "moved")
    logs.mkdir(mode=0o777)
    logs.chmod(0o777)
    give_away(logs)
    with pytest.warns(UserWarning, match="moved to logs.not-yours-"):
        fd = open_private_log(rundir.rank_log(run, 1))
    os.close(fd)
    assert mine_and_private(logs) and mine_and_private(rundir.rank_log(run, 1), stat.S_ISREG, 0o600)


def test_a_fifo_in_a_logs_place_does_not_hang_the_rank(run):
    fifo = rundir.rank_log(run, 1)
    os.mkfifo(fifo)
    with pytest.warns(UserWarning, match="is not a regular file"):
        os.close(open_private_log(fifo))
    assert mine_and_private(fifo, stat.S_ISREG, 0o600)


# ---------------------------------------------------------------------------- 9. cleanup
@pytest.fixture
def live_tmp(tmp_path):
    """A live run's private temp folder, with its rendezvous store, as a launch makes it."""
    run = tmp_path / "live-run"
    folder = private_tmp(run)
    (Path(folder) / "store").write_text("rendezvous")
    yield run, folder
    if os.path.exists(folder):
        import shutil
        shutil.rmtree(folder)


def _record(run_dir, **fields):
    rundir.update_launch_record(run_dir, **fields)
    return rundir.launch_record_path(run_dir)


def test_cleanup_follows_no_other_users_launch_record(tmp_path, live_tmp, give_away):
    _, folder = live_tmp
    planted = tmp_path / "their-run"
    record = _record(planted, tmp_dir=folder, pids=[], start_times=[])
    for p in (record, record.parent):
        give_away(p)
    with pytest.warns(UserWarning, match=rf"ends nothing and removes nothing: .*is owned by uid {OTHER_UID}"):
        assert cleanup(planted, grace_s=0.1) == []
    assert (Path(folder) / "store").read_text() == "rendezvous"


def test_cleanup_removes_only_the_temp_folder_its_own_run_made(tmp_path, live_tmp):
    live_run, folder = live_tmp
    copied = tmp_path / "copied-run"  # the user's own record, naming another run's folder
    _record(copied, tmp_dir=folder, pids=[], start_times=[])
    assert cleanup(copied, grace_s=0.1) == []
    assert os.path.isdir(folder)
    unclaimed = tempfile.mkdtemp(prefix="nbddp-")  # an nbddp-* folder no launch of this run made
    _record(copied, tmp_dir=unclaimed)
    cleanup(copied, grace_s=0.1)
    assert os.path.isdir(unclaimed)
    os.rmdir(unclaimed)
    _record(live_run, tmp_dir=folder, pids=[], start_times=[])  # its own run's cleanup removes it
    cleanup(live_run, grace_s=0.1)
    assert not os.path.exists(folder)


def test_only_the_users_private_record_is_read(tmp_path, give_away):
    run = tmp_path / "run"
    record = _record(run, started=1.0)
    assert rundir.read_launch_record(run) == {"started": 1.0}
    record.parent.chmod(0o777)  # others may have written it
    assert rundir.read_launch_record(run) == {}
    with pytest.raises(rundir.NotPrivate):
        rundir.read_launch_record(run, strict=True)
    record.parent.chmod(0o700)
    give_away(record)
    assert rundir.read_launch_record(run) == {}
    assert json.loads(record.read_text()) == {"started": 1.0}
