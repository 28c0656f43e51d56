"""A GPU server is shared: what nbddp opens must be reachable from this machine only."""

import os
import signal
import socket

import pytest

from nbddp import NbddpError, spawn_train
from conftest import WORKERS, proc_state, survivors, wait_for

FAULTY = f"{WORKERS / 'faulty.py'}"


def _socket_inodes(pids):
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    return inodes


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp* prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def listening_addresses(pids):
    """``(address, port)`` of every listening TCP socket the processes hold."""
    inodes, out = _socket_inodes(pids), []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                host, port = local.split(":")
                out.append((_address(host, family), int(port, 16)))
    return out


def test_store_and_workers_listen_on_loopback_only(tmp_path, runs_dir):
    go = tmp_path / "go"
    h = spawn_train(f"{FAULTY}:barrier_then_wait_for_file", str(go), nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False)
    try:
        assert wait_for(lambda: h.progress or all(
            (h.run_dir / ".nbddp" / f"rank{r}.json").exists() and '"step": 1' in
            (h.run_dir / ".nbddp" / f"rank{r}.json").read_text() for r in (0, 1)), 90), "workers did not start"
        found = listening_addresses([os.getpid(), *h.pids])
        # nbddp's own group meets in a private FileStore (tests/test_private_rendezvous.py): no store port
        assert h.spec.store_port is None and h.spec.store_path, h.spec
        assert found and all(addr in ("127.0.0.1", "::1") for addr, _ in found), found
    finally:
        go.write_text("go")
        h.wait(timeout=60)


def test_a_background_run_whose_folder_vanishes_still_ends(tmp_path, runs_dir):
    import shutil

    go = tmp_path / "go"
    h = spawn_train(f"{FAULTY}:barrier_then_wait_for_file", str(go), nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False, grace_s=1)
    assert wait_for(lambda: (h.run_dir / ".nbddp" / "launch.json").exists(), 30)
    # Gone from its path at once (as `rm -rf` of a moved folder); the ranks, still writing by
    # path, cannot refill it while it is deleted.
    gone = tmp_path / "gone"
    os.rename(h.run_dir, gone)
    shutil.rmtree(gone)
    h.stop(wait=False)
    assert wait_for(lambda: not h.running, 60), "the run never reached an end state"
    assert survivors(h.pids) == {}
    with pytest.raises(NbddpError):
        h.wait(timeout=1)


def test_a_monitor_that_breaks_ends_the_run_and_its_workers(tmp_path, runs_dir, monkeypatch):
    from nbddp import RunAbandoned
    from nbddp.kernel.handle import RunHandle

    go = tmp_path / "go"
    h = spawn_train(f"{FAULTY}:barrier_then_wait_for_file", str(go), nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False)
    monkeypatch.setattr(RunHandle, "_read_streams", lambda self: (_ for _ in ()).throw(OSError(5, "I/O error")))
    assert wait_for(lambda: not h.running, 30), "the run never reached an end state"
    with pytest.raises(RunAbandoned, match="could not watch the run"):
        h.wait(timeout=1)
    assert survivors(h.pids) == {}


_COLD_LAUNCH = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even when the suite runs under nohup or in a background job (SIGINT ignored from the start)
import sys, time
sys.path.insert(0, {root!r})
import nbddp
print("launching", flush=True)
try:
    nbddp.spawn_train({target!r}, {go!r}, nprocs=2, runs_dir={runs!r}, echo=False, grace_s=1)
except nbddp.TrainingInterrupted as exc:
    print("TrainingInterrupted:", exc, flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
print("alive", flush=True)
time.sleep(120)  # the kernel lives on after the interrupted cell
"""


@pytest.mark.parametrize("delay", [0.05, 1.0, 3.0])
def test_an_interrupt_at_any_moment_of_a_cold_launch_leaves_no_worker(tmp_path, delay):
    """A fresh process calls spawn_train (forkserver start included), gets SIGINT ``delay`` s later, lives on."""
    import subprocess
    import sys
    import time
    import uuid

    from conftest import ROOT

    marker = uuid.uuid4().hex
    code = _COLD_LAUNCH.format(root=str(ROOT), target=f"{FAULTY}:barrier_then_wait_for_file",
                               go=str(tmp_path / "go"), runs=str(tmp_path / "runs"))
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "NBDDP_TEST_MARKER": marker},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline().startswith("launching")
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out = read_until(proc, "alive", timeout=120)
        assert "alive" in out, out
        # the bare exception's own line (the notice may name the KeyboardInterrupt the ranks were given)
        assert "KeyboardInterrupt" not in out.splitlines() or not (tmp_path / "runs").exists(), (
            f"a bare KeyboardInterrupt after the run folder was made: {out}")
        assert wait_for(lambda: not launch_workers(marker, proc.pid), timeout=10), (
            f"workers of the launch remain: {launch_workers(marker, proc.pid)}; output: {out}")
    finally:
        proc.kill()
        proc.wait()


def read_until(proc, start: str, timeout: float) -> str:
    """What ``proc`` printed up to the first line starting with ``start``, or all of it by ``timeout`` s."""
    import queue
    import threading

    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in iter(proc.stdout.readline, "")], daemon=True).start()
    seen = []
    try:
        while not seen or not seen[-1].startswith(start):
            seen.append(lines.get(timeout=timeout))
    except queue.Empty:
        pass
    return "".join(seen)


def test_an_interrupt_that_the_import_of_torch_would_swallow_still_interrupts(tmp_path):
    """torch drops a KeyboardInterrupt that lands while it imports numpy: nbddp's lazy import holds it."""
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    (tmp_path / "swallows.py").write_text(textwrap.dedent("""
        import os, signal, time
        try:  # what torch does around its numpy import
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        print("imported", flush=True)
    """))
    code = textwrap.dedent(f"""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even under nohup
        sys.path[:0] = [{str(ROOT)!r}, {str(tmp_path)!r}]
        import nbddp
        try:
            nbddp._import_holding_interrupts("swallows")
        except KeyboardInterrupt:
            print("KeyboardInterrupt after the import", flush=True)
        else:
            print("the interrupt was lost", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.split() == "imported KeyboardInterrupt after the import".split(), out


def launch_workers(marker: str, launcher: int):
    """Live or zombie processes carrying the marker, but the launcher and its multiprocessing helpers.

    The forkserver and the resource tracker are the launcher's own children and stay for the
    next launch; workers are the forkserver's children (or the launcher's, under spawn).
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == launcher:
            continue
        try:
            env = open(f"/proc/{entry}/environ", "rb").read()
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if f"NBDDP_TEST_MARKER={marker}".encode() not in env or proc_state(int(entry)) is None:
            continue
        if ppid == launcher and (b"forkserver import main" in cmd or b"resource_tracker" in cmd):
            continue
        found.append(int(entry))
    return found
