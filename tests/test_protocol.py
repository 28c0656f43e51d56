"""The records that cross between kernel and ranks: each read back as written, and read leniently."""

import json
import pickle

from nbddp.contract import protocol, rundir
from nbddp.contract.protocol import ErrorRecord, Heartbeat, Progress


def test_heartbeat_round_trip_and_position(tmp_path):
    writer = protocol.HeartbeatWriter(tmp_path, 1)
    beat = Heartbeat(rank=1, pid=42, state="running", epoch=2, step=5, phase="eval", waiting=True,
                     progress_time=1.5, beat_time=2.5, stopping=True)
    writer.write(beat)
    writer.close()
    assert protocol.read_heartbeats(tmp_path, 3) == {1: beat}, "ranks without a heartbeat are left out"
    assert beat.position > Heartbeat(rank=0, epoch=2, step=9, phase="train").position, "evaluation follows training"


def test_an_older_or_hand_written_heartbeat_reads_with_defaults(tmp_path):
    path = rundir.heartbeat_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 7, "epoch": 0, "step": 3, "future_field": 1}))
    assert protocol.read_heartbeats(tmp_path, 1)[0] == Heartbeat(rank=0, pid=7, epoch=0, step=3)
    path.write_text('{"pid": 7, "ep')  # caught mid-rewrite
    assert protocol.read_heartbeats(tmp_path, 1) == {}


def test_progress_is_one_flat_record(tmp_path):
    assert protocol.read_progress(tmp_path) is None
    writer = protocol.ProgressWriter(tmp_path)
    writer.write(Progress({"epoch": 1, "loss": 0.5}, 12.3456))
    writer.close()
    assert json.loads(rundir.progress_path(tmp_path).read_text()) == {"epoch": 1, "loss": 0.5, "time": 12.346}
    assert protocol.read_progress(tmp_path).as_dict() == {"epoch": 1, "loss": 0.5, "time": 12.346}


def test_stop_request_carries_its_reason(tmp_path):
    rundir.state_dir(tmp_path).mkdir()
    assert protocol.read_stop_request(tmp_path) is None
    protocol.write_stop_request(tmp_path, "interrupt")
    assert rundir.stop_path(tmp_path).read_text() == "interrupt"
    assert protocol.read_stop_request(tmp_path) == "interrupt"
    rundir.stop_path(tmp_path).write_text("")  # a request without a reason still stops
    assert protocol.read_stop_request(tmp_path) == "stop"
    protocol.clear_stop_request(tmp_path)
    assert protocol.read_stop_request(tmp_path) is None


def test_error_record_from_an_exception(tmp_path):
    class NaNOnOtherRank(RuntimeError):
        rank = 3

    try:
        raise NaNOnOtherRank("loss is NaN\non rank 3")
    except RuntimeError as exc:
        record = ErrorRecord.from_exception(exc, 1, "Traceback ...", secondary=False, epoch=0, step=4)
    record.write(tmp_path)
    read = protocol.read_error_records(tmp_path, 2)
    assert read == {1: record}
    assert (record.type, record.root_rank, record.first_line, record.epoch) == ("NaNOnOtherRank", 3, "loss is NaN", 0)


def test_torch_error_file_becomes_the_record_unless_the_rank_wrote_one(tmp_path):
    trace = 'Traceback (most recent call last):\n  File "w.py", line 1, in <module>\nValueError: bad value\n'
    torch_file = tmp_path / "pytorch-errorfile.pickle"
    torch_file.write_bytes(pickle.dumps(trace))
    protocol.adopt_torch_error_file(tmp_path, 0, 99, str(torch_file))
    rec = protocol.read_error_records(tmp_path, 1)[0]
    assert (rec.type, rec.message, rec.pid, rec.traceback) == ("ValueError", "bad value", 99, trace)
    torch_file.write_bytes(pickle.dumps("Traceback:\nOther: not this one\n"))
    protocol.adopt_torch_error_file(tmp_path, 0, 99, str(torch_file))
    assert protocol.read_error_records(tmp_path, 1)[0].type == "ValueError", "the rank's own record is kept"
    torch_file.write_bytes(pickle.dumps(ValueError("an object, not a string")))
    assert protocol.read_torch_traceback(str(torch_file)) is None


def test_result_round_trip(tmp_path):
    assert not protocol.has_result(tmp_path)
    protocol.write_result(tmp_path, {"acc": 0.9})
    protocol.write_result(tmp_path, [1, 2], rank=1)
    assert protocol.has_result(tmp_path)
    assert protocol.read_result(tmp_path) == {"acc": 0.9} and protocol.read_result(tmp_path, 1) == [1, 2]
