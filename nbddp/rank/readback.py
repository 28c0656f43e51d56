"""A step's device values read on the host one step later, so that the host never waits for the device.

On a GPU the host queues a step's kernels and runs ahead of the device. Reading a value on the
host (``.item()``, ``.tolist()``, ``bool()``, ``.cpu()``) waits until the device has computed it:
read in the step that produced it, the host cannot queue the next step until the device has
finished this one, and the device then idles while it does. So the training loop starts a copy of
each step's values (its loss) to pinned host memory as soon as the forward has queued them, with
a CUDA event behind the copy (:class:`Copies`), and reads it at the next step (:func:`read`), when
the device is long past that forward. Only the end of an epoch, a checkpoint, a stop or a read
error read the step just done: they wait for the device anyway.

:func:`read` is the one place the training loop reads a value the device computed: it is told
which step reads and why, and it knows which step produced the value. :func:`recording` lists
those reads (the tests check that no steady step reads its own).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch


@dataclass
class Late:
    """Values of step ``step`` on their way to the host: ``values`` is readable once ``event`` has passed."""

    step: int
    values: torch.Tensor          # on the host: pinned memory the copy lands in, or the CPU tensor itself
    event: Optional[Any] = None   # a ``torch.cuda.Event`` recorded after the copy; None: nothing to wait for


@dataclass
class Read:
    """A read :func:`recording` saw: produced by step ``produced``, read at step ``step``, for ``why``."""

    produced: int
    step: int
    why: str
    values: List[float]


class Copies:
    """Copies of a small per-step device tensor into host memory, two pinned buffers in turn.

    Step n's copy is read at step n+1, before step n+2 writes into the same buffer again, so two
    are enough and no step allocates. A CPU tensor needs no copy: it is kept as it is.
    """

    def __init__(self):
        self._slots: List[Optional[tuple]] = [None, None]
        self._turn = 0

    def start(self, step: int, values: torch.Tensor) -> Late:
        """The copy of step ``step``'s ``values``, queued behind the work that computes them."""
        values = values.detach().reshape(-1)  # read as a list, whatever its shape
        if values.device.type != "cuda":
            # The CPU computed it already. Another accelerator's tensor is read as it is, a step
            # later: a wait then, but not for the step still running.
            return Late(step, values)
        slot = self._slots[self._turn]
        if slot is None or slot[0].shape != values.shape or slot[0].dtype != values.dtype:
            slot = (torch.empty(values.shape, dtype=values.dtype, pin_memory=True), torch.cuda.Event())
            self._slots[self._turn] = slot
        self._turn ^= 1
        host, event = slot
        host.copy_(values, non_blocking=True)
        event.record()  # on the current stream, behind the copy
        return Late(step, host, event)


_recording: Optional[List[Read]] = None


def read(late: Late, step: int, why: str) -> List[float]:
    """The values of ``late`` as floats, read at step ``step`` (``why``: ``"next step"``, ``"epoch end"``, ...).

    Waits for the copy's event only: by the next step the device has finished the forward that
    computed them, so the wait is for nothing the host still has to queue.

    Raises:
        ValueError: ``step`` is before the step that produced the values (a bookkeeping error).
    """
    if step < late.step:
        raise ValueError(f"values of step {late.step} read at step {step}: "
                         "a step's values exist only from that step on")
    if late.event is not None:
        late.event.synchronize()
    values = late.values.tolist()
    if _recording is not None:
        _recording.append(Read(late.step, step, why, values))
    return values


@contextlib.contextmanager
def recording() -> Iterator[List[Read]]:
    """Every :func:`read` while inside, in order, as :class:`Read` records (for tests)."""
    global _recording
    saved, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = saved


__all__ = ["Copies", "Late", "Read", "read", "recording"]
