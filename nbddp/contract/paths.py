"""What kind of thing a path is, before nbddp reads it: special files and pseudo-filesystems.

Reading a FIFO waits for a writer forever, a character device (``/dev/zero``) never ends, and
``/proc`` or ``/sys`` hold endless, self-referencing trees (``/proc/self/root`` is ``/``).
Data scans and weight loads ask here first, so such a path gets a message instead of a hang.
Used on both sides (kernel preflight and workers): imports only the standard library.
"""

from __future__ import annotations

import os
import stat
from typing import Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

#: File system types that are the kernel's views of itself, not storage.
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc", "efivarfs", "nsfs", "autofs",
    "rpc_pipefs", "hugetlbfs",
})

_mounts: Optional[dict] = None


def _filesystem_types() -> dict:
    """``{st_dev: fstype}`` of this machine's mounts, from /proc/self/mountinfo (read once)."""
    global _mounts
    if _mounts is None:
        found = {}
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    head, _, tail = line.partition(" - ")
                    fields = head.split()
                    if len(fields) >= 3 and tail:
                        major, _, minor = fields[2].partition(":")
                        found[os.makedev(int(major), int(minor))] = tail.split()[0]
        except (OSError, ValueError):
            pass  # not Linux: the path prefixes below still catch the usual places
        _mounts = found
    return _mounts


def pseudo_filesystem(path: PathLike, st: Optional[os.stat_result] = None) -> Optional[str]:
    """The pseudo-filesystem type ``path`` lies on (``"proc"``, ``"sysfs"``...), or None.

    Args:
        path: any existing path; links are followed.
        st: its ``os.stat`` result, when the caller has it already.
    """
    st = st if st is not None else os.stat(path)
    kind = _filesystem_types().get(st.st_dev)
    if kind is not None:
        return kind if kind in PSEUDO_FILESYSTEMS else None
    real = os.path.realpath(path)
    for top, name in (("/proc", "proc"), ("/sys", "sysfs")):
        if real == top or real.startswith(top + "/"):
            return name
    return None


def special_file_kind(st: os.stat_result) -> Optional[str]:
    """``"a FIFO"``, ``"a socket"``, ``"a character device"``, ``"a block device"``, or None."""
    mode = st.st_mode
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return None


__all__ = ["PSEUDO_FILESYSTEMS", "pseudo_filesystem", "special_file_kind"]
