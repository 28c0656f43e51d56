"""``%%ranks``: run a cell on a live group of ranks (:func:`nbddp.start_ranks`).

``%%ranks`` runs the cell on every rank of the group started last; ``%%ranks 1`` or ``%%ranks
0,2`` on those ranks only; ``%%ranks --group NAME`` on another group. The cell is plain Python
(IPython's ``%`` and ``!`` lines are the kernel's, not the ranks').

Kernel side.
"""

from __future__ import annotations

import shlex
from typing import Callable, List, Optional, Tuple

from ...contract.errors import ConfigError

USAGE = "%%ranks [RANKS] [--group NAME], RANKS as 1 or 0,2 (default: every rank)"


def parse_line(line: str) -> Tuple[Optional[List[int]], Optional[str]]:
    """``(ranks or None, group name or None)`` of a ``%%ranks`` line; bad words are refused with the usage."""
    ranks, group = None, None
    words = shlex.split(line)
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("--group", "-g") and i + 1 < len(words):
            group, i = words[i + 1], i + 2
            continue
        if word.startswith("--group="):
            group, i = word.partition("=")[2], i + 1
            continue
        if ranks is None and word.replace(",", "").replace(" ", "").isdigit():
            ranks, i = [int(p) for p in word.split(",") if p.strip()], i + 1
            continue
        if ranks is None and word == "all":
            i += 1
            continue
        raise ConfigError(f"%%ranks {line}: {word!r} is not understood; use {USAGE}")
    return ranks, group


def ranks_cell(line: str, cell: str, shell, find_group: Callable) -> None:
    """What ``%%ranks line`` does with ``cell``; ``find_group(name or None)`` gives the group."""
    ranks, group = parse_line(line)
    count = getattr(shell, "execution_count", None)
    label = f"Cell In[{count}]" if count is not None else None
    find_group(group).run(cell, ranks=ranks, label=label)


_registered: set = set()


def register(shell, find_group: Callable) -> None:
    """Register ``%%ranks`` in ``shell`` (once per shell); ``find_group`` as :func:`ranks_cell` takes it."""
    if id(shell) in _registered:
        return

    def ranks(line, cell):
        return ranks_cell(line, cell, shell, find_group)

    ranks.__doc__ = f"Run the cell on the ranks of a group started with nbddp.start_ranks: {USAGE}."
    shell.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    _registered.add(id(shell))


__all__ = ["register", "parse_line", "ranks_cell", "USAGE"]
