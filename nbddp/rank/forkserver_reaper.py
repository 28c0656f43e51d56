"""Imported by the warm forkserver only (:data:`nbddp.kernel.forkserver.PRELOAD`): it becomes a child
subreaper and, when it exits with the kernel, ends and reaps every descendant it has.

The forkserver parents the ranks of ``start_method="forkserver"``. A rank killed by a signal
cannot end what it started; those processes then re-parent here (not to init), and end here at
the latest when the kernel goes away (see :mod:`nbddp.rank.reaper`). Importing this module anywhere
but in multiprocessing's forkserver does nothing.
"""

import atexit
import os
import sys
import warnings

from . import reaper


def _in_forkserver() -> bool:
    """True while multiprocessing's ``forkserver.main`` imports its preload list in this process."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


def _at_exit(server_pid: int) -> None:
    # SIGKILL at once: the kernel is gone, and the ranks, whose parent-death signal is SIGKILL,
    # would get no more time from it than this.
    if os.getpid() == server_pid:  # never in a rank forked from the server
        reaper.end_descendants(grace_s=0)
        # The server holds nothing to flush; tearing down an interpreter with torch loaded takes
        # seconds on a busy machine, while a process of the run would still show.
        os._exit(0)


if _in_forkserver() and reaper.become_subreaper():
    # The server reaps what re-parents to it in its SIGCHLD loop, and warns of each such pid.
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    atexit.register(_at_exit, os.getpid())
