"""GPUs shared fairly between kernels: an advisory lease per GPU (``nbddp.contract.leases``), with the GPU
listing faked (``tests/fake_gpu.py``). Two kernels launching with ``gpus="idle"`` at the same
moment never get the same GPU; a lease dies with its kernel, however it ends; the listing and the
panel's picker name the holder. Each kernel here is a process of its own; none starts a worker."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbddp.contract import leases
from nbddp.contract.gpus import list_gpus, resolve_gpus
from conftest import WORKERS, wait_for
from fake_gpu import install_fake_nvml

H100 = "NVIDIA H100 80GB HBM3"
GIB = 1024
UUID = [f"GPU-{c * 8}-1111-2222-3333-444444444444" for c in "abcd"]
IDLE4 = [(H100, u, 80 * GIB, 80 * GIB - 600, 0) for u in UUID]
INFO = f"{WORKERS / 'faulty.py'}:info"

# A kernel: the fake listing, spawn_train(gpus="idle") up to the point where it would start the
# workers; there it writes the GPUs it got and holds them until the test says "done".
KERNEL = r"""
import json, os, sys, time
sys.path[:0] = [{tests!r}]
from fake_gpu import fake_nvml
sys.modules["pynvml"] = fake_nvml(json.loads({gpus!r}))
os.environ.pop("CUDA_VISIBLE_DEVICES", None)
import nbddp
import nbddp.kernel.launch as launch
go, done, out = sys.argv[1:4]

def start_processes(fn, args, nprocs, **kwargs):
    with open(out + ".tmp", "w") as f:
        json.dump({{"gpus": list(args[0].gpus), "pid": os.getpid()}}, f)
    os.replace(out + ".tmp", out)
    while not os.path.exists(done):
        time.sleep(0.02)
    raise SystemExit(0)

launch.mp.start_processes = start_processes
while not os.path.exists(go):
    time.sleep(0.005)
try:
    nbddp.spawn_train({target!r}, gpus="idle", runs_dir={runs!r}, echo=False, start_method="spawn")
except nbddp.ConfigError as e:
    with open(out, "w") as f:
        json.dump({{"error": str(e)}}, f)
"""


@pytest.fixture
def lease_dir(tmp_path, monkeypatch):
    folder = tmp_path / "leases"
    monkeypatch.setenv(leases.LEASES_ENV, str(folder))
    return folder


def start_kernel(tmp_path, name: str, go: Path, done: Path):
    script = tmp_path / f"{name}.py"
    script.write_text(KERNEL.format(tests=str(Path(__file__).parent), gpus=json.dumps(IDLE4), target=INFO,
                                    runs=str(tmp_path / "runs")))
    out = tmp_path / f"{name}.json"
    proc = subprocess.Popen([sys.executable, str(script), str(go), str(done), str(out)], env=os.environ.copy())
    return proc, out


def test_two_kernels_launching_idle_at_the_same_moment_never_share_a_gpu(tmp_path, lease_dir):
    go, done = tmp_path / "go", tmp_path / "done"
    kernels = [start_kernel(tmp_path, f"kernel{i}", go, done) for i in range(2)]
    try:
        time.sleep(3)  # both imported nbddp and wait at the line
        go.write_text("go")
        assert wait_for(lambda: all(out.exists() for _, out in kernels), 90), "a kernel did not decide"
        got = [json.loads(out.read_text()) for _, out in kernels]
    finally:
        done.write_text("done")
        for proc, _ in kernels:
            proc.wait(timeout=60)
    chosen = [set(g.get("gpus", ())) for g in got]
    assert not chosen[0] & chosen[1], got
    assert chosen[0] | chosen[1] and chosen[0] | chosen[1] <= {0, 1, 2, 3}, got
    for g in got:
        assert "gpus" in g or "leased by" in g["error"], got  # a loser is told who holds the GPUs
    assert stat.S_IMODE(lease_dir.stat().st_mode) == 0o1777  # every user's kernels lease there
    assert not any(leases.holders([type("G", (), {"index": i, "uuid": u})() for i, u in enumerate(UUID)]).values())


def test_the_listing_names_the_holder_and_a_killed_kernels_lease_is_reclaimed(tmp_path, lease_dir, monkeypatch):
    install_fake_nvml(monkeypatch, IDLE4)
    go, done = tmp_path / "go", tmp_path / "done"
    go.write_text("go")
    proc, out = start_kernel(tmp_path, "holder", go, done)
    try:
        assert wait_for(out.exists, 90), "the kernel did not lease"
        held = json.loads(out.read_text())
        assert held["gpus"] == [0, 1, 2, 3]
        gpus = list_gpus()
        assert all(g.lease and g.lease.startswith("leased by ") and f"pid {proc.pid}" in g.lease for g in gpus), gpus
        assert "run " in gpus[0].lease and f"pid {proc.pid}" in gpus[0].label()
        with pytest.raises(Exception, match="leased by"):
            resolve_gpus("idle")  # every GPU is idle in memory, and every one is leased
        from nbddp.ui.devices import DevicePicker

        picker = DevicePicker(gpus, None, 1)
        assert not any(box.value for box in picker.gpu_checkboxes)  # the picker leaves leased GPUs alone
        assert all("leased by" in box.description for box in picker.gpu_checkboxes)
        os.kill(proc.pid, signal.SIGKILL)  # killed mid-run: nothing released the lease by hand
        proc.wait(timeout=30)
        assert [g.lease for g in list_gpus()] == [None] * 4
        assert resolve_gpus("idle") == [0, 1, 2, 3]
        lease = leases.try_lease(0, UUID[0], run="again")
        assert lease is not None
        assert "run again" in list_gpus()[0].lease
        lease.release()
        assert list_gpus()[0].lease is None
    finally:
        done.write_text("done")
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_gpu_chosen_by_hand_that_another_kernel_leases_warns_and_is_shared(lease_dir, monkeypatch):
    from nbddp.contract.gpus import BusyGPUWarning

    install_fake_nvml(monkeypatch, IDLE4)
    held = leases.try_lease(1, UUID[1], run="other")
    try:
        with pytest.warns(BusyGPUWarning, match="GPU 1 is leased by"):
            assert resolve_gpus([1]) == [1]
        assert resolve_gpus("idle") == [0, 2, 3]
    finally:
        held.release()


def test_an_unusable_lease_folder_leases_nothing_and_launches_anyway(tmp_path, monkeypatch):
    install_fake_nvml(monkeypatch, IDLE4)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(leases.LEASES_ENV, str(blocker))
    assert leases.try_lease(0, UUID[0]) is None
    assert resolve_gpus("idle") == [0, 1, 2, 3]
    # The launch goes on, and says leases are off and why (another user could have planted the file).
    from nbddp.kernel.launch import _leased

    with pytest.warns(UserWarning, match=r"GPU leases are off: .*file.* is not a folder .*NBDDP_GPU_LEASES"):
        assert _leased([0, 1])[0] == [0, 1]
    assert leases.unusable_reason() is not None
    monkeypatch.setenv(leases.LEASES_ENV, str(tmp_path / "leases"))
    assert leases.unusable_reason() is None
