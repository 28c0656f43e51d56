"""Data-loading processes inside a rank: forked from it (no second forkserver), kept between
epochs, seeded per image so that the number of workers changes nothing."""

import random

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from nbddp import spawn_train
from nbddp.data import SeededDataset, SeededSampler, item_seed
from conftest import WORKERS, make_tree, worker_children


def test_loader_workers_fork_from_the_rank_and_persist_across_epochs(tmp_path, runs_dir):
    tree = make_tree(tmp_path / "data", per_class=8)
    result = spawn_train(f"{WORKERS / 'lifecycle.py'}:loader_probe", str(tree), nprocs=1, runs_dir=runs_dir,
                         echo=False)
    v = result.value
    first, second = v["epochs"]
    assert len(first["workers"]) == 2
    assert first["parents"] == [v["rank"]] * 2, "nbddp's loader workers are the rank's own children"
    assert second["workers"] == first["workers"], "the same worker processes serve every epoch"
    assert sorted(v["descendants"]) == sorted(first["workers"]), "no forkserver nor anything else under the rank"
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
