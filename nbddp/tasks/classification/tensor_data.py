"""The tensor data path: decode once, keep uint8 tensors on the device, augment whole batches.

Worker side. ``TrainConfig(data_pipeline="tensor")`` switches the built-in worker to it:

- every image is decoded once (EXIF, modes and corrupt files handled by ``load_rgb``), its
  shorter side resized to ``load_size = int(image_size / 0.875)`` and centre-cropped to a
  ``load_size`` square, and kept as one ``uint8`` tensor ``[N, 3, S, S]`` on the rank's device
  (GPU memory on GPUs: no loader processes, no host-to-device copy per step);
- a batch is one index into that tensor;
- augmentation runs on the whole batch at once, on the device: a random resized crop and
  horizontal flip through one ``affine_grid``/``grid_sample``, then normalisation as one fused
  multiply-add. Evaluation takes the centre ``image_size`` crop, like the PIL pipeline's
  ``Resize(S) + CenterCrop``.

What differs from the PIL pipeline (``data_pipeline="pil"``, the reference): random crops
come from the centre square of each image rather than the full rectangle, and resizing is
bilinear without antialiasing (crops are at most ``S / image_size`` = 1.14x larger than the
output, so aliasing is slight). The random parameters come from torch's global generator,
which the worker seeds per (seed, epoch, rank): resumed runs draw what uninterrupted runs draw.

Memory: ``N * 3 * S * S`` bytes per rank (the digits at 32 px: 7 MB; 3,670 flower photos at
224 px: 0.7 GB).

The decoded images are kept between launches (:mod:`nbddp.tasks.classification.decoded_store`,
in the user's private cache folder, up to ``NBDDP_DECODED_CACHE_GB``): a relaunch over the same
files reads them back instead of decoding, and the ranks of one launch decode them once between
them.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from . import decoded_store
from .data import IMAGENET_MEAN, IMAGENET_STD, Sample, load_rgb, loader_processes, resize_size


# Side of the cached square: the PIL pipeline's evaluation resize, so that the centre crop of
# the cache is what the PIL pipeline evaluates.
load_size = resize_size


def cache_bytes(n_images: int, image_size: int) -> int:
    """Memory the cache takes per rank, in bytes."""
    s = load_size(image_size)
    return n_images * 3 * s * s


class _Decode(Dataset):
    def __init__(self, samples: Sequence[Sample], size: int):
        self.samples, self.size = list(samples), size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        from torchvision.transforms import functional as TF

        image = load_rgb(self.samples[i][0])
        image = TF.center_crop(TF.resize(image, self.size), [self.size, self.size])
        return TF.pil_to_tensor(image)


class TensorCache:
    """Every image of ``samples`` decoded once into ``images`` (uint8 ``[N, 3, S, S]``) and ``labels``.

    Decoded images are read back from the user's store of them when it holds these files as they
    are now (:mod:`nbddp.tasks.classification.decoded_store`); ``decoded`` says how many images
    this cache decoded itself (0 when read back).

    Args:
        samples: ``(path, class_index)`` pairs.
        image_size: the training crop side; the cache keeps ``load_size(image_size)`` squares.
        device: where the tensors live (the rank's GPU, or the CPU).
        workers: processes that decode in parallel (0: in this process).

    Raises:
        DataError: an image cannot be read (named by path).
        ValueError: ``NBDDP_DECODED_CACHE_GB`` is not a size in GiB.
    """

    def __init__(self, samples: Sequence[Sample], image_size: int, device: torch.device, workers: int = 0):
        size = load_size(image_size)
        images = torch.empty(len(samples), 3, size, size, dtype=torch.uint8)

        def decode(out: torch.Tensor) -> None:
            # Forked decoders: no interpreter start nor torch import per worker (see loader_processes).
            loader = DataLoader(_Decode(samples, size), batch_size=64, **loader_processes(workers))
            offset = 0
            for batch in loader:
                out[offset:offset + len(batch)] = batch
                offset += len(batch)

        self.decoded = len(samples) if decoded_store.fill(samples, size, images, decode) else 0
        self.images = images.to(device)
        self.labels = torch.tensor([int(c) for _, c in samples], dtype=torch.long, device=device)

    def __len__(self) -> int:
        return len(self.labels)


class TensorBatches:
    """Batches of a ``TensorCache`` in the order of ``sampler``: a drop-in for a DataLoader.

    Each batch is ``(uint8 images [B, 3, S, S], labels [B])`` on the cache's device; pass
    :class:`BatchAugment` (training) or :class:`CenterCropNormalize` (evaluation) to the engine
    as ``batch_transform``.
    """

    def __init__(self, cache: TensorCache, sampler: Sampler[int], batch_size: int, drop_last: bool = False):
        self.cache, self.sampler, self.batch_size, self.drop_last = cache, sampler, batch_size, drop_last

    def _batches(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __len__(self) -> int:
        # The sampler's length: with nbddp.tasks.classification.data.SkipSampler, what remains of a resumed epoch.
        return self._batches(len(self.sampler))

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        order = torch.as_tensor(list(iter(self.sampler)), dtype=torch.long).to(self.cache.labels.device)
        for b in range(self._batches(len(order))):  # the pass's own items, whatever len() says later
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            yield self.cache.images[idx], self.cache.labels[idx]


class _Normalize:
    def __init__(self):
        self._consts: dict = {}

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 or float 0..255 -> ImageNet-normalised float32, as ToTensor + Normalize do."""
        key = x.device
        if key not in self._consts:
            mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
            std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
            self._consts[key] = (1.0 / (255.0 * std), mean / std)
        scale, shift = self._consts[key]
        return x.float() * scale - shift


class CenterCropNormalize(_Normalize):
    """Evaluation: the centre ``image_size`` crop of each cached square, normalised."""

    def __init__(self, image_size: int):
        super().__init__()
        self.image_size = image_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s, c = x.shape[-1], self.image_size
        top = int(round((s - c) / 2.0))  # torchvision's CenterCrop offset
        return self.normalize(x[..., top:top + c, top:top + c])


class BatchAugment(_Normalize):
    """Training: random resized crop (+ horizontal flip) of a whole batch in one ``grid_sample``.

    The crop boxes follow torchvision's ``RandomResizedCrop``: area fraction uniform in
    ``[crop_scale, 1]``, log aspect ratio uniform in ``[log 3/4, log 4/3]``, up to 10 tries per
    image, else the whole square.

    Args:
        image_size: output side.
        crop_scale: smallest area fraction kept.
        hflip: flip half the images horizontally.
        generator: random source (default: torch's global CPU generator, seeded by the worker). A
            CUDA generator draws on its own device, so the boxes never pass through the CPU; its
            stream differs from a CPU generator's with the same seed.
    """

    def __init__(self, image_size: int, crop_scale: float = 0.08, hflip: bool = True,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        self.image_size, self.crop_scale, self.hflip, self.generator = image_size, crop_scale, hflip, generator
        # torch.rand(generator=g) needs its tensor on g's device: draw where the generator lives.
        self._device = torch.device("cpu") if generator is None else generator.device

    def boxes(self, n: int, side: int) -> torch.Tensor:
        """``[n, 4]`` crop boxes ``(top, left, height, width)`` in pixels of a ``side`` square (on the generator's device)."""
        tries = 10
        g, dev = self.generator, self._device
        area = side * side * (self.crop_scale + (1 - self.crop_scale) * torch.rand(n, tries, generator=g, device=dev))
        log_ratio = math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * torch.rand(n, tries, generator=g, device=dev)
        ratio = torch.exp(log_ratio)
        w = torch.sqrt(area * ratio).round()
        h = torch.sqrt(area / ratio).round()
        ok = (w > 0) & (h > 0) & (w <= side) & (h <= side)
        first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((n,), -1, device=dev))
        rows = torch.arange(n, device=dev)
        pick = first.clamp(min=0)
        w = torch.where(first >= 0, w[rows, pick], torch.full((n,), float(side), device=dev))
        h = torch.where(first >= 0, h[rows, pick], torch.full((n,), float(side), device=dev))
        top = torch.floor(torch.rand(n, generator=g, device=dev) * (side - h + 1))
        left = torch.floor(torch.rand(n, generator=g, device=dev) * (side - w + 1))
        return torch.stack([top, left, h, w], 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, _, side, side_w = x.shape
        if side != side_w:
            raise ValueError(f"BatchAugment needs square images, got {tuple(x.shape)}")
        top, left, h, w = self.boxes(n, side).unbind(1)
        dev = self._device
        flip = ((torch.rand(n, generator=self.generator, device=dev) < 0.5) if self.hflip
                else torch.zeros(n, dtype=torch.bool, device=dev))
        # affine_grid maps output coordinates in [-1, 1] to input coordinates in [-1, 1]
        # (align_corners=False: -1 and 1 are the outer pixel edges): scale by the box size,
        # shift to the box centre, and mirror x for flipped images.
        theta = torch.zeros(n, 2, 3, device=dev)
        theta[:, 0, 0] = (w / side) * torch.where(flip, -1.0, 1.0)
        theta[:, 1, 1] = h / side
        theta[:, 0, 2] = (2 * left + w) / side - 1
        theta[:, 1, 2] = (2 * top + h) / side - 1
        theta = theta.to(x.device, non_blocking=True)
        grid = F.affine_grid(theta, [n, 3, self.image_size, self.image_size], align_corners=False)
        out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
        return self.normalize(out)


__all__ = ["BatchAugment", "CenterCropNormalize", "TensorBatches", "TensorCache", "cache_bytes", "load_size"]
