"""What makes a process a rank, before any of the user's code: it dies with its parent, leaves the
warm server's pipe and the kernel's process group, draws its own random state from the OS (a fork of
the warm server would share the server's), becomes a child subreaper, takes SIGINT as a
``KeyboardInterrupt``, forks its own children (DataLoader workers) so that they die with it,
writes its stacks on a signal, and runs the start-up hook tests and users may name.

Worker side.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing.process
import os
import random
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from . import interrupt as rank_interrupt
from . import reaper
from ..contract import rundir, targets
from ..contract.protocol import STACK_SIGNAL, LaunchSpec
from ..contract.safe_path import add_after_stdlib
from .logs import open_private_log


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def set_parent_death_signal(parent_pid: Optional[int]) -> None:
    """Ask Linux to SIGKILL us when our parent dies, then check it has not died already.

    The parent is the kernel (spawn) or the forkserver (warm starts), which itself exits when
    the kernel goes away. The signal follows the parent *thread* that started us, which is why
    spawn_train starts workers from the caller's thread, not from a short-lived one.
    """
    expected = parent_pid if parent_pid is not None else os.getppid()
    _set_pdeathsig()
    # The parent may have died between our start and the prctl call: then we were re-parented.
    if os.getppid() != expected:
        os._exit(1)


_fork_parent: Optional[int] = None  # set in the parent just before a fork; the child reads its copy


def _before_fork() -> None:
    global _fork_parent
    # Only forks from the main thread: the parent-death signal follows the forking *thread*, and
    # a child forked from a short-lived thread would die with that thread.
    _fork_parent = os.getpid() if threading.current_thread() is threading.main_thread() else None


def _after_fork_in_child() -> None:
    if _fork_parent is not None:
        _set_pdeathsig()
        # The parent died before prctl, or only its main thread did (the signal follows the thread;
        # the rank lives on as a zombie leader with other threads): no signal will come.
        if os.getppid() != _fork_parent or _thread_state(_fork_parent) in ("Z", "X"):
            os._exit(1)


def _thread_state(tid: int) -> Optional[str]:
    """The state ('R', 'S', 'Z'...) of thread ``tid`` of this process's parent; None where /proc cannot tell."""
    try:
        with open(f"/proc/{tid}/task/{tid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def fork_children() -> None:
    """Make this rank's own child processes (DataLoader workers) fork from it and die with it.

    A rank started by a forkserver has ``forkserver`` as its default start method, and one
    started by spawn ``spawn`` (multiprocessing sets the start method in the child): each
    DataLoader worker would then be a fresh interpreter that imports torch (seconds per worker,
    every epoch unless the workers persist), and could not unpickle a dataset class defined in a
    worker file. ``fork`` copies the rank instead, in milliseconds. It is safe here: the kernel's
    CUDA state never reaches a rank, and DataLoader workers never touch CUDA.

    Every child forked from the rank's main thread also gets the parent-death signal, so when
    the rank is killed (SIGKILL leaves it no chance to end its workers) its workers follow at
    once instead of lingering until torch's own watchdog notices, or forever inside a slow item.
    """
    import multiprocessing

    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


#: The environment variable naming the per-rank start-up hook (see :func:`run_rank_hook`).
RANK_HOOK_ENV = "NBDDP_RANK_HOOK"


def run_rank_hook(rank: int) -> None:
    """Call the per-rank start-up hook, if ``$NBDDP_RANK_HOOK`` names one.

    ``NBDDP_RANK_HOOK="path/to/file.py:function"`` (or ``"package.module:function"``) is loaded
    and called as ``function(rank)`` once in every rank, first thing: before the rank's output
    goes to its log, before its process group exists and before the worker function is loaded.
    It is the place for per-process set-up that must precede everything else: logging
    configuration, ``faulthandler.enable()``, instrumentation or monkeypatches (nbddp's own tests
    inject their faults this way, ``tests/workers/faults.py``). Set it with
    ``spawn_train(..., env={"NBDDP_RANK_HOOK": "hooks.py:setup"})``, or export it before
    torchrun/srun (it then runs at every restart; ``TORCHELASTIC_RESTART_COUNT`` says which).
    ``RANK`` and friends may not be set yet: use the ``rank`` argument. An exception it raises
    fails the rank like any other start-up error.
    """
    spec = os.environ.get(RANK_HOOK_ENV)
    if spec:
        targets.load_target(spec)(rank)


#: The environment variable that marks a run's processes (the kernel side's ``procs.MARKER_ENV``).
_MARKER_ENV = "NBDDP_RUN_DIR"


_stack_file = None  # kept open for faulthandler, for the rank's life


def stacks_on_signal(run_dir: Path, rank: int) -> None:
    """On :data:`~nbddp.contract.protocol.STACK_SIGNAL`, write every thread's Python stack to ``rank<r>.stacks.log``.

    ``faulthandler`` writes from its C signal handler, so a rank stuck in a collective, in
    native code or holding the GIL in a loop still answers; the kernel reads what is appended
    (:mod:`nbddp.kernel.stacks`). Its own file keeps rank 0's log, echoed into the cell, clean.
    """
    global _stack_file
    try:
        _stack_file = os.fdopen(open_private_log(rundir.stacks_log(run_dir, rank)), "a")
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    except (OSError, AttributeError, ValueError, RuntimeError):  # no such signal here: no stacks on demand
        _stack_file = None


def _release_server_alive_fd() -> None:
    """Close this rank's copy of the warm server's "alive" pipe (a forkserver rank gets one).

    The server exits when every copy is closed; the kernel holds one for as long as it lives. A
    copy here would pass to every process the rank forks, and one that hid and outlived the
    rank (a rank killed by SIGKILL cannot end them) would keep the server, and through it
    nothing else, alive after the kernel: the server ends what re-parented to it only when it
    exits (:mod:`nbddp.rank.forkserver_reaper`). Ranks start their own children by fork, never
    through the server, so they never need the pipe.
    """
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        forkserver._forkserver._forkserver_alive_fd = None
        with contextlib.suppress(OSError):
            os.close(fd)


def fresh_random_state() -> None:
    """Seed torch's, numpy's and Python's global generators from the OS, as a new interpreter does.

    A warm rank is a fork of a server that imported torch and numpy long before, so it inherits
    their generators: without this every rank, and with the server reused every launch, would
    draw the same numbers (unseeded dropout, augmentation, random data, DataLoader workers' base
    seeds), where under torchrun or spawn each rank draws its own. CUDA's generators need nothing:
    torch makes them at CUDA's first use, in the rank, each seeded from the OS (the server only
    imports, never starts CUDA). Not ``torch.seed()``: it queues CUDA's seed with a formatted
    stack, whose source lines cost 15-25 ms in a fresh rank. Python's ``random`` is reseeded by
    fork already, but not by every start; ``numpy.random`` only if loaded (its import seeds it,
    and importing it here would cost a spawned rank 50-100 ms). Runs first in a rank, before the
    start-up hook and the user's code, which may seed as they like: code that seeds draws the
    same numbers on every launch.
    """
    torch.default_generator.seed()
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def become_rank_process(spec: LaunchSpec) -> None:
    """This process as a rank: its own process group and subreaper, signals, fresh random state, the
    launching kernel's environment and working directory, and the run's marker."""
    set_parent_death_signal(spec.parent_pid)
    fresh_random_state()
    # Whatever this rank starts stays in its process tree, however it hides (nbddp.rank.reaper).
    reaper.become_subreaper()
    _release_server_alive_fd()
    try:
        os.setpgid(0, 0)  # own process group: the launcher can signal our DataLoader workers too
    except OSError:
        pass
    rank_interrupt.install()  # SIGINT: a KeyboardInterrupt, whatever the kernel's server inherited
    fork_children()
    if spec.env:
        os.environ.clear()  # exactly the launching kernel's environment of this launch
        os.environ.update(spec.env)
        tempfile.tempdir = None  # TMPDIR is the run's private folder: a forked rank forgets the server's
    if spec.cwd:
        os.chdir(spec.cwd)  # the kernel's working directory now, not the warm server's at its start
        # multiprocessing finds a spawned child's __main__ ("python train.py" run by a relative
        # path) from the directory the process started in: the kernel's, as for `python train.py`.
        multiprocessing.process.ORIGINAL_DIR = spec.cwd
        # The kernel's folder, where Jupyter has it: after the standard library (the process
        # started without it, nbddp.contract.safe_path), so a module there is found, a json.py is not.
        add_after_stdlib(spec.cwd)
    # The run's marker (``procs.MARKER_ENV``), absolute, before any user code: every process the
    # rank starts inherits it, so the kernel finds them even in a session of their own.
    os.environ[_MARKER_ENV] = os.path.abspath(spec.run_dir)


__all__ = ["set_parent_death_signal", "fresh_random_state", "fork_children", "run_rank_hook", "RANK_HOOK_ENV",
           "stacks_on_signal", "become_rank_process"]
