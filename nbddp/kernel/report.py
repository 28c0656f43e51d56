"""Turn what the ranks left behind into one error that names the root cause.

When one rank fails, the others usually fail *because of it* (their peer vanished, or they
timed out waiting). Naming the first rank whose process ended, or the first error record, is
often wrong. The rules, in order:

1. an error that knows its cause (``exc.rank``, e.g. a NaN seen on another rank);
2. a primary exception (not a communication error), earliest first;
3. a rank that died on its own (signal or exit code) without an error record; then a rank whose
   process ended with exit code 0 before its function returned (``os._exit(0)`` in a worker):
   its peers lost it in a collective;
4. a rank that stopped making progress, for hangs: among the ranks without an error of their
   own (a rank whose collective failed or timed out was waiting for another), the one whose
   stack is not in a collective, then the stalest heartbeat;
5. the earliest communication error.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ..contract.errors import WorkerError
from ..contract import rundir
from ..contract.protocol import ErrorRecord, Heartbeat, read_error_records, read_heartbeats
from .rank_text import (foreign_key_note, output_before_failure, reported_progress, shown_frames, tail,
                        where_known)
from .stacks import Stacks, from_traceback, last_collectives


@dataclass
class RankEnd:
    """How one rank's process ended, as the launcher saw it."""

    rank: int
    pid: int
    exitcode: Optional[int]
    seen_at: float
    by_launcher: bool  # ended during nbddp's own shutdown (so not a root cause by itself)


def signal_name(exitcode: Optional[int]) -> Optional[str]:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


# NCCL's watchdog ends a rank that waited in a collective past the timeout with SIGABRT, after
# logging this: the rank was waiting for another one, so its death is a consequence.
_WATCHDOG_MARKERS = ("watchdog caught collective operation timeout", "watchdog thread terminated")


def aborted_by_watchdog(end: Optional[RankEnd], log_path: Path, start: int = 0) -> bool:
    """True if the rank died of SIGABRT after NCCL's watchdog timed out its wait."""
    if end is None or end.exitcode != -signal.SIGABRT:
        return False
    text = tail(log_path, 200, start).lower()
    return any(m in text for m in _WATCHDOG_MARKERS)


def left_unfinished(end: Optional[RankEnd], rec: Optional[ErrorRecord], beat: Optional[Heartbeat]) -> bool:
    """True if the rank's process ended on its own with exit code 0 before its function returned.

    A rank that returns says so in its last heartbeat (``finishing``, then ``done``) before it
    exits; one that calls ``os._exit(0)`` mid-run leaves its peers waiting for it, and exits "fine".
    """
    return (end is not None and end.exitcode == 0 and not end.by_launcher and rec is None
            and (beat is None or beat.state not in ("finishing", "done")))


def find_root_cause(ends: Dict[int, RankEnd], records: Dict[int, ErrorRecord], beats: Dict[int, Heartbeat],
                    consequences: frozenset = frozenset(), stacks: Optional[Dict] = None) -> int:
    """Pick the rank that caused a failure (see the module docstring for the rules).

    ``consequences``: ranks whose death is known to be secondary (NCCL's watchdog abort).
    ``stacks``: where the ranks were (:class:`nbddp.kernel.stacks.RankStack` by rank), to tell a rank
    waiting in a collective from the one it waits for.
    """
    for rec in sorted(records.values(), key=lambda r: r.time):
        if rec.root_rank is not None and not rec.secondary:
            return int(rec.root_rank)
    primary = [r for r in records.values() if not r.secondary]
    if primary:
        if len(primary) > 1 and len({(r.type, r.message) for r in primary}) == 1:
            # Every rank failed the same way (the same code ran on each: argparse's exit, a bad
            # path): the lowest rank, not whichever happened to write first.
            return min(r.rank for r in primary)
        return min(primary, key=lambda r: r.time).rank
    died = [e for e in ends.values() if not e.by_launcher and e.exitcode not in (0, None)
            and e.rank not in records and e.rank not in consequences]
    if died:
        return min(died, key=lambda e: e.seen_at).rank
    left = [e for e in ends.values() if left_unfinished(e, records.get(e.rank), beats.get(e.rank))]
    if left:
        return min(left, key=lambda e: e.seen_at).rank
    if beats:
        def staleness(b: Heartbeat):
            # A rank waiting in a collective is behind the one it waits for; then least progress
            # (epoch, phase, step), then the oldest progress time.
            waiting = bool(stacks and b.rank in stacks and stacks[b.rank].waiting_in)
            return (waiting, *b.position, b.progress_time if b.progress_time is not None else 0.0)
        # A rank that returned (exit code 0) is not stuck, however old its last progress.
        stuck = [b for r, b in beats.items() if (r not in records or records[r].secondary)
                 and not (r in ends and ends[r].exitcode == 0)]
        # A rank whose collective failed or timed out was waiting for one that has no error.
        waited_for = [b for b in stuck if b.rank not in records]
        if stuck and len(records) < len(beats):
            return min(waited_for or stuck, key=staleness).rank
    if records:
        return min(records.values(), key=lambda r: r.time).rank
    return min(ends) if ends else 0


def how_ranks_stopped(ends: Dict[int, RankEnd], records: Dict[int, ErrorRecord],
                      request: str = "the stop request") -> str:
    """How each rank of a stopped run ended, ranks that ended alike together:
    ``"ranks 0-1: KeyboardInterrupt at the stop request; rank 2: SIGTERM"``. ``request`` names
    what asked them to stop (``"the interrupt"`` for Jupyter's Interrupt or Ctrl-C)."""
    kinds: Dict[str, list] = {}
    for r in sorted(ends):
        rec, code = records.get(r), ends[r].exitcode
        if rec is not None and rec.type == "KeyboardInterrupt":
            kind = f"KeyboardInterrupt at {request}"
        elif code == 0:
            kind = f"finished after {request}"
        elif signal_name(code):
            kind = f"ended by {signal_name(code)}"
        else:
            kind = f"{rec.type} after {request}" if rec else f"exit code {code}"
        kinds.setdefault(kind, []).append(r)
    return ranks_alike(kinds, "; ")


def ranks_alike(by_what: Dict[str, list], sep: str) -> str:
    """``"ranks 0-1: <what>; rank 2: <other>"``: each entry's ranks (sorted) as one label."""
    parts = []
    for what, ranks in by_what.items():
        label = f"rank {ranks[0]}" if len(ranks) == 1 else (
            f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1))
            else "ranks " + ", ".join(map(str, ranks)))
        parts.append(f"{label}: {what}")
    return sep.join(parts)


def _ended(rank: int, end: Optional[RankEnd], rec: Optional[ErrorRecord], beat: Optional[Heartbeat] = None) -> str:
    """How a rank's process ended, in a few words, for the ranks' table."""
    if rec is not None:
        process = _process(rec)
        return rec.type + (" (after a peer)" if rec.secondary else f" in {process[0].split(' of ')[0]}" if process else "")
    if end is None or end.exitcode is None:
        return "running"
    if left_unfinished(end, rec, beat):
        return "exit code 0 before returning"
    if end.by_launcher:
        return "stopped by nbddp"
    return signal_name(end.exitcode) or f"exit code {end.exitcode}"


def _heartbeat_words(beat: Optional[Heartbeat], now: float) -> str:
    """``"train, epoch 0, step 5, heartbeat 1 s ago, progress 56 s ago"``, or ``"none"``: when the rank
    was last known alive and when it last moved are two things (a rank waiting for a hung one beats on)."""
    if beat is None:
        return "none"
    at = [beat.phase or "train"] + [f"{k} {v}" for k, v in (("epoch", beat.epoch), ("step", beat.step)) if v is not None]
    if beat.waiting:
        at.append("in a collective")
    at += [f"{what} {max(0.0, now - when):.0f} s ago"
           for what, when in (("heartbeat", beat.beat_time), ("progress", beat.progress_time)) if when]
    return ", ".join(at)


def ranks_table(run_dir: Path, ends: Dict[int, RankEnd], records: Dict[int, ErrorRecord],
                beats: Dict[int, Heartbeat], world_size: int, stacks=None, lines: int = 20,
                skip_tail: frozenset = frozenset(), log_starts: Optional[Dict[int, int]] = None) -> str:
    """Every rank in one compact table (how it ended, its last heartbeat, where its stack was),
    then the last ``lines`` lines of each rank's log (those in ``skip_tail`` are shown already)."""
    now = time.time()
    rows = [("rank", "ended", "last heartbeat", "where")]
    for r in range(world_size):
        where = stacks[r].where_words().removeprefix("is in ") if stacks and r in stacks else ""
        rows.append((str(r), _ended(r, ends.get(r), records.get(r), beats.get(r)), _heartbeat_words(beats.get(r), now), where))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    table = ["  " + "  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + ("  " + row[3] if row[3] else "")
             for row in rows]
    parts = ["--- every rank ---", *[t.rstrip() for t in table]]
    for r in range(world_size):
        if r in skip_tail:
            continue
        text = tail(rundir.rank_log(run_dir, r), lines, (log_starts or {}).get(r, 0))
        if text.strip():
            parts.append(f"--- rank {r}: last {lines} lines of rank{r}.log ---\n{text}")
    return "\n".join(parts)


def _process(rec: Optional[ErrorRecord]) -> Optional[tuple]:
    """``(name, log file name, pid)`` of the failed process a launcher script's record stands for
    (:mod:`nbddp.rank.spawned`), or None. The log is a file name in the run's logs, nothing else."""
    found = rec.process if rec is not None else None
    if not isinstance(found, dict) or not isinstance(found.get("name"), str) or not isinstance(found.get("log"), str):
        return None
    pid = found.get("pid")
    return found["name"], Path(found["log"]).name, pid if isinstance(pid, int) else None


def _same_error(a: Optional[ErrorRecord], b: Optional[ErrorRecord]) -> bool:
    """Two ranks raised the same error (the same code ran on each)."""
    return a is not None and b is not None and (a.type, a.message) == (b.type, b.message)


def _headline(root: int, rec, end: Optional[RankEnd], beat, records, watchdog: frozenset,
              server_died: Optional[str], log_path: Path, log_start: int):
    """The error's kind and its first line: what happened to the root-cause rank."""
    sig = signal_name(end.exitcode) if end else None
    if rec and not rec.secondary and rec.type == "SystemExit":
        # sys.exit(2) from argparse says why only on stderr: its last lines are the headline.
        said = "\n".join("    " + line for line in tail(log_path, 6, log_start).splitlines() if line.strip())
        kind = "exit"
        headline = f"rank {root} exited with SystemExit({rec.message or 'None'})" + (
            f"; its last output:\n{said}" if said else "")
    elif rec and not rec.secondary and _process(rec):  # a process a launcher script started itself
        kind = "exception"
        name = _process(rec)[0]
        headline = f"{name} raised {rec.type}: {rec.message}" if rec.traceback else f"{name} {rec.message}"
    elif rec and not rec.secondary:
        kind = "exception"
        headline = f"rank {root} raised {rec.type}: {rec.message}"
        if rec.root_rank is not None and rec.rank != root:
            headline = f"rank {root}: {rec.type}: {rec.message}"
    elif server_died:
        kind = "server"
        headline = (f"the launch server died ({server_died}) and its ranks ended with it; the next launch "
                    "starts a new one")
    elif root in watchdog:
        kind = "watchdog"
        headline = (f"rank {root} timed out waiting in a collective and NCCL's watchdog aborted it; "
                    "no rank was found behind it")
    elif rec:
        kind = "collective"
        headline = f"rank {root} failed in a collective: {rec.type}: {rec.message}"
    elif left_unfinished(end, rec, beat):
        kind = "left"
        headline = (f"rank {root} left without finishing: its process ended with exit code 0 before its function "
                    "returned (os._exit(0), or code that ends the process, in the worker), and the other ranks "
                    "lost it in a collective. Let every rank return from the function.")
    elif end and not end.by_launcher and sig:
        hint = " — possibly out of memory (check `dmesg`, lower batch_size)" if sig == "SIGKILL" else ""
        kind = "signal"
        headline = f"rank {root} was killed by {sig}{hint}"
    elif end and not end.by_launcher and end.exitcode not in (0, None):
        kind = "exit-code"
        headline = (f"rank {root} exited with code {end.exitcode} without a Python exception "
                    "(sys.exit/os._exit in the worker, or a crash in native code)")
    else:
        last = beat.progress_time if beat and beat.progress_time is not None else time.time()
        age = time.time() - last
        kind = "hang"
        headline = f"rank {root} stopped making progress (last progress {age:.0f} s ago)"
        gave_up = [r for r in sorted(records) if records[r].secondary and r != root]
        if gave_up:
            who = f"rank {gave_up[0]}" if len(gave_up) == 1 else "ranks " + ", ".join(map(str, gave_up))
            headline += (f"; {who} gave up waiting for it: {records[gave_up[0]].type}: "
                         f"{records[gave_up[0]].first_line[:160]}")
    return kind, headline


def _other_ranks(root: int, ends: Dict[int, RankEnd], records, beats, watchdog: frozenset,
                 world_size: int) -> List[str]:
    """One phrase per other rank: what it raised, or how it ended; the ranks that raised the root's
    error as one phrase (it is said once, in the headline)."""
    others, alike = [], [r for r in sorted(records) if r != root and _same_error(records[r], records.get(root))]
    if alike:
        others.append(ranks_alike({f"the same {records[root].type}": alike}, ""))
    for r in sorted(set(range(world_size)) - {root} - set(alike)):
        o_rec, o_end = records.get(r), ends.get(r)
        if o_rec:
            others.append(f"rank {r}: {o_rec.type}: {o_rec.first_line[:160]}")
        elif r in watchdog:
            others.append(f"rank {r}: aborted by NCCL's watchdog while waiting for rank {root}")
        elif o_end and o_end.by_launcher:
            others.append(f"rank {r}: stopped by nbddp after rank {root} failed")
        elif o_end:
            others.append(f"rank {r}: {_ended(r, o_end, None, beats.get(r))}")
    return others


def _with_tracebacks(stacks, records: Dict[int, ErrorRecord]):
    """Where each rank was: a rank that failed on its own is placed by its traceback (it raised
    there, and by the time it was asked it may have been gone or mid-exit); a rank nbddp stopped
    (KeyboardInterrupt) by its live stack when it gave one."""
    placed = dict(stacks)
    for r, rec in records.items():
        if not rec.traceback or (rec.type == "KeyboardInterrupt" and r in placed and placed[r].threads):
            continue
        placed[r] = from_traceback(r, rec.traceback, raised=not rec.secondary)
    return Stacks(placed)


def build_worker_error(run_dir: Path, ends: Dict[int, RankEnd], world_size: int,
                       server_died: Optional[str] = None, stacks=None,
                       log_starts: Optional[Dict[int, int]] = None, store_port: Optional[int] = None) -> WorkerError:
    """Compose the one exception the notebook shows for a failed run.

    Args:
        log_starts: each rank's log size when this launch started: only what the launch wrote
            is quoted (a resumed or restarted run appends to its logs).
        server_died: how the warm server the ranks forked from ended (``"signal 9"``), if it
            died during the run: every rank then ends with it, without a word of its own.
        stacks: where the live ranks were when the failure was seen (:class:`nbddp.kernel.stacks.Stacks`).
        store_port: the kernel's ``env://`` store's port, when the ranks met there: a failed
            rendezvous that a key of another user explains says so (:func:`foreign_key_note`).
    """
    records, beats = read_error_records(run_dir, world_size), read_heartbeats(run_dir, world_size)
    logs = {r: rundir.rank_log(run_dir, r) for r in range(world_size)}
    starts = log_starts or {}
    watchdog = frozenset(r for r in range(world_size) if aborted_by_watchdog(ends.get(r), logs[r], starts.get(r, 0)))
    if stacks:
        stacks = _with_tracebacks(stacks, records)
    root = find_root_cause(ends, records, beats, watchdog, stacks)
    rec, end, beat = records.get(root), ends.get(root), beats.get(root)
    log_path = rundir.rank_log(run_dir, root)
    process = _process(rec)
    if process:  # the process a launcher script started that failed: its own log, its pid
        log_path, starts = rundir.logs_dir(run_dir) / process[1], {**starts, root: 0}
    printed = output_before_failure(log_path, rec, starts.get(root, 0), lines=1)
    # A resumed or restarted launch's folder holds the progress of the launches before it: not used.
    reported = reported_progress(Path(run_dir), root) if not starts.get(root) else ""
    where, epoch, step = where_known(rec, beat, reported, bool(printed))
    sig = signal_name(end.exitcode) if end else None
    pid = end.pid if end else (beat.pid if beat else None)
    if process and process[2] is not None:
        pid = process[2]

    kind, headline = _headline(root, rec, end, beat, records, watchdog, server_died, log_path, starts.get(root, 0))

    parts = [f"Training failed: {headline}",
             f"  {where} · pid {pid} · log: {log_path}"]
    foreign = foreign_key_note(rec, store_port)
    if foreign:
        parts.append(foreign)
    if stacks:
        parts.append(f"Where the ranks were: {stacks.summary()}")
    nccl = last_collectives(run_dir, world_size)
    if nccl:
        parts.append("NCCL's flight recorder, each rank's last collective: "
                     + "; ".join(f"rank {r}: {what}" for r, what in sorted(nccl.items())))
    others = _other_ranks(root, ends, records, beats, watchdog, world_size)
    if others:
        parts.append("Other ranks: " + "; ".join(others))
    if rec and rec.traceback:  # the rank's own output is in its log, and echoed for rank 0
        parts.append(f"--- traceback of {process[0] if process else f'rank {root}'} (the error above; its whole output: "
                     f"{log_path.name}) ---\n"
                     f"{shown_frames(rec)}")
    else:
        log_tail = tail(log_path, start=starts.get(root, 0))
        if log_tail:
            parts.append(f"--- last lines of {log_path.name} ---\n{log_tail}")
    # A rank that raised the root's error would show that traceback again: its log is a path away.
    alike = frozenset(r for r in records if _same_error(records[r], rec))
    parts.append(ranks_table(run_dir, ends, records, beats, world_size, stacks, skip_tail=frozenset({root}) | alike,
                             log_starts=starts))
    return WorkerError(
        "\n".join(parts), rank=root, exc_type=rec.type if rec else None, signal=sig,
        exitcode=end.exitcode if end else None, epoch=epoch, step=step,
        traceback=rec.traceback if rec else None, log_path=log_path, run_dir=Path(run_dir), kind=kind,
        retryable=bool(rec and rec.retryable),
    )
