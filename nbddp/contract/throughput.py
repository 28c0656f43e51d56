"""The dense peak TFLOP/s of known GPUs, per precision (what an MFU is a fraction of), and how a record's rates read.

Data, not code: :data:`PEAKS` is the table, one row per GPU model, each value the vendor's
datasheet figure **without** structured sparsity (the datasheets print the sparse figure, twice
the dense one, with an asterisk). A device is found by its full CUDA name (what
``torch.cuda.get_device_name`` says) matched against each row's pattern, and, where the rank
knows it, its count of streaming multiprocessors (SMs): a name that matches no row, or a MIG
slice (its name carries the profile; its SMs are a part of the GPU's), has no peak, and nbddp
then reports no MFU rather than a guess. GeForce cards compute bf16 and fp16 with fp32
accumulation (what PyTorch asks for) at half their fp16-accumulate rate: the RTX 4090's row is
that half.

Precisions: ``"bf16"`` and ``"fp16"`` (tensor cores, autocast), ``"tf32"`` (fp32 tensors
through the tensor cores: cuDNN's convolutions by default, matmuls under
``torch.set_float32_matmul_precision("high")``), ``"fp32"`` (the CUDA cores).

Sources: the NVIDIA datasheets of the A100 (2021), H100 (2023), H200 (2024), L40S (2023), L4
(2023) and A10 (2021), and the NVIDIA Ada GPU architecture whitepaper (v2.02), appendix A (RTX 4090).

Both sides: the ranks put ``tflops``, ``mfu`` and ``data_wait`` into their records
(:mod:`nbddp.rank.flops`, which reads the device's name), the epoch line and the panel show them
(:func:`rates_text`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class Peak:
    """One GPU model: the names it goes by, its SMs, and its dense peak TFLOP/s per precision."""

    model: str            # as people say it: "H100 SXM"
    names: Tuple[str, ...]  # regular expressions, each matched against the whole CUDA device name
    sms: int              # streaming multiprocessors of the whole GPU
    tflops: Dict[str, float]


def _p(bf16: float, tf32: float, fp32: float, fp16: Optional[float] = None) -> Dict[str, float]:
    return {"bf16": bf16, "fp16": bf16 if fp16 is None else fp16, "tf32": tf32, "fp32": fp32}


#: Dense peak TFLOP/s of each known GPU. Names are matched whole (``re.fullmatch``): "NVIDIA A10"
#: is not "NVIDIA A10G" nor "NVIDIA A100", "NVIDIA H200" is not "NVIDIA H200 NVL", "NVIDIA GeForce
#: RTX 4090" is not its "D" or "Laptop GPU".
PEAKS: Tuple[Peak, ...] = (
    Peak("A100", (r"NVIDIA A100-(SXM4|PCIE)-(40|80)GB", r"NVIDIA A100 (40|80)GB PCIe"), 108, _p(312, 156, 19.5)),
    Peak("H100 SXM", (r"NVIDIA H100 80GB HBM3", r"NVIDIA H100 SXM5 80GB"), 132, _p(989.4, 494.7, 67)),
    Peak("H100 PCIe", (r"NVIDIA H100 PCIe",), 114, _p(756.5, 378, 51)),
    Peak("H200", (r"NVIDIA H200",), 132, _p(989.4, 494.7, 67)),
    Peak("L40S", (r"NVIDIA L40S",), 142, _p(362.05, 183, 91.6)),
    Peak("L4", (r"NVIDIA L4",), 58, _p(121, 60, 30.3)),
    Peak("A10", (r"NVIDIA A10",), 72, _p(125, 62.5, 31.2)),
    Peak("RTX 4090", (r"NVIDIA GeForce RTX 4090",), 128, _p(165.2, 82.6, 82.6)),
)


def find(name: Optional[str], sms: Optional[int] = None) -> Optional[Peak]:
    """The row of the GPU called ``name`` (with ``sms`` multiprocessors, where known), or None.

    Args:
        name: the CUDA device name, e.g. ``"NVIDIA H100 80GB HBM3"``; None (a CPU) finds nothing.
        sms: the device's multiprocessor count (``torch.cuda.get_device_properties(i).multi_processor_count``):
            a device with another count (a MIG slice, a cut-down variant of the same name) finds nothing.
    """
    if not name:
        return None
    text = " ".join(name.split())
    for peak in PEAKS:
        if any(re.fullmatch(pattern, text) for pattern in peak.names):
            return peak if sms is None or sms == peak.sms else None
    return None


def peak_tflops(name: Optional[str], precision: Optional[str], sms: Optional[int] = None) -> Optional[float]:
    """The dense peak TFLOP/s of the GPU called ``name`` at ``precision``; None where not known (never guessed).

    Raises:
        ValueError: ``precision`` is none of :data:`PRECISIONS` (nor None).
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: one of {', '.join(map(repr, PRECISIONS))}, or None (no MFU)")
    peak = find(name, sms)
    return None if peak is None or precision is None else peak.tflops[precision]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def rates_text(record: dict, sep: str = "  ") -> str:
    """A record's rates as the epoch line shows them: ``"  21.3 TFLOP/s (MFU 2.16%)  data wait 4%"``.

    The text starts with ``sep`` when it is not empty; :func:`rates_parts` are its parts.
    """
    return "".join(sep + p for p in rates_parts(record))


def rates_parts(record: dict) -> list:
    """``["21.3 TFLOP/s (MFU 2.16%)", "data wait 4%"]``: each part only where the record has it (no ``mfu``
    off a GPU or on one the table does not know)."""
    parts = []
    if _number(record.get("tflops")):
        mfu = f" (MFU {record['mfu'] * 100:.3g}%)" if _number(record.get("mfu")) else ""
        tflops = record["tflops"]
        parts.append(f"{tflops:.1f} TFLOP/s{mfu}" if tflops >= 1 else f"{tflops:.3g} TFLOP/s{mfu}")
    if _number(record.get("data_wait")):
        parts.append(f"data wait {record['data_wait']:.0%}")
    return parts


__all__ = ["PEAKS", "PRECISIONS", "Peak", "find", "peak_tflops", "rates_parts", "rates_text"]
