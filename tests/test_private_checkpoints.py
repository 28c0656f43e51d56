"""A run's checkpoints are the user's alone, and a write is never cut by an Interrupt (one process, CPU).

Written ``0600`` in ``0700`` folders whatever the umask (a team's umask 002 included); read on
resume only through descriptors checked to be the user's and writable by no one else, from the run
folder down; refused by name otherwise, before a byte is unpickled. The two-user attacks are in
``test_shared_users_checkpoints.py``; this file checks each refusal with one user's own files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from pathlib import Path

import pytest
import torch

from nbddp.contract.checkpoint import load_checkpoint, save_run_checkpoint, uninterrupted
from nbddp.contract.private import NotPrivate
from nbddp.rank import sharded_checkpoint


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "runs" / "r"
    with umask(0o002):
        folder.mkdir(parents=True)  # a team's run folder: group-writable, as its project folder
    return folder


def test_a_plain_checkpoint_is_written_private_and_read_only_if_private(run):
    path = run / "checkpoints" / "last.pt"
    with umask(0o002):
        save_run_checkpoint({"step": 3}, path)
    assert _modes(run / "checkpoints") == {".": 0o700, "last.pt": 0o600}
    assert load_checkpoint(path, run_dir=run) == {"step": 3}

    path.chmod(0o664)  # a file others may write may hold anything, whoever made it
    with pytest.raises(NotPrivate, match=f"{path} may be written by other users.*chmod go-w {path}"):
        load_checkpoint(path, run_dir=run)
    assert load_checkpoint(path) == {"step": 3}, "a file you name yourself is read as before"
    path.chmod(0o600)
    (run / "checkpoints").chmod(0o775)
    with pytest.raises(NotPrivate, match=f"{run / 'checkpoints'} may be written by other users.*chmod -R go-w"):
        load_checkpoint(path, run_dir=run)
    with umask(0o002):
        save_run_checkpoint({"step": 4}, path)  # the next save narrows the folder again
    assert _modes(run / "checkpoints") == {".": 0o700, "last.pt": 0o600}


def test_a_link_or_a_hard_link_on_the_way_is_refused(run, tmp_path):
    path = run / "checkpoints" / "last.pt"
    save_run_checkpoint({"step": 3}, path)
    os.link(path, tmp_path / "other-name.pt")  # what writes one writes the other
    with pytest.raises(NotPrivate, match="has other names"):
        load_checkpoint(path, run_dir=run)
    os.unlink(tmp_path / "other-name.pt")
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoints").rename(elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(NotPrivate, match=f"{run / 'checkpoints'} is a symbolic link.*Remove"):
        load_checkpoint(path, run_dir=run)


def _model():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_is_written_private_and_every_file_read_is_checked(run):
    model, optimizer = _model()
    with umask(0o002):
        sharded_checkpoint.save(run, "last", {"model": model, "optimizer": optimizer, "step": 3}, True)
    assert _modes(run / "checkpoints") == {".": 0o700, "last.dcp": 0o700, "last.dcp/.metadata": 0o600,
                                           "last.dcp/__0_0.distcp": 0o600, "last.dcp/extra.pt": 0o600}
    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.AdamW(other.parameters())
    assert sharded_checkpoint.load(run, "last", {"model": other, "optimizer": other_optimizer}) == {"step": 3}
    assert torch.equal(other.weight, model.weight)
    for name in ("__0_0.distcp", ".metadata", "extra.pt"):  # the shard's own pickles too, not only .metadata
        path = run / "checkpoints" / "last.dcp" / name
        path.chmod(0o664)
        with pytest.raises(NotPrivate, match=f"{path} may be written by other users"):
            sharded_checkpoint.load(run, "last", {"model": other, "optimizer": other_optimizer})
        path.chmod(0o600)


def test_a_write_is_not_cut_by_an_interrupt_which_comes_right_after_it():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGINT)  # delivered at once to this (the main) thread
            done.append("written")
        done.append("after")  # never: the KeyboardInterrupt comes here
    assert done == ["written"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_write_that_failed_at_a_stop_says_it_was_dropped_for_the_stop():
    """A peer that took its KeyboardInterrupt outside its save leaves the collective: this rank's save
    fails, and that failure is the stop's, not a checkpoint error."""
    with pytest.raises(KeyboardInterrupt, match="dropped at the stop.*Connection reset") as caught:
        with uninterrupted(stop_requested=lambda: True):
            raise RuntimeError("Connection reset by peer")
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(OSError, match="No space"):  # no stop: the write's own error
        with uninterrupted(stop_requested=lambda: False):
            raise OSError(28, "No space left on device")


def test_the_built_in_workers_write_on_the_steps_path_is_not_cut_by_an_interrupt(tmp_path):
    """A CPU rank writes its checkpoint in the caller's thread: an Interrupt in the middle of
    ``torch.save`` waits until the file is whole and in place, and the heartbeat says it writes."""
    from nbddp.contract.checkpoint import BackgroundSaver

    saver, path, seen = BackgroundSaver(background=False), tmp_path / "checkpoints" / "last.pt", []

    def write(obj, where):
        seen.append(saver.writing)
        os.kill(os.getpid(), signal.SIGINT)  # the kernel's staged stop, mid-write
        save_run_checkpoint(obj, where)

    with pytest.raises(KeyboardInterrupt):
        saver.save({"step": 7}, path, write=write)
    assert seen == [True] and not saver.writing
    assert load_checkpoint(path, run_dir=tmp_path) == {"step": 7}
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]
