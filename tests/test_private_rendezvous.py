"""The rendezvous on one machine is the user's alone: nbddp's own process group meets in a
FileStore in a ``0700`` folder (no port another local user could dial), and ``launch.json`` and
the rank logs are the user's alone whatever the umask. Launches whose code calls
``init_process_group("env://")`` keep a TCP store on loopback (tests/test_own_code.py)."""

import datetime
import json
import os
import stat
from pathlib import Path

import pytest
import torch.distributed as dist

from nbddp import spawn_train
from conftest import WORKERS, wait_for

FAULTY = f"{WORKERS / 'faulty.py'}"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def reachable_by_tcp(port) -> bool:
    """True when a TCPStore client at 127.0.0.1:port can write a key (what any local user could do)."""
    if port is None:
        return False
    try:
        client = dist.TCPStore("127.0.0.1", int(port), None, False, timeout=datetime.timedelta(seconds=3))
        client.set("intruder", "1")
        return True
    except Exception:
        return False


def test_a_launch_store_has_no_port_and_lives_in_a_private_folder(tmp_path, runs_dir):
    go = tmp_path / "go"
    h = spawn_train(f"{FAULTY}:barrier_then_wait_for_file", str(go), nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False)
    try:
        launch = h.run_dir / ".nbddp" / "launch.json"
        assert wait_for(lambda: launch.exists() and all(
            '"step": 1' in (h.run_dir / ".nbddp" / f"rank{r}.json").read_text()
            for r in (0, 1) if (h.run_dir / ".nbddp" / f"rank{r}.json").exists()) and
            all((h.run_dir / ".nbddp" / f"rank{r}.json").exists() for r in (0, 1)), 90), "workers did not meet"
        record = json.loads(launch.read_text())
        assert not reachable_by_tcp(record.get("port")), record  # no port, so nothing to dial
        assert record["store"] == "file"
        folder = Path(h.spec.store_path).parent
        assert folder.is_dir() and mode(folder) == 0o700 and folder.stat().st_uid == os.getuid()
    finally:
        go.write_text("go")
        result = h.wait(timeout=60)
    assert result.run_dir == h.run_dir
    assert not folder.exists(), "the private folder is removed with the run"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_launch_record_and_rank_logs_are_private_under_umask_022(runs_dir, umask_022):
    result = spawn_train(f"{FAULTY}:info", nprocs=2, runs_dir=runs_dir, echo=False)
    run = result.run_dir
    assert mode(run / ".nbddp" / "launch.json") == 0o600
    assert mode(run / "logs") == 0o700
    logs = {p.name: mode(p) for p in (run / "logs").iterdir()}
    assert {"rank0.log", "rank1.log", "rank0.stacks.log", "rank1.stacks.log"} <= set(logs), logs
    assert set(logs.values()) == {0o600}, f"every log, the stacks' included, is the user's alone: {logs}"
    assert result.value["env"]["MASTER_PORT"].isdigit()  # torchrun's environment is still complete


def test_a_resumed_run_makes_its_older_logs_private(runs_dir, umask_022):
    first = spawn_train(f"{FAULTY}:info", nprocs=1, runs_dir=runs_dir, echo=False)
    logs = first.run_dir / "logs"
    os.chmod(logs, 0o755)
    os.chmod(logs / "rank0.log", 0o644)  # as an older nbddp left them
    spawn_train(f"{FAULTY}:info", nprocs=1, runs_dir=runs_dir, echo=False, resume=first.run_dir)
    assert mode(logs) == 0o700 and mode(logs / "rank0.log") == 0o600


def test_an_env_store_listens_only_once_the_ranks_are_about_to_start():
    import socket

    from nbddp.kernel.rendezvous import Rendezvous

    meet = Rendezvous("tcp", 30)
    try:
        assert meet.store_port and meet.master_port == meet.store_port
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", meet.store_port))  # the port is the launch's, and nobody can dial it yet
        meet.open()
        assert reachable_by_tcp(meet.store_port)
    finally:
        meet.close()
    assert not reachable_by_tcp(meet.store_port)


POISONED_SCRIPT = """
import os, time
import torch.distributed as dist
if os.environ["RANK"] == "1":
    time.sleep(600)  # never arrives: another local user answers in its place
dist.init_process_group("gloo")
"""


def listening_ports() -> set:
    """The loopback TCP ports that listen, as any local user reads them from /proc/net/tcp."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return {int(f[1].split(":")[1], 16) for f in (line.split() for line in lines) if f[3] == "0A"}


def test_a_key_another_user_forged_in_an_env_store_is_named_in_the_error_not_taken_for_out_of_memory(tmp_path,
                                                                                                        runs_dir):
    import nbddp

    if not hasattr(dist.TCPStore, "list_keys"):
        pytest.skip("this torch's TCPStore cannot list keys")
    script = tmp_path / "meets_by_env.py"
    script.write_text(POISONED_SCRIPT)
    h = spawn_train(str(script), nprocs=2, runs_dir=runs_dir, block=False, echo=False)
    try:
        port = h.spec.store_port
        assert port in listening_ports()  # what the other user sees
        intruder = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
        assert wait_for(lambda: any(k.endswith("/0") for k in intruder.list_keys()), 90), "rank 0 did not arrive"
        mine = next(k for k in intruder.list_keys() if k.endswith("/0"))
        # Rank 0 now waits for rank 1's address: a length field read as gigabytes.
        intruder.set(mine[:-1] + "1", bytes.fromhex("0000000000000010ffffffff"))
        with pytest.raises(nbddp.WorkerError) as failed:
            h.wait(timeout=120)
    finally:
        h.stop() if h.running else None
    message = str(failed.value)
    assert "rank 0 raised MemoryError: std::bad_alloc" in message
    assert f"127.0.0.1:{port} that every local user can read and write" in message
    assert "not a lack of memory" in message and "fn(ctx)" in message


def test_only_a_failure_while_the_ranks_meet_on_an_open_store_is_put_down_to_a_foreign_key():
    from nbddp.contract.protocol import ErrorRecord
    from nbddp.kernel.report import foreign_key_note

    meeting = ('  File "train.py", line 6, in <module>\n    dist.init_process_group("gloo")\n'
               '  File ".../torch/distributed/distributed_c10d.py", line 1700, in init_process_group\n')
    forged = ErrorRecord(rank=0, type="MemoryError", message="std::bad_alloc", traceback=meeting + "MemoryError\n")
    assert "127.0.0.1:29555 that every local user" in foreign_key_note(forged, 29555)
    assert foreign_key_note(forged, None) == ""  # the ranks met in a private FileStore
    training = ErrorRecord(rank=0, type="MemoryError", message="", traceback='  File "train.py", line 30, in step\n')
    assert foreign_key_note(training, 29555) == ""  # out of memory in training is out of memory
    backend = ErrorRecord(rank=0, type="DistBackendError", message="NCCL error: unhandled system error (/dev/shm)",
                          traceback=meeting)
    assert foreign_key_note(backend, 29555) == ""
