"""A GPU server is shared: what nbddp opens must be reachable from this machine only."""

import os
import socket

from nbddp import spawn_train
from conftest import WORKERS, wait_for

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
        assert any(port == h.spec.store_port for _, port in found), found  # the check sees the store
        assert found and all(addr in ("127.0.0.1", "::1") for addr, _ in found), found
    finally:
        go.write_text("go")
        h.wait(timeout=60)
