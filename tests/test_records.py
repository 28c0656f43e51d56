"""RecordFile: the heartbeat and progress records readers poll while workers rewrite them; create_once:
a file (a database) nobody sees half made."""

import errno
import json
import os

import pytest

from nbddp.contract import rundir
from nbddp.contract.rundir import RecordFile


def test_records_rewrite_in_place_and_always_parse(tmp_path):
    path = tmp_path / "rank0.json"
    rec = RecordFile(path, size=64)
    rec.write({"step": 1})
    inode = os.stat(path).st_ino
    assert json.loads(path.read_text()) == {"step": 1}
    rec.write({"step": 2, "note": "x" * 200})  # longer than the padding: the record grows
    rec.write({"step": 3})  # shorter again: no tail of the longer one is left behind
    assert json.loads(path.read_text()) == {"step": 3}
    assert os.stat(path).st_ino == inode, "later writes go in place, not through a rename"
    assert not [p for p in tmp_path.iterdir() if p.name != "rank0.json"], "no temp file left"
    rec.close()


def test_first_write_replaces_a_stale_record_atomically(tmp_path):
    path = tmp_path / "progress.json"
    path.write_text('{"step": 99, "from": "an earlier launch"}')
    stale_inode = os.stat(path).st_ino
    rec = RecordFile(path)
    rec.write({"step": 0})
    assert json.loads(path.read_text()) == {"step": 0}
    assert os.stat(path).st_ino != stale_inode
    rec.close()


def test_create_once_makes_a_missing_file_whole_keeps_one_that_exists_and_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "sub" / "store.db"
    path.parent.mkdir()
    made = []

    def make(scratch):
        assert scratch.parent == path.parent and not path.exists()  # built beside it, never at it
        scratch.write_bytes(b"whole")
        made.append(scratch)

    assert rundir.create_once(path, make) is True and path.read_bytes() == b"whole"
    assert rundir.create_once(path, make) is False and len(made) == 1  # an existing file is never remade
    assert sorted(p.name for p in path.parent.iterdir()) == ["store.db"]

    other = tmp_path / "other.db"

    def first_then_fail(scratch):
        other.write_bytes(b"theirs")  # another process linked its file meanwhile
        scratch.write_bytes(b"mine")

    assert rundir.create_once(other, first_then_fail) is False and other.read_bytes() == b"theirs"

    def broken(scratch):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        rundir.create_once(tmp_path / "broken.db", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db", "sub"]


def test_create_once_without_hard_links_or_a_folder_makes_nothing_and_lets_the_caller_open_it(tmp_path, monkeypatch):
    """FAT, some FUSE and SMB mounts refuse hard links (EPERM, ENOTSUP): the caller then opens the
    path itself, as before; a dead writer's leftover scratch file is removed on the way."""
    def no_links(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    leftover = tmp_path / ".store.db.tmp-999999999-dead"  # a pid no process has
    leftover.write_bytes(b"half")
    monkeypatch.setattr(os, "link", no_links)
    assert rundir.create_once(tmp_path / "store.db", lambda scratch: scratch.write_bytes(b"whole")) is False
    assert list(tmp_path.iterdir()) == []
    assert rundir.create_once(tmp_path / "missing" / "store.db", lambda scratch: None) is False
    assert list(tmp_path.iterdir()) == []  # no folder made for a mistyped path
