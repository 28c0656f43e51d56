"""GPUs shared fairly between kernels: an advisory lease per GPU (``nbddp.contract.leases``), with the GPU
listing faked (``tests/fake_gpu.py``). Two kernels launching with ``gpus="idle"`` at the same
moment never get the same GPU; a lease dies with its kernel, however it ends; the listing and the
panel's picker name the holder. Each kernel here is a process of its own; none starts a worker."""

import contextlib
import functools
import json
import os
import pwd
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
import nbddp.kernel.ranks as ranks
go, done, out = sys.argv[1:4]

def start_processes(fn, args, nprocs, **kwargs):
    with open(out + ".tmp", "w") as f:
        json.dump({{"gpus": list(args[0].gpus), "pid": os.getpid()}}, f)
    os.replace(out + ".tmp", out)
    while not os.path.exists(done):
        time.sleep(0.02)
    raise SystemExit(0)

ranks.mp.start_processes = start_processes
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


# ------------------------------------------------------------------------------ other users
# The tests below play other users of a shared server: as root they plant files owned by other uids
# and run the victim (or the attacker) as another uid; elsewhere they are skipped, and the one
# ownership seam (``leases._my_uid``) is tested by pretending.
ROOT = os.geteuid() == 0
# Without root the victim and the attacker are this user: what does not need another uid still runs.
VICTIM, ATTACKER = (65534, 4242) if ROOT else (os.geteuid(), os.geteuid())
needs_root = pytest.mark.skipif(not ROOT, reason="plays other users' uids: needs root")


@pytest.fixture
def shared_dir(monkeypatch):
    """A lease folder every uid can reach (pytest's tmp_path is private to its user)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="nbddp-leases-test-"))
    base.chmod(0o755)
    monkeypatch.setenv(leases.LEASES_ENV, str(base / "leases"))
    yield base / "leases"
    shutil.rmtree(base, ignore_errors=True)


def run_as(uid: int) -> dict:
    """Popen's arguments that make a process ``uid`` (none for this user: dropping groups needs root)."""
    return {} if uid == os.geteuid() else dict(user=uid, group=uid, extra_groups=[])


@functools.lru_cache(maxsize=None)
def python_for(uid: int) -> str:
    """A Python the other uid may run (a virtual environment in a private home may not be one):
    ``nbddp.contract.leases`` needs only the standard library."""
    import shutil

    for exe in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if exe and subprocess.run([exe, "-c", "pass"], **run_as(uid), cwd="/",
                                      timeout=30).returncode == 0:
                return exe
    pytest.skip(f"no Python that uid {uid} may run")


def as_user(uid: int, code: str, folder: Path):
    """Run ``code`` (which prints one JSON value) as ``uid``; a hang fails the test instead of the suite."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), **{leases.LEASES_ENV: str(folder)})
    try:
        done = subprocess.run([python_for(uid), "-c", code], **run_as(uid), env=env,
                              cwd=folder.parent, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"uid {uid} hung on a file another user planted")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


LEASE_ALL = ("import json; from nbddp import leases\n"
             "got = [leases.try_lease(i, u) for i, u in enumerate({uuids!r})]\n"
             "print(json.dumps([g is not None for g in got]))")


@contextlib.contextmanager
def holding_as(uid: int, uuids, folder: Path):
    """``uid`` leases ``uuids`` and holds them (a lease lives as long as its holder) until the block ends;
    yields which it got."""
    import select

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), **{leases.LEASES_ENV: str(folder)})
    code = LEASE_ALL.format(uuids=list(uuids)) + "\nimport sys; sys.stdout.flush(); sys.stdin.read()"
    proc = subprocess.Popen([python_for(uid), "-c", code], **run_as(uid), env=env,
                            cwd=folder.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if not select.select([proc.stdout], [], [], 60)[0]:
            pytest.fail(f"uid {uid} hung on a file another user planted")
        yield json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def view(uuids=UUID):
    return leases.holders([type("G", (), {"index": i, "uuid": u})() for i, u in enumerate(uuids)])


def plant(path: Path, kind: str, owner: int = ATTACKER) -> None:
    if kind == "fifo":
        os.mkfifo(path, 0o444)  # readable: a plain open for reading waits for a writer that never comes
    elif kind == "link":
        (path.parent / f"{path.name}.target").mkdir(mode=0o777)
        path.symlink_to(path.parent / f"{path.name}.target")
    elif kind == "folder":
        path.mkdir(mode=0o777)
    else:
        path.write_text("mine")
        path.chmod(0o600)
    if ROOT:
        os.chown(path, owner, owner, follow_symlinks=False)


@pytest.mark.parametrize("kind", ["fifo", "link", "folder", "private"])
def test_nothing_another_user_plants_in_the_lease_folder_blocks_or_silences_a_lease(shared_dir, kind):
    shared_dir.mkdir()
    shared_dir.chmod(0o1777)
    # Where older versions kept one lock file per GPU, and where the victim's own folder goes.
    for i, u in enumerate(UUID[:2]):
        plant(shared_dir / f"{u}.lock", kind)
    plant(shared_dir / f"u{VICTIM}", kind)
    with holding_as(VICTIM, UUID[:2], shared_dir) as got:
        assert got == [True, True]
        held = view(UUID[:2])  # every other user sees them leased, by the victim's uid (not what a file says)
        assert sorted(held) == [0, 1] and all(h.startswith(f"leased by {pwd.getpwuid(VICTIM).pw_name} (pid ")
                                              for h in held.values()), held
        assert as_user(ATTACKER, LEASE_ALL.format(uuids=UUID[:2]), shared_dir) == [False, False]


@needs_root
def test_the_lease_folders_owner_can_neither_remove_nor_hide_another_users_lease(shared_dir):
    shared_dir.mkdir()
    shared_dir.chmod(0o1777)
    os.chown(shared_dir, ATTACKER, ATTACKER)  # the attacker ran nbddp first
    mine = leases.try_lease(0, UUID[0], run="mine")
    try:
        assert mine is not None
        wrecked = as_user(ATTACKER, r"""
import json, os, shutil
done, names = [], os.listdir("leases")
os.mkdir("leases/trap")
for name in names:
    path = os.path.join("leases", name)
    for how, act in (("unlink", os.unlink), ("rmtree", shutil.rmtree), ("truncate", lambda p: open(p, "w").close()),
                     ("move", lambda p: os.rename(p, "leases/trap/" + name)),
                     ("hide", lambda p: os.rename(p, "leases/.gone-" + name))):
        try:
            act(path)
            done.append(how + " " + name)
            break
        except OSError:
            pass
print(json.dumps(done))""", shared_dir)
        assert wrecked in ([f"hide u{os.geteuid()}"], [])  # renaming within the folder is all its owner may do
        assert "leased by root (pid" in view()[0] and "run mine" in view()[0]
        assert as_user(VICTIM, LEASE_ALL.format(uuids=UUID[:1]), shared_dir) == [False]
    finally:
        mine.release()
    assert view() == {}
    assert as_user(VICTIM, LEASE_ALL.format(uuids=UUID[:1]), shared_dir) == [True]


def claim(folder: Path, pid: int, start, ticket, key=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key or leases.lease_key(0, UUID[0])}@{pid}-test"
    path.write_text(json.dumps({"pid": pid, "start": start, "ticket": ticket, "run": "theirs"}))
    return path


def test_a_claim_counts_while_its_process_lives_and_a_recycled_pid_does_not(shared_dir):
    holder = subprocess.Popen(["sleep", "60"])
    try:
        start = leases._proc_start(holder.pid)[1]
        path = claim(shared_dir / "someone", holder.pid, start, 1)
        assert f"pid {holder.pid}, run theirs" in view()[0]
        assert leases.try_lease(0, UUID[0]) is None
        path.write_text(json.dumps({"pid": holder.pid, "start": start + 1, "ticket": 1}))  # same pid, another process
        assert view() == {}
        path.write_text(json.dumps({"pid": holder.pid, "start": start, "ticket": 1}))
        assert 0 in view()
    finally:
        holder.kill()
        holder.wait()
    assert view() == {}  # dead: the file stays, the lease is gone
    lease = leases.try_lease(0, UUID[0])
    assert lease is not None
    lease.release()


def test_a_rival_choosing_its_ticket_is_waited_for_and_never_shares_the_gpu(shared_dir, monkeypatch):
    holder = subprocess.Popen(["sleep", "60"])
    try:
        start = leases._proc_start(holder.pid)[1]
        path = claim(shared_dir / "someone", holder.pid, start, None)  # made its claim, no ticket yet
        monkeypatch.setattr(leases, "CHOOSING_S", 0.05)
        got = leases.attempt(0, UUID[0])
        assert got.lease is None and f"pid {holder.pid}" in got.held_by  # undecided for too long: it wins
        path.write_text(json.dumps({"pid": holder.pid, "start": start, "ticket": time.monotonic_ns() + 10**12}))
        got = leases.attempt(0, UUID[0])  # its ticket is later than ours: ours wins, it withdraws
        assert got.lease is not None
        got.lease.release()
    finally:
        holder.kill()
        holder.wait()


@needs_root
def test_a_gpu_that_cannot_be_leased_says_why(shared_dir):
    shared_dir.mkdir(mode=0o755)  # another user (root here) made it, and only they may write in it
    got = as_user(VICTIM, "import json; from nbddp import leases\n"
                          f"print(json.dumps(leases.attempt(0, {UUID[0]!r}).off))", shared_dir)
    assert f"{shared_dir} is not writable by you (owner uid 0, mode 755" in got


@needs_root
def test_two_users_leasing_the_same_gpus_at_the_same_moment_never_share_one(shared_dir):
    shared_dir.mkdir()
    shared_dir.chmod(0o1777)
    go = shared_dir.parent / "go"
    code = ("import json, os, sys, time\nfrom nbddp import leases\n"
            f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.001)\n"
            f"got = [leases.try_lease(i, u) is not None for i, u in enumerate({UUID!r})]\n"
            "print(json.dumps(got), flush=True)\nsys.stdin.read()")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), **{leases.LEASES_ENV: str(shared_dir)})
    for _ in range(3):
        users = [subprocess.Popen([python_for(uid), "-c", code], **run_as(uid), env=env,
                                  cwd=shared_dir.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for uid in (VICTIM, ATTACKER)]
        try:
            time.sleep(0.5)  # both wait at the line
            go.write_text("go")
            got = [json.loads(u.stdout.readline()) for u in users]
        finally:
            for u in users:
                u.kill()
                u.wait()
            go.unlink()
        assert not any(a and b for a, b in zip(*got)), got  # a GPU leased by both
