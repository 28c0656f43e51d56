"""The warm forkserver: one server process per kernel with torch and DDP imported, started early.

``spawn_train``'s workers fork from multiprocessing's forkserver, a fresh interpreter (never a
fork of the kernel) that has imported :data:`PRELOAD`. Starting it and importing torch there
costs seconds; without help the first launch of a kernel pays for it. So in a Jupyter kernel
``import nbddp`` (and building a ``TrainingPanel`` anywhere) starts the server at once from a
daemon thread, which then imports torch and the launcher in the kernel (:data:`KERNEL_PRELOAD`),
and the first launch finds both ready, as a relaunch does. ``NBDDP_PREWARM=0``
turns that off; scripts, ``python -m nbddp``, workers and the server itself never pre-warm.

The server is multiprocessing's own (``multiprocessing.forkserver._forkserver``): a launch that
comes while the pre-warm is still starting it waits on the server's lock and then uses it, and
the server ends with the kernel as before (it exits when the kernel's end of its "alive" pipe
closes, which a kernel killed by SIGKILL closes too).

The kernel's ``__main__`` is the notebook's namespace. Starting the server asks
``multiprocessing.spawn.get_preparation_data`` about the parent, which reads ``__main__`` and
also fixes multiprocessing's default start method (a later ``set_start_method`` in the notebook
would then fail). The pre-warm thread therefore hands the server only what it uses, the
kernel's ``sys.path``, and leaves ``__main__`` and the start method alone; other threads are
answered as before. The server never imports ``__main__`` since it is not in the preload list.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from typing import Optional

#: What the forkserver imports once, so that forked workers start with it in memory: torch,
#: the distributed stack, DDP (whose constructor otherwise imports torch._dynamo, 1-2 s) and
#: nbddp's worker side. Never torch.cuda initialisation: the server only imports. The last
#: makes the server a child subreaper (:mod:`nbddp.rank.forkserver_reaper`).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "torchvision", "torch.utils.tensorboard", "nbddp.rank.runtime",
           "nbddp.tasks.classification.worker", "nbddp.rank.forkserver_reaper"]

#: ``NBDDP_PREWARM=0`` (or ``false``, ``no``, ``off``) turns the pre-warm off.
ENV_VAR = "NBDDP_PREWARM"

_prepared = False
_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_local = threading.local()

#: Why the last pre-warm failed, if it did (the next launch then starts the server itself).
last_error: Optional[BaseException] = None


def prepare() -> None:
    """Set the preload list of multiprocessing's forkserver (before it starts; idempotent)."""
    global _prepared
    if not _prepared:
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        _prepared = True


def unsafe_here() -> bool:
    """True on the interpreters whose forkserver listens on an abstract Unix socket (3.10.0-3.10.8,
    3.11.0; CVE-2022-42919): any local user could connect to it and have it run their code as
    you. ``pyproject.toml`` excludes them; this guards an install that went around that."""
    version = tuple(sys.version_info[:3])
    return (3, 10, 0) <= version < (3, 10, 9) or version == (3, 11, 0)


_warned_unsafe = False


def start_method(requested: str) -> str:
    """``requested``, or ``"spawn"`` in place of ``"forkserver"`` where :func:`unsafe_here` (said once)."""
    global _warned_unsafe
    if requested != "forkserver" or not unsafe_here():
        return requested
    if not _warned_unsafe:
        _warned_unsafe = True
        warnings.warn(f"Python {sys.version.split()[0]}'s forkserver listens on a socket any local user can "
                      "use (CVE-2022-42919): nbddp starts workers with spawn instead (seconds slower per "
                      "launch). Upgrade to Python >= 3.10.9 or >= 3.11.1 for warm launches.", stacklevel=3)
    return "spawn"


def enabled() -> bool:
    """False when ``NBDDP_PREWARM`` says no, on an interpreter whose forkserver is unsafe
    (:func:`unsafe_here`), and in any process multiprocessing started (workers)."""
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off") or unsafe_here():
        return False
    import multiprocessing

    return multiprocessing.parent_process() is None


def in_kernel() -> bool:
    """True inside a running IPython kernel (ipykernel's application is up), never in a script."""
    if "ipykernel" not in sys.modules:
        return False
    app = sys.modules.get("ipykernel.kernelapp")
    try:
        return app is not None and bool(app.IPKernelApp.initialized())
    except Exception:  # noqa: BLE001 - an unusual ipykernel: no pre-warm, nothing else changes
        return False


def prewarm() -> Optional[threading.Thread]:
    """Start the forkserver (with :data:`PRELOAD`) in a daemon thread, unless one is running.

    Returns the thread, or None when pre-warming is off here (see :func:`enabled`). Calling it
    again while the server runs costs nothing; if the server has died, it starts a new one.
    """
    global _thread
    if not enabled():
        return None
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_start, name="nbddp-prewarm", daemon=True)
            _thread.start()
        return _thread


def prewarm_in_kernel() -> Optional[threading.Thread]:
    """What ``import nbddp`` does: :func:`prewarm` in a Jupyter kernel, nothing elsewhere."""
    return prewarm() if in_kernel() else None


def server_pid() -> Optional[int]:
    """The pid of this process's forkserver, or None before it was started."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def start_server() -> None:
    """Start the server now unless it runs (what the pre-warm and a launch both call).

    The server starts in a session of its own: Jupyter's Interrupt (and a terminal's Ctrl-C)
    signals the kernel's whole process group, and a server that took it while importing torch
    died with its traceback in the cell, failed the launch with an ``EOFError`` and stayed a
    zombie. The server is nbddp's, not the user's: the user's Interrupt never reaches it (a
    blocked signal mask is not enough, since the server's start resets it). It still ends with
    the kernel (its "alive" pipe), and its ranks lead their own groups as before. The kernel's
    own thread blocks SIGINT for the start, so an Interrupt meanwhile reaches the kernel after.
    """
    prepare()
    from multiprocessing import forkserver

    with _sys_path_only(), _own_session(), _sigint_blocked():
        forkserver.ensure_running()  # under the server's lock: a launch waits for a pre-warm


#: The servers started (their ``Popen``), kept so that ``subprocess`` never reaps one itself:
#: multiprocessing waits for its server, and :func:`server_death` looks at it.
_started: list = []


def _spawn_in_own_session(path, args, passfds) -> int:
    """``multiprocessing.util.spawnv_passfds``, with the child in a new session (``setsid``), its
    ``python -c`` never importing from the kernel's folder (:mod:`nbddp.contract.safe_path`)."""
    import subprocess

    from ..contract.safe_path import safe_argv

    proc = subprocess.Popen(safe_argv(args), executable=path, pass_fds=tuple(sorted(map(int, passfds))),
                            close_fds=True, start_new_session=True)
    _started.append(proc)
    return proc.pid


@contextlib.contextmanager
def _own_session():
    """In this thread, multiprocessing starts its helper processes in a session of their own.

    Other threads (a launch with ``start_method='spawn'``, the notebook's own multiprocessing)
    are answered by the original; it is put back unless someone else replaced it meanwhile.
    """
    from multiprocessing import util

    original = util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        if getattr(_local, "own_session", False):
            return _spawn_in_own_session(path, args, passfds)
        return original(path, args, passfds)

    util.spawnv_passfds = spawnv_passfds
    _local.own_session = True
    try:
        yield
    finally:
        _local.own_session = False
        if util.spawnv_passfds is spawnv_passfds:
            util.spawnv_passfds = original


def server_death(pid: Optional[int]) -> Optional[str]:
    """``"signal N"`` or ``"exit code N"`` when server ``pid`` has ended, else ``None``.

    Looks without reaping (``WNOWAIT``): multiprocessing reaps its dead server itself, and
    starts a new one, at the next launch.
    """
    if pid is None:
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if info is None or info.si_pid == 0:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"signal {info.si_status}"
    return f"exit code {info.si_status}"


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked in this thread; a child it starts inherits the blocked mask through exec."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


#: What the kernel's first launch imports (torch, torch.multiprocessing, the launcher and its
#: handle), imported by the pre-warm thread while the kernel is idle after ``import nbddp``.
KERNEL_PRELOAD = ["nbddp.kernel.launch"]


def _start() -> None:
    global last_error
    try:
        start_server()
        last_error = None
    except BaseException as exc:  # noqa: BLE001 - never into the notebook: the launch retries
        last_error = exc
    _import_kernel_side()


def _import_kernel_side() -> None:
    """Import :data:`KERNEL_PRELOAD` in this (the pre-warm) thread, so the first ``spawn_train``
    does not wait seconds for torch. An Interrupt never lands here (signals reach the main thread
    only); a cell that needs one of these meanwhile waits for it on the module's import lock, and
    a failure is left for that cell's own import to raise."""
    import importlib

    for name in KERNEL_PRELOAD:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the launch imports it again and says what is wrong
            return


def _kernel_sys_path() -> list:
    """``sys.path`` as ``spawn.get_preparation_data`` reports it (``''`` as the start folder)."""
    from multiprocessing import process

    path = sys.path.copy()
    with contextlib.suppress(ValueError):
        path[path.index("")] = process.ORIGINAL_DIR
    return path


@contextlib.contextmanager
def _sys_path_only():
    """In this thread, ``spawn.get_preparation_data`` reports only ``sys.path``.

    It otherwise reads the parent's ``__main__`` and fixes the default start method. The
    replacement answers every other thread with the original, so a launch or the notebook's own
    multiprocessing running meanwhile see no difference; it is put back unless someone else
    replaced it in the meantime.
    """
    from multiprocessing import spawn

    original = spawn.get_preparation_data

    def get_preparation_data(name):
        if getattr(_local, "sys_path_only", False):
            return {"sys_path": _kernel_sys_path()}
        return original(name)

    spawn.get_preparation_data = get_preparation_data
    _local.sys_path_only = True
    try:
        yield
    finally:
        _local.sys_path_only = False
        if spawn.get_preparation_data is get_preparation_data:
            spawn.get_preparation_data = original
