"""The decode pipeline's augmentation boxes: which part of each image is kept, and whether it is mirrored.

Training: torchvision's ``RandomResizedCrop`` (area fraction uniform in ``(crop_scale, 1)``, log
aspect ratio uniform in ``[log 3/4, log 4/3]``, up to 10 tries, else the centre clamped to the
ratio range) and a flip with probability 1/2, drawn from torch's CPU generator seeded with the
image's seed (:func:`nbddp.tasks.classification.loading.item_seed`): the numbers the PIL pipeline's
transforms draw for the same key. Evaluation: the centre crop the reference's ``Resize`` +
``CenterCrop`` keep.

A loader process draws them for every image of a batch, so the rank that decodes on its device
receives the boxes with the bytes. Seeding a ``torch.Generator`` and drawing five numbers through
it costs ~50-100 us an image in Python calls; :class:`SeedDraws` reads the same numbers from one
Mersenne Twister (torch's CPU generator is the standard MT19937, seeded with the seed's low 32
bits) in one call, and applies torch's own conversions to them, in ~10 us.

Both sides (loader processes and ranks).
"""

from __future__ import annotations

import math
import struct
from typing import Optional, Tuple

import torch

from .data import resize_size

Box = Tuple[int, int, int, int]  # (top, left, height, width) in the image's pixels

_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")
_MASK24 = (1 << 24) - 1  # the bits torch's float32 uniform keeps of a 32-bit draw
# Numbers an image's training box and flip can need: 10 tries of 2, then 2 offsets and the flip.
_DRAWS = 24


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even), as a Python float."""
    return _F32.unpack(_F32.pack(x))[0]


def _fused_f32(x: float, scale: float, offset: float) -> float:
    """``x * scale + offset`` rounded once to float32: torch's fused multiply-add on its CPU kernels.

    ``x * scale`` is exact in a double (24-bit by 24-bit mantissas); the sum is rounded to a
    double first, which gives another float32 than one rounding only when the double falls
    exactly half-way between two float32s while the exact sum does not: then the exact sum's
    side (TwoSum's error term) decides.
    """
    product = x * scale
    total = product + offset
    back = total - product
    error = (product - (total - back)) + (offset - back)
    rounded = _f32(total)
    if error and (_U64.unpack(_F64.pack(total))[0] & ((1 << 29) - 1)) == 1 << 28:
        # A tie of the double: the float32 neighbours are total -/+ half an ulp; take error's side.
        import numpy as np

        toward = np.float32(np.inf if error > 0 else -np.inf)
        other = float(np.nextafter(np.float32(rounded), toward))
        if abs(other - total) == abs(rounded - total):
            rounded = other
    return rounded


def _raw_draws(seed: int, n: int) -> Optional[list]:
    """The first ``n`` 32-bit outputs of ``torch.Generator().manual_seed(seed)``, or None without numpy's MT19937."""
    global _bits
    try:
        if _bits is None:
            import numpy as np

            _bits = np.random.MT19937()
        _bits._legacy_seeding(seed & 0xFFFFFFFF)  # MT19937's own seeding of one 32-bit word: torch's
        return _bits.random_raw(n).tolist()
    except (ImportError, AttributeError, TypeError):  # a numpy without it: torch's generator, one call a draw
        return None


_bits = None  # one bit generator a process, seeded again for each image


class SeedDraws:
    """The numbers ``torch.Generator().manual_seed(seed)`` gives to ``uniform_``, ``randint`` and ``rand`` of one value.

    Each of those calls takes one 32-bit output of the generator: ``uniform_(lo, hi)`` keeps its
    low 24 bits ``u`` and returns ``float32(u / 2**24 * (hi - lo) + lo)`` (lo, hi and their
    difference in float32, one rounding), ``randint(0, n)`` returns ``output % n``. Here the
    outputs are read ahead in one call and converted the same way.
    """

    def __init__(self, seed: int):
        raw = _raw_draws(seed, _DRAWS)  # a box and its flip take 23 at most: 10 tries of 2, 2 offsets, 1 flip
        self._generator = torch.Generator().manual_seed(seed) if raw is None else None
        self._take = iter(raw or ()).__next__

    def uniform(self, lo: float, hi: float) -> float:
        if self._generator is not None:
            return float(torch.empty(1).uniform_(lo, hi, generator=self._generator))
        bounds = _bounds.get((lo, hi))
        if bounds is None:
            lo32, hi32 = _f32(lo), _f32(hi)
            bounds = _bounds[lo, hi] = (_f32(hi32 - lo32), lo32)
        return _fused_f32((self._take() & _MASK24) / (1 << 24), *bounds)

    def randint(self, n: int) -> int:
        """``randint(0, n)``: an integer in ``[0, n)``."""
        if self._generator is not None:
            return int(torch.randint(0, n, (1,), generator=self._generator))
        return self._take() % n

    def rand(self) -> float:
        if self._generator is not None:
            return float(torch.rand(1, generator=self._generator))
        return (self._take() & _MASK24) / (1 << 24)


_bounds: dict = {}  # (lo, hi) -> (hi - lo, lo) as torch's float32 uniform_ takes them


class _TorchDraws:
    """A ``torch.Generator`` behind :class:`SeedDraws`'s methods: the draws as torch makes them."""

    def __init__(self, g: torch.Generator):
        self.g = g

    def uniform(self, lo: float, hi: float) -> float:
        return float(torch.empty(1).uniform_(lo, hi, generator=self.g))

    def randint(self, n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=self.g))

    def rand(self) -> float:
        return float(torch.rand(1, generator=self.g))


def crop_box(height: int, width: int, scale: tuple, ratio: tuple, g) -> Box:
    """``(top, left, h, w)`` of a random resized crop (torchvision's algorithm), drawn from ``g``:
    a :class:`SeedDraws` or a ``torch.Generator`` (the same numbers for the same seed)."""
    draws = g if isinstance(g, (SeedDraws, _TorchDraws)) else _TorchDraws(g)
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * draws.uniform(scale[0], scale[1])
        aspect = math.exp(draws.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = draws.randint(height - h + 1)
            left = draws.randint(width - w + 1)
            return top, left, h, w
    in_ratio = width / height  # fallback: the centre, clamped to the ratio range
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def centre_box(height: int, width: int, image_size: int) -> Box:
    """The evaluation crop in the original image's pixels: the shorter side resized to
    ``resize_size(image_size)``, then the centre ``image_size`` square."""
    side = min(height, width) * image_size / resize_size(image_size)
    h = w = max(1, int(round(side)))
    return (height - h) // 2, (width - w) // 2, h, w


class Crops:
    """Each image's box and flip in one split: drawn from its seed (training) or its centre (evaluation).

    Args:
        image_size: the output side (evaluation's centre crop depends on it).
        train: random resized crops and flips; else the centre crop, never flipped.
        crop_scale, hflip: as in :class:`nbddp.TrainConfig`.
    """

    def __init__(self, image_size: int, train: bool, crop_scale: float = 0.08, hflip: bool = True):
        self.image_size, self.train = image_size, train
        self.scale, self.ratio, self.hflip = (crop_scale, 1.0), (3 / 4, 4 / 3), hflip

    def box(self, seed: int, height: int, width: int) -> Tuple[Box, bool]:
        """``((top, left, h, w), flip)`` of an image of ``height x width`` with augmentation seed ``seed``."""
        if not self.train:
            return centre_box(height, width, self.image_size), False
        draws = SeedDraws(seed)
        box = crop_box(height, width, self.scale, self.ratio, draws)
        return box, self.hflip and draws.rand() < 0.5


__all__ = ["Crops", "SeedDraws", "centre_box", "crop_box"]
