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
