"""Where the panel's run starts: this server, or a SLURM job on a partition (``spawn_train(cluster=...)``).

Shown only where SLURM's ``sbatch`` is on the PATH; the partitions are the ones ``sinfo`` lists,
the cluster's default first. The run itself then shows as a local one does: the handle follows the
job through the run folder (:mod:`nbddp.kernel.slurm_group`).
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, List, Optional, Tuple

import ipywidgets as W

from .layout import GREY, LABEL

HERE, SLURM = "this server", "SLURM"


def partitions() -> Tuple[List[str], Optional[str]]:
    """``(partitions, default)`` as ``sinfo`` lists them; none where it does not answer."""
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=10,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return [], None
    names = done.stdout.split() if done.returncode == 0 else []
    default = next((n.rstrip("*") for n in names if n.endswith("*")), None)
    found = list(dict.fromkeys(n.rstrip("*") for n in names))
    return ([default] + [n for n in found if n != default] if default else found), default


class ClusterPicker:
    """"this server / SLURM", and the partition, where ``sbatch`` is on the PATH (else hidden).

    Attributes:
        where_toggle: ``"this server"`` or ``"SLURM"``.
        partition_dropdown: the partitions ``sinfo`` lists (shown once SLURM is chosen).
        cluster_box: the picker's widget (hidden without SLURM).
        widgets: what a run in progress locks.
    """

    def __init__(self) -> None:
        names, _default = partitions() if shutil.which("sbatch") else ([], None)
        self.available = bool(names)
        self.where_toggle = W.ToggleButtons(options=[HERE, SLURM], value=HERE, description="Run on",
                                            style=LABEL, tooltips=["start the ranks on this server",
                                                                   "submit the ranks as one SLURM job"])
        self.partition_dropdown = W.Dropdown(options=names, value=names[0] if names else None,
                                             description="partition", style=LABEL,
                                             layout=W.Layout(width="220px", display="none"))
        note = W.HTML(f"<span style='{GREY}'>a SLURM job: queued, then followed here as a run on this server "
                      "is</span>", layout=W.Layout(display="none"))
        self._note = note
        self.where_toggle.observe(self._show, names="value")
        self.cluster_box = W.HBox([self.where_toggle, self.partition_dropdown, note],
                          layout=W.Layout(align_items="center", flex_flow="row wrap",
                                          display=None if self.available else "none"))
        self.widgets: List[W.Widget] = [self.where_toggle, self.partition_dropdown]

    def _show(self, _change: Any = None) -> None:
        shown = None if self.where_toggle.value == SLURM else "none"
        self.partition_dropdown.layout.display = shown
        self._note.layout.display = shown

    def cluster(self, gpus: int = 0) -> Any:
        """``nbddp.Slurm(partition=...)`` for a SLURM run (``gpus`` a node), else None (this server)."""
        if not self.available or self.where_toggle.value != SLURM:
            return None
        from ..kernel.slurm import Slurm

        return Slurm(partition=self.partition_dropdown.value, gpus_per_node=gpus or None)

    def set_busy(self, busy: bool) -> None:
        for w in self.widgets:
            w.disabled = busy


__all__ = ["ClusterPicker", "partitions"]
