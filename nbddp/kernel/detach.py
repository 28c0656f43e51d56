"""``spawn_train(..., detach=True)``: the kernel's side of a detached run's start.

The run is handed to a supervisor of its own (:mod:`nbddp.kernel.supervisor`): a fresh
interpreter in a session of its own, started through a process that exits at once, so that it is
no child of the kernel and nothing that ends the kernel or its process group reaches it. The
launch travels on the supervisor's standard input (a pipe: nothing read back from a folder); the
supervisor answers on its standard output once the ranks have started (or with the error that
stopped them), and takes over the kernel's GPU leases. From then on this kernel only follows the
run through its folder (:mod:`nbddp.kernel.follow`), as any other kernel of the user's may.
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
from ..contract.leases import Leases
from ..contract.private import open_private_file
from ..contract.safe_path import python_argv

#: The supervisor's own lines (a restart, a hang, its errors), in the run's private logs folder.
LOG_NAME = "supervisor.log"
#: How long the kernel waits for the supervisor to say that the ranks started.
START_TIMEOUT_S = 600.0

# The supervisor's first lines, run with the launching folder dropped from sys.path before anything is
# imported (contract.safe_path.python_argv: a file there never shadows the standard library or nbddp);
# then it forks and the first process exits, so the supervisor is no child of the kernel.
_BOOT = ("import os, sys\n"
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
        boot = subprocess.Popen(python_argv(_BOOT, launches.start_method), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, start_new_session=True, close_fds=True)
    finally:
        os.close(log)
    pid: Optional[int] = None
    with interrupts_held() as interrupted:
        # Given up here (an Interrupt, an error), the pipe closes: a supervisor that then says its
        # ranks started finds no one to tell, and ends the run (its "ok" cannot be written).
        try:
            boot.stdin.write(data)
            boot.stdin.close()
            boot.wait()  # the first process exits at once; the supervisor is its child, now init's
            answers = _Answers(boot.stdout, run_dir, lambda: bool(interrupted))
            pid = int(answers.line().split()[1])
            answer = answers.line()
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


class _Answers:
    """The supervisor's lines on its standard output, read as they come (an Interrupt ends the wait)."""

    def __init__(self, stream, run_dir: Path, interrupted: Callable[[], bool]):
        self.stream, self.run_dir, self.interrupted = stream, run_dir, interrupted
        self.deadline = time.time() + START_TIMEOUT_S
        self.buffer = b""

    def line(self) -> str:
        """The next line; its log's end in the error when the supervisor died without one."""
        while b"\n" not in self.buffer:
            if self.interrupted():
                raise KeyboardInterrupt
            if time.time() > self.deadline:
                raise NbddpError(f"the supervisor of the detached run in {self.run_dir} did not start its workers "
                                 f"within {START_TIMEOUT_S:.0f} s; see {supervisor_log(self.run_dir)}")
            ready, _, _ = select.select([self.stream], [], [], 0.1)
            if ready:
                chunk = os.read(self.stream.fileno(), 1 << 16)
                if not chunk:
                    raise NbddpError(f"the supervisor of the detached run in {self.run_dir} ended before its "
                                     f"workers started:\n{_log_tail(self.run_dir)}")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
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


__all__ = ["start_detached", "DetachedLaunch", "supervisor_log", "LOG_NAME"]
