"""GPU discovery and choice in the kernel, with NVML and nvidia-smi stubbed.

Discovery: odd fields, no driver, CUDA_VISIBLE_DEVICES as users set it, and the tensor pipeline's
GPU-memory preflight. Choice, like a good colleague: each GPU's memory in use, utilisation and other
processes, the idle rule, ``gpus="idle"`` in TrainConfig / spawn_train / the CLI (stopped before any
worker starts), and the warning for a busy GPU chosen by hand.
"""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from nbddp import ConfigError, TrainConfig, cli, spawn_train
from nbddp.kernel import launch as launch_mod
from nbddp.kernel import ranks as ranks_mod
from nbddp.contract.gpus import (IDLE, IDLE_RULE, BusyGPUWarning, GPUInfo, _smi_process_counts, check_gpu_ids,
                        cuda_visible_devices, gpu_setup_problem, idle_gpus, list_gpus, preselected_gpus, resolve_gpus)
from nbddp.tasks.classification import planning as classification
from nbddp.tasks.classification.tensor_data import BatchAugment, cache_bytes
from conftest import WORKERS, small_cfg
from fake_gpu import H100, hide_nvidia_smi, install_fake_nvidia_smi, install_fake_nvml

A100 = "NVIDIA A100-SXM4-40GB"
FOUR = [(A100, f"GPU-{c * 8}-1111-2222-3333-444444444444", 40960, 40000 - i, i) for i, c in enumerate("abcd")]
UUID = [g[1] for g in FOUR]
INFO = f"{WORKERS / 'faulty.py'}:info"  # never started: the kernel refuses first, or start_processes is stubbed
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


# ============================================================================== choosing GPUs
H100_NAME = H100[0]
GIB = 1024
# GPU 0 and 2 idle; GPU 1 holds 12 GiB of someone's work; GPU 3 has its memory free but is 50% busy.
SHARED = [(H100_NAME, UUID[0], 80 * GIB, 80 * GIB - 600, 0),
          (H100_NAME, UUID[1], 80 * GIB, 68 * GIB, 35),
          (H100_NAME, UUID[2], 80 * GIB, 79 * GIB, 2),
          (H100_NAME, UUID[3], 80 * GIB, 78 * GIB, 50)]
BUSY = [SHARED[1], SHARED[3]]
PROCS = {0: [], 1: [4101, 4102], 2: [4201], 3: [4301]}


class Stopped(Exception):
    """Raised by the stubbed ``start_processes``: the launch got as far as starting workers."""


@pytest.fixture
def no_workers(monkeypatch):
    """Stop spawn_train where it would start workers; record what it would have started them with."""
    seen = {}

    def start_processes(fn, args, nprocs, **kwargs):
        spec = args[0]
        seen.update(gpus=list(spec.gpus), world=nprocs, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                    run_dir=spec.run_dir)
        raise Stopped

    monkeypatch.setattr(ranks_mod.mp, "start_processes", start_processes)
    return seen


def no_busy_warning(record):
    return not [w for w in record if issubclass(w.category, BusyGPUWarning)]


# ------------------------------------------------------------------------------ what each GPU reports
def test_nvml_rows_carry_memory_in_use_utilisation_and_other_processes(monkeypatch):
    procs = {**PROCS, 2: [4201, os.getpid()]}  # the kernel's own CUDA context is not another process
    install_fake_nvml(monkeypatch, SHARED, procs=procs)
    gpus = list_gpus()
    assert [(g.memory_used_mib, g.utilization_pct, g.processes) for g in gpus] == [
        (600, 0, 0), (12 * GIB, 35, 2), (GIB, 2, 1), (2 * GIB, 50, 1)]
    assert gpus[1].label() == f"GPU 1: {H100_NAME} · 12.0/80.0 GiB used · 35% busy · 2 processes"
    assert gpus[2].label() == f"GPU 2: {H100_NAME} · 1.0/80.0 GiB used · 2% busy · 1 process"
    assert gpus[0].state() == "0.6/80.0 GiB used, 0% busy, 0 processes"
    assert [g.idle for g in gpus] == [True, False, True, False]


def test_nvidia_smi_fallback_counts_processes_per_gpu(tmp_path, monkeypatch):
    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=SHARED, procs={1: [4101, 4102], 3: [os.getpid()]})
    gpus = list_gpus()
    assert [g.processes for g in gpus] == [0, 2, 0, 0]
    assert [g.memory_used_mib for g in gpus] == [600, 12 * GIB, GIB, 2 * GIB]
    assert "12.0/80.0 GiB used · 35% busy · 2 processes" in gpus[1].label()


def test_an_nvidia_smi_without_compute_apps_leaves_processes_unknown(tmp_path, monkeypatch):
    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=SHARED[:2])  # refuses --query-compute-apps
    gpus = list_gpus()
    assert [g.processes for g in gpus] == [None, None]
    assert [g.memory_used_mib for g in gpus] == [600, 12 * GIB]
    assert gpus[1].label().endswith("· 35% busy · ? processes")


def test_compute_apps_output_is_read_strictly():
    me = os.getpid()
    assert _smi_process_counts("") == {}
    assert _smi_process_counts("No running processes found\n") == {}
    assert _smi_process_counts(f"{UUID[0]}, 12\n{UUID[0]}, 13\n{UUID[1]}, {me}\n") == {UUID[0]: 2, UUID[1]: 0}
    assert _smi_process_counts("GPU 0: something else entirely\n") is None  # not rows: unknown, not zero
    assert _smi_process_counts(f"{UUID[0]}, [N/A]\n") is None
    assert _smi_process_counts(None) is None


def test_an_nvml_process_call_that_fails_is_unknown_and_the_rest_stays(monkeypatch):
    install_fake_nvml(monkeypatch, SHARED[:2], procs=PROCS, fail={(1, "processes")})
    assert [g.processes for g in list_gpus()] == [0, None]
    install_fake_nvml(monkeypatch, SHARED[:2])  # a driver without the call
    gpus = list_gpus()
    assert [g.processes for g in gpus] == [None, None] and [g.utilization_pct for g in gpus] == [0, 35]


def test_unknown_memory_reads_as_unknown_in_use():
    g = GPUInfo(0, H100_NAME, 80 * GIB, None, 3, processes=1)
    assert g.memory_used_mib is None and g.label() == f"GPU 0: {H100_NAME} · ?/80.0 GiB used · 3% busy · 1 process"


# ------------------------------------------------------------------------------ the idle rule
@pytest.mark.parametrize("total, free, util, idle", [
    (1000, 900, 10, True),     # exactly 90% free, exactly 10% busy: idle
    (1000, 899, 0, False),     # just under 90% free
    (1000, 1000, 11, False),   # just over 10% busy
    (1000, 900, None, True),   # utilisation unknown (MIG): the memory decides
    (1000, 899, None, False),
    (1000, None, 0, False),    # memory unknown: never idle
    (None, 900, 0, False),
    (0, 0, 0, False),
    (81559, 73404, 0, True),   # 90.0004% free
    (81559, 73402, 0, False),  # 89.9979% free
])
def test_idle_rule_edges(total, free, util, idle):
    assert GPUInfo(0, H100_NAME, total, free, util).idle is idle


def test_the_rule_is_one_string_the_panel_can_show():
    assert IDLE_RULE == "idle: at least 90% memory free and at most 10% busy"
    assert IDLE == "idle"


def test_processes_alone_do_not_make_a_gpu_busy():
    # The rule is memory and utilisation: a small idle context elsewhere does not take the GPU away.
    assert GPUInfo(0, H100_NAME, 80 * GIB, 79 * GIB, 0, processes=3).idle


# ------------------------------------------------------------------------------ the panel's API
def test_idle_gpus_and_what_a_picker_ticks(monkeypatch):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    assert idle_gpus() == [0, 2]
    assert preselected_gpus() == ([0, 2], "not ticked, in use: 1 (12.0/80.0 GiB used, 35% busy, 2 processes), "
                                          "3 (2.0/80.0 GiB used, 50% busy, 1 process)")
    gpus = list_gpus()
    assert idle_gpus(gpus[:1]) == [0] and preselected_gpus(gpus[:1]) == ([0], "")
    assert preselected_gpus(gpus[1::2]) == ([], "no idle GPU: 1 (12.0/80.0 GiB used, 35% busy, 2 processes), "
                                                "3 (2.0/80.0 GiB used, 50% busy, 1 process) — tick one to share it")
    assert preselected_gpus([]) == ([], "")


# ------------------------------------------------------------------------------ resolving gpus="idle"
def test_idle_resolves_to_the_idle_gpus_in_cuda_order(monkeypatch):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    assert resolve_gpus("idle") == [0, 2]
    assert resolve_gpus(" IDLE ") == [0, 2]
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS, visible="2,1,0")
    assert resolve_gpus("idle") == [2, 0]  # the kernel's CUDA_VISIBLE_DEVICES order and limits


def test_no_idle_gpu_is_an_error_naming_each_gpus_state_and_the_fix(monkeypatch):
    install_fake_nvml(monkeypatch, BUSY, procs={0: [4101, 4102], 1: [4301]})
    with pytest.raises(ConfigError) as info:
        resolve_gpus("idle")
    text = str(info.value)
    assert text.startswith(f"gpus='idle': no GPU is idle now ({IDLE_RULE}):\n")
    assert f"  GPU 0: {H100_NAME} · 12.0/80.0 GiB used · 35% busy · 2 processes\n" in text
    assert f"  GPU 1: {H100_NAME} · 2.0/80.0 GiB used · 50% busy · 1 process\n" in text
    assert "Choose GPUs explicitly to share one (gpus=[0], --gpus 0" in text and "or wait until one is free" in text


def test_idle_without_any_gpu_is_the_no_gpu_error(tmp_path, monkeypatch):
    install_fake_nvml(monkeypatch, init_error="Driver Not Loaded")
    hide_nvidia_smi(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match=r"^gpus='idle': no GPU found \(.*no NVIDIA driver.*use nprocs=N to train"):
        resolve_gpus("idle")


def test_idle_with_several_mig_instances_says_why(monkeypatch):
    mig_a = ("A100 MIG 1g.5gb", "MIG-0e2d3f6a-1b2c-5d4e-8f90-a1b2c3d4e5f6", 4864, 4800)
    mig_b = ("A100 MIG 2g.10gb", "MIG-7a8b9c0d-1e2f-5a3b-8c4d-e5f6a7b8c9d0", 9856, 9800)
    install_fake_nvml(monkeypatch, SHARED[:2], visible=f"{mig_a[1]},{mig_b[1]}", migs={1: [mig_a, mig_b]})
    with pytest.raises(ConfigError, match="gpus='idle': .*CUDA gives a process one MIG instance only"):
        resolve_gpus("idle")


def test_other_words_and_ids_pass_as_before(monkeypatch):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with pytest.raises(ConfigError, match=r"gpus='0,1': give GPU ids .* or gpus='idle'"):
        resolve_gpus("0,1")
    with pytest.raises(ConfigError, match="gpus=3: give a list of GPU ids"):
        resolve_gpus(3)
    with warnings.catch_warnings(record=True) as record:
        assert resolve_gpus([2, 0]) == [2, 0] and resolve_gpus(None) == [] and resolve_gpus(()) == []
    assert no_busy_warning(record)


# ------------------------------------------------------------------------------ a busy GPU chosen by hand
def test_a_busy_gpu_chosen_by_hand_warns_in_one_line_naming_it(monkeypatch):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with pytest.warns(BusyGPUWarning) as record:
        assert resolve_gpus([0, 1, 3]) == [0, 1, 3]
    assert [str(w.message) for w in record] == [
        "GPU 1 is not idle (12.0/80.0 GiB used, 35% busy, 2 processes): this run shares it with what runs "
        "there; gpus='idle' picks idle GPUs only",
        "GPU 3 is not idle (2.0/80.0 GiB used, 50% busy, 1 process): this run shares it with what runs "
        "there; gpus='idle' picks idle GPUs only"]
    assert all(w.filename == __file__ for w in record)  # shown at the caller's line (the cell), not nbddp's


def test_the_warning_repeats_at_every_launch(monkeypatch):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # Python's own action for a UserWarning: once per line of code
        for _ in range(2):
            resolve_gpus([1])  # the same message from the same line, launch after launch
    assert len(record) == 2
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("ignore", BusyGPUWarning)  # the user's filters still apply
        resolve_gpus([1])
    assert record == []


def test_spawn_train_warns_for_a_busy_gpu_before_the_launch(monkeypatch, runs_dir, no_workers):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with pytest.warns(BusyGPUWarning, match=r"^GPU 1 is not idle \(12\.0/80\.0 GiB used, 35% busy, 2 processes\)"):
        with pytest.raises(Stopped):
            spawn_train(INFO, gpus=[1, 0], runs_dir=runs_dir, echo=False)
    assert no_workers["gpus"] == [1, 0] and no_workers["visible"] == "1,0"


# ------------------------------------------------------------------------------ spawn_train(gpus="idle")
def test_spawn_train_idle_picks_the_idle_gpus_before_any_worker(monkeypatch, runs_dir, no_workers):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(Stopped):
            spawn_train(INFO, gpus="idle", runs_dir=runs_dir, echo=False)
    assert no_busy_warning(record)
    assert no_workers["gpus"] == [0, 2] and no_workers["world"] == 2 and no_workers["visible"] == "0,2"


def test_spawn_train_idle_with_none_idle_stops_in_the_kernel(monkeypatch, runs_dir, no_workers):
    install_fake_nvml(monkeypatch, BUSY, procs={0: [4101, 4102], 1: [4301]})
    with pytest.raises(ConfigError, match=r"(?s)gpus='idle': no GPU is idle now.*GPU 0: .*2 processes.*wait"):
        spawn_train(INFO, gpus="idle", runs_dir=runs_dir, echo=False)
    assert no_workers == {} and not runs_dir.exists()


def test_spawn_train_refuses_other_gpu_words(monkeypatch, runs_dir, no_workers):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with pytest.raises(ConfigError, match=r"gpus='0,2': give GPU ids"):
        spawn_train(INFO, gpus="0,2", runs_dir=runs_dir, echo=False)
    assert no_workers == {}


# ------------------------------------------------------------------------------ TrainConfig(gpus="idle")
def test_config_takes_ids_or_idle_and_nothing_else(tmp_path):
    assert TrainConfig(gpus="idle").gpus == "idle" and TrainConfig(gpus=" Idle").gpus == "idle"
    assert TrainConfig(gpus=[1, 0]).gpus == (1, 0) and TrainConfig(gpus=None).gpus == ()
    assert TrainConfig(gpus="idle").device_type == "cuda"
    assert TrainConfig(gpus="").gpus == ()  # as before: no GPU
    for bad in ("0,1", "all", ["a"], [0, "x"], 3):
        with pytest.raises(ConfigError, match=r"TrainConfig\.gpus=.*must be GPU ids .* or 'idle' for the GPUs idle "
                                              r"at launch \(idle: at least 90% memory free"):
            TrainConfig(gpus=bad)
    with pytest.raises(ConfigError, match="lists a GPU twice"):
        TrainConfig(gpus=(1, 1))
    with pytest.raises(ConfigError, match="GPU ids are >= 0"):
        TrainConfig(gpus=(-1,))


def test_config_json_round_trips_idle(tmp_path):
    cfg = TrainConfig(gpus="idle", runs_dir=str(tmp_path / "runs"))
    assert cfg.to_dict()["gpus"] == "idle"
    path = cfg.save(tmp_path / "config.json")
    assert json.loads(path.read_text())["gpus"] == "idle"
    assert TrainConfig.load(path) == cfg
    assert TrainConfig.load(TrainConfig(gpus=[2, 0]).save(tmp_path / "ids.json")).gpus == (2, 0)


def test_an_idle_config_has_no_world_size_until_launch():
    with pytest.raises(ConfigError, match="gpus='idle' picks its GPUs at launch"):
        TrainConfig(gpus="idle").world_size


def test_spawn_train_with_an_idle_config_runs_on_the_idle_gpus(tree, runs_dir, monkeypatch, no_workers):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(Stopped):
            spawn_train(small_cfg(tree, runs_dir, epochs=1, gpus="idle", name="colleague"), echo=False)
    assert no_busy_warning(record)
    assert no_workers["gpus"] == [0, 2] and no_workers["world"] == 2 and no_workers["visible"] == "0,2"
    saved = json.loads((Path(no_workers["run_dir"]) / "config.json").read_text())
    assert saved["gpus"] == [0, 2]  # the run records the GPUs it ran on


def test_spawn_train_with_an_idle_config_and_no_idle_gpu_makes_no_run(tree, runs_dir, monkeypatch, no_workers):
    install_fake_nvml(monkeypatch, BUSY)
    with pytest.raises(ConfigError, match="gpus='idle': no GPU is idle now"):
        spawn_train(small_cfg(tree, runs_dir, epochs=1, gpus="idle", name="colleague"), echo=False)
    assert no_workers == {} and not runs_dir.exists()


def test_spawn_train_with_a_config_on_a_busy_gpu_warns(tree, runs_dir, monkeypatch, no_workers):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    with pytest.warns(BusyGPUWarning, match="^GPU 3 is not idle"):
        with pytest.raises(Stopped):
            spawn_train(small_cfg(tree, runs_dir, epochs=1, gpus=[3], name="colleague"), echo=False)
    assert no_workers["gpus"] == [3]


# ------------------------------------------------------------------------------ the CLI
@pytest.fixture
def cli_launches(monkeypatch):
    calls = []

    def fake_spawn_train(target, **kwargs):
        calls.append((target, kwargs))
        raise SystemExit(0)  # nothing runs

    monkeypatch.setattr(launch_mod, "spawn_train", fake_spawn_train)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_cli_gpus_idle_trains_on_the_idle_gpus(tree, tmp_path, monkeypatch, capsys, cli_launches):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    args = ["train", "--data-path", str(tree), "--runs-dir", str(tmp_path / "runs"), "--gpus", "idle"]
    with pytest.raises(SystemExit):
        cli.main(args)
    (cfg, _kwargs), = cli_launches
    assert cfg.gpus == (0, 2)
    assert "with GPUs [0, 2]" in capsys.readouterr().out


def test_cli_gpus_idle_from_a_config_file_and_in_run(tree, tmp_path, monkeypatch, cli_launches):
    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    path = TrainConfig(data_path=str(tree), gpus="idle", runs_dir=str(tmp_path / "runs")).save(tmp_path / "c.json")
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", str(path)])
    assert cli_launches[-1][0].gpus == (0, 2)
    with pytest.raises(SystemExit):
        cli.main(["run", INFO, "--gpus", "IDLE"])
    assert cli_launches[-1][1]["gpus"] == "idle"  # resolved by spawn_train, in the kernel
    ns = cli.argparse.Namespace(config=str(path), **{f: None for f in TrainConfig.__dataclass_fields__})
    assert cli.build_config(ns).gpus == "idle"  # kept as a word until the launch (torchrun ignores gpus)


def test_cli_gpus_idle_with_none_idle_exits_with_the_reason(tree, tmp_path, monkeypatch, capsys, cli_launches):
    install_fake_nvml(monkeypatch, BUSY, procs={0: [4101, 4102], 1: [4301]})
    code = cli.main(["train", "--data-path", str(tree), "--runs-dir", str(tmp_path / "runs"), "--gpus", "idle"])
    err = capsys.readouterr().err
    assert code == 2 and cli_launches == []
    assert "gpus='idle': no GPU is idle now" in err and "2 processes" in err and "Traceback" not in err
    assert cli.main(["train", "--gpus", "0,x"]) == 2
    assert "'idle' (the GPUs idle at launch)" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the panel's picker
def test_the_panel_ticks_only_the_idle_gpus_and_says_the_rule(tmp_path, monkeypatch):
    from nbddp import TrainingPanel

    install_fake_nvml(monkeypatch, SHARED, procs=PROCS)
    panel = TrainingPanel(TrainConfig(runs_dir=str(tmp_path / "runs")))
    assert [b.value for b in panel.gpu_checkboxes] == [True, False, True, False]
    note = panel.gpu_rule_note.value
    assert IDLE_RULE in note and "not ticked, in use: 1 (" in note and "2 processes" in note
    # a choice the caller made is kept, busy or not (the launch warns then)
    chosen = TrainingPanel(TrainConfig(gpus=(1,), runs_dir=str(tmp_path / "runs")))
    assert [b.value for b in chosen.gpu_checkboxes] == [False, True, False, False]
    assert TrainingPanel(TrainConfig(gpus="idle", runs_dir=str(tmp_path / "runs"))).config.gpus == (0, 2)


def test_the_panel_ticks_nothing_when_no_gpu_is_idle_and_says_why(tmp_path, monkeypatch):
    from nbddp import TrainingPanel

    install_fake_nvml(monkeypatch, BUSY, procs={0: [1], 1: [2]})
    panel = TrainingPanel(f"{WORKERS / 'faulty.py'}:info", runs_dir=str(tmp_path / "runs"))
    assert [b.value for b in panel.gpu_checkboxes] == [False, False]
    assert "no idle GPU" in panel.gpu_rule_note.value and "tick one to share it" in panel.gpu_rule_note.value


def test_a_busy_gpu_warns_a_launch_from_python_c(tmp_path, monkeypatch):
    """``python -c`` has no source for its __main__ (its loader is the built-in importer): the busy-GPU
    warning still shows, where it used to raise ImportError("'__main__' is not a built-in module")."""
    import subprocess
    import sys

    from conftest import ROOT

    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=[(H100[0], H100[1], 81559, 40000, 90)])
    code = ("import sys; sys.modules['pynvml'] = None  # NVML absent: the fake nvidia-smi answers\n"
            "from nbddp.contract.gpus import resolve_gpus\n"
            "print(resolve_gpus([0]))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[0]"
    assert "BusyGPUWarning: GPU 0 is not idle" in p.stderr, p.stderr
