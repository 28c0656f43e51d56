"""The decode pipeline's resize: a box of each decoded image, mirrored or not, to one ``S x S`` square.

Both ways compute PyTorch's antialiased bilinear resize (``F.interpolate(mode="bilinear",
antialias=True, align_corners=False)``, PIL's filter): :func:`resize_each` calls it image by image;
:func:`resize_batch` writes the same linear map as two batched matrix products, ``Wy @ crop @ Wx^T``,
whose rows are the filter's normalised weights (zero outside the image's box, so the crops of a
batch can share one padded tensor), and mirrors by reversing ``Wx``'s rows. The results agree to
float rounding.

Image by image, a GPU rank's one host thread spends ~30-50 us an image launching the crop,
conversion, resize, copy and flip; the batch takes ~25 launches whatever its size. On a CPU the
arithmetic decides instead, and the per-image resize does less of it (it reads only the filter's
taps), so a CPU rank keeps it.

Worker side.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

#: Elements (of 3 x h x w crops, padded to the largest) one batched call gathers at most: its
#: int64 indices and float copy take 12 bytes each (200 MB). A batch of larger crops is resized
#: in several calls.
CHUNK_ELEMENTS = 1 << 24


def resize_each(images: Sequence[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, size: int,
                device: torch.device) -> torch.Tensor:
    """``N x 3 x size x size`` float: each image's box (a row of ``boxes``: top, left, height, width)
    resized on its own, mirrored where ``flips`` says (the CPU way)."""
    out = torch.empty(len(images), 3, size, size, device=device)
    for i, (img, (top, left, h, w), flip) in enumerate(zip(images, boxes.tolist(), flips.tolist())):
        crop = img[None, :, top:top + h, left:left + w].float()
        out[i] = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
        if flip:
            out[i] = out[i].flip(-1)
    return out


def filter_weights(lengths: torch.Tensor, padded: int, size: int) -> torch.Tensor:
    """``[n, size, padded]``: row ``i`` of image ``k`` weighs the ``lengths[k]`` input pixels for output pixel ``i``.

    PyTorch's antialiased bilinear filter: scale ``s = length / size``, support ``max(s, 1)``,
    centre ``s * (i + 0.5)``, a triangle ``max(0, 1 - |j + 0.5 - centre| / max(s, 1))`` over the
    input pixels ``j < length``, each row normalised to sum 1. Columns from ``length`` on are 0.
    """
    length = lengths.to(torch.float64).view(-1, 1, 1)
    scale = length / size
    support = scale.clamp(min=1.0)
    centre = scale * (torch.arange(size, dtype=torch.float64, device=lengths.device).view(1, -1, 1) + 0.5)
    j = torch.arange(padded, dtype=torch.float64, device=lengths.device).view(1, 1, -1)
    weights = (1.0 - ((j + 0.5 - centre) / support).abs()).clamp(min=0.0) * (j < length)
    return (weights / weights.sum(-1, keepdim=True)).float()


def _chunks(boxes: torch.Tensor) -> List[tuple]:
    """``(start, end)`` runs of images whose padded crops stay within :data:`CHUNK_ELEMENTS` (one image at least)."""
    n = len(boxes)
    if n * 3 * int(boxes[:, 2].max()) * int(boxes[:, 3].max()) <= CHUNK_ELEMENTS:
        return [(0, n)]
    runs, start, hc, wc = [], 0, 0, 0
    for i, (_, _, h, w) in enumerate(boxes.tolist()):
        nh, nw = max(hc, h), max(wc, w)
        if i > start and (i - start + 1) * 3 * nh * nw > CHUNK_ELEMENTS:
            runs.append((start, i))
            start, nh, nw = i, h, w
        hc, wc = nh, nw
    runs.append((start, n))
    return runs


def _end_to_end(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """The images' pixels in one 1-D tensor, in one call (DDP's own helper), else by a view of each."""
    try:
        from torch._utils import _flatten_dense_tensors

        return _flatten_dense_tensors(list(images))
    except (ImportError, AttributeError, RuntimeError):
        return torch.cat([img.reshape(-1) for img in images])


def resize_batch(images: Sequence[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, size: int,
                 device: torch.device, sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``N x 3 x size x size`` float: every image's box resized in a few batched calls (the GPU way).

    ``boxes`` (``int64 [N, 4]``: top, left, height, width), ``flips`` (``bool [N]``) and ``sizes``
    (``int64 [N, 2]``: each image's height and width, read from the images when not given) are on
    the CPU. The images are laid end to end in one tensor; each chunk gathers its boxes into one
    padded ``n x 3 x h x w`` tensor (edge pixels repeated: their weights are 0) and resizes it
    with two batched matrix products.
    """
    n = len(images)
    out = torch.empty(n, 3, size, size, device=device)
    if n == 0:
        return out
    flat = _end_to_end(images)
    if sizes is None:
        sizes = torch.tensor([(img.shape[-2], img.shape[-1]) for img in images], dtype=torch.int64)
    plane = sizes[:, 0] * sizes[:, 1]
    start = torch.cumsum(3 * plane, 0) - 3 * plane
    # Per image: where it starts, its plane, its width, its box; one copy to the device.
    geometry = torch.cat([start[:, None], plane[:, None], sizes[:, 1:], boxes], 1).to(device, non_blocking=True)
    mirrored = flips.to(device, non_blocking=True)
    channel = torch.arange(3, device=device).view(1, 3, 1, 1)
    for a, b in _chunks(boxes):
        base, plane, width, top, left, h, w = geometry[a:b].unbind(1)
        hc, wc = int(boxes[a:b, 2].max()), int(boxes[a:b, 3].max())
        rows = top[:, None] + torch.minimum(torch.arange(hc, device=device), h[:, None] - 1)  # [m, hc]
        cols = left[:, None] + torch.minimum(torch.arange(wc, device=device), w[:, None] - 1)  # [m, wc]
        pixel = (rows * width[:, None])[:, :, None] + cols[:, None, :]  # [m, hc, wc] within a plane
        index = pixel[:, None] + (base[:, None, None, None] + channel * plane[:, None, None, None])
        crops = flat.take(index).float()  # [m, 3, hc, wc]
        m = b - a
        both = filter_weights(torch.cat([h, w]), max(hc, wc), size)  # the rows' and the columns' at once
        wy, wx = both[:m, :, :hc], both[m:, :, :wc]  # [m, S, hc], [m, S, wc]
        wx = torch.where(mirrored[a:b, None, None], wx.flip(1), wx)
        # Rows of every channel at once, then columns of every channel at once: two products of m
        # matrices (not 3m), the channels side by side in each.
        across = torch.bmm(crops.view(m, 3 * hc, wc), wx.transpose(1, 2))  # [m, 3*hc, S]
        across = across.view(m, 3, hc, size).transpose(1, 2).reshape(m, hc, 3 * size)
        out[a:b] = torch.bmm(wy, across).view(m, size, 3, size).transpose(1, 2)
    return out


__all__ = ["CHUNK_ELEMENTS", "filter_weights", "resize_batch", "resize_each"]
