"""A script that starts its own processes, run as it is: the processes it spawns are watched.

``python multigpu.py`` ending in ``mp.spawn(main, args=(...), nprocs=world_size)`` runs in one
nbddp process, the launcher (``call="spawns"``, chosen by the kernel from the script's source,
:func:`nbddp.contract.conventions.script_spawns`). While it runs,
``torch.multiprocessing.spawn`` and ``start_processes`` start the same processes, with the same
function, arguments and start method, each wrapped (:class:`Spawned`) so that

* its output (Python's and C++'s: fd 1 and 2) goes to a log of its own, ``logs/spawned{i}.log``
  (``0600``, as a rank's log), and the launcher echoes every line of it into its own output,
  prefixed ``[rank{i}] ``: the cell shows the processes live, the logs keep all of it;
* its torch threads are the launcher's share divided among the processes it started;
* a failure's traceback is in its log too (torch sends it only to the launcher).

The launcher is a child subreaper whose descendants nbddp ends and reaps at the run's end
(:mod:`nbddp.rank.reaper`), and torch gives each process a parent-death signal: nothing it
spawned outlives the run. A stop or an Interrupt raises ``KeyboardInterrupt`` in the launcher,
waiting in ``join()``; it passes SIGINT to every live process so that their ``finally:`` blocks
run, waits :data:`GRACE_S`, then SIGTERM, then SIGKILL, and re-raises. A process that fails is
named, with its log, before torch's exception goes up through the script. Processes started with
``join=False`` that the script leaves unjoined are waited for when it returns, as ``python
script.py`` waits for them at its exit (and ended as above when it raises).

Worker side (the launcher and the processes it starts).
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import os
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from ..contract import rundir, statedir
from ..contract.conventions import MP_SPAWN, check_call
from ..contract.errors import ConfigError, shown_traceback
from .logs import redirect_output

#: Seconds the launcher's processes get to end on their own after an Interrupt (SIGINT), then after
#: SIGTERM: both within the kernel's own 3 s before it sends the launcher SIGTERM.
GRACE_S = 1.0
#: Seconds between two reads of the processes' logs.
POLL_S = 0.1


class Spawned:
    """The function a script spawns, as one watched process runs it: ``fn(index, *args)``."""

    def __init__(self, fn: Callable[..., Any], run_dir: str, threads: int, group: int = 0):
        self.fn, self.run_dir, self.threads, self.group = fn, run_dir, threads, group

    def __call__(self, index: int, *args: Any) -> Any:
        redirect_output(rundir.spawned_log(self.run_dir, index, self.group))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(self.threads)
        import torch

        torch.set_num_threads(self.threads)
        try:
            self.fn(index, *args)  # torch's spawn drops what it returns
        except (KeyboardInterrupt, SystemExit):
            raise  # torch's own rules: an Interrupt ends the process quietly, sys.exit(n) is its exit code
        except BaseException as exc:
            # The log keeps the traceback from the code on (torch hands it to the launcher only); the
            # launcher reads what it was from the note, to say it once.
            text = shown_traceback(traceback.format_exc())
            print(text, end="" if text.endswith("\n") else "\n", file=sys.stderr, flush=True)
            _note_failure(self.run_dir, index, self.group, exc, text)
            if isinstance(exc, Exception):
                raise
            raise _Escaped(f"{type(exc).__name__}: {exc}") from None
        _leave()


class _Escaped(Exception):
    """A ``BaseException`` of the code's own (``class Abort(BaseException)``), raised as torch's spawn
    reports an ``Exception``: any other it lets through to ``multiprocessing``, which prints its
    traceback a second time and tells the launcher only "exit code 1"."""


def _note_failure(run_dir: str, index: int, group: int, exc: BaseException, text: str) -> None:
    """What process ``index`` raised, for the launcher (the run's private state folder); best effort."""
    note = {"type": type(exc).__name__, "message": str(exc), "traceback": text, "pid": os.getpid()}
    with contextlib.suppress(Exception):
        statedir.write_json(run_dir, rundir.spawned_error_path(run_dir, index, group).name, note)


def _leave() -> None:
    """End a process that returned, as a rank ends: Python's own exit steps (its threads joined,
    ``atexit`` run, output flushed), then ``os._exit(0)``, without the C++ teardown. torch 2.14's
    gloo can abort there ("terminate called without an active exception": SIGABRT after a clean
    run, about one ``python multigpu.py`` in ten on this 2-core machine even with a barrier
    before ``destroy_process_group``), which mp.spawn reports as the process's failure."""
    import atexit

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # the non-daemon threads the code started, as the interpreter waits for them
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


#: One piece of output: a line, or a rewrite of the current line (a ``\r`` progress bar).
_PIECE = re.compile(r"[^\r\n]*(?:\r\n|\n|\r)")


def pieces_of(text: str, final: bool = False) -> tuple:
    """``(pieces, rest)``: ``text`` cut after each ``\n``, ``\r\n`` or ``\r``, and what follows the last.

    Only these end a piece (``str.splitlines`` also cuts at form feeds and Unicode separators,
    which belong inside a line). A ``\r`` at the very end waits for the next read, since it may
    be the start of ``\r\n``; ``final`` gives everything, a last line without its newline too.
    """
    pieces, pos = [], 0
    for m in _PIECE.finditer(text):
        if not final and m.end() == len(text) and m.group().endswith("\r"):
            break
        pieces.append(m.group())
        pos = m.end()
    rest = text[pos:]
    if final and rest:
        pieces.append(rest + "\n")
        rest = ""
    return pieces, rest


class _Followed:
    """One process's log as the echo reads it: where it is, and what of it is not shown yet."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0  # a later spawn appends to the log
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character cut by a read waits
        self.rest = ""
        self.traceback: List[str] = []  # a traceback being read, held until its error line
        self.ended = False  # ... which came: shown at the end of the read, unless its chain goes on


#: Lines inside a traceback that are not indented (a chain of exceptions goes on after them).
_CHAIN = ("Traceback (most recent call last):", "During handling of the above exception",
          "The above exception was the direct cause")


class LogEcho:
    """Copies what the processes' logs gain into the launcher's output, each piece prefixed with its
    rank (a ``\r`` progress line too, so the cell updates it in place)."""

    def __init__(self, out: Callable[[str], None]):
        self._out = out
        self._files: Dict[str, _Followed] = {}  # by the label its pieces carry
        self._errors: Dict[str, str] = {}  # the error line of each traceback shown, and whose it was
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def follow(self, paths: Sequence[Path], labels: Sequence[str]) -> None:
        with self._lock:
            for label, path in zip(labels, paths):
                if label not in self._files or self._files[label].path != path:
                    self._files[label] = _Followed(path)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nbddp-spawned-echo", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.read()
            except Exception:  # noqa: BLE001 - the output is in the logs whatever happens to the echo
                pass

    def read(self, final: bool = False) -> None:
        with self._lock:
            for label, followed in self._files.items():
                try:
                    with open(followed.path, "rb") as f:
                        f.seek(followed.offset)
                        data = f.read()
                except OSError:
                    continue
                followed.offset += len(data)
                text = followed.rest + followed.decoder.decode(data, final=final)
                pieces, followed.rest = pieces_of(text, final)
                shown = self._shown(label, followed, pieces, final)
                if shown:
                    self._out("".join(f"[{label}] {piece}" for piece in shown))

    def _shown(self, label: str, followed: _Followed, pieces: List[str], final: bool) -> List[str]:
        """What of ``pieces`` to show now. A traceback is held until its error line; one whose error
        another process's traceback showed already (the same code failed on every process) is said
        in one line, its whole text in its log: the cell says the error once, whatever the count."""
        shown: List[str] = []
        for piece in pieces:
            line = piece.rstrip("\r\n")
            if followed.traceback:
                if followed.ended and line.strip() and not line.startswith(_CHAIN):
                    shown += self._told(label, followed)  # the traceback ended: this is the code's output
                else:
                    followed.traceback.append(piece)
                    if line.strip() and not line[:1].isspace():
                        followed.ended = not line.startswith(_CHAIN)  # an error line (its chain may go on)
                    continue
            if line.startswith(_CHAIN[0]):
                followed.traceback, followed.ended = [piece], False
            else:
                shown.append(piece)
        if followed.traceback and (followed.ended or final):
            shown += self._told(label, followed)
        return shown

    def _told(self, label: str, followed: _Followed) -> List[str]:
        held, followed.traceback, followed.ended = followed.traceback, [], False
        error = next((p.strip() for p in reversed(held) if p.strip() and not p[:1].isspace()), "")
        first = self._errors.setdefault(error, label)
        if first == label:
            return held
        return [f"the same error as {first}; its traceback is in logs/{followed.path.name}\n"]

    def close(self) -> None:
        """Stop following; what the logs hold that was not shown yet is shown now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.read(final=True)


def _writer(stream: Any) -> Callable[[str], None]:
    """Writes to ``stream``, the launcher's output when the script started (not a stream it swaps in)."""
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()
    return write


@contextlib.contextmanager
def watch_spawns(run_dir: Path, script: str) -> Iterator[None]:
    """While the launcher runs ``script``, its ``torch.multiprocessing`` spawns are watched (see the module)."""
    import torch.multiprocessing as tmp

    saved = tmp.spawn, tmp.start_processes
    watch = _Watch(run_dir, script, saved[1])
    tmp.spawn, tmp.start_processes = watch.spawn, watch.start_processes
    try:
        yield
        watch.join_left()  # as `python script.py` waits at its exit for the processes it did not join
    except BaseException:
        watch.end_left()
        raise
    finally:
        tmp.spawn, tmp.start_processes = saved
        watch.echo.close()


class _Watch:
    """The launcher's ``spawn`` and ``start_processes``: torch's, each process wrapped and watched."""

    def __init__(self, run_dir: Path, script: str, original: Callable[..., Any]):
        self.run_dir, self.script, self.original = run_dir, script, original
        self.echo = LogEcho(_writer(sys.stdout))
        self.pid = os.getpid()
        self.unjoined: List[tuple] = []  # (context, fn) of the script's join=False starts
        self.starts: List[Any] = []      # every start's context

    def spawn(self, fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, join: bool = True,
              daemon: bool = False, start_method: str = "spawn") -> Any:
        if start_method != "spawn":  # as torch's own spawn: it warns and spawns
            warnings.warn(f"torch.multiprocessing.spawn only supports start_method=spawn (got: {start_method}); "
                          "use torch.multiprocessing.start_processes for another", FutureWarning, stacklevel=2)
        return self.start_processes(fn, args, nprocs, join, daemon, "spawn")

    def start_processes(self, fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, join: bool = True,
                        daemon: bool = False, start_method: str = "spawn") -> Any:
        import torch

        if os.getpid() != self.pid:  # a forked process of the script's starts its own: torch's, unwatched
            return self.original(fn, args, nprocs, join, daemon, start_method)
        try:
            print(launch_notice(self.script, fn, args, nprocs), flush=True)
        except Exception:  # noqa: BLE001 - a notice never stands in the way of the script's own call
            pass
        # A start after the earlier ones ended appends to their logs; one beside a start that still
        # runs (join=False) gets logs, and labels, of its own.
        group = len(self.starts) if any(p.is_alive() for c in self.starts for p in c.processes) else 0
        labels = [f"rank{i}" if group == 0 else f"group{group}.rank{i}" for i in range(nprocs)]
        for i in range(nprocs):  # an earlier start's failure (the script caught it) is not this one's
            statedir.unlink(self.run_dir, rundir.spawned_error_path(self.run_dir, i, group).name)
        self.echo.follow([rundir.spawned_log(self.run_dir, i, group) for i in range(nprocs)], labels)
        threads = max(1, torch.get_num_threads() // max(nprocs, 1))
        context = self.original(Spawned(fn, str(self.run_dir), threads, group), args, nprocs, join=False,
                                daemon=daemon, start_method=start_method)
        context.nbddp_group = group  # which logs its processes write
        self.starts.append(context)
        if not join:
            self.unjoined.append((context, fn))
            return context  # the script joins it; the echo and the reaper follow its processes
        self._join(context, fn)
        return None

    def _join(self, context: Any, fn: Callable[..., Any]) -> None:
        try:
            while not context.join():
                pass
        except BaseException as exc:
            _end(context, exc, fn, self.run_dir)
            raise
        finally:
            self.echo.read()

    def join_left(self) -> None:
        for context, fn in self.unjoined:
            if any(not p.daemon for p in context.processes):
                self._join(context, fn)

    def end_left(self) -> None:
        for context, fn in self.unjoined:
            if any(p.is_alive() for p in context.processes):
                _end(context, KeyboardInterrupt(), fn, self.run_dir)


def _end(context: Any, exc: BaseException, fn: Callable[..., Any], run_dir: Path) -> None:
    """After ``join()`` raised: an Interrupt reaches every live process (SIGINT, then SIGTERM, then
    SIGKILL); a process's failure is named with its log."""
    processes = context.processes
    index = getattr(exc, "error_index", None)
    if index is not None:
        group = getattr(context, "nbddp_group", 0)
        note = statedir.read_json(run_dir, rundir.spawned_error_path(run_dir, index, group).name)
        _name_the_process(exc, index, len(processes), getattr(fn, "__name__", "fn"),
                          rundir.spawned_log(run_dir, index, group), note if isinstance(note, dict) else {})
    live = [p for p in processes if p.is_alive()]
    for how, wait in ((signal.SIGINT, GRACE_S), (signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        for p in live:
            with contextlib.suppress(OSError):
                os.kill(p.pid, how)
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            live = [p for p in live if p.is_alive()]
            time.sleep(0.05)
        live = [p for p in live if p.is_alive()]
        if not live:
            break
    for p in processes:
        p.join(timeout=5)


def _name_the_process(exc: BaseException, index: int, count: int, name: str, log: Path, note: dict) -> None:
    """Say in torch's exception, in one line, which process failed, what it raised and where its
    output is (torch's message repeats the process's whole traceback, which its log and the cell's
    echo hold), and attach it as ``exc.nbddp_process``: the launcher's error record is then that
    process's failure (``nbddp.rank.runtime``). It stays torch's exception for the script."""
    process = f"process {index} of {count} ({name})"
    if isinstance(note.get("type"), str) and isinstance(note.get("message"), str):
        kind, message, text = note["type"], note["message"], str(note.get("traceback") or "")
        what = f"raised {kind}: {message}"
    else:  # it died without a Python exception (a signal, os._exit, a crash in native code)
        raised = [line for line in str(exc).splitlines() if line.strip()]
        said = raised[0].strip().replace(f"process {index:d} ", "", 1) if raised else "failed"
        kind, message, text = type(exc).__name__, said, ""
        what = said
    pid = note.get("pid") if isinstance(note.get("pid"), int) else getattr(exc, "pid", None)
    exc.args = (f"{process} {what}; its output: {log}",)
    if hasattr(exc, "msg"):
        exc.msg = exc.args[0]
    exc.nbddp_process = {"name": process, "log": log.name, "pid": pid, "type": kind, "message": message,
                         "traceback": text}


def launch_notice(script: str, fn: Callable[..., Any], args: tuple, nprocs: int) -> str:
    """What the launcher says when the script spawns: what nbddp watches, and the function form
    with every nbddp feature, as a call that can be copied when the arguments are plain values."""
    name = getattr(fn, "__name__", "fn")
    head = (f"nbddp: {Path(script).name} started {nprocs} process{'es' if nprocs != 1 else ''} running {name}; "
            f"nbddp watches them (output below by rank, logs in logs/spawned<i>.log). For heartbeats, per-rank return "
            f"values and restarts, launch the function itself:")
    call = function_form(script, fn, args, nprocs)
    return f"{head}\n  {call}"


def function_form(script: str, fn: Callable[..., Any], args: tuple, nprocs: int) -> str:
    """``spawn_train('<script>:<fn>', *args, nprocs=N, call='mp.spawn')``, checked: the function is
    defined at the top level of the script, and every argument is a plain value written as Python
    reads it back. Otherwise a sentence that says what keeps it from being one."""
    code = getattr(fn, "__code__", None)
    qualname = getattr(fn, "__qualname__", "")
    script_file = os.path.abspath(script) if not script.startswith("-m ") else None
    if code is None or "<" in qualname or "." in qualname or \
            (script_file is not None and os.path.abspath(code.co_filename) != script_file):
        return f"(not from here: {qualname or fn!r} is not a top-level function of {script})"
    where = script if script_file is not None else script[3:].strip()
    written = []
    for i, value in enumerate(args):
        text = repr(value)
        if len(text) > 200:
            return (f"spawn_train({f'{where}:{qualname}'!r}, ..., nprocs={nprocs}, call='mp.spawn'), with its "
                    f"arguments after the rank: argument {i + 1} ({type(value).__name__}) is too long to write here")
        try:
            if ast.literal_eval(text) != value:
                raise ValueError
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return (f"spawn_train({f'{where}:{qualname}'!r}, ..., nprocs={nprocs}, call='mp.spawn'), with its "
                    f"arguments after the rank: argument {i + 1} ({type(value).__name__}) is not a plain value, "
                    "which a launch from the notebook would build itself (plain values cross to the processes)")
        written.append(text)
    try:  # the kernel's own check of such a launch, so that the call shown is one that starts
        check_call(fn, MP_SPAWN, args, {}, qualname)
    except ConfigError as exc:
        return f"(the function form does not fit as it is: {exc})"
    shown = "".join(f", {t}" for t in written)
    return f"spawn_train({f'{where}:{qualname}'!r}{shown}, nprocs={nprocs}, call='mp.spawn')"


__all__ = ["Spawned", "LogEcho", "watch_spawns", "launch_notice", "function_form", "GRACE_S"]
