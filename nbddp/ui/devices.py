"""The device picker: one checkbox per GPU (memory in use, load, processes), or a CPU process count."""

from __future__ import annotations

import html
from typing import Any, List, Optional, Sequence, Tuple

import ipywidgets as W

from ..contract.errors import ConfigError
from ..contract.gpus import IDLE, IDLE_RULE, GPUInfo, gpu_setup_problem, preselected_gpus
from ..contract.system import cpu_cores
from .layout import GREY, LABEL


def gpu_choice(gpus: Any) -> Optional[set]:
    """The GPUs the caller chose (a set of ids), or None to pre-select the idle ones."""
    if gpus is None or gpus == IDLE or (not isinstance(gpus, str) and not tuple(gpus)):
        return None
    return set(gpus)


class DevicePicker:
    """GPUs to tick, or CPU processes to count where there is no GPU.

    Args:
        gpus: the GPUs found (``list_gpus()``); empty for a CPU machine.
        start_gpus: the ids to tick; ``None`` ticks the idle ones (a good colleague leaves busy GPUs alone).
        start_nprocs: the starting number of CPU processes.

    Attributes:
        gpu_checkboxes: one per GPU, labelled with its memory in use, load and processes.
        nprocs_input: the CPU process count (``None`` when there are GPUs).
        device_note: what the picker shows (GPUs and nccl, or why there is no GPU).
        gpu_rule_note: which GPUs were pre-selected and why (GPUs only).
        box: the picker's widget.
        widgets: what a run in progress locks.
    """

    def __init__(self, gpus: Sequence[GPUInfo], start_gpus: Optional[set], start_nprocs: int):
        self.gpus = list(gpus)
        self.gpu_checkboxes: List[W.Checkbox] = []
        self.nprocs_input: Optional[W.BoundedIntText] = None
        self.refresh_button: Optional[W.Button] = None
        self.box = self._gpu_box(start_gpus) if self.gpus else self._cpu_box(start_nprocs)
        self.widgets: List[W.Widget] = list(self.gpu_checkboxes) or [self.nprocs_input]

    def _gpu_box(self, start: Optional[set]) -> W.Box:
        idle, note = preselected_gpus(self.gpus)
        chosen = start if start is not None else set(idle)
        self.gpu_checkboxes = [W.Checkbox(value=g.index in chosen, description=g.label(), indent=False,
                                          layout=W.Layout(width="auto")) for g in self.gpus]
        self.refresh_button = W.Button(description="Refresh", icon="refresh", layout=W.Layout(width="110px"),
                                       tooltip="read memory and utilisation again")
        self.device_note = W.HTML("<b>GPUs</b> (one process each, nccl)")
        self.gpu_rule_note = W.HTML(f"<span style='{GREY}'>Pre-selected: the idle GPUs ({html.escape(IDLE_RULE)})"
                                    f"{'. ' + html.escape(note) if note else ''}</span>")
        return W.VBox([self.device_note, *self.gpu_checkboxes, self.gpu_rule_note, self.refresh_button])

    def _cpu_box(self, start: int) -> W.Box:
        cores = cpu_cores()
        # 1..cores, unless the caller asks for more (oversubscribing works, slowly): keep its value.
        self.nprocs_input = W.BoundedIntText(value=start, min=1, max=max(cores, start), description="CPU processes",
                                             style=LABEL, layout=W.Layout(width="220px"))
        # Several MIG instances in CUDA_VISIBLE_DEVICES list no GPU: say why, not just "none".
        problem = gpu_setup_problem()
        why = f" ({html.escape(problem)})" if problem else ""
        self.device_note = W.HTML(
            f"<span style='{GREY}'>No GPU found{why}: training runs on CPU processes with gloo ({cores} cores "
            "here).</span>", layout=W.Layout(margin="0 0 0 12px"))
        return W.HBox([self.nprocs_input, self.device_note], layout=W.Layout(align_items="center",
                                                                            flex_flow="row wrap"))

    def refresh(self, fresh: Sequence[GPUInfo]) -> None:
        """Relabel the GPUs with ``fresh`` readings (a GPU that vanished keeps its old label)."""
        by_index = {g.index: g for g in fresh}
        for box, g in zip(self.gpu_checkboxes, self.gpus):
            if g.index in by_index:
                box.description = by_index[g.index].label()

    def chosen(self) -> Tuple[Tuple[int, ...], Optional[int]]:
        """``(gpus, None)`` from the ticked GPUs, or ``((), nprocs)`` on a machine without one.

        Raises:
            ConfigError: no GPU is ticked.
        """
        if not self.gpus:
            return (), int(self.nprocs_input.value)
        ticked = tuple(g.index for g, box in zip(self.gpus, self.gpu_checkboxes) if box.value)
        if not ticked:
            raise ConfigError("no GPU selected: tick at least one GPU in the panel")
        return ticked, None

    def set_busy(self, busy: bool) -> None:
        for w in self.widgets:
            w.disabled = busy


__all__ = ["DevicePicker", "gpu_choice"]
