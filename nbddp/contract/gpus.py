"""GPU discovery for the kernel, without initialising CUDA in it.

A kernel that initialised CUDA can no longer fork, and holds a CUDA context (hundreds of MB of
GPU memory) for as long as it lives. So the kernel asks NVML (``nvidia-ml-py``) or, failing
that, ``nvidia-smi``; ``torch.cuda`` is never touched here.

GPU ids are NVML's indices, the ``GPU`` column of ``nvidia-smi`` (PCI bus order). Workers are
started with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, the order NVML uses, so ``gpus=[2]`` means the
same card in ``nvidia-smi``, in the panel and in the worker.

The kernel's own ``CUDA_VISIBLE_DEVICES`` (set by the user, SLURM or a container) limits the
GPUs listed, and a launch passes the user's own words for the chosen GPUs on to the workers
(an index, a ``GPU-…`` UUID or a ``MIG-…`` instance), never a bare index that could name a GPU
outside an allocation. Index words are read as CUDA reads them in the worker: in PCI bus order.

Listing never raises: a field the driver cannot give (``[N/A]``, ``[Not Supported]``, an NVML
error) is ``None``, and a machine without a driver has no GPUs.

On a shared server nbddp behaves like a good colleague: each GPU reports its memory in use,
utilisation and the number of other processes computing on it, :attr:`GPUInfo.idle` applies
:data:`IDLE_RULE`, ``gpus="idle"`` (:func:`resolve_gpus`) trains on the GPUs idle at launch, and
choosing a GPU that is not idle warns (:class:`BusyGPUWarning`) before the launch.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .errors import ConfigError
from .leases import holders

#: The word that asks for the GPUs idle at launch: ``gpus="idle"`` (TrainConfig, spawn_train, --gpus idle).
IDLE = "idle"
IDLE_MIN_FREE_PCT = 90
IDLE_MAX_BUSY_PCT = 10
#: When a GPU counts as idle (:attr:`GPUInfo.idle`), in words a picker can show.
IDLE_RULE = f"idle: at least {IDLE_MIN_FREE_PCT}% memory free and at most {IDLE_MAX_BUSY_PCT}% busy"


class BusyGPUWarning(UserWarning):
    """A GPU chosen for a run is not idle (:data:`IDLE_RULE`): the run shares it with what runs there."""


@dataclass(frozen=True)
class GPUInfo:
    """One GPU (or the one MIG instance) this kernel may use.

    Attributes:
        index: the id ``gpus=[...]`` takes: NVML's index, as in ``nvidia-smi`` (for a MIG
            instance, its GPU's index).
        name: product name, e.g. ``"NVIDIA H100 80GB HBM3"`` (a MIG instance adds its profile).
        memory_total_mib: memory in MiB, ``None`` where the driver does not say.
        memory_free_mib: free memory in MiB now, ``None`` where the driver does not say.
        utilization_pct: busy percentage now, ``None`` where not supported (e.g. MIG).
        uuid: ``"GPU-…"``, or ``"MIG-…"`` for a MIG instance; ``None`` where unknown.
        processes: compute processes on it now other than this kernel (NVML's
            ``nvmlDeviceGetComputeRunningProcesses``, or ``nvidia-smi --query-compute-apps``),
            of any user; ``None`` where the driver does not say.
        lease: who holds the GPU's advisory lease (:mod:`nbddp.contract.leases`), e.g. ``"leased by alice
            (pid 4242, run 20250101-120000-mnist)"``; ``None`` when no kernel holds it.
    """

    index: int
    name: str
    memory_total_mib: Optional[int]
    memory_free_mib: Optional[int]
    utilization_pct: Optional[int]
    uuid: Optional[str] = None
    processes: Optional[int] = None
    lease: Optional[str] = None

    @property
    def memory_used_mib(self) -> Optional[int]:
        """Memory in use in MiB (total - free: every process's, and the driver's reserve), or ``None``."""
        if self.memory_total_mib is None or self.memory_free_mib is None:
            return None
        return max(0, self.memory_total_mib - self.memory_free_mib)

    @property
    def idle(self) -> bool:
        """:data:`IDLE_RULE`: at least 90% of the memory free and at most 10% busy.

        Unknown memory is never idle; unknown utilisation (MIG, some drivers) leaves it to the memory.
        """
        total, free, util = self.memory_total_mib, self.memory_free_mib, self.utilization_pct
        if total is None or free is None or total <= 0:
            return False
        if free * 100 < total * IDLE_MIN_FREE_PCT:  # integers: exactly 90% free is idle
            return False
        return util is None or util <= IDLE_MAX_BUSY_PCT

    def state(self) -> str:
        """``"12.1/80.0 GiB used, 35% busy, 2 processes"`` (``?`` for what the driver does not say)."""
        return ", ".join(self._state_parts())

    def label(self) -> str:
        """``"GPU 0: NVIDIA H100 80GB HBM3 · 12.1/80.0 GiB used · 35% busy · 2 processes"``, for a picker."""
        return " · ".join([f"GPU {self.index}: {self.name}", *self._state_parts()])

    def _state_parts(self) -> List[str]:
        util = "?" if self.utilization_pct is None else f"{self.utilization_pct}%"
        n = self.processes
        procs = "? processes" if n is None else f"{n} process{'' if n == 1 else 'es'}"
        parts = [f"{_gib(self.memory_used_mib)}/{_gib(self.memory_total_mib)} GiB used", f"{util} busy", procs]
        return parts + ([self.lease] if self.lease else [])


def _gib(mib: Optional[int]) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f}"


# ------------------------------------------------------------------------------ reading the driver
def _nvml_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_device(pynvml, handle, index: int, util: bool = True) -> GPUInfo:
    """One device's fields; a field NVML refuses is None, the others stay."""
    def field(read):
        try:
            return read()
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported, _Unknown, _GpuIsLost...: unknown
            return None

    name = field(lambda: _nvml_text(pynvml.nvmlDeviceGetName(handle))) or "NVIDIA GPU"
    uuid = field(lambda: _nvml_text(pynvml.nvmlDeviceGetUUID(handle)))
    mem = field(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    total = field(lambda: int(mem.total) // 2**20) if mem is not None else None
    free = field(lambda: int(mem.free) // 2**20) if mem is not None else None
    busy = field(lambda: int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)) if util else None
    procs = field(lambda: _others(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)))
    return GPUInfo(index, name, total, free, busy, uuid, procs)


def _others(pids) -> int:
    """How many of ``pids`` are not this kernel (which may have used CUDA itself)."""
    me = os.getpid()
    return sum(1 for pid in pids if int(pid) != me)


def _from_nvml(with_mig: bool) -> Optional[Tuple[List[GPUInfo], List[GPUInfo]]]:
    """``(GPUs, MIG instances)`` from NVML, or None where NVML is missing or has no driver."""
    try:
        import pynvml  # provided by nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver (NVMLError_LibraryNotFound, _DriverNotLoaded): no GPUs
        return None
    try:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception:  # noqa: BLE001 - a driver that cannot count: let nvidia-smi try
            return None
        gpus, migs = [], []
        for i in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            except Exception:  # noqa: BLE001 - no permission (outside this cgroup) or lost: not usable
                continue
            gpus.append(_nvml_device(pynvml, handle, i))
            if with_mig:
                migs += _nvml_mig_instances(pynvml, handle, i)
        return gpus, migs
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - nothing to release
            pass


def _nvml_mig_instances(pynvml, handle, index: int) -> List[GPUInfo]:
    try:
        slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except Exception:  # noqa: BLE001 - no MIG support on this GPU
        return []
    out = []
    for j in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except Exception:  # noqa: BLE001 - NVMLError_NotFound: an empty slot
            continue
        # NVML has no utilisation for a MIG instance; its memory is the instance's slice.
        out.append(_nvml_device(pynvml, mig, index, util=False))
    return out


_SMI_FIELDS = "index,uuid,memory.total,memory.free,utilization.gpu,name"


def _smi_number(text: str) -> Optional[int]:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]", "N/A": the driver does not say


def _from_nvidia_smi() -> Optional[List[GPUInfo]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = subprocess.run(
            [exe, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # no driver: nvidia-smi exits non-zero ("couldn't communicate with the NVIDIA driver")
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",", 5)]  # the name comes last: it may hold a comma
        if len(parts) != 6 or not parts[0].isdigit():
            continue
        uuid = parts[1] if parts[1].startswith("GPU-") else None
        total, free, util = (_smi_number(p) for p in parts[2:5])
        out.append(GPUInfo(int(parts[0]), parts[5], total, free, util, uuid))
    if any(g.uuid for g in out):
        counts = _smi_process_counts(_run_smi(exe, "--query-compute-apps=gpu_uuid,pid"))
        if counts is not None:
            out = [dataclasses.replace(g, processes=counts.get(g.uuid, 0)) if g.uuid else g for g in out]
    return out


def _run_smi(exe: str, query: str) -> Optional[str]:
    try:
        return subprocess.run([exe, query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # an older nvidia-smi without the field, a timeout: unknown


def _smi_process_counts(text: Optional[str]) -> Optional[Dict[str, int]]:
    """Compute processes per GPU UUID other than this kernel, from ``--query-compute-apps=gpu_uuid,pid``.

    ``None`` (unknown) for output that is not such rows; no row for a GPU means no process.
    """
    if text is None:
        return None
    pids: Dict[str, List[int]] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].startswith("GPU-") and parts[1].isdigit():
            pids.setdefault(parts[0], []).append(int(parts[1]))
        elif line.strip() and "no running processes" not in line.lower():
            return None
    return {uuid: _others(p) for uuid, p in pids.items()}


# ------------------------------------------------------------------------------ CUDA_VISIBLE_DEVICES
def _mig_refusal(raw: str, words: List[str]) -> Optional[str]:
    words = [w for w in words if w]
    migs = [w for w in words if w.startswith("MIG-")]
    if not migs or len(words) == 1:
        return None
    return (f"CUDA_VISIBLE_DEVICES={raw!r} names {len(words)} devices, {len(migs)} of them MIG instances, but CUDA "
            "gives a process one MIG instance only, so nbddp's processes could not each have their own. Set "
            f"CUDA_VISIBLE_DEVICES to one MIG instance (e.g. os.environ['CUDA_VISIBLE_DEVICES'] = {migs[0]!r} before "
            "the launch) and train on it with gpus=[its GPU id], or run one process per instance "
            "(one notebook or `python -m nbddp` each).")


def _resolve(raw: Optional[str], gpus: List[GPUInfo], migs: List[GPUInfo],
             nvml: bool) -> Tuple[List[Tuple[GPUInfo, str]], Optional[str]]:
    """The visible GPUs, each with the word that names it in ``CUDA_VISIBLE_DEVICES``, and why none.

    Read as CUDA reads the variable: words in order, separated by commas; an index counts in PCI
    bus order (workers get ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); a ``GPU-``/``MIG-`` word may be a
    unique prefix of the UUID; the first word that names no device hides it and every later one.
    """
    if raw is None:
        return [(g, str(g.index)) for g in gpus], None
    words = [w.strip() for w in raw.split(",")]
    refusal = _mig_refusal(raw, words)
    if refusal:
        return [], refusal
    named = [w for w in words if w]
    if len(named) == 1 and named[0].startswith("MIG-"):
        word = named[0]
        match = [m for m in migs if m.uuid and m.uuid.startswith(word)]
        if not match and word.startswith("MIG-GPU-"):
            # The R450 form MIG-GPU-<uuid>/<gpu instance>/<compute instance> names its GPU.
            gpu_uuid, _, rest = word[len("MIG-"):].partition("/")
            match = [GPUInfo(g.index, f"{g.name} MIG {rest}", None, None, None, word)
                     for g in gpus if g.uuid and g.uuid.startswith(gpu_uuid)]
        if len(match) == 1:
            return [(match[0], word)], None
        how = ("`nvidia-smi -L` lists the MIG instances" if nvml else
               "nbddp finds MIG instances through NVML: pip install nvidia-ml-py")
        return [], f"CUDA_VISIBLE_DEVICES={raw!r}: no MIG instance {word!r} found here; {how}."
    out: List[Tuple[GPUInfo, str]] = []
    for word in words:
        if word.isdigit():
            found = [g for g in gpus if g.index == int(word)]
        elif word.startswith("GPU-"):
            found = [g for g in gpus if g.uuid and g.uuid.startswith(word)]
        else:
            found = []  # "-1", "", a MIG word among others, a typo: CUDA stops here
        if len(found) != 1 or any(found[0] is g for g, _ in out):
            break
        out.append((found[0], word))
    return out, None


def _visible() -> Tuple[List[Tuple[GPUInfo, str]], Optional[str]]:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    with_mig = raw is not None and "MIG-" in raw  # MIG instances are looked up only when named
    nvml = _from_nvml(with_mig)
    if nvml is not None:
        gpus, migs = nvml
    else:
        gpus, migs = _from_nvidia_smi() or [], []
    visible, problem = _resolve(raw, gpus, migs, nvml is not None)
    held = holders([g for g, _ in visible])  # another kernel's launch may not show in memory yet
    return [(dataclasses.replace(g, lease=held[g.index]) if g.index in held else g, w) for g, w in visible], problem


def list_gpus() -> List[GPUInfo]:
    """The GPUs this kernel may use, with name, memory and utilisation (empty without GPUs).

    Ids are ``nvidia-smi``'s; the kernel's ``CUDA_VISIBLE_DEVICES`` limits the list and its order
    (index words count in PCI bus order, as in the workers, which nbddp starts with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``). With one MIG instance in ``CUDA_VISIBLE_DEVICES`` the list
    holds that instance under its GPU's id. Never raises and never initialises CUDA.
    """
    return [g for g, _ in _visible()[0]]


def gpu_setup_problem() -> Optional[str]:
    """Why the kernel's ``CUDA_VISIBLE_DEVICES`` leaves nbddp no GPU (e.g. several MIG instances), or None."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None or "MIG-" not in raw:
        return None
    return _visible()[1]


def _check(ids: Sequence[int], available: List[GPUInfo], problem: Optional[str]) -> None:
    if problem is not None and ids:
        raise ConfigError(f"gpus={list(ids)}: {problem}")
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (this kernel's CUDA_VISIBLE_DEVICES={raw!r} shows only these)" if raw is not None else ""
    listing = "\n".join("  " + g.label() for g in available)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"gpus={list(ids)} lists a GPU twice; each process needs its own GPU. GPUs here{where}:\n{listing}")
    known = {g.index for g in available}
    missing = [i for i in ids if i not in known]
    if missing and not available:
        raise ConfigError(_no_gpu(f"gpus={list(ids)}"))
    if missing:
        raise ConfigError(f"gpus={list(ids)}: no GPU with id {missing}; choose ids from the list. GPUs here{where}:\n{listing}")


def _no_gpu(asked: str) -> str:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"{asked}: no GPU found (neither NVML nor nvidia-smi sees one: no NVIDIA driver here"
            f"{', or CUDA_VISIBLE_DEVICES=' + repr(raw) + ' hides them' if raw is not None else ''}); "
            "use nprocs=N to train on CPU processes.")


def check_gpu_ids(ids: Sequence[int], available: Optional[Sequence[GPUInfo]] = None) -> None:
    """Refuse out-of-range or repeated GPU ids, listing the GPUs there are.

    Args:
        ids: the ids asked for (``gpus=[...]``).
        available: the GPUs to check against (default: :func:`list_gpus`).

    Raises:
        ConfigError: an id twice, an id not listed, or no GPU at all (with the reason).
    """
    if available is None:
        visible, problem = _visible()
        _check(ids, [g for g, _ in visible], problem)
    else:
        _check(ids, list(available), None)


def cuda_visible_devices(ids: Sequence[int]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that gives rank r the GPU ``ids[r]`` as its ``cuda:r``.

    Each GPU is named by the kernel's own word for it (index, ``GPU-…`` UUID or ``MIG-…``
    instance) where the kernel has ``CUDA_VISIBLE_DEVICES``, else by its index. Index words are
    read in PCI bus order: set this value together with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

    Raises:
        ConfigError: as :func:`check_gpu_ids`; also for several MIG instances (CUDA gives a
            process one).
    """
    visible, problem = _visible()
    _check(ids, [g for g, _ in visible], problem)
    word = {g.index: w for g, w in visible}
    return ",".join(word[i] for i in ids)


# ------------------------------------------------------------------------------ idle GPUs
def idle_gpus(gpus: Optional[Sequence[GPUInfo]] = None) -> List[int]:
    """The ids of the GPUs idle now (:data:`IDLE_RULE`) that no kernel leases, in listing order.

    Args:
        gpus: GPUs already listed (default: :func:`list_gpus` now).
    """
    return [g.index for g in (list_gpus() if gpus is None else gpus) if g.idle and not g.lease]


def preselected_gpus(gpus: Optional[Sequence[GPUInfo]] = None) -> Tuple[List[int], str]:
    """What a GPU picker ticks at first, and a note on what it left out and why.

    Returns:
        ``(ids, note)``: the idle GPUs' ids; note is ``""`` when every GPU is idle (or there is
        none), names the GPUs in use when only some are idle, and when none is idle says so,
        GPU by GPU: ``"no idle GPU: 0 (12.1/80.0 GiB used, 35% busy, 2 processes), 1 (…) — tick
        one to share it"``.
    """
    gpus = list_gpus() if gpus is None else list(gpus)
    ids = idle_gpus(gpus)
    busy = ", ".join(f"{g.index} ({g.state()})" for g in gpus if g.index not in ids)
    if not busy:
        return ids, ""
    if not ids:
        return ids, f"no idle GPU: {busy} — tick one to share it"
    return ids, f"not ticked, in use: {busy}"


def _none_idle(available: Sequence[GPUInfo]) -> str:
    listing = "\n".join("  " + g.label() for g in available)
    return (f"gpus='idle': no GPU is idle now ({IDLE_RULE}):\n{listing}\n"
            "Choose GPUs explicitly to share one (gpus=[0], --gpus 0, or tick it in the panel), "
            "or wait until one is free (nvidia-smi shows what runs there).")


def resolve_gpus(value: Union[str, Sequence[int], None]) -> List[int]:
    """The GPU ids a launch trains on, decided in the kernel before any worker starts.

    Args:
        value: ``"idle"`` (the GPUs idle now, :data:`IDLE_RULE`, in listing order), GPU ids, or
            ``None``/empty (CPU processes).

    Returns:
        The ids. A chosen GPU that is not idle warns (:class:`BusyGPUWarning`, one line naming
        its memory in use and processes): the run would share it. Ids are not checked here
        (:func:`cuda_visible_devices` refuses unknown ones, listing the GPUs).

    Raises:
        ConfigError: ``"idle"`` and no GPU is idle (each GPU's state, and the way out), or no GPU
            at all (the no-GPU error); another string.
    """
    if isinstance(value, str):
        if value.strip().lower() != IDLE:
            raise ConfigError(f"gpus={value!r}: give GPU ids as nvidia-smi shows them (gpus=[0, 1]), "
                              f"or gpus={IDLE!r} for the GPUs idle at launch ({IDLE_RULE})")
        visible, problem = _visible()
        available = [g for g, _ in visible]
        if problem is not None:
            raise ConfigError(f"gpus={IDLE!r}: {problem}")
        if not available:
            raise ConfigError(_no_gpu(f"gpus={IDLE!r}"))
        ids = idle_gpus(available)
        if not ids:
            raise ConfigError(_none_idle(available))
        return ids
    try:
        ids = list(value or [])
    except TypeError:
        raise ConfigError(f"gpus={value!r}: give a list of GPU ids (gpus=[0, 1]) or {IDLE!r}") from None
    if ids:
        _warn_busy(ids, list_gpus())
    return ids


def _warn_busy(ids: Sequence[Any], available: Sequence[GPUInfo]) -> None:
    by_id = {g.index: g for g in available}
    for i in ids:
        g = by_id.get(i) if isinstance(i, int) else None
        if g is not None and not g.idle:
            _warn_at_caller(f"GPU {i} is not idle ({g.state()}): this run shares it with what runs there; "
                            f"gpus={IDLE!r} picks idle GPUs only", BusyGPUWarning)
        elif g is not None and g.lease:
            _warn_at_caller(f"GPU {i} is {g.lease}: that launch may not show in its memory yet, and this run "
                            f"shares the GPU with it; gpus={IDLE!r} picks GPUs no kernel leases", BusyGPUWarning)


def _warn_at_caller(message: str, category: type) -> None:
    """Warn at the first caller outside nbddp (the cell), at every launch.

    ``warnings.warn`` would show a message once per line of code under the "default" action,
    so a second launch on the same busy GPU would say nothing; without a registry it is shown
    each time, and the user's filters ("ignore", "error") still apply.
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    where = (message, category, frame.f_code.co_filename, frame.f_lineno)
    try:
        warnings.warn_explicit(*where, module=frame.f_globals.get("__name__"), registry=None,
                               module_globals=frame.f_globals)
    except ImportError:
        # The caller's module has no source its loader can give (``python -c``: __main__'s loader
        # is the built-in importer, which raises): the warning, without the source line.
        warnings.warn_explicit(*where, module=frame.f_globals.get("__name__"), registry=None)
