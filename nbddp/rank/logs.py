"""A process's output in a log file of its user's alone: every rank's, and the processes a launcher script starts.

Worker side.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..contract import rundir
from ..contract.private import open_private_file


def open_private_log(log_path: Path) -> int:
    """A descriptor appending to ``log_path``, a file of the user's alone (:func:`nbddp.contract.private.open_private_file`).

    A rank's output and its stacks (paths, tokens a library prints, the code's names) are its
    user's alone, however group-writable the runs folder is: created ``0600`` whatever the umask,
    never through a link, and never into a folder or file another user put in the logs' place."""
    return open_private_file(log_path, rundir.RUN_LOGS)


def redirect_output(log_path: Path) -> None:
    """Send fd 1 and 2 (Python and C++ output alike) to the rank's log file, line-buffered."""
    fd = open_private_log(log_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")


__all__ = ["open_private_log", "redirect_output"]
