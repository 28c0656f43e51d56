"""Shared test helpers: process-survival checks read /proc, as the reliability doc asks."""

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
EXAMPLES = ROOT / "examples"


def proc_state(pid: int):
    """'R', 'S', 'Z' (zombie)... or None when the pid no longer exists."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def children_of(pid: int):
    """Pids whose parent is ``pid`` (zombies included)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


def survivors(pids):
    """The pids that still exist, live or zombie (a zombie is a survivor too)."""
    return {p: s for p in pids if (s := proc_state(p)) is not None}


def worker_children():
    """Children of this test process other than multiprocessing helpers (resource tracker)."""
    res = []
    for pid in children_of(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "resource_tracker" in cmd or "forkserver" in cmd:
            continue
        res.append(pid)
    return res


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


@pytest.fixture
def runs_dir(tmp_path):
    return tmp_path / "runs"


def make_tree(root: Path, classes=("a", "b", "c"), per_class: int = 12, size: int = 16, seed: int = 0) -> Path:
    """A small learnable class-folder tree: each class has its own colour, plus noise."""
    import random

    from PIL import Image

    rng = random.Random(seed)
    palette = [(220, 40, 40), (40, 200, 60), (50, 60, 220), (230, 200, 30), (200, 50, 200)]
    for ci, name in enumerate(classes):
        folder = Path(root) / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            base = palette[ci % len(palette)]
            img = Image.new("RGB", (size, size))
            img.putdata([tuple(max(0, min(255, c + rng.randint(-40, 40))) for c in base) for _ in range(size * size)])
            img.save(folder / f"{i:03d}.png")
    return Path(root)


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "data")


def fault_env(spec: str) -> dict:
    """Worker environment that injects the faults ``spec`` ("<where>:<rank>:<action>", see tests/workers/faults.py)."""
    return {"NBDDP_RANK_HOOK": f"{WORKERS / 'faults.py'}:install", "NBDDP_FAULT": spec}

@pytest.fixture
def kernel(tmp_path):
    """A real Jupyter kernel of this environment (kernelspec ``python3``), in ``tmp_path``."""
    pytest.importorskip("jupyter_client")
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
