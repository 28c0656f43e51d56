"""Data-loading processes inside a rank: forked from it (no second forkserver), kept between
epochs, seeded per image so that the number of workers changes nothing."""

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from nbddp import spawn_train
from nbddp.tasks.classification.data import SeededDataset, SeededSampler, item_seed
from conftest import WORKERS, make_tree, worker_children


def test_loader_workers_fork_from_the_rank_and_persist_across_epochs(tmp_path, runs_dir):
    tree = make_tree(tmp_path / "data", per_class=8)
    result = spawn_train(f"{WORKERS / 'lifecycle.py'}:loader_probe", str(tree), nprocs=1, runs_dir=runs_dir,
                         echo=False)
    v = result.value
    first, second = v["epochs"]
    assert len(first["workers"]) == 2 and len(first["val_workers"]) == 2
    assert first["parents"] == [v["rank"]] * 4, "nbddp's loader workers are the rank's own children"
    assert second["workers"] == first["workers"], "the same worker processes serve every epoch"
    assert second["val_workers"] == first["val_workers"], "and every evaluation"
    assert sorted(v["descendants"]) == sorted(first["workers"] + first["val_workers"]), \
        "no forkserver nor anything else under the rank"
    # A user's own DataLoader (its Dataset class lives in the worker file) forks from the rank too.
    assert v["start_method"] == "fork"
    assert {ppid for _pid, ppid in v["user_workers"]} == {v["rank"]}
    assert not worker_children()


class _Random(Dataset):
    """Each item draws from torch and random: what a random augmentation does."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(1).item(), random.random()])


def _epochs(num_workers: int, persistent: bool, dataset=_Random):
    sampler = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=5)
    loader = DataLoader(SeededDataset(dataset()), batch_size=4, sampler=SeededSampler(sampler, 5),
                        num_workers=num_workers, persistent_workers=persistent,
                        multiprocessing_context="fork" if num_workers else None)
    out = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        out.append(torch.cat(list(loader)))
    return out


class _Quiet(_Random):
    def __getitem__(self, i):
        return torch.tensor([float(i), 0.0, 0.0])


def test_each_items_randomness_depends_on_seed_epoch_and_index_only():
    torch.manual_seed(123)
    ref = _epochs(0, False)
    after_seeded = torch.get_rng_state()
    torch.manual_seed(123)
    _epochs(0, False, _Quiet)
    assert torch.equal(after_seeded, torch.get_rng_state()), "loading in the rank leaves its random state alone"
    for workers, persistent in [(2, True), (1, False)]:
        got = _epochs(workers, persistent)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (workers, persistent)
    # Epochs differ, and so do the draws of one image across epochs.
    assert not torch.equal(ref[0], ref[1])
    by_index = [{int(r[0]): (r[1].item(), r[2].item()) for r in e} for e in ref]
    assert by_index[0][3] != by_index[1][3]
    assert item_seed(0, 1, 2) != item_seed(0, 2, 1)


def test_skip_sampler_leaves_out_the_batches_done_for_one_pass_only():
    from nbddp.tasks.classification.data import SkipSampler

    def loader(sampler, workers):
        return DataLoader(SeededDataset(_Random()), batch_size=4, sampler=sampler, drop_last=True,
                          num_workers=workers, multiprocessing_context="fork" if workers else None)

    base = DistributedSampler(_Random(), num_replicas=1, rank=0, shuffle=True, seed=5)
    base.set_epoch(3)
    full = list(loader(SeededSampler(base, 5), 0))
    assert len(full) == 6
    for workers in (0, 2):
        sampler = SkipSampler(SeededSampler(DistributedSampler(_Random(), num_replicas=1, rank=0, shuffle=True,
                                                               seed=5), 5))
        sampler.set_epoch(3)
        sampler.skip(2 * 4)  # two steps of batch 4 done
        dl = loader(sampler, workers)
        assert len(sampler) == 16 and len(dl) == 4, "the loader's length is the steps that remain"
        rest = list(dl)
        assert len(rest) == 4 and all(torch.equal(a, b) for a, b in zip(full[2:], rest)), workers
        assert len(dl) == 4, "still this pass's length until the next epoch"
        sampler.set_epoch(4)
        assert len(dl) == 6 and len(list(dl)) == 6, "the next epoch is whole"
    again = SkipSampler(DistributedSampler(_Random(), num_replicas=1, rank=0, shuffle=False))
    again.skip(20)
    assert list(again) == [20, 21, 22, 23] and list(again) == list(range(24)), "the skip is for one pass"
    assert again.epoch == 0 and len(again) == 24
    with pytest.raises(ValueError, match="integer >= 0"):
        again.skip(-1)


def test_seeding_an_item_touches_only_the_cpu_generator(monkeypatch):
    """Loading in a GPU rank (``num_workers=0``) must not reseed its GPU generators for every image:
    that would reset the training's GPU randomness (dropout) at each batch, and ``torch.manual_seed``
    also records a Python stack per call while CUDA is not initialised (a cost of every item)."""
    called = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: called.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: called.append(seed))
    items = [SeededDataset(_Random())[(i, 100 + i)] for i in range(4)]
    assert called == [], "the GPU generators were seeded by the data loading"
    torch.manual_seed(0)
    same = [SeededDataset(_Random())[(i, 100 + i)] for i in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(items, same)), "each item's draws depend on its seed alone"


class _Noted(Dataset):
    """Items noted in a shared file by whichever process reads them: the loader processes' progress."""

    def __init__(self, path):
        self.path = str(path)

    def __len__(self):
        return 24

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return torch.tensor([float(i)])


def test_an_epoch_started_ahead_is_read_by_the_loader_processes_before_anyone_asks(tmp_path):
    from nbddp.tasks.classification.data import EpochLoader, SkipSampler
    from conftest import wait_for

    noted = tmp_path / "noted"
    # As the built-in worker's loaders are made: seeded keys, then the items.
    order = SkipSampler(SeededSampler(DistributedSampler(_Random(), num_replicas=1, rank=0, shuffle=True, seed=5), 5))
    loader = DataLoader(SeededDataset(_Noted(noted)), batch_size=4, sampler=order, drop_last=True, num_workers=2,
                        persistent_workers=True, multiprocessing_context="fork")
    ahead = EpochLoader(loader, order)
    order.set_epoch(0)
    assert [b.flatten().tolist() for b in ahead] == [b.flatten().tolist() for b in loader], "a pass as the loader's"
    noted.write_text("")
    order.set_epoch(1)
    expected = [b.flatten().tolist() for b in loader]
    noted.write_text("")
    ahead.start(1)
    # Nobody iterates: the loader processes read the epoch's first batches all the same.
    assert wait_for(lambda: len(noted.read_text().split()) >= 4, timeout=30), "the first batch read ahead"
    assert [b.flatten().tolist() for b in ahead] == expected, "the pass started ahead is epoch 1's"
    assert sorted(noted.read_text().split()) == sorted(str(i) for i in range(24)), "that pass, no other: each item once"
    # A skip armed after the start: the started pass no longer fits, a new one honours the skip.
    ahead.start(1)
    order.skip(8)
    assert [b.flatten().tolist() for b in ahead] == expected[2:]


def test_the_next_epoch_loads_while_the_built_in_worker_evaluates_and_evaluation_restarts_no_loader(tmp_path,
                                                                                                  runs_dir):
    from conftest import small_cfg

    tree = make_tree(tmp_path / "data", per_class=10)
    probe = tmp_path / "probe"
    env = {"NBDDP_RANK_HOOK": f"{WORKERS / 'prefetch_probe.py'}:install", "NBDDP_PROBE": str(probe),
           "NBDDP_PROBE_SEED": "0", "NBDDP_PROBE_WAIT_S": "20"}
    spawn_train(small_cfg(tree, runs_dir, nprocs=1, num_workers=2, seed=0, name="prefetch"), echo=False, env=env)
    lines = [line.split() for line in probe.read_text().splitlines()]
    assert ["prefetched", "yes"] in lines, "epoch 2's first batches were read while epoch 1 was evaluated"
    val_ids = {line[2] for line in lines if line[0] == "eval"}
    assert len(val_ids) == 1 and sum(line[0] == "eval" for line in lines) == 3, "2 epochs and the final pass"
    val_pids = {line[1] for line in lines if line[0] == "item" and line[2] in val_ids}
    train_pids = {line[1] for line in lines if line[0] == "train"}
    assert len(val_pids) == 2 and len(train_pids) == 2, "the same 2 loader processes every time, for each split"
    seeds = [line[2] for line in lines if line[0] == "train"]
    assert seeds and len(seeds) == len(set(seeds)), "each item read once: the pass started ahead is the one trained on"
