"""What the ranks' heartbeats say about a run that stopped moving.

Two rules read the heartbeats of one launch (every rank running, none with an error):

- **a lagging rank is hung** (:func:`find_lagging_rank`): the ranks ahead of it wait for it in a
  collective, so once its progress is ``stall_timeout_s`` old the run is stopped, naming it;
- **a quiet run is explained** (:class:`QuietWatch`): every rank stopped at the same point, so
  none lags and no collective times out (a data loader whose workers hang on a dead network
  file system, a lock every rank waits on). Nothing would ever end or explain such a run. Once no
  rank has made progress for ``stall_timeout_s``, and for three times the longest gap the run
  has shown so far, the kernel takes every rank's stack and says once where they are. It does
  not end the run: code that reports progress once per long evaluation or epoch can look the
  same, and its user is the one who knows (Stop ends it).

Kernel side.
"""

from __future__ import annotations

from typing import Dict, Optional

from ..contract.protocol import Heartbeat, read_error_records
from .stacks import building_words, collect as collect_stacks

#: How many times the longest gap between two reports of progress a quiet spell must last to be told.
QUIET_FACTOR = 3.0


def find_lagging_rank(beats: Dict[int, Heartbeat], now: float, stall_timeout_s: float) -> Optional[int]:
    """A rank behind the others whose progress stopped ``stall_timeout_s`` ago (a hang).

    Only a rank that lags can be hung: the ones ahead of it are waiting for it in a
    collective. Ranks all at the same point (a long evaluation, a checkpoint) never trip it.
    """
    lead = max(b.position for b in beats.values())
    for rank, b in sorted(beats.items()):
        progressed = b.progress_time if b.progress_time is not None else now
        if b.position < lead and now - progressed > stall_timeout_s:
            return rank
    return None


class QuietWatch:
    """Notices, once per quiet spell, that no rank of a launch has made progress for long.

    Example:
        >>> watch = QuietWatch(stall_timeout_s=120, launched_at=t0)
        >>> watch.quiet_for(beats, now)      # None, or the seconds since the last progress (once)
    """

    def __init__(self, stall_timeout_s: float, launched_at: float):
        self.stall_timeout_s = stall_timeout_s
        self._since = launched_at  # the newest progress seen (the launch, before any)
        self._longest = 0.0  # the longest gap between two reports seen in this launch
        self._told = False

    def quiet_for(self, beats: Dict[int, Heartbeat], now: float) -> Optional[float]:
        """How long no rank has made progress, the first time that is long enough to tell; else None.

        Only ranks that report progress can be judged: None until every rank has reported once."""
        if not beats or any(b.progress_time is None for b in beats.values()):
            return None
        newest = max(b.progress_time for b in beats.values())
        if newest > self._since:  # progress: a new spell, and the run's rhythm learned
            self._longest = max(self._longest, newest - self._since)
            self._since, self._told = newest, False
        quiet = now - self._since
        if self._told or quiet < max(self.stall_timeout_s, QUIET_FACTOR * self._longest):
            return None
        self._told = True
        return quiet

    def pause(self, now: float) -> None:
        """Time until ``now`` is no quiet spell (a rank sat at a debugger's prompt): a new spell starts."""
        self._since, self._told = max(self._since, now), False

    @property
    def longest_gap_s(self) -> float:
        """The longest time between two reports of progress seen so far (the launch to the first, included)."""
        return self._longest


def where_all_are(beats: Dict[int, Heartbeat]) -> str:
    """``" (all at epoch 0, step 5)"`` when every rank reported the same place, else ``""``."""
    places = {(b.epoch, b.phase, b.step) for b in beats.values()}
    if len(places) != 1:
        return ""
    epoch, phase, step = places.pop()
    parts = [f"epoch {epoch}" if epoch is not None else "", f"step {step}" if step is not None else "",
             phase if phase not in (None, "train") else ""]
    text = ", ".join(p for p in parts if p)
    return f" (all at {text})" if text else ""


def check_progress(handle, now: float) -> None:
    """Stop a run with a hung rank (one that lags); explain, once, a run in which no rank moves.

    Args:
        handle: the run's :class:`~nbddp.kernel.handle.RunHandle`, from its watch (its ``poll``).
        now: the time of this look.
    """
    if read_error_records(handle.run_dir, handle.world_size):
        return  # a failure is on its way: the error tells it
    beats = handle._ranks.beats()
    if any(b.state == "debugging" for b in beats.values()):
        handle._quiet.pause(now)  # the time at a prompt is no quiet spell
        return
    if len(beats) < handle.world_size or any(b.state != "running" for b in beats.values()):
        return
    if find_lagging_rank(beats, now, handle.stall_timeout_s) is not None:
        handle._stacks_before_stopping()
        handle._begin_shutdown("failure")
        return
    quiet = handle._quiet.quiet_for(beats, now)
    if quiet is not None:
        _tell_quiet(handle, beats, quiet)


def _tell_quiet(handle, beats: Dict[int, Heartbeat], quiet: float) -> None:
    """No rank has made progress, and none lags: say where every rank is; the run goes on. A rank that
    waits for a C++ extension's build is said to build it (a first build takes minutes; the next
    launch loads it from the cache)."""
    pids = handle._ranks.answering()
    stacks = collect_stacks(handle.run_dir, pids, timeout=2.0) if pids else None
    where = stacks.summary() if stacks else ""
    building = building_words(stacks, pids) if stacks else ""
    if building:
        handle._notice(f"nbddp: no rank has made progress for {quiet:.0f} s: {building}. A first build takes "
                       "minutes; later launches load it from there. The run goes on; Stop (or handle.stop()) ends it.")
        return
    handle._notice(f"nbddp: no rank has made progress for {quiet:.0f} s{where_all_are(beats)}, and none is behind "
                   f"the others: {where or 'their stacks did not come (handle.stacks() asks again)'}. The run goes "
                   "on; Stop (or handle.stop()) ends it.")
