"""GPU discovery for the kernel, without initialising CUDA in it.

A kernel that initialised CUDA can no longer fork, and holds a CUDA context (hundreds of MB of
GPU memory) for as long as it lives. So the kernel asks NVML (``nvidia-ml-py``) or, failing
that, ``nvidia-smi``; ``torch.cuda`` is never touched here.

Indices are NVML's (PCI bus order). Workers are started with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
so ``gpus=[2]`` means the same card in ``nvidia-smi``, in the panel and in the worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .errors import ConfigError


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    memory_total_mib: int
    memory_free_mib: int
    utilization_pct: Optional[int]

    def label(self) -> str:
        util = "?" if self.utilization_pct is None else f"{self.utilization_pct}%"
        return (f"GPU {self.index}: {self.name} · {self.memory_free_mib / 1024:.1f}/"
                f"{self.memory_total_mib / 1024:.1f} GiB free · {util} busy")


def _visible_filter() -> Optional[List[int]]:
    """The kernel's own CUDA_VISIBLE_DEVICES, if it restricts the GPUs by index."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    try:
        return [int(x) for x in raw.split(",") if x.strip() != ""]
    except ValueError:
        return None  # UUIDs or MIG names: show everything, let CUDA resolve them


def _from_nvml() -> Optional[List[GPUInfo]]:
    try:
        import pynvml  # provided by nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                util = int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:  # noqa: BLE001 - not supported on some cards / MIG
                util = None
            out.append(GPUInfo(i, name.decode() if isinstance(name, bytes) else name,
                               mem.total // 2**20, mem.free // 2**20, util))
        return out
    finally:
        pynvml.nvmlShutdown()


def _from_nvidia_smi() -> Optional[List[GPUInfo]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,memory.free,utilization.gpu",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        util = int(parts[4]) if parts[4].isdigit() else None
        out.append(GPUInfo(int(parts[0]), parts[1], int(float(parts[2])), int(float(parts[3])), util))
    return out


def list_gpus() -> List[GPUInfo]:
    """The GPUs this kernel may use, with name, memory and utilisation (empty without GPUs)."""
    gpus = _from_nvml()
    if gpus is None:
        gpus = _from_nvidia_smi() or []
    allowed = _visible_filter()
    if allowed is not None:
        gpus = [g for g in gpus if g.index in allowed]
    return gpus


def check_gpu_ids(ids: Sequence[int], available: Optional[Sequence[GPUInfo]] = None) -> None:
    """Refuse out-of-range or repeated GPU ids, listing the GPUs there are."""
    available = list_gpus() if available is None else list(available)
    listing = "\n".join("  " + g.label() for g in available) or "  (none: no NVIDIA driver or GPU found)"
    if len(set(ids)) != len(ids):
        raise ConfigError(f"gpus={list(ids)} lists a GPU twice; each process needs its own GPU. GPUs here:\n{listing}")
    known = {g.index for g in available}
    missing = [i for i in ids if i not in known]
    if missing:
        fix = "use nprocs=N to train on CPU processes" if not available else "choose ids from the list"
        raise ConfigError(f"gpus={list(ids)}: no GPU with id {missing}; {fix}. GPUs here:\n{listing}")
