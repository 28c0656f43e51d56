"""Make the kernel-side GPU listing see GPUs on a machine without any: a fake ``nvidia-smi`` or NVML.

Only the listing in the test process is faked (``nbddp.contract.gpus``); a worker launched on such a GPU
meets the real CUDA of this machine, which is how a test sees CUDA's own start-up error.

A GPU is ``(name, uuid, memory_total_mib, memory_free_mib, utilization_pct)``; a value may be a
string as the driver prints it, e.g. ``"[N/A]"`` or ``"[Not Supported]"``. GPU i has index i.

Compute processes are opt-in (``procs={gpu index: [pid, ...]}``, GPUs not named have none);
without them the fakes cannot list processes (NVML: "Function Not Found", nvidia-smi: not a valid
field), as an old driver, so every GPU's ``processes`` is unknown.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import types
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

H100 = ("NVIDIA H100 80GB HBM3", "GPU-2f7c1e4a-9b1d-4c55-8e3a-6d0b5f1a9c01", 81559, 81000, 0)

_SCRIPT = r'''#!{python}
# A fake nvidia-smi written by tests/fake_gpu.py: answers --query-gpu=... and -L for fixed GPUs.
import json, sys

GPUS = json.loads({gpus!r})
PROCS = json.loads({procs!r})
EXIT = {exit_code}
if EXIT:
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
          "Make sure that the latest NVIDIA driver is installed and running.")
    sys.exit(EXIT)
apps = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--query-compute-apps=")]
if apps:
    if PROCS is None:
        print(f'Field "{{apps[0].split(",")[0]}}" is not a valid field to query.', file=sys.stderr)
        sys.exit(2)
    for i, pids in sorted(PROCS.items()):
        for pid in pids:
            values = {{"gpu_uuid": GPUS[int(i)][1], "pid": pid, "used_memory": 1024, "process_name": "python"}}
            print(", ".join(str(values[f]) for f in apps[0].split(",")))
    sys.exit(0)
query = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--query-gpu=")]
if not query:
    for i, (name, uuid, *_rest) in enumerate(GPUS):
        print(f"GPU {{i}}: {{name}} (UUID: {{uuid}})")
    sys.exit(0)
units = "nounits" not in " ".join(sys.argv)
for i, (name, uuid, total, free, util) in enumerate(GPUS):
    values = {{"index": i, "name": name, "uuid": uuid, "memory.total": total, "memory.free": free,
               "utilization.gpu": util, "pci.bus_id": f"00000000:{{0x18 + i:02X}}:00.0"}}
    row = []
    for field in query[0].split(","):
        if field not in values:
            print(f'Field "{{field}}" is not a valid field to query.', file=sys.stderr)
            sys.exit(2)
        v = values[field]
        if units and isinstance(v, int) and field.startswith("memory."):
            v = f"{{v}} MiB"
        elif units and isinstance(v, int) and field.startswith("utilization."):
            v = f"{{v}} %"
        row.append(str(v))
    print(", ".join(row))
'''


def install_fake_nvidia_smi(tmp_path: Path, monkeypatch, gpus: Sequence[Tuple] = (H100,), exit_code: int = 0,
                            visible: Optional[str] = None, procs: Optional[Dict[int, List[int]]] = None) -> Path:
    """Put a fake ``nvidia-smi`` first on ``PATH`` and make NVML unavailable, for this test.

    Args:
        tmp_path: where the script is written (its own folder, put first on ``PATH``).
        monkeypatch: pytest's, so that everything is undone after the test.
        gpus: the GPUs it prints, GPU i with index i.
        exit_code: non-zero makes it fail as it does without a driver.
        visible: the kernel's ``CUDA_VISIBLE_DEVICES`` for the test (default: unset).
        procs: pids computing on each GPU (``--query-compute-apps``); ``None``: the field is refused.

    Returns:
        The script's path.
    """
    folder = tmp_path / "fake-nvidia-smi"
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(_SCRIPT.format(python=sys.executable, gpus=json.dumps([list(g) for g in gpus]),
                                     procs=json.dumps(procs), exit_code=int(exit_code)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError: NVML absent
    _set_visible(monkeypatch, visible)
    return script


def hide_nvidia_smi(tmp_path: Path, monkeypatch) -> None:
    """``PATH`` without any ``nvidia-smi``: an empty folder (enough for the listing, not for launching)."""
    folder = tmp_path / "no-nvidia-smi"
    folder.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(folder))
    assert shutil.which("nvidia-smi") is None


def _set_visible(monkeypatch, visible: Optional[str]) -> None:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


# ------------------------------------------------------------------------------ a fake pynvml
class NVMLError(Exception):
    """Stands for pynvml.NVMLError (its subclasses carry the code; the message is enough here)."""


class _Memory:
    def __init__(self, total_mib: int, free_mib: int):
        self.total, self.free, self.used = total_mib * 2**20, free_mib * 2**20, (total_mib - free_mib) * 2**20


class _Process:
    def __init__(self, pid: int):
        self.pid, self.usedGpuMemory = pid, 1024 * 2**20


class _Util:
    def __init__(self, gpu: int):
        self.gpu, self.memory = gpu, 0


def fake_nvml(gpus: Sequence[Tuple] = (H100,), fail: Iterable[Tuple[int, str]] = (),
              init_error: Optional[str] = None, migs: Optional[Dict[int, List[Tuple]]] = None,
              procs: Optional[Dict[int, List[int]]] = None) -> types.ModuleType:
    """A ``pynvml`` module that answers for ``gpus``.

    Args:
        gpus: as for :func:`install_fake_nvidia_smi` (numbers only).
        fail: ``(gpu index, field)`` pairs whose call raises NVMLError: field is one of
            ``"handle"``, ``"name"``, ``"uuid"``, ``"memory"``, ``"utilization"``, ``"processes"``.
        init_error: make ``nvmlInit`` raise with this message (no driver).
        migs: MIG instances per GPU index, each ``(name, "MIG-…" uuid, total_mib, free_mib)``.
        procs: pids computing on each GPU; ``None``: the call is missing from the driver.
    """
    fail, migs = set(fail), dict(migs or {})
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.calls = []

    def check(i, what):
        m.calls.append((i, what))
        if (i, what) in fail:
            raise NVMLError(f"Not Supported ({what} of GPU {i})")

    def nvmlInit():
        if init_error:
            raise NVMLError(init_error)

    def handle(i):
        check(i, "handle")
        return ("gpu", i)

    def field(h, what, gpu_value, mig_value):
        if h[0] == "gpu":
            check(h[1], what)
            return gpu_value(gpus[h[1]])
        return mig_value(migs[h[1]][h[2]])

    def utilization(h):
        if h[0] == "mig":
            raise NVMLError("Not Supported (utilisation of a MIG instance)")
        check(h[1], "utilization")
        return _Util(gpus[h[1]][4])

    def processes(h):
        if procs is None or h[0] == "mig":
            raise NVMLError("Function Not Found")
        check(h[1], "processes")
        return [_Process(pid) for pid in procs.get(h[1], [])]

    def max_migs(h):
        if h[1] not in migs:
            raise NVMLError("Not Supported (no MIG mode)")
        return 7

    def mig_handle(h, j):
        if j >= len(migs[h[1]]):
            raise NVMLError("Not Found")
        return ("mig", h[1], j)

    m.nvmlInit = nvmlInit
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetName = lambda h: field(h, "name", lambda g: g[0].encode(), lambda x: x[0])
    m.nvmlDeviceGetUUID = lambda h: field(h, "uuid", lambda g: g[1], lambda x: x[1])
    m.nvmlDeviceGetMemoryInfo = lambda h: field(h, "memory", lambda g: _Memory(g[2], g[3]),
                                                lambda x: _Memory(x[2], x[3]))
    m.nvmlDeviceGetUtilizationRates = utilization
    m.nvmlDeviceGetComputeRunningProcesses = processes
    m.nvmlDeviceGetMaxMigDeviceCount = max_migs
    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    return m


def install_fake_nvml(monkeypatch, gpus: Sequence[Tuple] = (H100,), visible: Optional[str] = None,
                      **kwargs) -> types.ModuleType:
    """Put :func:`fake_nvml` in ``sys.modules`` as ``pynvml`` for this test; returns the module."""
    m = fake_nvml(gpus, **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", m)
    _set_visible(monkeypatch, visible)
    return m
