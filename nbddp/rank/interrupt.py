"""A rank's SIGINT: a ``KeyboardInterrupt`` between two statements, as Ctrl-C gives in a terminal.

The kernel sends SIGINT to a rank that has not stopped when asked (a Stop or an Interrupt; see
:mod:`nbddp.kernel.shutdown`), whatever the rank runs: the built-in worker, a ``fn(ctx)``
function that never checks ``ctx.should_stop()``, an mp.spawn or torchrun function, a script.
Its ``finally:`` blocks and context managers then run before the staged SIGTERM. The handler is
installed whatever disposition the rank inherited: a Jupyter server started with ``nohup`` or
from a background job ignores SIGINT, and so would every process it starts.

A rank leads its own process group (a session for a warm server's ranks), so Jupyter's
Interrupt, sent to the kernel's group, never reaches it: only the kernel's staged stop does.

Worker side.
"""

from __future__ import annotations

import signal

#: What a rank's ``KeyboardInterrupt`` says (its log keeps the traceback; the cell a short notice).
MESSAGE = "nbddp: the notebook asked this run to stop and it had not stopped yet"


def _raise(signum, frame):
    raise KeyboardInterrupt(MESSAGE)


def install() -> None:
    """SIGINT raises ``KeyboardInterrupt`` in this rank's main thread, and is not blocked."""
    signal.signal(signal.SIGINT, _raise)
    # A rank starts with SIGINT blocked (the warm server's children; under spawn, the kernel blocks
    # it while starting them, so that a Jupyter Interrupt sent to the kernel's process group during
    # the rank's first seconds, before it leaves that group, never interrupts its imports). One
    # that waits now was sent to the kernel's group, not to this rank: it is taken and dropped.
    # Then it must not stay blocked, or neither the kernel's SIGINT nor its own children's Ctrl-C
    # would arrive.
    if signal.SIGINT in signal.sigpending():
        signal.sigwait({signal.SIGINT})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
