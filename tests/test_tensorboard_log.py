"""TensorBoard's log file lives in a private folder and never follows a planted link."""

import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from nbddp.ui import tensorboard as tb


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_log_goes_to_a_private_folder_and_ignores_planted_links(tmp_path):
    port = free_port()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    # Another user of the machine plants a link where the log used to go, predictably.
    planted = Path(tempfile.gettempdir()) / f"nbddp-tensorboard-{os.getpid()}-{port}.log"
    planted.unlink(missing_ok=True)
    planted.symlink_to(victim)
    try:
        server = tb.start_tensorboard(tmp_path / "runs", port=port)
        try:
            log = server.log_path
            assert log != planted and not log.is_symlink() and log.is_file()
            folder = log.parent
            assert folder != Path(tempfile.gettempdir())
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
            assert stat.S_IMODE(log.stat().st_mode) == 0o600
        finally:
            server.stop()
        assert not folder.exists(), "a clean stop leaves no log folder behind"
        assert victim.read_text() == "precious"
    finally:
        planted.unlink(missing_ok=True)
