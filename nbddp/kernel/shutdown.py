"""The staged end of a run's processes: ask, then SIGINT (a Stop or an Interrupt), then SIGTERM, then SIGKILL.

A :class:`Shutdown` knows only time and its own stage; what it asks of the processes goes
through the two functions it is given (send a signal to every live rank; say whether the ranks
are still finishing), so it can be driven by a fake clock in a test. :class:`nbddp.kernel.handle.RunHandle`
starts one on a Stop, an Interrupt or a failure and calls :meth:`Shutdown.advance` on every poll;
the run ends when every process has exited, whatever the stage.

Kernel side.
"""

from __future__ import annotations

import enum
import signal
from typing import Callable, Dict, Iterable

from ..contract.protocol import Heartbeat

# After a stop request (Stop or Interrupt), the longest a worker that saw it and still sends
# heartbeats may take to finish (its last step, checkpoint, evaluation and export) before it is
# ended with SIGTERM.
STOP_TIMEOUT_S = 300.0

# A rank beats every second, even inside a collective: one silent this long past grace_s is stuck.
_BEAT_SLACK_S = 2.0


class Stage(enum.Enum):
    ASK = "ask"    # the stop request is written; the ranks may finish on their own
    INT = "int"    # SIGINT sent (a KeyboardInterrupt in each rank); SIGTERM follows grace_s later
    TERM = "term"  # SIGTERM sent; SIGKILL follows grace_s later
    KILL = "kill"  # SIGKILL sent; nothing is left to do but reap


class Shutdown:
    """One run's staged shutdown, started for ``reason`` at ``now``.

    Transitions (``since``: when the current stage began):

    * start: ``failure`` goes straight to TERM (the peers of a failed rank are most likely
      blocked in a collective: no point asking nicely), unless a rank is writing a checkpoint
      in the background: then ASK until the write ends (or ``stop_timeout_s``), so the failure
      of one rank does not cost the checkpoint another is writing; ``stop`` and ``interrupt`` to ASK.
    * ASK → INT: for ``stop`` and ``interrupt``, once ``stop_timeout_s`` has passed or the
      ranks are no longer finishing (see :func:`ranks_finishing`): each rank gets SIGINT, a
      ``KeyboardInterrupt`` between two statements whatever its code, so its ``finally:`` blocks
      and context managers run, as Ctrl-C would in a terminal.
    * ASK → TERM: for any other reason after ``grace_s``.
    * INT → TERM: ``grace_s`` after the SIGINT (code that caught it, or waits in a collective), or,
      while a rank writes a checkpoint (its ``KeyboardInterrupt`` waits for the write to be
      whole), once the write ends, up to ``stop_timeout_s`` after the request. A stop keeps the result: the workers may be finishing the epoch's evaluation,
      the export or NCCL's teardown, which can take far longer than ``grace_s`` on a GPU. An
      interrupt keeps the work: the step in flight and its checkpoint can take longer too.
    * TERM → KILL: ``grace_s`` after the SIGTERM.
    * any → KILL at once: :meth:`kill_now` (a second Interrupt).

    Args:
        reason: ``"stop"``, ``"interrupt"``, ``"failure"`` or ``"pruned"`` (a sweep's pruner: as a stop).
        now: the time it starts.
        grace_s: how long SIGTERM is given before SIGKILL (and a non-stop request before SIGTERM).
        stop_timeout_s: the longest finishing ranks are waited for after a stop or interrupt.
        kill: sends a signal to every rank still running.
        finishing: ``finishing(now, since)``: True while the ranks may still be finishing.
        writing: ``writing(now)``: True while a live rank writes a checkpoint (its heartbeat fresh).
    """

    def __init__(self, reason: str, now: float, grace_s: float, stop_timeout_s: float,
                 kill: Callable[[int], None], finishing: Callable[[float, float], bool],
                 writing: Callable[[float], bool] = lambda now: False):
        self.reason, self.grace_s, self.stop_timeout_s = reason, grace_s, stop_timeout_s
        self._kill, self._finishing, self._writing = kill, finishing, writing
        self.stage, self.since, self.asked = Stage.ASK, now, now
        if reason == "failure" and not writing(now):
            self._enter(Stage.TERM, now)

    @property
    def waits_for_finish(self) -> bool:
        """A stop or an interrupt lets ranks that obey the request finish their work."""
        return self.reason in ("stop", "interrupt", "pruned")

    def advance(self, now: float) -> Stage:
        """Move on if this stage's time is up; returns the stage it is in afterwards."""
        if self.stage is Stage.ASK:
            if self.reason == "failure":
                if now - self.since < self.stop_timeout_s and self._writing(now):
                    return self.stage
            elif self.waits_for_finish:
                if now - self.since < self.stop_timeout_s and self._finishing(now, self.since):
                    return self.stage
            elif now - self.since < self.grace_s:
                return self.stage
            self._enter(Stage.INT if self.waits_for_finish else Stage.TERM, now)
            return self.stage
        elif self.stage is Stage.INT and now - self.since >= self.grace_s:
            if now - self.asked < self.stop_timeout_s and self._writing(now):
                return self.stage  # a checkpoint being written: its rank's KeyboardInterrupt follows it
            self._enter(Stage.TERM, now)
        elif self.stage is Stage.TERM and now - self.since >= self.grace_s:
            self._enter(Stage.KILL, now)
        return self.stage

    def end_starting(self, now: float) -> None:
        """No rank has reached the code yet (they import, or meet the others): there is nothing of the
        user's to finish, save or clean up, and a rank waiting in the rendezvous (C++) would ignore a
        ``KeyboardInterrupt`` for ``grace_s``. SIGTERM now, SIGKILL ``grace_s`` later."""
        if self.stage is Stage.ASK:
            self._enter(Stage.TERM, now)

    def kill_now(self, now: float) -> None:
        """No more grace (a second Interrupt): SIGKILL every rank now."""
        self._enter(Stage.KILL, now)

    def _enter(self, stage: Stage, now: float) -> None:
        self.stage, self.since = stage, now
        self._kill({Stage.INT: signal.SIGINT, Stage.TERM: signal.SIGTERM}.get(stage, signal.SIGKILL))


def ranks_finishing(now: float, since: float, grace_s: float, beats: Dict[int, Heartbeat],
                    running: Iterable[int]) -> bool:
    """True while the ranks may still be finishing after a stop request made at ``since``.

    That is: within ``grace_s`` of the request, or once a rank has seen the request
    (``ctx.should_stop()``; the built-in worker checks it every step), as long as every running
    rank's heartbeat is younger than ``grace_s + 2`` s (it beats every second, even inside a
    collective). A worker that never asks whether to stop gets ``grace_s``.

    Args:
        beats: this launch's heartbeats, by rank.
        running: the ranks whose process is still running.
    """
    for rank in running:
        beat = beats.get(rank)
        last = max((beat.beat_time or 0.0) if beat else 0.0, since)  # not started: from the request
        if now - last > grace_s + _BEAT_SLACK_S:
            return False  # stuck (or stopped) with its heartbeat
    return now - since < grace_s or any(b.stopping for b in beats.values())
