"""Nothing from a run folder runs as you unless it is yours; the ranks' temp files are private; a
resumed launch echoes only its own output (shared servers: docs/reliability.md)."""

import os
import pickle
import stat

import pytest

from nbddp.contract import rundir, statedir
from nbddp import spawn_train
from nbddp.contract.protocol import read_result, write_result
from conftest import WORKERS

PRIVATE = WORKERS / "private.py"
OTHER_UID = 4242  # a user id that is not the test's (root may give files to any)
as_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")


@pytest.fixture
def shared_runs(tmp_path):
    """A group-writable runs folder, used under umask 002: how project folders are often set up."""
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o2775)
    old = os.umask(0o002)
    yield runs
    os.umask(old)


def _marker_payload(marker):
    class Planted:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))
    return pickle.dumps(Planted())


def test_the_state_folder_is_private_whatever_the_umask(shared_runs):
    result = spawn_train(f"{PRIVATE}:say", nprocs=2, kwargs={"tag": "one"}, runs_dir=shared_runs, echo=False,
                         all_values=True)
    state = rundir.state_dir(result.run_dir)
    assert stat.S_IMODE(os.lstat(state).st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in state.iterdir()}
    assert "launch.json" in modes and "rank0.json" in modes
    assert set(modes.values()) == {0o600}, modes
    assert result.values == ["one", "one"]
    # Every rank's value was read into the kernel and its file removed: a large one would fill the folder.
    assert not [name for name in modes if name.startswith("result")], modes


def test_a_result_that_is_not_provably_yours_is_never_unpickled(tmp_path, monkeypatch):
    run = tmp_path / "run"
    rundir.make_state_dir(run)
    write_result(run, {"ok": 1})
    assert stat.S_IMODE(os.lstat(rundir.result_path(run)).st_mode) == 0o600
    assert read_result(run) == {"ok": 1}
    path, marker = rundir.result_path(run), tmp_path / "ran"

    path.unlink()  # a link to a pickle elsewhere (one of the user's, even): refused, not followed
    elsewhere = tmp_path / "elsewhere.pkl"
    elsewhere.write_bytes(_marker_payload(marker))
    path.symlink_to(elsewhere)
    with pytest.raises(rundir.NotPrivate, match="result.pkl is a symbolic link"):
        read_result(run)
    path.unlink()

    write_result(run, {"ok": 2})
    path.chmod(0o664)  # a file of the user's the group may write (metrics.jsonl under umask 002, moved here)
    with pytest.raises(rundir.NotPrivate, match=r"result\.pkl may be written by other users"):
        read_result(run)
    path.chmod(0o600)
    rundir.state_dir(run).chmod(0o770)  # a folder the group may write into
    with pytest.raises(rundir.NotPrivate, match=r"\.nbddp may be written by other users"):
        read_result(run)
    # Never narrowed (what others put in it would stay): moved aside, unread, and made anew.
    with pytest.warns(UserWarning, match=r"\.nbddp may be written by other users, so it was not used .*nothing in it was read"):
        rundir.make_state_dir(run)
    with pytest.raises(FileNotFoundError):
        read_result(run)
    write_result(run, {"ok": 2})
    assert read_result(run) == {"ok": 2}

    real = os.getuid()  # the file belongs to someone else (seen from another uid: no root needed)
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    with pytest.raises(rundir.NotPrivate, match=f"owned by uid {real}, not by you"):
        read_result(run)
    assert not marker.exists()


@as_root
def test_another_users_result_planted_during_the_run_is_refused(shared_runs, tmp_path):
    marker = tmp_path / "planted-code-ran"
    with pytest.raises(rundir.NotPrivate, match=f"result.pkl is owned by uid {OTHER_UID}, not by you"):
        spawn_train(f"{PRIVATE}:plant_result", nprocs=2, kwargs={"marker": str(marker), "uid": OTHER_UID},
                    runs_dir=shared_runs, echo=False)
    assert not marker.exists()


@as_root
def test_resume_true_skips_runs_of_other_users(tmp_path):
    runs = tmp_path / "runs"
    mine, theirs = runs / "20250101-120000-t", runs / "20250101-130000-t"
    for folder, started in ((mine, 1.0), (theirs, 2.0)):
        rundir.atomic_write(rundir.checkpoint_path(folder), b"x")
        rundir.update_launch_record(folder, started=started)
    assert rundir.newest_run(runs, "t") == theirs
    os.chown(theirs, OTHER_UID, -1)
    assert rundir.newest_run(runs, "t") == mine
    link = runs / "20250101-140000-t"  # a link to a run (of the user's, even) is not one of the user's folders
    link.symlink_to(mine)
    assert rundir.newest_run(runs, "t") == mine


def test_the_ranks_temp_folder_is_private_and_gone_after_the_run(tmp_path):
    handle = spawn_train(f"{PRIVATE}:tmp_info", nprocs=2, runs_dir=tmp_path, echo=False, block=False,
                         all_values=True)
    error_files = handle._ranks.error_files()
    result = handle.wait()
    folder = result.value["tmp"]
    assert {v["tmp"] for v in result.values} == {folder}
    assert result.value["mode"] == 0o700 and result.value["uid"] == os.getuid()
    assert result.value["inside"] == folder
    # torch's per-rank error files are named there, not in the shared temp folder
    assert error_files and all(os.path.dirname(p) == folder for p in error_files)
    assert not os.path.exists(folder)
    # torch.compile's cache is the user's private one (never torch's default in the shared /tmp),
    # shared between runs
    from nbddp.contract.private import cache_home
    assert result.value["compile_cache"] == str(cache_home() / "nbddp" / "compile" / "inductor")


def test_a_resumed_launch_echoes_only_its_own_output(tmp_path, capsys):
    first = spawn_train(f"{PRIVATE}:say", nprocs=1, kwargs={"tag": "first"}, runs_dir=tmp_path)
    assert "launch first says hello" in capsys.readouterr().out
    again = spawn_train(f"{PRIVATE}:say", nprocs=1, kwargs={"tag": "second"}, resume=first.run_dir)
    out = capsys.readouterr().out
    assert again.run_dir == first.run_dir
    assert "[rank0] launch second says hello" in out
    assert "first" not in out, out
    log = rundir.rank_log(first.run_dir, 0).read_text()
    assert "launch first" in log and "launch second" in log  # the log keeps both launches


def test_a_linked_torch_error_file_is_not_read(tmp_path):
    from nbddp.contract.protocol import read_torch_traceback

    real = tmp_path / "real.pickle"
    real.write_bytes(pickle.dumps("Traceback:\nValueError: x\n"))
    assert read_torch_traceback(str(real)) == "Traceback:\nValueError: x\n"
    link = tmp_path / "pytorch-errorfile-x.pickle"
    link.symlink_to(real)
    assert read_torch_traceback(str(link)) is None


def test_attach_follows_a_run_folder_by_its_own_name_never_through_a_link(tmp_path):
    import nbddp

    run = tmp_path / "run"
    statedir.ensure(run)
    link = tmp_path / "linked"
    link.symlink_to(run)
    with pytest.raises(rundir.NotPrivate, match="linked is a symbolic link.*never through a link"):
        nbddp.attach(str(link))
    assert statedir.pinned(link) is None and statedir.pinned(run) is None
