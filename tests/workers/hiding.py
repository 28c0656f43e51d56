"""A worker that starts children hiding from every trace but the process tree, and returns them."""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _to_devnull() -> None:
    fd = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(fd, target)


def _sleep_forever() -> None:
    while True:
        time.sleep(60)


def _fork(child_setup) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            child_setup()
            _sleep_forever()
        finally:
            os._exit(0)
    return pid


def _double_fork() -> int:
    """A daemon: the child forks the grandchild, which leaves the session, and exits at once."""
    r, w = os.pipe()

    def middle():
        os.close(r)
        grandchild = _fork(lambda: (os.setsid(), _to_devnull()))
        os.write(w, str(grandchild).encode())
        os._exit(0)

    child = _fork(middle)
    os.close(w)
    grandchild = int(os.read(r, 32))
    os.close(r)
    os.waitpid(child, 0)
    return grandchild


def hide(ctx, kill_self: str = ""):
    """Start four hiding children; return ``{how: (pid, start time)}`` or, with ``kill_self``,
    write it to that file and die by SIGKILL (nothing of the rank's own cleanup runs)."""
    hidden = {}
    popen = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(60)"], env={},
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    hidden["Popen(start_new_session, env={}, DEVNULL)"] = popen.pid
    from_thread = []
    thread = threading.Thread(target=lambda: from_thread.append(_fork(lambda: (os.setsid(), _to_devnull()))))
    thread.start()
    thread.join()
    hidden["fork from a thread + setsid + /dev/null"] = from_thread[0]
    libc = ctypes.CDLL(None, use_errno=True)
    hidden["fork + PR_SET_PDEATHSIG 0"] = _fork(lambda: libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0))
    hidden["double fork + setsid"] = _double_fork()
    found = {how: (pid, _start_time(pid)) for how, pid in hidden.items()}
    if kill_self:
        Path(kill_self).write_text(repr(found))
        record = ctx.run_dir / ".nbddp" / f"tree-rank{ctx.rank}.json"
        while not (record.exists() and all(str(pid) in record.read_text() for pid, _ in found.values())):
            time.sleep(0.05)  # the rank's recorder has seen them all: what the kernel will read
        os.kill(os.getpid(), signal.SIGKILL)
    return found
