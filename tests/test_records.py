"""RecordFile: the heartbeat and progress records readers poll while workers rewrite them."""

import json
import os

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
