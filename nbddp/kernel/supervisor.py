"""A detached run's supervisor (``spawn_train(..., detach=True)``): the run's owner instead of a kernel.

A kernel dies (out of memory, a restart, the server's idle culler) and, by design, its runs die
with it. A detached run is owned by this small process instead, started by
:mod:`nbddp.kernel.detach` in a session of its own, no child of the kernel. It runs the kernel's
own machinery for a local run, unchanged: :func:`nbddp.kernel.launch._start` and a
:class:`~nbddp.kernel.handle.RunHandle` (staged stop, restarts, hang detection and stacks, every
rank and what it started reaped, the GPU leases held until the end), then keeps the outcome (the
worker's value, or the error) for its followers (:mod:`nbddp.kernel.owners`) and exits.

Its ranks watch it as ranks watch a kernel (their parent-death signal, the launch's owner in
their spec): a supervisor killed by SIGKILL takes its ranks with it, so they never train
unobserved, and its leases stop counting. A SIGTERM (or SIGINT) to it is a Stop of the run. Its
own lines (a restart, a hang, its errors) go to ``logs/supervisor.log``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
from typing import Any, List

from ..contract import statedir
from ..contract.errors import NbddpError
from ..contract.leases import Leases, adopt
from ..contract.system import start_time
from .detach import DetachedLaunch


def _start_run(job: DetachedLaunch) -> Any:
    """The kernel's start of a local run, here: the ranks started and watched by a RunHandle."""
    from .forkserver import prepare as prepare_forkserver
    from .launch import _start
    from .restarts import RestartPolicy

    launches = job.launches
    statedir.pin(launches.run_dir, job.state_id)
    leases = Leases([lease for lease in (adopt(h) for h in job.leases) if lease is not None])
    spec, meet, child_env, tmp_dir = launches.prepare(restart=0)
    try:
        if launches.start_method == "forkserver":
            prepare_forkserver()
        watch = dict(job.watch, restarts=RestartPolicy(launcher=launches, **job.restarts))
        return _start(spec, meet, leases, child_env, launches, tmp_dir, watch, None, block=False, detached=True)
    except BaseException:
        meet.close()
        leases.release()
        raise


def main() -> int:
    """The supervisor: start the run handed over on stdin, answer on stdout, own the run to its end."""
    answer = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # its prints go to its log from here on; a dead kernel's pipe must not end it
    try:
        answer.write(f"pid {os.getpid()} {start_time(os.getpid())}\n".encode())
    except OSError:  # the kernel has given up already
        return 1
    stop: List[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stop of the supervisor is a Stop of the run
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if sys.argv[1:] == ["forkserver"]:
        from .forkserver import prewarm

        prewarm()  # the server imports torch while this process does (the launch's unpickling imports it)
    try:
        job = pickle.loads(sys.stdin.buffer.read())
        handle = _start_run(job)
    except BaseException as exc:  # noqa: BLE001 - said to the kernel, which raises it
        with contextlib.suppress(OSError):
            answer.write(f"error {_exception_hex(exc)}\n".encode())
        return 1
    try:
        answer.write(b"ok\n")
        answer.close()
    except OSError:  # the kernel gave up on the start (an Interrupt, or it died): the run is no one's
        handle.end_now()
        return 1
    with contextlib.suppress(OSError):
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    while handle.running:
        if stop:
            handle.stop(wait=False)
            stop.clear()
        time.sleep(0.2)
    return 0


def _exception_hex(exc: BaseException) -> str:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - an exception that cannot be rebuilt travels as its text
        data = pickle.dumps(NbddpError(f"{type(exc).__name__}: {exc}"))
    return data.hex()


__all__ = ["main"]
