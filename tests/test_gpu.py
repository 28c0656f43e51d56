"""What only a GPU shows: NCCL, AMP, channels_last, the tensor pipeline on the device. Skipped without CUDA."""

import pytest
import torch

from nbddp import TrainConfig, spawn_train
from nbddp.gpus import list_gpus
from conftest import EXAMPLES, make_tree

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_gpu_listing_without_cuda_in_this_process_matches_torch():
    assert [g.index for g in list_gpus()] == list(range(torch.cuda.device_count()))


@needs_cuda
def test_linear_regression_on_nccl(runs_dir):
    result = spawn_train(f"{EXAMPLES}/linear_regression.py:train", gpus=[0], runs_dir=runs_dir, echo=False)
    assert result.backend == "nccl"
    assert [v for (v,) in result.value["w"]] == pytest.approx([2.0, 3.0], abs=1e-3)


@needs_cuda
@pytest.mark.parametrize("amp, channels_last", [(True, False), (True, True), (False, True)])
def test_builtin_worker_amp_and_channels_last(tmp_path, runs_dir, amp, channels_last):
    tree = make_tree(tmp_path / "data", per_class=16)
    gpus = list(range(min(2, torch.cuda.device_count())))
    cfg = TrainConfig(data_path=str(tree), model="resnet18", image_size=64, epochs=2, batch_size=4,
                      lr=0.01, gpus=gpus, amp=amp, channels_last=channels_last, runs_dir=str(runs_dir))
    result = spawn_train(cfg, echo=False)
    assert result.backend == "nccl"
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in result.metrics)


@needs_cuda
def test_batch_augment_on_the_gpu_matches_the_cpu():
    from nbddp.tensor_data import BatchAugment

    x = torch.randint(0, 256, (8, 3, 36, 36), dtype=torch.uint8)
    cpu = BatchAugment(32, crop_scale=0.2, generator=torch.Generator().manual_seed(3))(x)
    gpu = BatchAugment(32, crop_scale=0.2, generator=torch.Generator().manual_seed(3))(x.cuda())
    assert gpu.device.type == "cuda"
    assert torch.allclose(gpu.cpu(), cpu, atol=1e-4)


@needs_cuda
def test_builtin_worker_tensor_pipeline_on_the_gpu(tmp_path, runs_dir):
    tree = make_tree(tmp_path / "data", per_class=16)
    gpus = list(range(min(2, torch.cuda.device_count())))
    cfg = TrainConfig(data_path=str(tree), model="resnet18", image_size=64, epochs=2, batch_size=4, lr=0.01,
                      gpus=gpus, amp=True, channels_last=True, data_pipeline="tensor", runs_dir=str(runs_dir))
    result = spawn_train(cfg, echo=False)
    assert result.backend == "nccl"
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in result.metrics)
    assert result.weights_path and result.weights_path.exists()
