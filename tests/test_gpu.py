"""What only a GPU shows: NCCL, AMP, channels_last, the tensor pipeline on the device.

GPU ids come from ``nbddp.list_gpus()`` (NVML or nvidia-smi), as a user's would, and this
process never initialises CUDA before the test that checks the kernel stays CUDA-free.
Every test skips without a GPU; the 2-GPU ones skip on a machine with one.
"""

import tempfile
from pathlib import Path

import pytest

from nbddp import ConfigError, TrainConfig, WorkerError, spawn_train
from nbddp.contract import rundir
from nbddp.contract.gpus import list_gpus
from conftest import EXAMPLES, WORKERS, free_port, make_tree, survivors, wait_for

pytestmark = pytest.mark.gpu
GPUS = [g.index for g in list_gpus()]
needs_gpu = pytest.mark.skipif(not GPUS, reason="needs an NVIDIA GPU")
needs_2_gpus = pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 NVIDIA GPUs")
GPU_WORKER = f"{WORKERS / 'gpu_worker.py'}"
FAULTY = f"{WORKERS / 'faulty.py'}"


def small_config(tmp_path, runs_dir, **kw):
    tree = make_tree(tmp_path / "data", per_class=16)
    base = dict(data_path=str(tree), model="resnet18", image_size=64, epochs=2, batch_size=4, lr=0.01,
                gpus=GPUS[:1], amp=True, channels_last=True, runs_dir=str(runs_dir))
    base.update(kw)
    return TrainConfig(**base)


def no_device_warning(run_dir: Path):
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank*.log"))
    assert "using the device under current context" not in logs
    assert "return func(*args, **kwargs)" not in logs


@needs_gpu
def test_builtin_gpu_run_keeps_this_process_cuda_free(tmp_path, runs_dir):
    """AMP + channels_last + tensor pipeline on GPU 0; export and prediction in this process."""
    import torch

    from nbddp import load_model, predict

    cfg = small_config(tmp_path, runs_dir, data_pipeline="tensor")
    result = spawn_train(cfg, echo=False)
    assert result.backend == "nccl"
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in result.metrics)
    # each epoch's peaks, from the GPU's own counters
    assert all(0 < m["gpu_mem_alloc_gib"] <= m["gpu_mem_reserved_gib"] for m in result.metrics), result.metrics
    assert result.weights_path and result.weights_path.exists()
    model, classes = load_model(result.run_dir)
    preds = predict(model, [str(next((tmp_path / "data" / "a").iterdir()))])
    assert preds[0].label in classes
    no_device_warning(result.run_dir)
    assert not torch.cuda.is_initialized(), "the launching process initialised CUDA"


@needs_gpu
def test_gpu_listing_without_cuda_in_this_process_matches_torch():
    import torch

    assert len(GPUS) == torch.cuda.device_count()


@needs_gpu
def test_amp_is_bf16_on_this_gpu_only_if_it_has_bf16_units():
    import torch

    from nbddp.rank.engine import autocast_dtype

    major, _ = torch.cuda.get_device_capability(0)
    assert autocast_dtype(torch.device("cuda", 0)) == (torch.bfloat16 if major >= 8 else torch.float16)


@needs_gpu
def test_linear_regression_on_nccl(runs_dir):
    result = spawn_train(f"{EXAMPLES}/linear_regression.py:train", gpus=GPUS[:1], runs_dir=runs_dir, echo=False)
    assert result.backend == "nccl"
    assert [v for (v,) in result.value["w"]] == pytest.approx([2.0, 3.0], abs=1e-3)


@needs_gpu
def test_custom_worker_with_nccl_collectives(runs_dir):
    gpus = GPUS[:2]
    n = len(gpus)
    result = spawn_train(f"{GPU_WORKER}:collectives", gpus=gpus, runs_dir=runs_dir, echo=False)
    v = result.value
    assert v["backend"] == "nccl" and v["device"] == "cuda:0"
    assert v["sum"] == [n * (n + 1) / 2] * 3
    assert v["gathered"] == list(range(n)) and v["broadcast"] == "from rank 0"
    assert v["mean"] == pytest.approx((n - 1) / 2) and v["any"] is True
    assert v["cpu_sum"] == n * (n - 1) / 2
    no_device_warning(result.run_dir)


@needs_gpu
def test_cuda_start_up_failure_shows_cudas_own_message(runs_dir):
    before = set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{EXAMPLES}/linear_regression.py:train", gpus=GPUS[:1], runs_dir=runs_dir, echo=False,
                    env={"CUDA_VISIBLE_DEVICES": "99"})
    err = info.value
    assert err.rank == 0 and err.exc_type in ("RuntimeError", "AcceleratorError"), str(err)
    assert "CUDA" in str(err) or "cuda" in str(err)
    assert "without a Python exception" not in str(err)
    assert set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*")) <= before


@needs_gpu
@pytest.mark.parametrize("amp, channels_last", [(True, False), (False, True)])
def test_builtin_worker_amp_and_channels_last_pil_pipeline(tmp_path, runs_dir, amp, channels_last):
    import torch

    result = spawn_train(small_config(tmp_path, runs_dir, amp=amp, channels_last=channels_last, num_workers=2),
                         echo=False)
    assert result.backend == "nccl"
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in result.metrics)


@needs_gpu
def test_builtin_worker_compiled_with_inductor_and_accumulation(tmp_path, runs_dir):
    import math

    result = spawn_train(small_config(tmp_path, runs_dir, epochs=1, compile=True, grad_accum_steps=2,
                                      optimizer="adamw", label_smoothing=0.1), echo=False)
    m = result.metrics[0]
    assert m["compile_s"] > 0 and math.isfinite(m["train_loss"]) and m["gpu_mem_alloc_gib"] > 0
    assert "torch.compile (backend inductor)" in (result.run_dir / "logs" / "rank0.log").read_text()
    assert result.weights_path and result.weights_path.exists()


@needs_gpu
def test_resume_on_gpu_continues_from_the_last_epoch(tmp_path, runs_dir):
    first = spawn_train(small_config(tmp_path, runs_dir, epochs=1, data_pipeline="tensor"), echo=False)
    resumed = spawn_train(small_config(tmp_path, runs_dir, epochs=2, data_pipeline="tensor",
                                       resume=str(first.run_dir)), echo=False)
    assert resumed.run_dir == first.run_dir
    assert [m["epoch"] for m in resumed.metrics] == [0, 1]  # the run folder's whole history
    assert "resumed from" in (resumed.run_dir / "logs" / "rank0.log").read_text()
    assert resumed.weights_path and resumed.weights_path.exists()


@needs_gpu
def test_stop_on_gpu_keeps_the_result_and_the_weights(tmp_path, runs_dir):
    cfg = small_config(tmp_path, runs_dir, epochs=200, data_pipeline="tensor")
    h = spawn_train(cfg, block=False, echo=False)
    assert wait_for(lambda: len(h.metrics) >= 1, timeout=180), "no epoch finished"
    h.stop()
    result = h.wait()
    assert result.stopped and result.weights_path and result.weights_path.exists()
    assert survivors(h.pids) == {}


@needs_gpu
def test_batch_augment_on_the_gpu_matches_the_cpu():
    import torch

    from nbddp.tasks.classification.tensor_data import BatchAugment

    x = torch.randint(0, 256, (8, 3, 36, 36), dtype=torch.uint8)
    cpu = BatchAugment(32, crop_scale=0.2, generator=torch.Generator().manual_seed(3))(x)
    gpu = BatchAugment(32, crop_scale=0.2, generator=torch.Generator().manual_seed(3))(x.cuda())
    assert gpu.device.type == "cuda"
    assert torch.allclose(gpu.cpu(), cpu, atol=1e-4)


@needs_gpu
def test_a_steady_training_step_never_waits_for_the_gpu():
    """CUDA's own check (``set_sync_debug_mode("error")``) over the steady steps: none of them makes the host wait
    for the device. Each step's loss is read at the next step, from pinned memory, behind an event."""
    import torch

    from nbddp.rank import readback
    from nbddp.rank.engine import train_one_epoch

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 3))
    model = model.to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 3, 32, 32, generator=g).to(dev), torch.randint(0, 3, (16,), generator=g).to(dev))
            for _ in range(8)]

    def batches():  # batch k is read during step k - 1: steps 2 to 5 run whole under the check
        for k, batch in enumerate(data):
            torch.cuda.set_sync_debug_mode("error" if 2 <= k < len(data) - 1 else "default")
            yield batch

    class Loader:
        def __len__(self):
            return len(data)

        def __iter__(self):
            return batches()

    try:
        with readback.recording() as reads:
            stats = train_one_epoch(model, opt, Loader(), dev, 0, amp_dtype=torch.bfloat16, channels_last=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats.steps == len(data) and torch.isfinite(torch.tensor(stats.loss))
    assert [(r.produced, r.step) for r in reads] == [(s, s + 1) for s in range(7)] + [(7, 7)]


@needs_2_gpus
def test_sync_bn_on_two_gpus_equals_one_process_on_the_whole_batch(runs_dir):
    import sys

    import torch

    sys.path.insert(0, str(WORKERS))
    import gpu_worker

    reference = gpu_worker.bn_model()
    x, y = gpu_worker.global_batch()
    gpu_worker.sgd_step(reference, x, y)
    result = spawn_train(f"{GPU_WORKER}:sync_bn_step", gpus=GPUS[:2], runs_dir=runs_dir, echo=False)
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(result.value[k].to(v.dtype), v, atol=1e-4, rtol=1e-4, msg=k)


@needs_2_gpus
def test_killed_rank_on_gpus_is_named(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{FAULTY}:kill_self", gpus=GPUS[:2], runs_dir=runs_dir, echo=False)
    assert info.value.rank == 1 and info.value.signal == "SIGKILL", str(info.value)


@needs_2_gpus
def test_hung_rank_on_gpus_is_named_before_nccls_watchdog(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{FAULTY}:hang_in_python", gpus=GPUS[:2], runs_dir=runs_dir, echo=False,
                    timeout_s=60, stall_timeout_s=5, grace_s=2)
    assert info.value.rank == 1 and "stopped making progress" in str(info.value), str(info.value)


@needs_gpu
@pytest.mark.parametrize("mode", ["cell", "script", "mp.spawn", "torchrun"])
def test_your_code_as_it_is_runs_on_the_chosen_gpu(tmp_path, runs_dir, monkeypatch, mode):
    """Each mode on one GPU with NCCL: the rank's LOCAL_RANK device is the GPU chosen."""
    import json
    import shutil

    own = tmp_path / "own"
    shutil.copytree(WORKERS / "own_code", own)
    monkeypatch.chdir(own)
    gpu = [GPUS[-1]]
    if mode == "cell":
        ns = {"__name__": "__main__"}
        exec("import torch\n\ndef train(ctx):\n    x = torch.ones(4, device=ctx.device)\n"
             "    return str(x.device), torch.cuda.current_device()\n", ns)
        assert spawn_train(ns["train"], gpus=gpu, runs_dir=runs_dir, echo=False).value == ("cuda:0", 0)
    elif mode == "script":
        spawn_train("torchrun_train.py", gpus=gpu, argv=["2", "1", "--batch_size", "4"], runs_dir=runs_dir, echo=False)
        assert json.loads((own / "report.json").read_text())["env"]["LOCAL_RANK"] == "0"
    elif mode == "mp.spawn":
        monkeypatch.setenv("OWN_CODE_PORT", str(free_port()))
        assert spawn_train("multigpu.py:main", 1, 2, 4, gpus=gpu, call="mp.spawn", runs_dir=runs_dir,
                           echo=False).value == 0
    else:
        assert spawn_train("env_fn.py:train", 3, gpus=gpu, call="torchrun", runs_dir=runs_dir,
                           echo=False).value == "run:3:1:0"


@needs_2_gpus
def test_a_collective_timeout_on_gpus_shows_stacks_and_the_flight_recorder(runs_dir):
    """Rank 1 stuck in Python, rank 0 in an NCCL all_reduce; no stall detector: NCCL's watchdog
    times the collective out and dumps its flight recorder into the run's private folder."""
    stuck = WORKERS / "stuck.py"
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{stuck}:one_rank_stuck", gpus=GPUS[:2], runs_dir=runs_dir, echo=False, timeout_s=20,
                    stall_timeout_s=0, grace_s=2)
    text = str(info.value)
    assert "rank 1 is in `load_batch` (stuck.py:" in text, text
    assert "NCCL's flight recorder, each rank's last collective: rank 0: all_reduce" in text, text


@needs_gpu
def test_the_decode_pipeline_decodes_jpegs_on_the_gpu_as_the_cpu_does(tmp_path, runs_dir):
    """nvJPEG and the CPU decoder agree to within rounding; the built-in worker trains on it."""
    from nbddp.tasks.classification.data import item_seed, scan_class_folders
    from nbddp.tasks.classification.decode_data import DeviceDecoder, FileBytes, collate

    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu import _flowers_like

    root = _flowers_like(tmp_path / "flowers", 40)
    _, samples = scan_class_folders(root)
    ds = FileBytes(samples)
    batch = collate([ds[(i, item_seed(0, 0, i))] for i in range(16)])[0]
    on_gpu = DeviceDecoder("cuda", 64, train=True)(batch.pin_memory())
    on_cpu = DeviceDecoder("cpu", 64, train=True)(batch)
    assert on_gpu.device.type == "cuda"
    assert (on_gpu.cpu() - on_cpu).abs().mean() < 0.05, "the same crops; decoders differ by rounding only"
    cfg = TrainConfig(data_path=str(root), model="resnet18", image_size=64, epochs=1, batch_size=8, gpus=GPUS[:1],
                      data_pipeline="decode", runs_dir=str(runs_dir), amp=True)
    assert spawn_train(cfg, echo=False).metrics[0]["images_per_s"] > 0


@needs_gpu
def test_profile_memory_keeps_the_allocator_history_at_an_out_of_memory_error(runs_dir):
    with pytest.raises(WorkerError) as info:
        spawn_train(f"{WORKERS / 'observed.py'}:out_of_memory", gpus=GPUS[:1], runs_dir=runs_dir, echo=False,
                    profile={"memory": True, "wait": 0, "warmup": 0, "active": 2})
    err = info.value
    assert err.exc_type == "OutOfMemoryError" and "pytorch.org/memory_viz" in str(err)
    snapshot = rundir.memory_snapshot_path(err.run_dir, 0)
    assert str(snapshot) in str(err) and snapshot.stat().st_size > 0
    import pickle

    with open(snapshot, "rb") as f:
        history = pickle.load(f)
    assert history["segments"] and any(history["device_traces"])  # allocations, with their stacks
    # the trace of the profiled steps is there too, on the GPU's activity
    assert rundir.profile_trace_path(err.run_dir, 0).is_file()


def test_profile_memory_is_refused_on_cpu_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="needs GPUs"):
        spawn_train(f"{WORKERS / 'observed.py'}:train", nprocs=1, runs_dir=tmp_path, profile={"memory": True})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- FSDP2
@needs_gpu
def test_fsdp_bf16_computes_in_bf16_keeps_fp32_weights_and_resumes(runs_dir):
    """mixed_precision="bf16": bf16 parameters in compute, fp32 master weights; a sharded checkpoint on the GPU."""
    worker = f"{WORKERS / 'sharded.py'}:train"
    first = spawn_train(worker, gpus=GPUS[:1], strategy="fsdp", runs_dir=runs_dir, echo=False,
                        kwargs=dict(steps=4, save_at=1, mixed_precision="bf16"))
    assert first.value["compute_dtype"] == "torch.bfloat16"
    assert first.value["master_dtype"] == ["torch.float32"]
    resumed = spawn_train(worker, gpus=GPUS[:1], strategy="fsdp", runs_dir=runs_dir, echo=False,
                          resume=first.run_dir, kwargs=dict(steps=4, resume=True, mixed_precision="bf16"))
    assert resumed.value["resumed"] == 1
    for k, v in first.value["weights"].items():
        assert v.device.type == "cpu" and (v - resumed.value["weights"][k]).abs().max() <= 1e-3, k


@needs_gpu
def test_fsdp_cpu_offload_keeps_the_shards_in_host_memory_and_trains_alike(runs_dir):
    worker = f"{WORKERS / 'sharded.py'}:train"
    runs = {offload: spawn_train(worker, gpus=GPUS[:1], strategy="fsdp", runs_dir=runs_dir, echo=False,
                                 kwargs=dict(steps=4, cpu_offload=offload)).value for offload in (False, True)}
    assert runs[True]["param_devices"] == ["cpu"] and runs[False]["param_devices"] == ["cuda"]
    for k, v in runs[False]["weights"].items():
        assert (v - runs[True]["weights"][k]).abs().max() <= 1e-4, k


@needs_gpu
def test_builtin_worker_sharded_on_a_gpu_reports_memory_and_exports(tmp_path, runs_dir):
    from nbddp import load_model

    result = spawn_train(small_config(tmp_path, runs_dir, strategy="fsdp", channels_last=False), echo=False)
    assert all(m["gpu_mem_alloc_gib"] > 0 for m in result.metrics)
    model, classes = load_model(result.run_dir)
    assert classes == ["a", "b", "c"]


@needs_2_gpus
def test_fsdp_holds_less_per_gpu_than_ddp(tmp_path):
    """bench/shard_worker.py's small transformer on 2 GPUs: FSDP's peak per GPU below DDP's."""
    import json

    peaks = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / f"{strategy}.json"
        spawn_train(str(Path(__file__).parents[1] / "bench" / "shard_worker.py"), gpus=GPUS[:2], echo=False,
                    argv=["--strategy", strategy, "--size", "tiny", "--bf16", "--out", str(out)],
                    runs_dir=tmp_path / "runs")
        record = json.loads(out.read_text())
        peaks[strategy] = max(r["total_bytes"] for r in record["ranks"])
    assert peaks["fsdp"] <= 0.6 * peaks["ddp"]
