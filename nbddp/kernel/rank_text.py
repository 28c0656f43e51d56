"""What a failed rank left behind, read for its one error: said once, and only what is known.

The last lines of its log, its own output before it failed (what it printed as it failed left
out), its traceback as the cell shows it (from the code it ran on, its last line left to the
headline), where it was as far as it reported (a step, rank 0's progress, or that its output
had begun: never a guess), and the one cause a rank's words alone cannot tell (a key another
user forged in an open rendezvous store) when, and only when, its message says so.

Kernel side.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional

from ..contract import rundir
from ..contract.errors import shown_traceback
from ..contract.protocol import ErrorRecord, read_progress, where_words


def tail(path: Path, lines: int = 20, start: int = 0) -> str:
    """The last ``lines`` lines of ``path`` written after byte ``start`` (this launch's: a resumed
    or restarted run appends to its rank logs)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(start, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def output_before_failure(path: Path, rec: Optional[ErrorRecord], start: int = 0, lines: int = 20) -> str:
    """The last ``lines`` lines the rank wrote to its log before what it printed as it failed.

    A rank that raised prints its traceback (:func:`nbddp.contract.errors.shown_traceback`), one
    that stopped because of another rank one line: both are left out, so what is left is the rank's
    own output. ``""`` when it wrote nothing else."""
    text = tail(path, 100_000, start)
    if rec is not None:
        cut = -1
        for printed in (shown_traceback(rec.traceback).strip() if rec.traceback else "",
                        f"rank {rec.rank} stopped because another rank failed", "Traceback (most recent call last):"):
            cut = text.rfind(printed) if printed else -1
            if cut >= 0:
                break
        text = text[:cut] if cut >= 0 else text
    return "\n".join(text.rstrip().splitlines()[-lines:]) if text.strip() else ""


def where_known(rec, beat, reported: str = "", printed: bool = False):
    """Where the root-cause rank was, as far as it is known: the words, its epoch and its step.

    The epoch and step it last reported (from its record, else its heartbeat: "after it reported
    step 3", since code may report a step as it begins or once it is done); else the progress it reported
    (``reported``: rank 0's ``ctx.progress`` or ``ctx.log`` fields); else whether it had printed
    (``printed``). Never a guess: a script reports no step, and one that trained printed."""
    where_from = rec or beat
    epoch = where_from.epoch if where_from else None
    step = where_from.step if where_from else None
    if epoch is not None or step is not None:  # the last it reported: it may have finished that step
        return f"after it reported {where_words(epoch, step)}", epoch, step
    if reported:
        return f"after it reported {reported}", epoch, step
    if printed:
        return "after its output began (it reported no step)", epoch, step
    if rec is None and beat is not None and beat.state == "running":
        return "no epoch or step reported yet (ctx.heartbeat says where a worker is)", epoch, step
    return "before it printed or reported anything", epoch, step


def reported_progress(run_dir: Path, rank: int) -> str:
    """``"loss 0.25, lr 0.1"``: the last progress rank 0 reported (``ctx.progress``, else ``ctx.log``), or ``""``."""
    if rank != 0:  # only rank 0's progress reaches the run folder
        return ""
    progress = read_progress(run_dir)
    fields = dict(progress.fields) if progress is not None else {}
    if not fields:
        last = tail(rundir.metrics_path(run_dir), 1)
        with contextlib.suppress(ValueError):
            fields = json.loads(last) if last.strip() else {}
    if not isinstance(fields, dict):
        return ""
    shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items() if k != "time"][:4]
    return ", ".join(shown)[:80]


def shown_frames(rec: ErrorRecord) -> str:
    """The rank's traceback as the cell shows it: from the code it ran on (no way in), and without its
    last line when the headline says it (``ValueError: boom``): the error is said once."""
    text = shown_traceback(rec.traceback).rstrip()
    said = f"{rec.type}: {rec.message}".rstrip() if rec.message else rec.type
    at = text.rfind(said)
    if at >= 0 and text[at:] == said:
        text = text[:text.rfind("\n", 0, at) + 1].rstrip() if "\n" in text[:at] else text
    return text


# A rank's rendezvous read a value it cannot parse: what a key forged by someone else gives (a
# length field read as gigabytes: std::bad_alloc, std::length_error), not a lack of memory. The
# message says so: C++'s exceptions as pybind11 passes them (bad_alloc is MemoryError, length_error
# a ValueError "basic_string..."), or bytes that are no text. A ValueError torch raises itself over
# an argument of init_process_group (device_id, backend) says something else, and is that error.
_FOREIGN_KEY_TYPES = ("MemoryError",)
_FOREIGN_KEY_WORDS = ("bad_alloc", "length_error", "basic_string", "unexpected key", "invalid key", "deserializ",
                      "can't decode byte")


def foreign_key_note(rec: Optional[ErrorRecord], store_port: Optional[int]) -> str:
    """A note for an error that a key another local user wrote into the kernel's ``env://`` store
    explains (``store_port``: that store's port, None when the ranks met privately), else ``""``.

    The store (:mod:`nbddp.kernel.rendezvous`) answers every local user; what a forged key does to
    ``init_process_group`` reads like out of memory (``MemoryError: std::bad_alloc``).
    """
    if rec is None or store_port is None:
        return ""
    text = f"{rec.message}\n{rec.traceback}".lower()
    meeting = any(w in text for w in ("init_process_group", "rendezvous", "tcpstore", "_store_based_barrier"))
    odd = rec.type in _FOREIGN_KEY_TYPES or any(w in rec.message.lower() for w in _FOREIGN_KEY_WORDS)
    if not (meeting and odd):
        return ""
    return (f"This rank failed while the ranks met (env://), reading what the launch's rendezvous store holds: "
            f"a TCPStore on 127.0.0.1:{store_port} that every local user can read and write while the run lasts "
            "(TCPStore has no authentication; /proc/net/tcp shows the port). A key another user wrote there fails "
            f"init_process_group this way: {rec.type}: {rec.message[:80]} is then not a lack of memory. On a shared "
            "server let nbddp make the process group: a function fn(ctx) (call='ctx'), whose ranks meet in a "
            "FileStore only you can open, instead of a script or a function calling init_process_group itself.")
