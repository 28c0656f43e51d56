"""A sweep's slots: where its trials run at the same time, GPUs by lease or CPU processes.

A GPU slot is ``gpus_per_trial`` GPUs that are idle and that no kernel leases (this one's other
trials included: their leases are held by this process, and a lease refuses a second holder),
leased here and handed to the trial's launch, which gives them back when the run ends
(:func:`nbddp.kernel.launch.on_leased_gpus`). A CPU slot is ``nprocs`` processes; ``parallel``
of them share the cores.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Set

from ..contract.errors import ConfigError
from ..contract.gpus import IDLE_RULE, list_gpus
from ..contract.leases import Leases, try_lease
from ..contract.system import cpu_cores

#: A GPU a trial of this sweep gave back within this many seconds counts as idle when no kernel
#: leases it: its load, sampled over the last second by the driver, still shows the trial.
_OWN_RECENT_S = 10.0


@dataclass
class Slot:
    """One trial's place: its CPU processes, or its GPUs and their leases."""

    nprocs: Optional[int] = None
    gpus: List[int] = field(default_factory=list)
    leases: Leases = field(default_factory=Leases)

    def describe(self) -> str:
        return f"GPU {','.join(map(str, self.gpus))}" if self.gpus else f"{self.nprocs} CPU process" + (
            "es" if self.nprocs != 1 else "")


class CpuSlots:
    """``parallel`` slots of ``nprocs`` CPU processes each."""

    def __init__(self, parallel: Optional[int], nprocs: int):
        cores = cpu_cores()
        self.nprocs = nprocs
        self.parallel = max(1, cores // nprocs) if parallel is None else parallel
        if self.parallel * nprocs > cores:
            warnings.warn(f"parallel={self.parallel} trials of nprocs={nprocs} processes need {self.parallel * nprocs} "
                          f"cores, and this machine has {cores}: the trials would slow one another down. Pass "
                          f"parallel={max(1, cores // nprocs)} (or fewer processes per trial).", stacklevel=4)
        self.busy = 0
        #: Intra-op threads per rank: the cores shared by every rank of every slot.
        self.threads = max(1, cores // (self.parallel * nprocs))

    @property
    def count(self) -> int:
        return self.parallel

    def take(self) -> Optional[Slot]:
        if self.busy >= self.parallel:
            return None
        self.busy += 1
        return Slot(nprocs=self.nprocs)

    def give(self, slot: Slot) -> None:
        self.busy -= 1


class GpuSlots:
    """Slots of ``per_trial`` idle GPUs each, leased; ``parallel`` of them at most."""

    def __init__(self, parallel: Optional[int], per_trial: int):
        self.per_trial = per_trial
        self.busy = 0
        self.in_use: Set[int] = set()  # this sweep's GPUs, whether or not leases work here
        self.given_back: dict = {}  # GPU -> when a trial of this sweep gave it back
        gpus = list_gpus()
        if not gpus:
            raise ConfigError(f"gpus_per_trial={per_trial}: this machine has no GPU nbddp can see; pass nprocs=N to "
                              "run the trials on CPU processes instead")
        if per_trial > len(gpus):
            raise ConfigError(f"gpus_per_trial={per_trial}: this machine has {len(gpus)} GPU(s); pass "
                              f"gpus_per_trial={len(gpus)} or fewer")
        free = len(self._idle(gpus)) // per_trial
        most = len(gpus) // per_trial
        self.parallel = most if parallel is None else parallel
        if free == 0:
            listing = "; ".join(g.label() for g in gpus)
            raise ConfigError(f"no {per_trial} GPU(s) are idle now ({IDLE_RULE}; GPUs another kernel leases are never "
                              f"taken): {listing}. Wait until one is free, or pass nprocs=N for CPU trials.")
        if self.parallel > free:
            warnings.warn(f"parallel={self.parallel}: only {free} slot(s) of {per_trial} idle GPU(s) are free now; the "
                          f"sweep runs {free} trial(s) at a time and takes more GPUs as they become idle (up to "
                          f"{self.parallel}). Pass parallel={free} to silence this.", stacklevel=4)
        self.threads = None
        self._next_try = 0.0

    @property
    def count(self) -> int:
        return self.parallel

    def _idle(self, gpus) -> List[int]:
        now = time.time()
        return [g.index for g in gpus if g.index not in self.in_use and not g.lease
                and (g.idle or now - self.given_back.get(g.index, -1e9) < _OWN_RECENT_S)]

    def take(self) -> Optional[Slot]:
        """A slot of leased GPUs, or None when ``parallel`` run or too few GPUs are free (asked at most once a second)."""
        now = time.time()
        if self.busy >= self.parallel or now < self._next_try:
            return None
        listed = list_gpus()
        idle = self._idle(listed)
        uuids = {g.index: g.uuid for g in listed}
        won = []
        for index in idle:
            if len(won) == self.per_trial:
                break
            lease = try_lease(index, uuids.get(index))
            if lease is not None:
                won.append(lease)
        if not won and idle and self._leases_off():
            # Leases do not work here (a warning says so at launch): this sweep's own bookkeeping
            # still keeps its trials apart.
            won_ids, leases = idle[:self.per_trial], Leases()
        else:
            won_ids, leases = [lease.index for lease in won], Leases(won)
        if len(won_ids) < self.per_trial:
            leases.release()
            self._next_try = now + 1.0
            return None
        self.busy += 1
        self.in_use.update(won_ids)
        return Slot(gpus=won_ids, leases=leases)

    @staticmethod
    def _leases_off() -> bool:
        from ..contract.leases import unusable_reason

        return unusable_reason() is not None

    def give(self, slot: Slot) -> None:
        slot.leases.release()  # the launch released them at the run's end; twice is harmless
        self.busy -= 1
        now = time.time()
        for g in slot.gpus:
            self.in_use.discard(g)
            self.given_back[g] = now
        self._next_try = 0.0


def make_slots(parallel: Optional[int], gpus_per_trial: Optional[int], nprocs: Optional[int], default_nprocs: int):
    """The sweep's slots: GPUs with ``gpus_per_trial``, CPU processes with ``nprocs``, else GPUs if any."""
    for label, value in (("parallel", parallel), ("gpus_per_trial", gpus_per_trial), ("nprocs", nprocs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{label}={value!r}: must be an integer >= 1")
    if gpus_per_trial is not None and nprocs is not None:
        raise ConfigError("give gpus_per_trial (GPUs per trial) or nprocs (CPU processes per trial), not both")
    if gpus_per_trial is None and nprocs is None and list_gpus():
        gpus_per_trial = 1
    if gpus_per_trial is not None:
        return GpuSlots(parallel, gpus_per_trial)
    return CpuSlots(parallel, nprocs or default_nprocs)
