"""The evaluation's batches are on their way before the evaluation asks for them (PIL and decode pipelines).

Real loader processes throughout: each item read is noted in a file by the process that reads it.
"""

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from nbddp import spawn_train
from nbddp.tasks.classification.loading import (EpochLoader, PassAhead, SeededDataset, SeededSampler, ShardSampler,
                                                SkipSampler, in_flight)
from conftest import WORKERS, make_tree, small_cfg, wait_for


class _Noted(Dataset):
    """``n`` items, each noted in a shared file by whichever process reads it."""

    def __init__(self, path, n: int):
        self.path, self.n = str(path), n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return torch.tensor([float(i)])


def _reads(path) -> list:
    return sorted(int(x) for x in path.read_text().split())


def _fork_loader(dataset, sampler, **kw) -> DataLoader:
    return DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, persistent_workers=True,
                      multiprocessing_context="fork", **kw)


def test_the_evaluation_pass_begins_as_the_training_pass_hands_out_its_last_indices(tmp_path):
    train_noted, val_noted = tmp_path / "train", tmp_path / "val"
    train_noted.write_text("")
    # As the built-in worker's loaders are made: seeded keys for training, an exact shard for evaluation.
    order = SkipSampler(SeededSampler(DistributedSampler(range(24), num_replicas=1, rank=0, shuffle=True, seed=5), 5))
    train = _fork_loader(SeededDataset(_Noted(train_noted, 24)), order, drop_last=True)
    val_loader = _fork_loader(_Noted(val_noted, 10), ShardSampler(10, 0, 1))
    expected = [b.flatten().tolist() for b in val_loader]
    val = PassAhead(val_loader)
    loader = EpochLoader(train, order, near_end=val.start)
    lead = in_flight(train)
    assert lead == 4 and len(train) == 12
    val_noted.write_text("")
    order.set_epoch(0)
    for i, _ in enumerate(loader):
        left = len(train) - i - 1
        if left > lead:  # the training processes still get new batches: the evaluation's wait
            assert val_noted.read_text() == "", f"nothing of the evaluation read with {left} batches left"
        elif left == lead:
            # Nobody iterates the evaluation's loader: its processes read its first batches all the same.
            assert wait_for(lambda: len(val_noted.read_text().split()) >= 2, timeout=30), "read ahead"
    assert [b.flatten().tolist() for b in val] == expected, "the pass begun ahead is the evaluation's"
    assert _reads(val_noted) == list(range(10)), "that pass, no other: each item read once"

    # A stop after the pass began: the next evaluation takes that pass; a second start() keeps it.
    val_noted.write_text("")
    val.start()
    val.start()
    assert [b.flatten().tolist() for b in val] == expected
    assert _reads(val_noted) == list(range(10)), "the pending pass was not reset and read again"

    # A pass handed out and left half read is never handed out again: the next one is whole.
    val.start()
    half = iter(val)
    next(half)
    assert [b.flatten().tolist() for b in val] == expected
    # Nor one that the loader's own iter() reset and read from behind PassAhead's back.
    val.start()
    behind = iter(val_loader)
    next(behind)
    assert [b.flatten().tolist() for b in val] == expected


def test_beginning_the_evaluation_pass_leaves_the_trainings_random_draws_alone(tmp_path):
    # A DataLoader without a generator of its own draws its processes' base seed from torch's
    # global generator when it starts them: mid-epoch, that would move the training's dropout draws.
    val = PassAhead(_fork_loader(_Noted(tmp_path / "val", 4), ShardSampler(4, 0, 1)))
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    val.start()
    assert torch.equal(torch.rand(4), expected)
    assert len(list(val)) == 2


@pytest.mark.parametrize("pipeline", ["pil", "decode"])
def test_the_built_in_worker_reads_the_evaluation_batches_before_evaluating_and_its_numbers_stay(tmp_path, runs_dir,
                                                                                                pipeline):
    tree = make_tree(tmp_path / "data")  # 3 x 12 images: 30 train (15 steps of 2), 6 validation (3 batches)
    probe = tmp_path / "probe"
    env = {"NBDDP_RANK_HOOK": f"{WORKERS / 'eval_ahead_probe.py'}:install", "NBDDP_PROBE": str(probe),
           "NBDDP_PROBE_WAIT_S": "30"}
    cfg = small_cfg(tree, runs_dir, nprocs=1, num_workers=2, batch_size=2, seed=0, data_pipeline=pipeline,
                    name=f"ahead-{pipeline}")
    result = spawn_train(cfg, echo=False, env=env)
    lines = [line.split() for line in probe.read_text().splitlines()]
    assert [line for line in lines if line[0] == "ahead"] == [["ahead", "yes"]] * 2, \
        "each epoch's validation items were read before its evaluation began"
    given = [line[1:] for line in lines if line[0] == "given"]
    fresh = [line[1:] for line in lines if line[0] == "fresh"]
    assert len(given) == 2 and given == fresh, "a pass begun ahead scores exactly as a new one"
    assert [float.fromhex(g[0]) for g in given] == [m["val_accuracy"] for m in result.metrics]
    # Between two evaluations' ends, the validation set is read twice (the pass begun ahead, the new
    # one) and no more: the pass begun ahead was not reset and read again.
    ends = [i for i, line in enumerate(lines) if line[0] == "eval-end"]
    for begin, end, count in zip([-1] + ends, ends, (int(g[2]) for g in given)):
        dataset = next(line[1] for line in lines[begin + 1:end] if line[0] == "eval-begin")
        reads = [line[3] for line in lines[begin + 1:end] if line[0] == "item" and line[2] == dataset]
        assert count > 0 and Counter(reads) == {index: 2 for index in set(reads)} and len(set(reads)) == count


def test_a_pass_that_cannot_begin_ahead_is_raised_by_the_evaluation_not_by_the_training_step():
    class Broken:  # a loader whose processes cannot start (one died; no memory to fork)
        def __iter__(self):
            raise RuntimeError("DataLoader worker (pid 123) exited unexpectedly")

        def __len__(self):
            return 1

    val = PassAhead(Broken())
    val.start()  # called in a training step: its error is not that batch's
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        iter(val)
