"""Restarts: which failures a run heals by itself, and the record of each restart.

``spawn_train(..., max_restarts=N)`` (or ``TrainConfig.max_restarts``): when a run fails in a
way a restart can heal, the kernel reaps every rank, waits a back-off, and launches the same
run again in the same run folder, from its last checkpoint: the built-in worker resumes its
``last.pt`` exactly (mid-epoch included), a worker of your own finds its state with
``ctx.load_checkpoint()``. The ranks of a restart see ``NBDDP_RESTART_COUNT`` (and, for
torchrun-style code, ``TORCHELASTIC_RESTART_COUNT``) set to its number.

The rule
--------
Retried, up to ``max_restarts`` times:

- a rank killed by a signal nbddp did not send (the kernel's OOM killer's SIGKILL, SIGSEGV,
  SIGBUS, SIGABRT), or one that exited with a non-zero code without a Python exception (a
  crash in native code, ``os._exit``);
- a hang: a rank that stopped making progress for ``stall_timeout_s``, a collective that
  failed or timed out (``timeout_s``), NCCL's watchdog; the launch server's death;
- an exception the rank classed as retryable (:func:`nbddp.rank.rank_errors.is_retryable`):
  :class:`nbddp.Retryable` (or ``retryable = True`` on the exception's class), the errors of
  ``torch.distributed``, errors of the GPU, its driver or NCCL;
- ``torch.OutOfMemoryError`` with ``oom="halve"`` (the built-in worker): the restart splits
  the per-rank batch (halves it; an odd one by its smallest factor) and multiplies
  ``grad_accum_steps`` by as much, so the global batch and the schedule stay the same. These
  restarts do not count against ``max_restarts`` (``oom="halve"`` works with the default 0):
  the batch bounds them, as a batch of 1 has nothing left to split.

Not retried, because they would fail again the same way: any other exception of the worker
(a ``TypeError`` at the first step, a ``KeyError``...), ``ConfigError``/``DataError``/
``WeightsError``, a non-finite loss (``NonFiniteLossError``), ``SystemExit`` (argparse's),
out of memory without ``oom="halve"`` or with a batch of 1. A Stop or an Interrupt is never
retried, at any moment: one that comes during the back-off ends the run.

The back-off is ``restart_backoff_s`` before the first restart, doubled for each next one, at
most :data:`MAX_BACKOFF_S`. Each restart is one line in the cell, an entry of
``TrainResult.restarts`` (or ``WorkerError.restarts`` when the run fails in the end) and of the
run's ``.nbddp/launch.json``.

Kernel side.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..contract.errors import ConfigError, WorkerError
from ..contract.protocol import MAX_RESTARTS_ENV, RESTART_ENV, where_words

#: ``oom=`` values: ``"fail"`` (an out-of-memory error ends the run) or ``"halve"``.
OOM_POLICIES = ("fail", "halve")
#: The longest wait between two restarts.
MAX_BACKOFF_S = 60.0

# Ends of a rank that say nothing about the worker's code: a restart may heal them.
_HEALABLE_KINDS = {
    "signal": "a rank was killed",
    "exit-code": "a rank crashed without a Python exception",
    "hang": "a rank hung",
    "collective": "a collective failed or timed out",
    "watchdog": "NCCL's watchdog aborted a collective",
    "server": "the launch server died",
}


@dataclass
class Restart:
    """One restart of a run.

    Attributes:
        number: 1 for the first restart.
        cause: what ended the launch before it (the failure's headline).
        rank: the rank that caused it.
        epoch, step: where that rank was.
        resumed_from: the checkpoint the restart continues from (``"checkpoints/last.pt"``),
            or ``None`` when there was none (the restart starts from the beginning).
        backoff_s: how long the kernel waited before relaunching.
        time: when the failure was seen.
        changes: settings the restart changed, ``{"batch_size": [16, 8], ...}`` (out of memory).
    """

    number: int
    cause: str
    rank: Optional[int]
    epoch: Optional[int] = None
    step: Optional[int] = None
    resumed_from: Optional[str] = None
    backoff_s: float = 0.0
    time: float = field(default_factory=time.time)
    changes: Dict[str, list] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self, max_restarts: int) -> str:
        """The cell's one line: cause, rank, where the restart resumes from."""
        where = where_words(self.epoch, self.step)
        where = f" at {where}" if where else ""
        changed = "".join(f"; {k} {v[0]} -> {v[1]}" for k, v in self.changes.items())
        start = f"from {self.resumed_from}" if self.resumed_from else "from the start (no checkpoint yet)"
        # Out-of-memory restarts (oom="halve") are bounded by the batch, not by max_restarts.
        count = f"restart {self.number} (out of memory, oom='halve')" if self.changes else \
            f"restart {self.number}/{max_restarts}"
        return (f"nbddp: {count}: {self.cause}{where}; relaunching in {self.backoff_s:g} s {start}{changed}")


def check_policy(max_restarts: Any, oom: Any, backoff_s: Any) -> None:
    """Refuse restart settings that would mean something else than they say (before any process starts)."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"max_restarts={max_restarts!r}: must be an integer >= 0 (0: a failure ends the run)")
    if oom not in OOM_POLICIES:
        raise ConfigError(f"oom={oom!r}: use 'fail' (out of memory ends the run) or 'halve' (restart with half the "
                          "per-rank batch and twice the gradient accumulation)")
    if isinstance(backoff_s, bool) or not isinstance(backoff_s, (int, float)) or not 0 <= backoff_s <= MAX_BACKOFF_S:
        raise ConfigError(f"restart_backoff_s={backoff_s!r}: seconds before the first restart, from 0 to "
                          f"{MAX_BACKOFF_S:g}")


def backoff(number: int, base_s: float) -> float:
    """Seconds to wait before restart ``number`` (1-based): ``base_s``, doubled each time, capped."""
    return min(MAX_BACKOFF_S, base_s * 2 ** (number - 1))


def split_batch(batch_size: int) -> Optional[int]:
    """The factor an out-of-memory restart divides ``batch_size`` by: 2, or an odd batch's smallest
    factor (so the global batch stays whole); ``None`` for a batch of 1."""
    for f in range(2, batch_size + 1):
        if batch_size % f == 0:
            return f
    return None


def decide(error: WorkerError, oom: Optional[str], batch_size: Optional[int]) -> Tuple[bool, str]:
    """``(retry, why)`` for a run that ended with ``error`` (see the module's rule).

    Args:
        oom: the run's ``oom`` policy.
        batch_size: the built-in worker's per-rank batch (``None`` for a worker of your own, whose
            batch nbddp cannot change).
    """
    kind = error.kind
    if kind in _HEALABLE_KINDS:
        return True, _HEALABLE_KINDS[kind]
    if error.exc_type == "OutOfMemoryError":
        if oom != "halve":
            return False, "out of memory fails again with the same batch (oom='halve' restarts with a smaller one)"
        if batch_size is None:
            return False, "out of memory in a worker of your own: nbddp cannot change its batch"
        if split_batch(batch_size) is None:
            return False, "out of memory with a batch of 1 per rank: nothing left to split"
        return True, "out of memory"
    if kind == "exit":
        return False, "SystemExit comes from the worker's own code and would end it again"
    if error.retryable:
        return True, f"{error.exc_type} is retryable"
    return False, (f"{error.exc_type or 'the error'} comes from the worker's code and would fail again the same "
                   "way (raise nbddp.Retryable for a failure a restart can heal)")


__all__ = ["Restart", "OOM_POLICIES", "MAX_BACKOFF_S", "RESTART_ENV", "MAX_RESTARTS_ENV", "check_policy", "backoff", "split_batch",
           "decide"]


@dataclass
class RestartPolicy:
    """A run's restart settings and the launcher that starts each restart (``spawn_train``'s).

    Attributes:
        launcher: has ``relaunch(number, changes) -> (processes, spec, meeting point, temp
            folder)`` and ``config`` (the built-in worker's config, else ``None``).
    """

    max_restarts: int = 0
    oom: str = "fail"
    backoff_s: float = 1.0
    launcher: Any = None

    def next_restart(self, error: WorkerError, done: list, resumes_from: Optional[str]) -> Tuple[Optional[Restart], str]:
        """The restart to make after ``error`` (``done``: the restarts made so far), or ``(None, why not)``."""
        if self.launcher is None:
            return None, ""
        halving = self.oom == "halve" and error.exc_type == "OutOfMemoryError"
        if self.max_restarts <= 0 and not halving:
            return None, ""
        config = getattr(self.launcher, "config", None)
        batch = getattr(config, "batch_size", None)
        retry, why = decide(error, self.oom, batch)
        if not retry:
            return None, f"not restarted: {why}"
        # The batch bounds the halvings (a batch of 1 has nothing left to split), max_restarts the rest.
        if not halving and sum(1 for r in done if not r.changes) >= self.max_restarts:
            return None, f"not restarted: the run made all of its max_restarts={self.max_restarts} restarts"
        changes: Dict[str, list] = {}
        if halving:
            f = split_batch(batch)
            accum = config.grad_accum_steps
            changes = {"batch_size": [batch, batch // f], "grad_accum_steps": [accum, accum * f]}
        number = len(done) + 1
        cause = str(error).splitlines()[0].removeprefix("Training failed: ")
        return Restart(number, cause, error.rank, error.epoch, error.step, resumes_from,
                       backoff(number, self.backoff_s), changes=changes), why


__all__ += ["RestartPolicy"]
