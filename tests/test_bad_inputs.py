"""Bad input is refused in the kernel, before any process starts, with the thing and the fix named.

(The data-folder cases — missing, empty, empty class, num_classes mismatch, corrupt image, batch
too large for a rank's share — are in test_classification.py.)
"""

import os

import pytest
import torch

from nbddp import ConfigError, TrainConfig, WeightsError, spawn_train
from nbddp.contract.gpus import GPUInfo, check_gpu_ids
from nbddp.tasks.classification.models import build_model
from conftest import WORKERS, small_cfg, worker_children

FAULTY = str(WORKERS / "faulty.py")
FAKE = [GPUInfo(0, "NVIDIA H100", 81559, 80000, 0), GPUInfo(1, "NVIDIA H100", 81559, 1000, 97)]


def nothing_started(runs_dir):
    return not worker_children() and not list(runs_dir.glob("*/logs/rank0.log"))


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
        spawn_train(small_cfg(tree, runs_dir, epochs=1, weights=str(tmp_path / "nope.pth")), echo=False)
    assert nothing_started(runs_dir)


def test_weights_of_another_architecture_listed_key_by_key(tree, runs_dir, tmp_path):
    path = tmp_path / "other.pth"
    torch.save(torch.nn.Sequential(torch.nn.Linear(4, 4)).state_dict(), path)
    with pytest.raises(WeightsError) as info:
        spawn_train(small_cfg(tree, runs_dir, epochs=1, weights=str(path)), echo=False)
    msg = str(info.value)
    assert "other.pth" in msg and "0.weight" in msg and "conv1.0.weight" in msg  # the model's own first key
    assert nothing_started(runs_dir)


def test_weights_not_weights_only_safe(tree, runs_dir, tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    path = tmp_path / "evil.pth"
    torch.save({"model": build_model("resnet18", 3).state_dict(), "x": Payload()}, path)
    with pytest.raises(WeightsError, match="weights-only|weights_only"):
        spawn_train(small_cfg(tree, runs_dir, epochs=1, weights=str(path)), echo=False)
    assert not (tmp_path / "ran").exists()
    assert nothing_started(runs_dir)


def test_output_folder_not_writable(tree, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"runs_dir=.*a-file/runs.*not writable.*choose another folder"):
        spawn_train(small_cfg(tree, blocker / "runs", epochs=1), echo=False)
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
    from nbddp.tasks.classification.planning import preflight

    assert preflight(small_cfg(tree, runs_dir, epochs=1, num_classes=3)) is None  # 3 classes, not 4


# ------------------------------------------------------------------ small inputs, clear answers
def test_zero_processes_refused(runs_dir, capsys):
    for n in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match=rf"nprocs={n!r}: must be an integer >= 1"):
            spawn_train(f"{FAULTY}:info", nprocs=n, runs_dir=runs_dir)
    from nbddp import cli

    assert cli.main(["run", f"{FAULTY}:info", "--nprocs", "0"]) == 2
    assert "nprocs=0: must be an integer >= 1" in capsys.readouterr().err
    assert nothing_started(runs_dir)


def test_timeout_below_the_minimum_refused(tree, runs_dir):
    with pytest.raises(ConfigError, match=r"TrainConfig\.timeout_s=0\.001: must be at least 5 seconds"):
        small_cfg(tree, runs_dir, epochs=1, timeout_s=0.001)
    for t in (0, 0.5, -3, float("nan")):
        with pytest.raises(ConfigError, match=r"timeout_s=.*: must be .*seconds"):
            spawn_train(f"{FAULTY}:info", nprocs=2, timeout_s=t, runs_dir=runs_dir)
    assert nothing_started(runs_dir)


def test_batch_of_one_image_under_batchnorm_refused(tree, runs_dir):
    from nbddp.tasks.classification.planning import preflight

    # resnet18 at 32 px ends on a 1x1 map: one image gives BatchNorm one value per channel.
    with pytest.raises(ConfigError, match=r"(?s)batch_size=1.*BatchNorm.*batch_size >= 2"):
        spawn_train(small_cfg(tree, runs_dir, epochs=1, batch_size=1, nprocs=1), echo=False)
    assert nothing_started(runs_dir)
    # frozen BatchNorm layers run in eval mode: a batch of one is fine there
    assert preflight(small_cfg(tree, runs_dir, epochs=1, batch_size=1, nprocs=1, freeze_layers=True)) is None


def test_last_partial_batch_is_dropped_not_a_one_image_batch(tree, runs_dir):
    from nbddp.tasks.classification.data import check_batch_fits, scan_class_folders, split_samples

    train, _ = split_samples(scan_class_folders(tree)[1], 0.2, 0)
    # 30 train images, 2 ranks: 15 each; batches of 7 leave one image, which is dropped
    assert (len(train), check_batch_fits(len(train), 2, 7)) == (30, 2)


def test_split_without_validation_images_refused(tmp_path, runs_dir):
    from nbddp import DataError
    from conftest import make_tree

    one = make_tree(tmp_path / "one", per_class=1)  # a single image per class: all go to training
    with pytest.raises(DataError, match=r"(?s)no validation image.*at least 2 images"):
        spawn_train(small_cfg(one, runs_dir, epochs=1, batch_size=3, nprocs=1), echo=False)
    assert nothing_started(runs_dir)


def test_names_that_are_not_utf8_refused(tree, runs_dir, tmp_path):
    from nbddp import DataError

    raw = os.fsencode(str(tmp_path)) + b"/data-\xff"
    os.rename(os.fsencode(str(tree)), raw)
    with pytest.raises(ConfigError, match=r"TrainConfig\.data_path=.*not valid UTF-8.*rename"):
        small_cfg(os.fsdecode(raw), runs_dir, epochs=1)
    # a class folder becomes a label in class_indices.json and in every prediction
    os.rename(raw, os.fsencode(str(tree)))
    os.rename(os.fsencode(str(tree / "a")), os.fsencode(str(tree)) + b"/caf\xe9")
    with pytest.raises(DataError, match=r"(?s)class folder.*not valid UTF-8: b'caf\\xe9'.*rename"):
        spawn_train(small_cfg(tree, runs_dir, epochs=1), echo=False)
    assert nothing_started(runs_dir)


def test_cli_bad_kwargs_and_gpu_ids_get_a_message_not_a_traceback(runs_dir, capsys):
    from nbddp import cli

    cases = [(["run", f"{FAULTY}:info", "--kwargs", "{bad"], "--kwargs '{bad' is not valid JSON"),
             (["run", f"{FAULTY}:info", "--kwargs", "[1, 2]"], "is a JSON list; pass an object"),
             (["run", f"{FAULTY}:info", "--gpus", "0,a"], "'a' is not a GPU id"),
             (["train", "--gpus", "0,a"], "'a' is not a GPU id")]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert nothing_started(runs_dir)


def test_cluster_command_counts_checked():
    cfg = TrainConfig()
    for kwargs, field in [({"nnodes": 0}, "nnodes=0"), ({"nproc_per_node": 0}, "nproc_per_node=0"),
                          ({"max_restarts": -1}, "max_restarts=-1"), ({"run_id": "a b"}, "run_id='a b'"),
                          ({"rdzv_endpoint": ""}, "rdzv_endpoint=''")]:
        with pytest.raises(ConfigError, match=rf"torchrun_command\({field}\)"):
            cfg.torchrun_command(**kwargs)
    for kwargs, field in [({"nodes": 0}, "nodes=0"), ({"gpus_per_node": 0}, "gpus_per_node=0"),
                          ({"cpus_per_task": 0}, "cpus_per_task=0")]:
        with pytest.raises(ConfigError, match=rf"sbatch_script\({field}\)"):
            cfg.sbatch_script(**kwargs)
