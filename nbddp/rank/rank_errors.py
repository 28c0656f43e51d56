"""Cause or consequence: which of a rank's errors come from another rank's failure.

When one rank fails, its peers fail too, with communication errors (the peer vanished, a wait
timed out). A rank marks such an error *secondary* in its error record, so the kernel looks
past it for the root cause (:mod:`nbddp.kernel.report`).

Worker side.
"""

from __future__ import annotations

import torch.distributed as dist

# Substrings of errors a rank gets because *another* rank failed (its peer vanished or never
# arrived). Such errors are consequences; the launcher looks past them for the root cause.
_SECONDARY_MARKERS = (  # compared in lower case
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "pair closure",
    "econnrefused",
    "nccl communicator was aborted",
    "process group has been destroyed",
    "ncclremoteerror",
    "remote process exiting",
)
# Errors of this rank's own set-up or hardware: causes, even when they come as a DistError
# (NCCL reports a broken /dev/shm, P2P or CUDA set-up as DistBackendError).
_PRIMARY_MARKERS = (
    "ncclunhandledcudaerror",
    "ncclinternalerror",
    "ncclinvalidusage",
    "ncclinvalidargument",
    "/dev/shm",
    "cuda error",
    "cuda failure",
    "out of memory",
    "no nvidia driver",
    "invalid device ordinal",
    "no cuda gpus are available",
    "busy or unavailable",
    "not compiled with cuda",
)


# Failures of the machine, the driver or the network, not of the code: a restart may heal them.
_RETRYABLE_MARKERS = (  # compared in lower case
    "cuda error", "cuda failure", "nccl", "ecc error", "uncorrectable", "xid", "launch failure",
    "driver shutting down", "connection reset", "connection refused", "broken pipe",
)
# ... except where the code is at fault: an index out of range on the GPU fails again the same way.
_CODE_MARKERS = ("device-side assert",)


def is_retryable(exc: BaseException) -> bool:
    """True when a restart may heal ``exc`` (the rule is :mod:`nbddp.kernel.restarts`'s).

    The worker said so (``nbddp.Retryable``, or ``retryable = True`` on its class); a
    communication error of ``torch.distributed`` (a peer vanished, a collective timed out); an
    error of the GPU, its driver or NCCL. ``torch.OutOfMemoryError`` is retried only with
    ``oom="halve"``, which the kernel decides from the exception's type.
    """
    if getattr(exc, "retryable", False) is True:
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return (isinstance(exc, RuntimeError) and type(exc).__name__ != "OutOfMemoryError"
            and any(m in text for m in _RETRYABLE_MARKERS) and not any(m in text for m in _CODE_MARKERS))


def is_secondary(exc: BaseException, during_init: bool = False) -> bool:
    """True for an error this rank got because another rank failed (a consequence, not a cause).

    Communication errors that say a peer vanished or never came are consequences; so is any
    other ``DistError`` once training runs. At set-up, a ``DistBackendError`` is NCCL (or gloo)
    failing on this rank's own system — shared memory, P2P, the network interface — and a
    cause, unless it says it timed out waiting for the others.
    """
    text = f"{type(exc).__name__}: {exc}".lower()
    if any(m in text for m in _PRIMARY_MARKERS):
        return False
    if any(m in text for m in _SECONDARY_MARKERS):
        return True
    if during_init and isinstance(exc, getattr(dist, "DistBackendError", ())):
        return False
    return isinstance(exc, getattr(dist, "DistError", ()))
