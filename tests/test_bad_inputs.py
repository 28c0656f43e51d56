"""Bad input is refused in the kernel, before any process starts, with the thing and the fix named.

(The data-folder cases — missing, empty, empty class, num_classes mismatch, corrupt image, batch
too large for a rank's share — are in test_classification.py.)
"""

import os

import pytest
import torch

from nbddp import ConfigError, TrainConfig, WeightsError, spawn_train
from nbddp.gpus import GPUInfo, check_gpu_ids
from nbddp.models import build_model
from conftest import WORKERS, worker_children

FAULTY = str(WORKERS / "faulty.py")
FAKE = [GPUInfo(0, "NVIDIA H100", 81559, 80000, 0), GPUInfo(1, "NVIDIA H100", 81559, 1000, 97)]


def nothing_started(runs_dir):
    return not worker_children() and not list(runs_dir.glob("*/logs/rank0.log"))


def cfg_for(tree, runs_dir, **kw):
    base = dict(data_path=str(tree), model="resnet18", image_size=32, epochs=1, batch_size=4,
                nprocs=2, runs_dir=str(runs_dir))
    return TrainConfig(**{**base, **kw})


def test_gpu_ids_out_of_range_or_repeated_list_the_gpus():
    with pytest.raises(ConfigError, match=r"(?s)no GPU with id \[2\].*GPU 0: NVIDIA H100.*GPU 1: NVIDIA H100"):
        check_gpu_ids([0, 2], FAKE)
    with pytest.raises(ConfigError, match="lists a GPU twice"):
        check_gpu_ids([1, 1], FAKE)
    check_gpu_ids([1, 0], FAKE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_gpus_on_a_machine_without_gpus(runs_dir):
    with pytest.raises(ConfigError, match="use nprocs=N to train on CPU processes"):
        spawn_train(f"{FAULTY}:info", gpus=[0], runs_dir=runs_dir)
    assert nothing_started(runs_dir)


def test_more_processes_than_gpus(runs_dir):
    with pytest.raises(ConfigError, match="one process per GPU"):
        spawn_train(f"{FAULTY}:info", gpus=[0, 1], nprocs=3, runs_dir=runs_dir)
    assert nothing_started(runs_dir)


def test_weights_file_missing(tree, runs_dir, tmp_path):
    with pytest.raises(WeightsError, match="nope.pth"):
        spawn_train(cfg_for(tree, runs_dir, weights=str(tmp_path / "nope.pth")), echo=False)
    assert nothing_started(runs_dir)


def test_weights_of_another_architecture_listed_key_by_key(tree, runs_dir, tmp_path):
    path = tmp_path / "other.pth"
    torch.save(torch.nn.Sequential(torch.nn.Linear(4, 4)).state_dict(), path)
    with pytest.raises(WeightsError) as info:
        spawn_train(cfg_for(tree, runs_dir, weights=str(path)), echo=False)
    msg = str(info.value)
    assert "other.pth" in msg and "0.weight" in msg and "conv1.weight" in msg
    assert nothing_started(runs_dir)


def test_weights_not_weights_only_safe(tree, runs_dir, tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    path = tmp_path / "evil.pth"
    torch.save({"model": build_model("resnet18", 3).state_dict(), "x": Payload()}, path)
    with pytest.raises(WeightsError, match="weights-only|weights_only"):
        spawn_train(cfg_for(tree, runs_dir, weights=str(path)), echo=False)
    assert not (tmp_path / "ran").exists()
    assert nothing_started(runs_dir)


def test_output_folder_not_writable(tree, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"runs_dir=.*a-file/runs.*not writable.*choose another folder"):
        spawn_train(cfg_for(tree, blocker / "runs"), echo=False)
    assert not worker_children()


def test_worker_not_importable_and_unpicklable_args(runs_dir, tmp_path):
    (tmp_path / "broken_worker.py").write_text("def train(ctx:\n    pass\n")
    with pytest.raises(ConfigError, match="syntax error at line 1"):
        spawn_train(f"{tmp_path / 'broken_worker.py'}:train", runs_dir=runs_dir)
    with pytest.raises(ConfigError, match=r"args\[0\].*generator.*cannot be sent"):
        spawn_train(f"{FAULTY}:info", (x for x in range(3)), runs_dir=runs_dir)
    assert nothing_started(runs_dir)


def test_hidden_folders_and_notebook_checkpoints_are_not_classes(tree, runs_dir):
    (tree / ".ipynb_checkpoints").mkdir()
    (tree / ".ipynb_checkpoints" / "x-checkpoint.png").write_bytes((tree / "a" / "000.png").read_bytes())
    (tree / "a" / ".ipynb_checkpoints").mkdir()
    (tree / "notes.txt").write_text("not an image")
    from nbddp.tasks.classification import preflight

    assert preflight(cfg_for(tree, runs_dir, num_classes=3)) is None  # 3 classes, not 4
