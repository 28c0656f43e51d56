"""How a rank's loader reads the built-in task's data: loader processes forked from the rank and dying
with it, every image's randomness seeded by (seed, epoch, image) whatever the number of
processes, an epoch resumed in its middle, the next epoch's pass and the evaluation's begun ahead,
and evaluation shards without padding.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Callable, Iterator, Optional

from torch.utils.data import Dataset, Sampler


# ---------------------------------------------------------------------------- loader processes
def loader_context() -> Optional[str]:
    """Start method of nbddp's DataLoader workers: ``"fork"`` where the platform has it.

    A forked worker is a copy of the rank with torch already imported: its first batch comes in
    milliseconds, where a spawned or forkserver-started one first imports torch (seconds each).
    Workers never touch CUDA, so forking a rank that uses a GPU is safe.
    """
    import multiprocessing

    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


class DieWithParent:
    """``worker_init_fn`` that ends a DataLoader worker when the process that started it dies.

    A rank killed with SIGKILL (the kernel died, the OOM killer) cannot end its workers itself;
    with Linux's parent-death signal they follow it at once, under any launcher.
    """

    def __init__(self):
        self.parent = os.getpid()  # the loader's process, recorded where the loader is built

    def __call__(self, worker_id: int) -> None:
        from ...rank.process import set_parent_death_signal

        set_parent_death_signal(self.parent)


def loader_processes(num_workers: int) -> dict:
    """The DataLoader keyword arguments that start ``num_workers`` worker processes well."""
    if num_workers <= 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "multiprocessing_context": loader_context(), "worker_init_fn": DieWithParent()}


def item_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of one sample's augmentation: a function of (seed, epoch, sample index) alone."""
    # splitmix64 over the three numbers: nearby inputs give unrelated seeds.
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


class SeededSampler(Sampler):
    """Wraps a sampler to yield ``(index, seed)`` pairs for :class:`SeededDataset`.

    The seed depends on ``(seed, epoch, index)`` only, where the epoch is the wrapped sampler's
    (``DistributedSampler.set_epoch``). So each image's random crop is the same whichever worker
    process draws it, however many workers there are, and whether the workers persist between
    epochs or not: a resumed run sees exactly what an uninterrupted one sees.
    """

    def __init__(self, sampler: Sampler, seed: int):
        self.sampler, self.seed = sampler, seed

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The wrapped sampler's epoch (0 if it has none)."""
        return getattr(self.sampler, "epoch", 0)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = getattr(self.sampler, "epoch", 0)
        return ((i, item_seed(self.seed, epoch, i)) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class SkipSampler(Sampler):
    """Wraps a sampler so that one pass can leave out its first items: a resumed epoch's batches already done.

    ``skip(n)`` drops the first ``n`` items of the *next* pass only; ``len()`` is what remains of
    it, so a ``DataLoader`` (or :class:`nbddp.tasks.classification.tensor_data.TensorBatches`) over this sampler has
    exactly the remaining steps, and a ``drop_last`` loader that skips ``steps * batch_size``
    items yields the very batches an uninterrupted pass would have yielded after ``steps``. The
    pass ends at the next ``set_epoch`` or the next iteration, after which nothing is skipped.
    Everything else (``set_epoch``, ``epoch``) is the wrapped sampler's.

    Example:
        >>> sampler = SkipSampler(DistributedSampler(ds, num_replicas=2, rank=0))
        >>> sampler.set_epoch(3)
        >>> sampler.skip(5 * batch_size)        # epoch 3 resumes at its step 5
        >>> loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True)
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._skip = 0
        self._state = "done"  # "armed" (next pass skips), "active" (this pass skips), "done"

    def skip(self, n: int) -> None:
        """Leave out the first ``n`` items of the next pass (``0``: leave out nothing)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"SkipSampler.skip({n!r}): need an integer >= 0")
        self._skip, self._state = n, "armed" if n else "done"

    @property
    def skipping(self) -> int:
        """Items the next (or current) pass leaves out."""
        return self._skip if self._state != "done" else 0

    @property
    def epoch(self) -> int:
        return getattr(self.sampler, "epoch", 0)

    def set_epoch(self, epoch: int) -> None:
        if self._state == "active":
            self._state = "done"  # a new epoch is a new pass
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        if self._state == "active":
            self._state = "done"  # a second pass over the same epoch skips nothing
        n = self.skipping
        if self._state == "armed":
            self._state = "active"
        it = iter(self.sampler)
        return itertools.islice(it, n, None) if n else it

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skipping)


class SeededDataset(Dataset):
    """Reads ``(index, seed)`` keys: seeds torch and ``random`` with ``seed``, then returns ``dataset[index]``.

    In the rank's own process (``num_workers=0``) the global random state is restored after the
    item, so data loading leaves the training randomness alone.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        import torch
        from torch.utils.data import get_worker_info

        index, seed = key
        in_worker = get_worker_info() is not None
        if not in_worker:
            saved = torch.get_rng_state(), random.getstate()
        # The CPU generator only, which the image transforms draw from: torch.manual_seed would
        # also reseed every GPU generator (the training's dropout, in a GPU rank without loader
        # workers) and, before CUDA starts, record a Python stack per call (5-8% of a CPU step).
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        try:
            return self.dataset[index]
        finally:
            if not in_worker:
                torch.set_rng_state(saved[0])
                random.setstate(saved[1])


class EpochLoader:
    """A training loader whose next epoch can be on its way while the rank evaluates this one.

    ``start(epoch)`` sets the order's epoch and begins that epoch's pass: a ``DataLoader``'s loader
    processes start reading its first batches (``prefetch_factor`` each) at once, so the epoch's
    first step finds them ready instead of waiting for them after the evaluation and the
    checkpoint. The next ``iter()`` returns that pass; an ``iter()`` without a ``start``, or after
    the order changed since (another epoch, a ``skip``), begins one as the wrapped loader does.
    ``len()`` and every other attribute are the wrapped loader's.

    Nothing random depends on when a pass starts: each image's augmentation comes from its own
    seed (:class:`SeededSampler`), and a ``DataLoader`` given its own ``generator`` draws its
    workers' seeds from it, once a pass, whenever that is.

    ``near_end``, if given, is called once a pass, as the pass hands out the batch after which at
    most ``in_flight(loader)`` remain: from then on the loader processes are given no new batch and
    free their cores as they finish, so what ``near_end`` starts (the evaluation's pass,
    :class:`PassAhead`) loads beside the epoch's last steps.

    Args:
        loader: a ``DataLoader`` (or anything iterable with a length) over ``order``.
        order: its sampler, a :class:`SkipSampler`.
        near_end: called once each pass near its end (see above), or None.
    """

    def __init__(self, loader, order: "SkipSampler", near_end: Optional[Callable[[], None]] = None):
        self.loader, self.order, self.near_end = loader, order, near_end
        self._ahead: Optional[tuple] = None  # (epoch, items skipped, the pass) begun by start()

    def start(self, epoch: int) -> None:
        """Begin the pass of ``epoch`` now (its loader processes start reading); ``iter()`` returns it."""
        self.order.set_epoch(epoch)
        self._ahead = (self.order.epoch, self.order.skipping, iter(self.loader))

    def __iter__(self):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (self.order.epoch, self.order.skipping):
            batches = ahead[2]
        else:
            batches = iter(self.loader)
        if self.near_end is None:
            return batches
        return _NearEnd(batches, len(self.loader), in_flight(self.loader), self.near_end)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name in ("loader", "order", "near_end", "_ahead"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def in_flight(loader) -> int:
    """Batches a ``DataLoader``'s processes are given ahead of its consumer (0 without processes)."""
    workers = getattr(loader, "num_workers", 0)
    return workers * (getattr(loader, "prefetch_factor", None) or 2) if workers > 0 else 0


class _NearEnd:
    """A pass that calls ``then()`` once, when it has handed out all but ``lead`` of its ``total`` batches (or fewer)."""

    def __init__(self, batches, total: int, lead: int, then: Callable[[], None]):
        self.batches, self.left, self.lead, self.then = batches, total, lead, then

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)  # an unreadable batch raises here, the pass still usable: no generator
        self.left -= 1
        if self.then is not None and self.left <= self.lead:
            then, self.then = self.then, None
            then()
        return batch


class PassAhead:
    """An evaluation loader whose pass can begin before the evaluation asks for it.

    ``start()`` begins a pass of the wrapped ``DataLoader`` now: its (persistent) loader processes
    start reading the first batches, ``prefetch_factor`` each, while the rank still trains. The
    next ``iter()`` hands out that pass, untouched, once; after that, or when nothing was started,
    ``iter()`` begins one as the loader does. The evaluation's batches depend on nothing that
    changes between passes (no epoch, no random draw), so a pass started during one epoch and
    used by a later evaluation (a stopped epoch's, then the final pass) yields what a new one would.

    A persistent-worker ``DataLoader`` has a single iterator, which every ``iter()`` resets (after
    waiting for the batches in flight): a started pass is therefore handed out only if the loader's
    iterator is still that pass and has yielded nothing, and ``start()`` leaves a pending pass
    alone. ``len()`` and every other attribute (``sampler``, ``dataset``) are the loader's.
    """

    def __init__(self, loader):
        self.loader = loader
        self._pending = None  # the pass begun by start(), not handed out yet

    def start(self) -> None:
        """Begin a pass now, unless one begun earlier is still waiting untouched.

        Torch's global generator is left as it was: a ``DataLoader`` without a generator of its own
        draws its processes' base seed from it when it starts them, and a pass begun in the middle
        of an epoch would otherwise move the training's draws (dropout) after that step, where a
        run resumed after it (its processes started in another epoch) would not.

        A pass that cannot begin (a loader process that died, no memory to fork) is left to the
        evaluation: its own ``iter()`` begins one and raises there, as an evaluation's error, never
        as the error of the training batch in whose step this was called.
        """
        import torch

        if not self._untouched(self._pending):
            state = torch.get_rng_state()
            try:
                self._pending = iter(self.loader)
            except Exception:  # noqa: BLE001 - raised again, where it belongs, by the evaluation's iter()
                self._pending = None
            finally:
                torch.set_rng_state(state)

    def _untouched(self, batches) -> bool:
        if batches is None:
            return False
        own = getattr(self.loader, "_iterator", None)  # a persistent-worker loader's single iterator, else None
        return (own is None or own is batches) and getattr(batches, "_num_yielded", 0) == 0

    def __iter__(self):
        pending, self._pending = self._pending, None
        return pending if self._untouched(pending) else iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name in ("loader", "_pending"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


# ---------------------------------------------------------------------------- distribution
class ShardSampler(Sampler[int]):
    """Exact, disjoint shards of a dataset for distributed evaluation.

    Rank ``r`` gets indices ``r, r + W, r + 2W, ...``: no padding and no duplicates, so the
    shards together hold every index exactly once (their lengths differ by at most one).
    Summing correct counts and sample counts over ranks then gives the exact accuracy.

    Why not ``DistributedSampler``: it pads the index list by repeating its first samples until
    the length divides by the world size, so some images are scored twice while the reference
    script divides by ``len(dataset)``: the accuracy is off, and can even exceed 100% on a tiny
    set. (Its ``drop_last=True`` instead skips samples.) Neither is an exact evaluation.

    Args:
        dataset_len: number of items in the dataset.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of processes.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size or dataset_len < 0:
            raise ValueError(
                f"ShardSampler(dataset_len={dataset_len}, rank={rank}, world_size={world_size}): "
                "need dataset_len >= 0, world_size >= 1 and 0 <= rank < world_size"
            )
        self.indices = range(rank, dataset_len, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def loader_workers(world_size: int, at_least: int = 0) -> int:
    """Data-loading processes per rank: the rank's share of the cores, less the rank itself (at most 16)."""
    from ...contract.system import cpu_cores

    return max(at_least, min(16, cpu_cores() // max(world_size, 1) - 1))
