"""GPU discovery in the kernel with NVML and nvidia-smi stubbed: odd fields, no driver,
CUDA_VISIBLE_DEVICES as users set it, and the tensor pipeline's GPU-memory preflight."""

import pytest
import torch

from nbddp import ConfigError, TrainConfig, spawn_train
from nbddp.gpus import BusyGPUWarning, GPUInfo, check_gpu_ids, cuda_visible_devices, gpu_setup_problem, list_gpus
from nbddp.tasks import classification
from nbddp.tensor_data import BatchAugment, cache_bytes
from conftest import WORKERS
from fake_gpu import H100, hide_nvidia_smi, install_fake_nvidia_smi, install_fake_nvml

A100 = "NVIDIA A100-SXM4-40GB"
FOUR = [(A100, f"GPU-{c * 8}-1111-2222-3333-444444444444", 40960, 40000 - i, i) for i, c in enumerate("abcd")]
UUID = [g[1] for g in FOUR]
INFO = f"{WORKERS / 'faulty.py'}:info"  # never started: the kernel refuses first
MIG_A = ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "MIG-0e2d3f6a-1b2c-5d4e-8f90-a1b2c3d4e5f6", 4864, 4800)
MIG_B = ("NVIDIA A100-SXM4-40GB MIG 2g.10gb", "MIG-7a8b9c0d-1e2f-5a3b-8c4d-e5f6a7b8c9d0", 9856, 9800)


# ------------------------------------------------------------------------------ fields the driver does not give
def test_nvidia_smi_fields_it_cannot_give_are_unknown_not_a_crash(tmp_path, monkeypatch):
    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=[
        H100,
        ("NVIDIA A100-SXM4-40GB", UUID[1], 40960, "[N/A]", "[Not Supported]"),
        ("NVIDIA GH200, Grace Hopper", UUID[2], "[N/A]", "[N/A]", "[N/A]"),  # a comma in the name, too
    ])
    gpus = list_gpus()
    assert gpus == [GPUInfo(0, H100[0], 81559, 81000, 0, H100[1]),
                    GPUInfo(1, "NVIDIA A100-SXM4-40GB", 40960, None, None, UUID[1]),
                    GPUInfo(2, "NVIDIA GH200, Grace Hopper", None, None, None, UUID[2])]
    assert gpus[1].label() == "GPU 1: NVIDIA A100-SXM4-40GB · ?/40.0 GiB used · ? busy · ? processes"
    assert gpus[2].label() == "GPU 2: NVIDIA GH200, Grace Hopper · ?/? GiB used · ? busy · ? processes"
    check_gpu_ids([2, 1])


def test_an_nvml_error_on_one_field_leaves_the_others(monkeypatch):
    nvml = install_fake_nvml(monkeypatch, FOUR[:3], fail={(0, "memory"), (1, "utilization"), (2, "handle")})
    gpus = list_gpus()
    assert gpus == [GPUInfo(0, A100, None, None, 0, UUID[0]),
                    GPUInfo(1, A100, 40960, 39999, None, UUID[1])]  # GPU 2 cannot be opened: not usable
    assert (1, "memory") in nvml.calls and (0, "utilization") in nvml.calls
    assert "?/? GiB used · 0% busy" in gpus[0].label()


def test_a_name_or_uuid_nvml_cannot_read_does_not_lose_the_gpu(monkeypatch):
    install_fake_nvml(monkeypatch, FOUR[:1], fail={(0, "name"), (0, "uuid")})
    assert list_gpus() == [GPUInfo(0, "NVIDIA GPU", 40960, 40000, 0, None)]


# ------------------------------------------------------------------------------ no driver
def test_no_driver_means_no_gpu_found_not_a_traceback(tmp_path, monkeypatch):
    install_fake_nvml(monkeypatch, init_error="Driver Not Loaded")
    hide_nvidia_smi(tmp_path, monkeypatch)
    assert list_gpus() == []
    with pytest.raises(ConfigError, match=r"gpus=\[0\]: no GPU found \(.*no NVIDIA driver.*use nprocs=N to train on CPU"):
        check_gpu_ids([0])


def test_nvidia_smi_failing_without_a_driver_means_no_gpu(tmp_path, monkeypatch):
    install_fake_nvidia_smi(tmp_path, monkeypatch, exit_code=9)
    assert list_gpus() == []
    with pytest.raises(ConfigError, match="no GPU found"):
        cuda_visible_devices([0])


def test_the_real_nvml_without_a_driver_lists_nothing(tmp_path, monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is here")
    hide_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert list_gpus() == []


def test_a_gpu_launch_without_a_driver_stops_in_the_kernel(tmp_path, monkeypatch, runs_dir):
    install_fake_nvidia_smi(tmp_path, monkeypatch, exit_code=9)
    with pytest.raises(ConfigError, match=r"no GPU found.*use nprocs=N"):
        spawn_train(INFO, gpus=[0], runs_dir=runs_dir)
    assert not runs_dir.exists()


# ------------------------------------------------------------------------------ CUDA_VISIBLE_DEVICES
def test_without_cuda_visible_devices_ids_are_indices_in_rank_order(monkeypatch):
    install_fake_nvml(monkeypatch, FOUR)
    assert [g.index for g in list_gpus()] == [0, 1, 2, 3]
    assert cuda_visible_devices([2, 0]) == "2,0"


def test_index_words_limit_the_list_and_pass_on_as_they_are(monkeypatch):
    install_fake_nvml(monkeypatch, FOUR, visible="3,1")
    assert [g.index for g in list_gpus()] == [3, 1]  # CUDA's order: cuda:0 is GPU 3
    assert cuda_visible_devices([1, 3]) == "1,3"
    with pytest.raises(ConfigError, match=r"(?s)no GPU with id \[0\].*CUDA_VISIBLE_DEVICES='3,1'.*GPU 3: .*GPU 1: "):
        cuda_visible_devices([0])


def test_uuid_words_pass_on_as_uuids_never_as_bare_indices(monkeypatch):
    install_fake_nvml(monkeypatch, FOUR, visible=f"{UUID[2]},{UUID[0]}")
    assert [(g.index, g.uuid) for g in list_gpus()] == [(2, UUID[2]), (0, UUID[0])]
    assert cuda_visible_devices([0, 2]) == f"{UUID[0]},{UUID[2]}"
    with pytest.raises(ConfigError, match=r"no GPU with id \[1\]"):
        cuda_visible_devices([1])  # a GPU outside the allocation


def test_a_unique_uuid_prefix_names_its_gpu_as_cuda_allows(monkeypatch):
    install_fake_nvml(monkeypatch, FOUR, visible="GPU-cccc")
    assert [g.index for g in list_gpus()] == [2]
    assert cuda_visible_devices([2]) == "GPU-cccc"


def test_mixed_words_and_cuda_stopping_at_the_first_unknown_one(monkeypatch):
    install_fake_nvml(monkeypatch, FOUR, visible=f"1,{UUID[3]}")
    assert cuda_visible_devices([3, 1]) == f"{UUID[3]},1"
    # CUDA hides every device from the first word that names none: "0,-1,2" shows GPU 0 only.
    install_fake_nvml(monkeypatch, FOUR, visible="0,-1,2")
    assert [g.index for g in list_gpus()] == [0]
    install_fake_nvml(monkeypatch, FOUR, visible="")
    assert list_gpus() == []
    with pytest.raises(ConfigError, match=r"no GPU found.*CUDA_VISIBLE_DEVICES='' hides them"):
        check_gpu_ids([0])


def test_uuid_words_work_with_nvidia_smi_too(tmp_path, monkeypatch):
    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=FOUR, visible=UUID[3])
    assert [g.index for g in list_gpus()] == [3]
    assert cuda_visible_devices([3]) == UUID[3]


def test_one_mig_instance_is_listed_under_its_gpu_and_passed_on(monkeypatch):
    install_fake_nvml(monkeypatch, FOUR[:2], visible=MIG_B[1], migs={1: [MIG_A, MIG_B]})
    assert list_gpus() == [GPUInfo(1, MIG_B[0], 9856, 9800, None, MIG_B[1])]
    assert cuda_visible_devices([1]) == MIG_B[1]
    assert gpu_setup_problem() is None


def test_several_mig_instances_are_refused_with_the_reason(monkeypatch, runs_dir):
    install_fake_nvml(monkeypatch, FOUR[:2], visible=f"{MIG_A[1]},{MIG_B[1]}", migs={1: [MIG_A, MIG_B]})
    assert list_gpus() == []
    reason = r"CUDA gives a process one MIG instance only.*one process per instance"
    assert gpu_setup_problem() is not None
    with pytest.raises(ConfigError, match=reason):
        cuda_visible_devices([1])
    with pytest.raises(ConfigError, match=reason):
        spawn_train(INFO, gpus=[1], runs_dir=runs_dir)
    assert not runs_dir.exists()


def test_an_unknown_mig_instance_says_where_to_find_them(tmp_path, monkeypatch):
    install_fake_nvml(monkeypatch, FOUR[:2], visible="MIG-ffff", migs={1: [MIG_A]})
    with pytest.raises(ConfigError, match=r"no MIG instance 'MIG-ffff' found here; `nvidia-smi -L` lists"):
        cuda_visible_devices([1])
    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=FOUR[:2], visible=MIG_A[1])
    with pytest.raises(ConfigError, match="through NVML: pip install nvidia-ml-py"):
        cuda_visible_devices([1])


def test_the_panel_says_why_several_mig_instances_give_no_gpu(tmp_path, monkeypatch):
    from nbddp.ui import TrainingPanel

    install_fake_nvml(monkeypatch, FOUR[:2], visible=f"{MIG_A[1]},{MIG_B[1]}", migs={1: [MIG_A, MIG_B]})
    panel = TrainingPanel(TrainConfig(runs_dir=str(tmp_path / "runs")))
    assert panel.gpu_checkboxes == [] and "one MIG instance" in panel.device_note.value


def test_the_panel_shows_gpus_whose_fields_are_unknown(tmp_path, monkeypatch):
    from nbddp.ui import TrainingPanel

    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=[H100, (A100, UUID[1], "[N/A]", "[N/A]", "[N/A]")])
    panel = TrainingPanel(TrainConfig(runs_dir=str(tmp_path / "runs")))
    assert [b.description for b in panel.gpu_checkboxes][1] == f"GPU 1: {A100} · ?/? GiB used · ? busy · ? processes"
    panel._refresh_gpus()


# ------------------------------------------------------------------------------ tensor pipeline on GPUs
def tensor_cfg(tree, runs_dir, gpus):
    return TrainConfig(data_path=str(tree), model="resnet18", image_size=224, epochs=1, batch_size=4, gpus=gpus,
                       runs_dir=str(runs_dir), data_pipeline="tensor")


def test_tensor_cache_larger_than_a_gpu_can_hold_is_refused(tree, runs_dir, tmp_path, monkeypatch):
    per_gpu = cache_bytes(36, 224)  # the tree's 36 images, kept whole on every GPU rank
    tight_mib = per_gpu // 2**20  # free memory smaller than twice the cache
    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=[H100, (A100, UUID[1], 40960, tight_mib, 0)])
    size = f"{per_gpu / 2**20:.1f} MiB"
    with pytest.raises(ConfigError, match=(rf"data_pipeline='tensor' would keep {size} of decoded images on each GPU "
                                           rf"\(36 images at 224 px\).*\(GPU 1 has {tight_mib}\.0 MiB free\).*"
                                           "use data_pipeline='pil'.*smaller image_size.*more free memory")):
        with pytest.warns(BusyGPUWarning, match="^GPU 1 is not idle"):  # its memory is nearly full
            spawn_train(tensor_cfg(tree, runs_dir, [0, 1]), echo=False)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_tensor_cache_that_fits_the_gpus_passes_the_preflight(tree, runs_dir, tmp_path, monkeypatch):
    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=[H100, (A100, UUID[1], "[N/A]", "[N/A]", "[N/A]")])
    assert classification.preflight(tensor_cfg(tree, runs_dir, [0, 1])) is None  # unknown free memory: no refusal


# ------------------------------------------------------------------------------ the batch augmentation's generator
def test_batch_augment_draws_on_the_cpu_exactly_as_before():
    # Recorded before generators could live on a GPU: the CPU stream must not change.
    aug = BatchAugment(16, crop_scale=0.2, generator=torch.Generator().manual_seed(7))
    assert aug.boxes(5, 40).tolist() == [[0.0, 2.0, 36.0, 28.0], [0.0, 3.0, 38.0, 37.0], [0.0, 1.0, 38.0, 38.0],
                                         [1.0, 2.0, 39.0, 31.0], [0.0, 6.0, 39.0, 32.0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batch_augment_with_a_cuda_generator_draws_on_the_gpu():
    x = torch.randint(0, 256, (8, 3, 40, 40), dtype=torch.uint8).cuda()
    outs = [BatchAugment(32, crop_scale=0.2, generator=torch.Generator(device="cuda").manual_seed(3))(x)
            for _ in range(2)]
    assert outs[0].device.type == "cuda" and outs[0].shape == (8, 3, 32, 32)
    assert torch.equal(outs[0], outs[1])
    boxes = BatchAugment(32, generator=torch.Generator(device="cuda").manual_seed(3)).boxes(64, 40)
    assert boxes.device.type == "cuda"
    top, left, h, w = boxes.cpu().unbind(1)
    assert bool(((top + h <= 40) & (left + w <= 40) & (h >= 1) & (w >= 1)).all())
