"""The thread that keeps a rank's heartbeat record current, and ends the rank when its kernel is gone.

Worker side.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Optional

from ..contract.protocol import Heartbeat, HeartbeatWriter


class HeartbeatThread(threading.Thread):
    """Keeps ``rank<r>.json`` current: pid, state, epoch, step, time of the last progress.

    Written at once when the worker reports progress (at most every 10 ms), so a rank killed
    mid-step is reported where it was; and by this thread every second, so the file stays
    fresh while the main thread waits in a collective (the GIL is released there). The
    *progress* time inside it tells a rank that stopped making progress.

    Args:
        writer: the rank's heartbeat file.
        snapshot: ``snapshot(state)``: the rank's heartbeat now, in lifecycle ``state``.
        watch: ``(pid, start time)`` of the kernel that launched the run; the rank ends itself
            once that process is gone. ``None``: nothing to watch (torchrun, srun).
        interval: seconds between the thread's own writes.
    """

    def __init__(self, writer: HeartbeatWriter, snapshot: Callable[[str], Heartbeat],
                 watch: Optional[tuple] = None, interval: float = 1.0):
        super().__init__(daemon=True, name="nbddp-heartbeat")
        self.file, self.snapshot, self.watch, self.interval = writer, snapshot, watch, interval
        self.state = "starting"  # then running, finishing, done or failed
        self._lock = threading.Lock()
        self._last_write = 0.0
        self._wake = threading.Event()
        #: ``poll_stop() -> reason or None``, looked at every beat for code that never asks
        #: ``ctx.should_stop()``; ``on_stop(reason)`` is called once when a request came.
        self.poll_stop: Optional[Callable[[], Optional[str]]] = None
        self.on_stop: Optional[Callable[[str], None]] = None

    def beat(self) -> None:
        """Write the heartbeat now."""
        record = self.snapshot(self.state)
        with self._lock:
            try:
                self.file.write(record)
            except OSError:
                pass  # a full disk must not kill the heartbeat; the main thread will report it
            self._last_write = time.time()

    def progressed(self) -> None:
        """The rank made progress: write at once, or within 10 ms if it just did."""
        if time.time() - self._last_write >= 0.01:
            self.beat()
        else:
            self._wake.set()  # coalesce: the thread writes it in a moment

    def run(self) -> None:
        from ..contract.system import is_same_process

        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            self.beat()
            if self.poll_stop is not None and self.state == "running":
                reason = self.poll_stop()
                if reason is not None:
                    self.poll_stop = None
                    self.on_stop(reason)
            if self.watch is not None and not is_same_process(*self.watch):
                # The kernel is gone (killed, restarted). Under a forkserver our parent is the
                # server, so the parent-death signal alone may not fire: end this rank and its
                # DataLoader workers (our process group) ourselves, even if the main thread is
                # blocked in a collective.
                os.killpg(os.getpgrp(), signal.SIGKILL)
