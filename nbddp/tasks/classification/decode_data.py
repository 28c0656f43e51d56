"""``data_pipeline="decode"``: loader workers read file bytes; each batch is decoded and augmented on the rank's device.

On a GPU the JPEGs of a batch are decoded together by nvJPEG (``torchvision.io.decode_jpeg(...,
device="cuda")``), then cropped, flipped, resized and normalised there: only the files' bytes
cross the loader (no decoded image, no float tensor), and the CPU cores that fed PIL are free.
PNG and other formats are decoded per image on the CPU (``decode_image``) and moved over. On a
CPU rank the same code decodes with torchvision's decoder, which is faster than PIL.

Augmentation is the reference's (random resized crop of scale ``(crop_scale, 1)`` and ratio
3/4–4/3, horizontal flip; evaluation resizes the shorter side to ``resize_size`` and takes the
centre), drawn for each image from a generator seeded by (seed, epoch, image) alone
(:class:`nbddp.tasks.classification.data.SeededSampler`): the same crops with any number of loader processes, and a
run resumed in the middle of an epoch sees what an uninterrupted one sees.

Worker side.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .data import IMAGENET_MEAN, IMAGENET_STD, Sample, resize_size
from ...contract.errors import DataError

_JPEG_MAGIC = b"\xff\xd8\xff"


@contextlib.contextmanager
def _quiet():
    """torchvision 0.29 deprecates its decoders in favour of TorchCodec, warning at every call: once
    is in the release notes, not in every rank's log per batch."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torchvision\.io")
        yield


class FileBytes(Dataset):
    """A file's bytes (a 1-D ``uint8`` tensor), its label and its augmentation seed, per key.

    Keys are ``(index, seed)`` from :class:`nbddp.tasks.classification.data.SeededSampler` (training) or plain
    indices (evaluation, seed 0). Reading bytes is all a loader process does.
    """

    def __init__(self, samples: Sequence[Sample]):
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        from torchvision.io import read_file

        index, seed = key if isinstance(key, tuple) else (key, 0)
        path, label = self.samples[index]
        with _quiet():
            data = read_file(str(path))
        return data, label, seed, str(path)


class EncodedBatch:
    """A batch of encoded images: their bytes end to end in one ``uint8`` tensor, with offsets,
    seeds and paths.

    One tensor, not one per image: a loader process hands each tensor over through shared
    memory, one file descriptor each, and a batch of small ones is what that handles worst.
    ``.to(device)`` keeps the bytes where they are: the decoder reads them from (pinned) CPU
    memory, as nvJPEG does, and what it decodes is already on the device.
    """

    def __init__(self, blob: torch.Tensor, offsets: list, seeds: list, paths: list):
        self.blob, self.offsets, self.seeds, self.paths = blob, offsets, seeds, paths

    @classmethod
    def of(cls, data: Sequence[torch.Tensor], seeds: list, paths: list) -> "EncodedBatch":
        offsets = [0]
        for d in data:
            offsets.append(offsets[-1] + d.numel())
        blob = torch.cat(list(data)) if data else torch.empty(0, dtype=torch.uint8)
        return cls(blob, offsets, seeds, paths)

    @property
    def data(self) -> list:
        """Each image's bytes (views into the one tensor)."""
        return [self.blob[a:b] for a, b in zip(self.offsets, self.offsets[1:])]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def to(self, device, non_blocking: bool = False) -> "EncodedBatch":
        return self

    def pin_memory(self) -> "EncodedBatch":
        return EncodedBatch(self.blob.pin_memory(), self.offsets, self.seeds, self.paths)


def collate(items) -> tuple:
    """``(EncodedBatch, labels)`` from :class:`FileBytes` items."""
    data, labels, seeds, paths = zip(*items)
    return EncodedBatch.of(data, list(seeds), list(paths)), torch.tensor(labels, dtype=torch.long)


def is_jpeg(data: torch.Tensor) -> bool:
    return data.numel() >= 3 and bytes(data[:3].tolist()) == _JPEG_MAGIC


def decode(batch: EncodedBatch, device: torch.device) -> list:
    """Every image of ``batch`` as a ``3 x H x W`` ``uint8`` tensor on ``device``: JPEGs together
    (nvJPEG on a GPU), the others one by one on the CPU.

    Raises:
        DataError: naming the file that cannot be decoded.
    """
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    with _quiet():
        return _decode(batch, device, decode_jpeg, decode_image, ImageReadMode.RGB)


def _decode(batch: EncodedBatch, device: torch.device, decode_jpeg, decode_image, rgb) -> list:
    out: list = [None] * len(batch)
    data = batch.data
    jpegs = [i for i, d in enumerate(data) if is_jpeg(d)]
    if jpegs:
        try:
            decoded = decode_jpeg([data[i] for i in jpegs], mode=rgb, device=device)
        except RuntimeError:
            decoded = None  # find the file at fault below, one by one
        for k, i in enumerate(jpegs):
            out[i] = decoded[k] if decoded is not None else _one(batch, i, device, decode_jpeg, rgb)
    for i, img in enumerate(out):
        if img is None:
            out[i] = _one(batch, i, device, decode_image, rgb)
    return out


def _one(batch: EncodedBatch, i: int, device: torch.device, fn, mode) -> torch.Tensor:
    try:
        img = fn(batch.data[i], mode=mode, **({"device": device} if fn.__name__ == "decode_jpeg" else {}))
    except RuntimeError as exc:
        raise DataError(f"cannot decode {batch.paths[i]}: {exc}. Remove or replace the file "
                        "(check_images=True finds such files before the launch)") from None
    return img.to(device, non_blocking=True)


def crop_box(height: int, width: int, scale: tuple, ratio: tuple, g: torch.Generator) -> tuple:
    """``(top, left, h, w)`` of a random resized crop, drawn from ``g`` (torchvision's algorithm)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(scale[0], scale[1], generator=g))
        aspect = math.exp(float(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=g)))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return top, left, h, w
    in_ratio = width / height  # fallback: the centre, clamped to the ratio range
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def centre_box(height: int, width: int, image_size: int) -> tuple:
    """The evaluation crop in the original image's pixels: the shorter side resized to
    ``resize_size(image_size)``, then the centre ``image_size`` square."""
    side = min(height, width) * image_size / resize_size(image_size)
    h = w = max(1, int(round(side)))
    return (height - h) // 2, (width - w) // 2, h, w


class DeviceDecoder:
    """The decode pipeline's batch transform: an :class:`EncodedBatch` in, a normalised
    ``N x 3 x S x S`` float batch on the rank's device out.

    Args:
        device: where to decode and augment (``cuda:i``: nvJPEG; ``cpu``: torchvision's decoder).
        image_size: ``S``.
        train: random resized crop and flip per image (seeded by its key); else the centre crop.
        crop_scale, hflip: as in :class:`nbddp.TrainConfig`.
    """

    #: The engine may decode the next batch while the device runs this step: each image's crop
    #: comes from its own seed, never from the rank's random state.
    prepare_ahead = True

    def __init__(self, device, image_size: int, train: bool, crop_scale: float = 0.08, hflip: bool = True):
        self.device, self.image_size, self.train = torch.device(device), image_size, train
        self.scale, self.ratio, self.hflip = (crop_scale, 1.0), (3 / 4, 4 / 3), hflip
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1) * 255

    def __call__(self, batch: EncodedBatch) -> torch.Tensor:
        images = decode(batch, self.device)
        s = self.image_size
        out = torch.empty(len(images), 3, s, s, device=self.device)
        for i, (img, seed) in enumerate(zip(images, batch.seeds)):
            flip = False
            if self.train:
                g = torch.Generator().manual_seed(int(seed))
                top, left, h, w = crop_box(img.shape[-2], img.shape[-1], self.scale, self.ratio, g)
                flip = self.hflip and bool(torch.rand(1, generator=g) < 0.5)
            else:
                top, left, h, w = centre_box(img.shape[-2], img.shape[-1], s)
            crop = img[None, :, top:top + h, left:left + w].float()
            out[i] = F.interpolate(crop, size=(s, s), mode="bilinear", align_corners=False, antialias=True)[0]
            if flip:
                out[i] = out[i].flip(-1)
        return (out - self.mean) / self.std


def decode_loaders(samples_train: Sequence[Sample], samples_val: Sequence[Sample], order, batch_size: int,
                   val_sampler, loader_kw: dict, generator: Optional[torch.Generator] = None):
    """``(train_loader, val_loader)`` over file bytes (the training one in ``order``'s seeded keys)."""
    from torch.utils.data import DataLoader

    train = DataLoader(FileBytes(samples_train), batch_size=batch_size, sampler=order, drop_last=True,
                       collate_fn=collate, generator=generator, **loader_kw)
    val = DataLoader(FileBytes(samples_val), batch_size=batch_size, sampler=val_sampler, collate_fn=collate,
                     **loader_kw)
    return train, val


__all__ = ["FileBytes", "EncodedBatch", "collate", "decode", "crop_box", "centre_box", "DeviceDecoder",
           "decode_loaders", "is_jpeg"]
