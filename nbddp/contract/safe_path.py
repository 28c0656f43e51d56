"""A safe import path for every Python process nbddp starts: the launching folder never ahead of the standard library.

``python -c CODE`` and ``python -m MODULE`` put the folder they start in first on ``sys.path``,
ahead of the standard library. nbddp starts its processes in the notebook's folder, which on a
shared server is a team's group-writable project folder: a ``json.py`` (or ``multiprocessing/``)
a group member puts there would be imported, as you, by the warm server, by every rank forked from
it, by a spawned rank and by every SLURM task. The Jupyter kernel itself does not do that: IPython
puts the notebook's folder after the standard library, before ``site-packages``.

So each process nbddp starts begins by dropping that first entry (Python 3.11's ``-P`` does the
same, but 3.10 has no ``-P``, and one way is tested everywhere), and the folder the user's code is
in is put back where Jupyter has it (:func:`add_after_stdlib`): the notebook's folder reaches a
rank as data (the launch's ``cwd``), not as the start of its import path.

- :func:`python_argv` / :func:`module_argv`: the command line of a fresh interpreter running code
  or a module (``python -m`` without its start folder): for the SLURM tasks, TensorBoard, a
  detached run's supervisor;
- :func:`starts_safely`: in this thread, the interpreters multiprocessing starts (its resource
  tracker, the forkserver, spawned children: all ``python -c``) begin with the drop;
- :func:`add_after_stdlib`: a folder on ``sys.path`` after the standard library.

Used on both sides (kernel and ranks): imports only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, List, Optional, Sequence

#: The first statement of every ``python -c`` nbddp starts: ``-c`` put ``''`` (the folder the
#: process starts in) first on ``sys.path``; nothing was imported from it yet (``sys`` is built in).
DROP_START_FOLDER = "import sys; sys.path[:1] = [p for p in sys.path[:1] if p != '']; "

_local = threading.local()


def safe_code(code: str) -> str:
    """``code`` for ``python -c``, preceded by :data:`DROP_START_FOLDER` (once)."""
    return code if code.startswith(DROP_START_FOLDER) else DROP_START_FOLDER + code


def safe_argv(argv: Sequence[str]) -> List[str]:
    """An interpreter's command line with its ``-c`` code made safe (:func:`safe_code`); others unchanged."""
    argv = list(argv)
    for i, word in enumerate(argv[1:-1], start=1):
        if word == "-c":
            argv[i + 1] = safe_code(argv[i + 1])
            break
        if not word.startswith("-"):
            break  # a script or a module: no -c in this command line
    return argv


def python_argv(code: str, *args: str, executable: Optional[str] = None) -> List[str]:
    """``python -c code args...`` that never imports from the folder it starts in."""
    return [executable or sys.executable, "-c", safe_code(code), *args]


def module_argv(module: str, *args: str, executable: Optional[str] = None) -> List[str]:
    """``python -m module args...`` as ``python -c``, without the start folder on ``sys.path``.

    ``runpy`` runs the module as ``__main__`` with ``sys.argv[0]`` its file, as ``-m`` does.
    """
    code = f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return python_argv(code, *args, executable=executable)


def _is_site(entry: str) -> bool:
    return os.path.basename(os.path.normpath(entry)) in ("site-packages", "dist-packages")


def add_after_stdlib(folder: str) -> None:
    """Put ``folder`` on ``sys.path`` where IPython puts the notebook's: before the first
    ``site-packages``, after the standard library; a folder already on it stays where it is."""
    folder = os.fspath(folder)
    if folder in sys.path or os.path.abspath(folder) in map(os.path.abspath, filter(None, sys.path)):
        return
    where = next((i for i, entry in enumerate(sys.path) if _is_site(entry)), len(sys.path))
    sys.path.insert(where, folder)


@contextlib.contextmanager
def starts_safely() -> Iterator[None]:
    """In this thread, every interpreter multiprocessing starts runs its ``-c`` code made safe.

    Its resource tracker, forkserver and spawned children are ``python -c "from multiprocessing...
    import main; main(...)"`` started through ``multiprocessing.util.spawnv_passfds``; other
    threads (the notebook's own multiprocessing) are answered by the original, which is put back
    unless someone else replaced it meanwhile.
    """
    from multiprocessing import util

    original = util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        if getattr(_local, "safe", 0):
            args = safe_argv(args)
        return original(path, args, passfds)

    util.spawnv_passfds = spawnv_passfds
    _local.safe = getattr(_local, "safe", 0) + 1
    try:
        yield
    finally:
        _local.safe -= 1
        if util.spawnv_passfds is spawnv_passfds:
            util.spawnv_passfds = original


__all__ = ["DROP_START_FOLDER", "safe_code", "safe_argv", "python_argv", "module_argv", "add_after_stdlib",
           "starts_safely"]
