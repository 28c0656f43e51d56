"""TensorBoard embedding: a real server process, HTTP checks, reuse, proxy URL, clean stop; its log
file lives in a private folder and never follows a planted link."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from pathlib import Path

import pytest

from nbddp.ui import tensorboard as tb
from conftest import free_port, survivors, wait_for

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(port, path):
    with NO_PROXY.open(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.status, r.read()


def write_events(logdir, run="run1"):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(logdir / run)) as w:
        for step in range(5):
            w.add_scalar("loss", 1.0 / (step + 1), step)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("tb") / "runs"
    write_events(logdir)
    srv = tb.start_tensorboard(logdir)
    yield srv
    srv.stop()


@pytest.mark.timeout(90)
def test_server_answers_and_lists_the_run(server):
    assert server.process.poll() is None
    assert get(server.port, "/")[0] == 200
    # The first scan of the log folder runs in the background: give it a bounded while.
    assert wait_for(lambda: "run1" in json.loads(get(server.port, "/data/runs")[1]), timeout=30)
    tags = json.loads(get(server.port, "/data/plugin/scalars/tags")[1])
    assert "loss" in tags["run1"]
    # Started with this interpreter, as a module: works without the environment on PATH.
    cmdline = open(f"/proc/{server.pid}/cmdline", "rb").read().split(b"\0")
    assert cmdline[0].decode() == sys.executable and b"--logdir" in cmdline
    assert server.log_path.exists() and "nbddp-tensorboard" in server.log_path.name


def test_same_logdir_reuses_the_server(server):
    again = tb.start_tensorboard(server.logdir)
    assert again is server and again.port == server.port
    assert tb.tensorboard_url(server.logdir) == f"http://localhost:{server.port}/"
    frame = tb.show_tensorboard(server.logdir, height=480).data
    assert f'src="http://localhost:{server.port}/"' in frame and 'height="480"' in frame
    # in the browser the frame follows the page's loopback host name (127.0.0.1 vs localhost)
    assert "location.hostname" in frame and f":{server.port}/" in frame


def test_proxy_url_is_used_for_the_iframe(server, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_PROXY_URL", "/proxy/%PORT%/")
    frame = tb.show_tensorboard(server.logdir).data
    assert f'src="/proxy/{server.port}/"' in frame and "<script>" not in frame
    assert server.url == f"http://localhost:{server.port}/"  # scripts still get the direct address


def test_busy_port_is_a_message_by_default_and_an_error_when_strict(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.warns(RuntimeWarning, match="already in use"):
            shown = tb.show_tensorboard(tmp_path / "logs", port=port)
        assert "TensorBoard could not start" in shown.data and f"port {port}" in shown.data
        with pytest.raises(tb.TensorBoardError, match="already in use"):
            tb.show_tensorboard(tmp_path / "logs", port=port, strict=True)


@pytest.mark.timeout(60)
def test_stop_ends_the_process_without_zombie(tmp_path):
    srv = tb.start_tensorboard(tmp_path / "logs")
    pid = srv.pid
    srv.stop()
    assert not survivors([pid])
    assert str(srv.logdir) not in tb._servers
    # A stopped server is not reused: the next call starts a new one.
    fresh = tb.start_tensorboard(tmp_path / "logs")
    try:
        assert fresh is not srv and fresh.process.poll() is None
    finally:
        fresh.stop()


@pytest.mark.timeout(90)
def test_server_dies_when_the_kernel_dies(tmp_path):
    """SIGKILL the process that started TensorBoard (no atexit runs): the server must end too.

    A helper becomes a child subreaper, so the orphaned server is re-parented to it and its
    exit status can be read; the helper reports how the server ended.
    """
    kernel = tmp_path / "kernel.py"  # stands for the Jupyter kernel: starts TensorBoard, then waits
    kernel.write_text(textwrap.dedent("""
        import sys, time
        from nbddp.ui.tensorboard import start_tensorboard
        server = start_tensorboard(sys.argv[1])
        print(server.pid, server.log_path, flush=True)
        time.sleep(600)
    """))
    helper = textwrap.dedent("""
        import ctypes, json, os, signal, subprocess, sys, time
        ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
        kernel = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
        tb_pid, log_path = kernel.stdout.readline().split()
        tb_pid = int(tb_pid)
        os.kill(kernel.pid, signal.SIGKILL)  # like the OOM killer: no atexit, no cleanup
        kernel.wait()
        deadline, status = time.time() + 20, None
        while time.time() < deadline:
            pid, st = os.waitpid(tb_pid, os.WNOHANG)
            if pid:
                status = st
                break
            time.sleep(0.1)
        print(json.dumps({"tb_pid": tb_pid, "status": status, "log": log_path,
                          "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
                          "code": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None}))
        if status is None:
            os.kill(tb_pid, signal.SIGKILL)
        while True:  # reap the rest (TensorBoard's data server), so nothing is left behind
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    """)
    out = subprocess.run([sys.executable, "-c", helper, str(kernel), str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["status"] is not None, f"TensorBoard outlived its parent: {report}"
    # TensorBoard catches SIGTERM and exits on its own, or dies of it.
    assert report["signal"] == signal.SIGTERM or report["code"] is not None, report
    assert not survivors([report["tb_pid"]])
    os.unlink(report["log"])  # kept on purpose after a kernel death; this one was expected


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
