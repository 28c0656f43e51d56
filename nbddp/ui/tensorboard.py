"""TensorBoard next to the notebook: one server per log folder, gone when the kernel goes.

Kernel side. The server is a child process of the kernel started with the kernel's own Python
(``sys.executable -m tensorboard.main``), so it works when the kernel's environment is not on
``PATH``. It never outlives the kernel:

* it is stopped at interpreter exit (``atexit``: kernel shutdown and restart);
* it gets SIGTERM from Linux if the kernel dies without running ``atexit`` (OOM killer,
  SIGKILL): the parent-death signal is set inside the child by a few lines of bootstrap code
  that then run ``tensorboard.main``, instead of a ``preexec_fn``, which can deadlock in a
  process with threads (a kernel has several);
* it runs in its own session, so Jupyter's Interrupt (SIGINT to the kernel's process group)
  interrupts the cell, not TensorBoard.

Its output goes to a log file in a private folder of the temp folder (named in every error),
never to a pipe that nobody reads and that would block it once full. The bootstrap arms the signal for the thread
that started the server: call these functions from the notebook's main thread (cells run there).
"""

from __future__ import annotations

import atexit
import contextlib
import html
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Dict, Optional

from ..contract.errors import NbddpError
from ..contract.paths import PathLike
from ..contract.safe_path import python_argv
from ..contract.rundir import RUNS_DIR


# Runs in the child before TensorBoard: argv[1] is the kernel's pid.
_BOOTSTRAP = """
import os, signal, sys
parent = int(sys.argv.pop(1))
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
except Exception:
    pass  # not Linux: atexit in the kernel still stops the server
if os.getppid() != parent:
    sys.exit(0)  # the kernel died before the signal was armed
import runpy
runpy.run_module("tensorboard.main", run_name="__main__", alter_sys=True)
"""

# The server's own address is loopback; a proxy from the environment must never be asked.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

_servers: Dict[str, "TensorBoardServer"] = {}
_lock = threading.Lock()


class TensorBoardError(NbddpError, RuntimeError):
    """TensorBoard could not be started (or answered no HTTP request in time)."""


def _answers(port: int, timeout: float = 2.0, path: str = "/") -> bool:
    try:
        with _OPENER.open(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - refused, reset, timeout, HTTP error: not (yet) serving
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"


def embed_url(port: int) -> str:
    """The address a browser uses to reach the server: ``TENSORBOARD_PROXY_URL`` or localhost.

    ``TENSORBOARD_PROXY_URL`` follows the jupyter-server-proxy convention, e.g.
    ``/proxy/%PORT%/`` (``%PORT%`` is replaced by the port).
    """
    proxy = os.environ.get("TENSORBOARD_PROXY_URL")
    if proxy:
        return proxy.replace("%PORT%", str(port))
    return f"http://localhost:{port}/"


class TensorBoardServer:
    """A TensorBoard process serving one log folder on ``127.0.0.1:<port>``.

    Attributes:
        logdir: the absolute log folder it serves.
        port: its TCP port on the loopback interface.
        process: the ``subprocess.Popen`` of the server.
        log_path: the file that receives its output.
    """

    def __init__(self, logdir: Path, port: int, process: subprocess.Popen, log_path: Path):
        self.logdir, self.port, self.process, self.log_path = logdir, port, process, log_path

    @property
    def url(self) -> str:
        """``http://localhost:<port>/``: the server as this machine sees it."""
        return f"http://localhost:{self.port}/"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        """The process runs and its port answers HTTP."""
        return self.process.poll() is None and _answers(self.port)

    def stop(self, timeout: float = 5.0) -> None:
        """End the server (SIGTERM, then SIGKILL after ``timeout``) and reap it: no zombie left."""
        with _lock:
            if _servers.get(str(self.logdir)) is self:
                del _servers[str(self.logdir)]
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.returncode in (0, -15, 143):  # a clean stop: its log tells nothing new
            with contextlib.suppress(OSError):
                self.log_path.unlink()
                self.log_path.parent.rmdir()  # its private folder, empty now

    def iframe(self, height: int = 600):
        """An embeddable frame of the server (see :func:`show_tensorboard`).

        Without a proxy the frame's host follows the page's own loopback name: a notebook
        opened at ``127.0.0.1`` with a frame at ``localhost`` is cross-site to the browser,
        which then denies TensorBoard its storage and it shows "Data could not be loaded".
        """
        from IPython.display import HTML

        src = embed_url(self.port)
        fid = f"nbddp-tensorboard-{self.port}-{int(time.time() * 1000)}"
        script = ""
        if not os.environ.get("TENSORBOARD_PROXY_URL"):
            script = (f"<script>(function(){{var f=document.getElementById('{fid}');var h=location.hostname;"
                      f"if(f&&['127.0.0.1','localhost','[::1]'].indexOf(h)>=0){{"
                      f"f.src=location.protocol.replace('https','http')+'//'+h+':{self.port}/';}}}})();</script>")
        return HTML(f'<iframe id="{fid}" src="{src}" width="100%" height="{height}" frameborder="0"></iframe>{script}')

    def __repr__(self) -> str:
        state = "running" if self.process.poll() is None else f"exited {self.process.returncode}"
        return f"TensorBoardServer(logdir={str(self.logdir)!r}, url={self.url!r}, pid={self.pid}, {state})"


def _launch(logdir: Path, port: int, timeout: float, reload_interval: int) -> TensorBoardServer:
    # A private folder (mkdtemp: 0700, a name nobody can guess or claim first) and a file
    # created exclusively without following links: in a shared /tmp, a predictable log name
    # lets another user plant a symlink there and have the kernel overwrite their target.
    folder = Path(tempfile.mkdtemp(prefix=f"nbddp-tensorboard-{port}-"))
    log_path = folder / "nbddp-tensorboard.log"
    # --load_fast=false: TensorBoard reads the events itself instead of starting its Rust data
    # server, a grandchild that would outlive it as a zombie when TensorBoard exits.
    # python -c started in the notebook's folder: never importing from it first (safe_path).
    cmd = [*python_argv(_BOOTSTRAP), str(os.getpid()), "--logdir", str(logdir), "--host", "127.0.0.1",
           "--port", str(port), "--reload_interval", str(reload_interval), "--load_fast", "false"]
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    server = TensorBoardServer(logdir, port, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TensorBoardError(
                f"TensorBoard exited with code {proc.returncode} before serving {logdir} on port {port}. "
                f"Its output ({log_path}):\n{_tail(log_path)}")
        if _answers(port, timeout=1.0):
            return server
        time.sleep(0.2)
    server.stop()
    raise TensorBoardError(
        f"TensorBoard did not answer on port {port} within {timeout:.0f} s (stopped it). "
        f"Its output ({log_path}):\n{_tail(log_path)}")


def start_tensorboard(logdir: PathLike = RUNS_DIR, port: Optional[int] = None, timeout: float = 30.0,
                      reload_interval: int = 5) -> TensorBoardServer:
    """Start TensorBoard for ``logdir``, or return the server already running for it.

    A server is reused when its process is alive and its port answers (and ``port`` is not
    set, or is the same). Run folders keep their events in ``<run>/tensorboard``, so
    ``logdir="runs"`` shows every run side by side.

    Args:
        logdir: folder searched recursively for event files (created if missing).
        port: TCP port (default: a free one chosen by the OS).
        timeout: seconds to wait for the server to answer HTTP.
        reload_interval: seconds between two scans of ``logdir`` for new events.

    Returns:
        The :class:`TensorBoardServer`.

    Raises:
        TensorBoardError: the port is taken, or the server exited or did not answer in time;
            the message holds the end of its output.
    """
    folder = Path(logdir).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder)
    with _lock:
        old = _servers.get(key)
    if old is not None:
        if old.alive() and port in (None, old.port):
            return old
        old.stop()
    if port is not None and not _port_is_free(port):
        raise TensorBoardError(f"port {port} is already in use; pass another port, or port=None for a free one")
    try:
        server = _launch(folder, port or _free_port(), timeout, reload_interval)
    except TensorBoardError as exc:
        if port is not None or "in use" not in str(exc):
            raise
        # The free port was taken between choosing and binding it: one more try.
        server = _launch(folder, _free_port(), timeout, reload_interval)
    with _lock:
        _servers[key] = server
    return server


def show_tensorboard(logdir: PathLike = RUNS_DIR, port: Optional[int] = None, height: int = 600,
                     strict: bool = False, timeout: float = 30.0):
    """Start (or reuse) TensorBoard for ``logdir`` and embed it in the notebook.

    Put it last in a cell (or pass it to ``display``). The iframe points at
    ``http://localhost:<port>/``, which works when the browser runs on the machine of the
    kernel. Elsewhere:

    * JupyterHub / jupyter-server-proxy: set ``TENSORBOARD_PROXY_URL="/proxy/%PORT%/"`` and
      the iframe goes through the Jupyter server instead.
    * A remote server over SSH: choose the port, e.g. ``show_tensorboard(port=6006)``, and
      forward it from your machine with ``ssh -L 6006:localhost:6006 server``; the iframe
      (and http://localhost:6006 in a browser tab) then reach it through the tunnel.

    A JupyterLab served over https blocks an http iframe: use the proxy, or open the URL in
    a tab.

    Args:
        logdir: folder with the runs (default ``runs``, where ``spawn_train`` puts them).
        port: TCP port (default: a free one).
        height: iframe height in pixels.
        strict: raise when the server cannot start; by default a message is shown instead, so
            a headless run of the notebook (CI) neither hangs nor fails on it.
        timeout: seconds to wait for the server.

    Returns:
        An ``IPython.display.HTML`` frame, or an ``HTML`` message when it could not start.
    """
    from IPython.display import HTML

    try:
        return start_tensorboard(logdir, port=port, timeout=timeout).iframe(height)
    except Exception as exc:  # noqa: BLE001 - strict=False: a message, not a failed cell
        if strict:
            raise
        warnings.warn(f"TensorBoard not shown: {exc}", RuntimeWarning, stacklevel=2)
        return HTML('<div style="color:var(--jp-error-color1,#c62828)"><b>TensorBoard could not start.</b>'
                    f'<pre style="white-space:pre-wrap">{html.escape(str(exc))}</pre></div>')


def tensorboard_url(logdir: PathLike = RUNS_DIR, port: Optional[int] = None) -> str:
    """Start (or reuse) TensorBoard for ``logdir`` (a run folder works too) and return its URL.

    For scripts and terminals: print it, or open it over an SSH tunnel (see
    :func:`show_tensorboard`).
    """
    return start_tensorboard(logdir, port=port).url


def stop_tensorboard(logdir: Optional[PathLike] = None) -> None:
    """Stop the server of ``logdir``, or every server this kernel started when ``None``."""
    with _lock:
        if logdir is None:
            servers = list(_servers.values())
        else:
            found = _servers.get(str(Path(logdir).expanduser().resolve()))
            servers = [found] if found else []
    for server in servers:
        server.stop()


atexit.register(stop_tensorboard)

__all__ = ["TensorBoardError", "TensorBoardServer", "embed_url", "show_tensorboard", "start_tensorboard",
           "stop_tensorboard", "tensorboard_url"]
