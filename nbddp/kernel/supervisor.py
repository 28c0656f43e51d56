"""A run that outlives its kernel, by choice (``spawn_train(..., detach=True)``): its supervisor.

A kernel dies (out of memory, a restart, the server's idle culler) and, by design, its runs die
with it. A detached run is owned by a small process of its own instead, the *supervisor*: a fresh
interpreter in a session of its own, not the kernel's child (started through a process that exits
at once), so nothing that ends the kernel or its process group reaches it. It runs the kernel's
own machinery for a local run, unchanged: :func:`nbddp.kernel.launch._start` and a
:class:`~nbddp.kernel.handle.RunHandle` (staged stop, restarts, hang detection and stacks, every
rank and what it started reaped, the GPU leases held until the end), then keeps the outcome (the
worker's value, or the error) for its followers (:mod:`nbddp.kernel.owners`) and exits.

Its ranks watch it as ranks watch a kernel (their parent-death signal, the launch's owner in
their spec): a supervisor killed by SIGKILL takes its ranks with it, so they never train
unobserved, and its leases stop counting. The kernel that launched the run follows it through the
run folder (:mod:`nbddp.kernel.follow`), as any other kernel may with ``nbddp.attach``.

The kernel hands the launch over on the supervisor's standard input (a pipe: nothing read back
from a folder), and the supervisor answers on its standard output once the ranks have started
(or with the error that stopped them); after that its output goes to ``logs/supervisor.log``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..contract import rundir, statedir
from ..contract.errors import NbddpError, TrainingInterrupted
from ..contract.leases import Leases, adopt
from ..contract.private import open_private_file
from ..contract.system import start_time

#: The supervisor's own lines (a restart, a hang, its errors), in the run's private logs folder.
LOG_NAME = "supervisor.log"
#: How long the kernel waits for the supervisor to say that the ranks started.
START_TIMEOUT_S = 600.0

# The supervisor's first lines. The launching folder is dropped from sys.path before anything is
# imported (`-c` puts it first), so a file there never shadows the standard library or nbddp; then
# it forks and the first process exits, so the supervisor is no child of the kernel.
_BOOT = ("import os, sys\n"
         "del sys.path[0]\n"
         "if os.fork():\n"
         "    os._exit(0)\n"
         "from nbddp.kernel.supervisor import main\n"
         "sys.exit(main())\n")


@dataclasses.dataclass
class DetachedLaunch:
    """What the supervisor needs to start and own the run (pickled through its standard input)."""

    launches: Any                 # nbddp.kernel.ranks.Launches: the plan, run folder, environment
    restarts: Dict[str, Any]      # max_restarts, oom, backoff_s
    watch: Dict[str, Any]         # RunHandle's settings (grace, stall and stop timeouts, logs)
    state_id: Optional[tuple]     # the state folder the kernel made (statedir.pin)
    leases: List[dict]            # the kernel's GPU leases, handed over (nbddp.contract.leases.adopt)


def supervisor_log(run_dir: Path) -> Path:
    return rundir.logs_dir(run_dir) / LOG_NAME


# ---------------------------------------------------------------------------- the kernel's side
def start_detached(launches: Any, leases: Leases, restarts: Dict[str, Any], watch: Dict[str, Any],
                   on_event: Optional[Callable[[str, Any], None]], block: bool) -> Any:
    """Start the run under a supervisor; once its ranks run, follow it here (a ``RunHandle``)."""
    from .follow import FollowedGroup, follow
    from .handle import interrupts_held
    from . import owners

    run_dir = Path(launches.run_dir)
    state = statedir.pinned(run_dir)
    echo = watch.get("echo", True)
    job = DetachedLaunch(launches=launches, restarts=restarts,
                         watch={**watch, "echo": False, "debug": "skip"},  # no one answers a prompt there
                         state_id=state.identity if state is not None else None, leases=leases.handoff())
    data = pickle.dumps(job)
    log = open_private_file(supervisor_log(run_dir), rundir.RUN_LOGS)
    try:
        boot = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, start_new_session=True, close_fds=True)
    finally:
        os.close(log)
    pid: Optional[int] = None
    with interrupts_held() as interrupted:
        try:
            boot.stdin.write(data)
            boot.stdin.close()
            boot.wait()  # the first process exits at once; the supervisor is its child, now init's
            pid = int(_answer(boot.stdout, run_dir, lambda: bool(interrupted)).split()[1])
            answer = _answer(boot.stdout, run_dir, lambda: bool(interrupted))
        except BaseException:
            _end_supervisor(pid)
            boot.stdout.close()
            if interrupted:
                raise TrainingInterrupted.for_run("interrupted", launches.world, run_dir,
                                                  how="before its supervisor had started every worker") from None
            raise
    boot.stdout.close()
    if answer.startswith("error "):
        raise pickle.loads(bytes.fromhex(answer.split(" ", 1)[1]))
    leases.forget()  # the supervisor holds them now, until the run ends
    group = FollowedGroup(run_dir, owners.owner_record(run_dir) or {"pid": pid, "detached": True})
    handle = follow(group, block=False, echo=echo, on_event=on_event,
                    log_start=watch.get("log_starts", {}).get(0, 0), notice=False)
    handle._notice(f"nbddp: detached run in {run_dir}, owned by its supervisor (pid {pid}): it goes on if this "
                   f"kernel stops; nbddp.attach({str(run_dir)!r}) follows it again, nbddp.runs() lists it")
    return handle.wait() if block else handle


def _answer(stream, run_dir: Path, interrupted: Callable[[], bool]) -> str:
    """The supervisor's next line; its log's end in the error when it died without one."""
    deadline = time.time() + START_TIMEOUT_S
    line = b""
    while not line.endswith(b"\n"):
        if interrupted():
            raise KeyboardInterrupt
        if time.time() > deadline:
            raise NbddpError(f"the supervisor of the detached run in {run_dir} did not start its workers within "
                             f"{START_TIMEOUT_S:.0f} s; see {supervisor_log(run_dir)}")
        ready, _, _ = select.select([stream], [], [], 0.1)
        if ready:
            chunk = os.read(stream.fileno(), 1 << 16)
            if not chunk:
                raise NbddpError(f"the supervisor of the detached run in {run_dir} ended before its workers "
                                 f"started:\n{_log_tail(run_dir)}")
            line += chunk
    return line.decode("utf-8", "replace").strip()


def _log_tail(run_dir: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(supervisor_log(run_dir).read_text(errors="replace").splitlines()[-lines:])
    return ""


def _end_supervisor(pid: Optional[int]) -> None:
    """A start given up: the supervisor killed (its ranks die with it: they watch it)."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- the supervisor
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
    answer.write(f"pid {os.getpid()} {start_time(os.getpid())}\n".encode())
    stop: List[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stop of the supervisor is a Stop of the run
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        job = pickle.loads(sys.stdin.buffer.read())
        handle = _start_run(job)
    except BaseException as exc:  # noqa: BLE001 - said to the kernel, which raises it
        with contextlib.suppress(OSError):
            answer.write(f"error {_exception_hex(exc)}\n".encode())
        return 1
    with contextlib.suppress(OSError):
        answer.write(b"ok\n")
        answer.close()
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


__all__ = ["start_detached", "main", "DetachedLaunch", "supervisor_log", "LOG_NAME"]
