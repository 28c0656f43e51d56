"""The fixed costs of a launch of the built-in worker, one number each, as rank 0 sees them.

=================  =====================================================================================
``kernel_checks``  the plan, in the kernel: the data folder scanned, the model, weights and batch checked
``processes``      from the plan to the rank's process: the run folder, the warm server (started by a
                   first launch outside Jupyter, or at ``import nbddp`` in a kernel), the fork
``rendezvous``     from the rank's start to the worker's first line: the rank's set-up, the process group
``data_scan``      the class folders read and split again, in the rank
``cache_build``    the loaders made: every image decoded once (``data_pipeline="tensor"``), or the loader
                   objects alone (``pil``, ``decode``: their processes start with the first pass)
``model_build``    the model, its optimizer and DDP, a checkpoint resumed
``first_step``     from the model built to the first step's loss on the host: the loader's first batch,
                   the first forward, backward and update (and, with ``compile=True``, the compilation);
                   the host reads a step's loss once the device is done with it
=================  =====================================================================================

The worker writes them into the first epoch record of its launch (``startup_<name>_s``, so they reach
``metrics.jsonl``, TensorBoard and ``result.metrics``); :func:`lines` prints them one line each
(``bench/launch.py --part costs`` on a CPU, ``bench/gpu.py``'s fixed costs on a GPU). The kernel's two
are known when the ranks run from the kernel's own plan: not after a restart (the plan is older), nor
under torchrun or srun (each rank plans for itself, inside its ``rendezvous``).

Both sides (the plan stamps its times in the kernel; the rest is the worker's).
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

from ...contract.protocol import RESTART_ENV

#: The costs, in launch order.
NAMES = ("kernel_checks", "processes", "rendezvous", "data_scan", "cache_build", "model_build", "first_step")


def _process_started() -> Optional[float]:
    """When this process started (``time.time()``'s clock), to 10 ms, or None where /proc does not say."""
    from ...contract.system import start_time

    ticks = start_time(os.getpid())
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK")) if ticks is not None else None
    except (OSError, ValueError):
        return None


class LaunchClock:
    """Rank 0's stamps of its launch's start-up (:data:`NAMES`); :meth:`take` gives them to one epoch record.

    Args:
        planned: the kernel's ``{"planned": t, "checked": t}`` (wall clock): when the plan began and
            when its checks ended; None or ``{}`` where not known.
    """

    def __init__(self, planned: Optional[dict] = None):
        now = time.time()
        self._stamps: Dict[str, float] = {"worker": now}
        started = _process_started()
        if started is not None:
            self._stamps["process"] = min(started, now)
        restarted = int(os.environ.get(RESTART_ENV) or 0) > 0
        if planned and not restarted and {"planned", "checked"} <= set(planned):
            # A plan made after this process started was made in it (under torchrun or srun): its
            # time is part of this rank's start (rendezvous), not the kernel's.
            if started is None or float(planned["checked"]) <= started:
                self._stamps["planned"], self._stamps["checked"] = float(planned["planned"]), float(planned["checked"])
        self._given = False

    def mark(self, name: str) -> None:
        """Note that ``name`` (``data_scan``, ``cache_build``, ``model_build``, ``first_step``) ends now (once)."""
        self._stamps.setdefault(name, time.time())

    def costs(self) -> Dict[str, float]:
        """``{name: seconds}`` of the costs known so far."""
        s, out = self._stamps, {}
        spans = {"kernel_checks": ("planned", "checked"), "processes": ("checked", "process"),
                 "rendezvous": ("process", "worker"), "data_scan": ("worker", "data_scan"),
                 "cache_build": ("data_scan", "cache_build"), "model_build": ("cache_build", "model_build"),
                 "first_step": ("model_build", "first_step")}
        for name in NAMES:
            a, b = spans[name]
            if a in s and b in s:
                out[name] = max(0.0, s[b] - s[a])
        return out

    def take(self) -> Dict[str, float]:
        """The costs as an epoch record's ``startup_<name>_s`` entries, the first time only (then ``{}``)."""
        if self._given or "first_step" not in self._stamps:
            return {}
        self._given = True
        return {f"startup_{name}_s": seconds for name, seconds in self.costs().items()}


def lines(record: dict, prefix: str = "fixed cost") -> List[str]:
    """One line per start-up cost in an epoch record (none if it has none): ``fixed cost: data scan 0.01 s``."""
    width = max(len(n) for n in NAMES)
    return [f"{prefix}: {name.replace('_', ' '):<{width}} {record[f'startup_{name}_s']:7.3f} s"
            for name in NAMES if isinstance(record.get(f"startup_{name}_s"), (int, float))]


__all__ = ["LaunchClock", "NAMES", "lines"]
