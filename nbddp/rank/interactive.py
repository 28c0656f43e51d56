"""A rank of an interactive group (``%%ranks``): a loop that runs the notebook's cells, one namespace kept.

The rank starts as every rank does (:func:`nbddp.rank.runtime.entry`: parent-death signal, its
own process group, subreaper, log file, heartbeats, the process group up) and calls
:func:`serve` as its worker function. ``serve`` connects to the kernel's channel
(:mod:`nbddp.contract.channel`) and answers its requests until the kernel says ``exit`` or goes:
run a cell's code in the rank's namespace, send a value back, set values.

- A cell's output goes to the rank's log (its stdout and stderr are the log), after a header
  with the cell's code, so the log keeps every cell and what it printed; the kernel echoes the
  log from where the cell's output starts (the offset in ``BEGIN``). The value of a cell's last
  expression is printed as its ``repr``, as IPython shows it.
- SIGINT raises ``KeyboardInterrupt`` only while a cell's code runs; between cells (waiting for
  the next request, answering one) it is dropped, so an Interrupt that comes late never ends
  the loop.
- A failing cell prints its traceback without this module's frames and answers ``ERROR``; the
  namespace stays.

Rank side.
"""

from __future__ import annotations

import ast
import linecache
import os
import pickle
import signal
import sys
import traceback
import types
import torch
import torch.distributed as dist

from ..contract import channel, targets

class _Interrupts:
    """SIGINT as ``KeyboardInterrupt`` while a cell's code runs, dropped otherwise."""

    def __init__(self) -> None:
        self.in_cell = False

    def handler(self, signum, frame) -> None:
        if self.in_cell:
            raise KeyboardInterrupt("interrupted from the notebook")


def _namespace(ctx) -> dict:
    """The cells' globals: a fresh ``__main__`` (classes defined in a cell pickle and save as in a
    script), with the rank's names in it."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    main.__dict__.update(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, dist=dist, torch=torch,
                         ctx=ctx)
    return main.__dict__


def _compiled(source: str, filename: str):
    """The cell as code to exec and, if it ends with an expression, that expression to eval."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show lines
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, filename, "exec")
    return body, (compile(last, filename, "eval") if last is not None else None)


def _users_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the cell's code on: this module's frames said nothing to its user."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _log_offset() -> int:
    """Where the log ends now (fd 1 is the rank's log, appended to)."""
    try:
        return os.fstat(1).st_size
    except OSError:
        return 0


def _run(sock, request: int, source: str, label: str, namespace: dict, interrupts: _Interrupts) -> None:
    # The cell's code in the log first: the log is the record of what this rank ran.
    print(f"\n>>> {label} (%%ranks)\n{source.rstrip()}\n<<<", flush=True)
    channel.send(sock, (channel.BEGIN, request, _log_offset()))
    status, error_type, error_line = channel.OK, None, None
    try:
        body, last = _compiled(source, label)
        interrupts.in_cell = True
        try:
            exec(body, namespace)
            value = eval(last, namespace) if last is not None else None
        finally:
            interrupts.in_cell = False
        if value is not None:
            namespace["_"] = value
            print(repr(value))
    except BaseException as exc:  # noqa: BLE001 - a cell's error is its answer; the loop goes on
        interrupts.in_cell = False
        status = channel.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else channel.ERROR
        error_type, error_line = type(exc).__name__, (str(exc).strip().splitlines() or [""])[0]
        _flush()
        print(_users_traceback(exc), end="", file=sys.stderr)
    _flush()
    channel.send(sock, (channel.DONE, request, status, error_type, error_line, None))


def _pull(sock, request: int, name: str, namespace: dict, rank: int) -> None:
    from .runtime import to_cpu

    if name not in namespace:
        channel.send(sock, (channel.DONE, request, channel.ERROR, "NameError",
                            f"name {name!r} is not defined on rank {rank}", None))
        return
    try:
        data = pickle.dumps(to_cpu(namespace[name]), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - said to the kernel, which raises it
        channel.send(sock, (channel.DONE, request, channel.ERROR, type(exc).__name__,
                            f"{name} ({type(namespace[name]).__name__}) cannot be sent to the kernel: {exc}", None))
        return
    channel.send(sock, (channel.DONE, request, channel.OK, None, None, data))


def _push(sock, request: int, data: bytes, namespace: dict) -> None:
    try:
        values = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - a class of the kernel's __main__, say
        channel.send(sock, (channel.DONE, request, channel.ERROR, type(exc).__name__,
                            f"cannot be loaded in a rank: {exc}; define its class in a file both import, "
                            "or build the value with %%ranks", None))
        return
    namespace.update(values)
    channel.send(sock, (channel.DONE, request, channel.OK, None, None, None))


def serve(ctx, channel_path: str) -> None:
    """Answer the kernel's requests until it says ``exit`` or its end of the channel closes."""
    sock = channel.connect(channel_path)
    targets.from_source_in_user_folders()  # a module of yours that a cell imports: as it is on disk now
    namespace = _namespace(ctx)
    interrupts = _Interrupts()
    signal.signal(signal.SIGINT, interrupts.handler)
    channel.send(sock, (channel.HELLO, ctx.rank, os.getpid()))
    try:
        while True:
            try:
                message = channel.receive(sock)  # a SIGINT meanwhile is dropped; the call resumes (PEP 475)
            except (EOFError, ConnectionError):
                return  # the kernel has gone: the rank ends with it
            op = message[0]
            if op == channel.OP_EXIT:
                return
            if op == channel.OP_RUN:
                _run(sock, message[1], message[2], message[3], namespace, interrupts)
            elif op == channel.OP_PULL:
                _pull(sock, message[1], message[2], namespace, ctx.rank)
            elif op == channel.OP_PUSH:
                _push(sock, message[1], message[2], namespace)
    finally:
        sock.close()


__all__ = ["serve"]
