"""``data_pipeline="decode"``: loader workers read file bytes; each batch is decoded and augmented on the rank's device.

On a GPU the JPEGs of a batch are decoded together by nvJPEG (``torchvision.io.decode_jpeg(...,
device="cuda")``), then cropped, flipped, resized and normalised there: only the files' bytes
cross the loader (no decoded image, no float tensor), and the CPU cores that fed PIL are free.
Other formats (PNG...) are decoded on the CPU by the loader processes, with torchvision's
decoder, and cross as pixels. On a CPU rank the same code decodes with torchvision's decoder,
which is faster than PIL.

Augmentation is the reference's (random resized crop of scale ``(crop_scale, 1)`` and ratio
3/4–4/3, horizontal flip; evaluation resizes the shorter side to ``resize_size`` and takes the
centre), drawn for each image from its seed (seed, epoch, image) alone
(:class:`nbddp.tasks.classification.data.SeededSampler`, :mod:`.crops`): the same crops with any
number of loader processes, and a run resumed in the middle of an epoch sees what an
uninterrupted one sees.

What runs where, so that the rank's one thread does a few calls per batch and nothing per
image (:class:`EncodedImages`, :class:`DeviceDecoder`): a loader process reads each file, reads a
JPEG's size from its header, draws its box and flip, and packs the batch into three tensors
(bytes, pixels of the other formats, one row of numbers per image); the rank decodes the JPEGs in
one call and resizes the whole batch in a few (:func:`.resize.resize_batch`; a CPU rank resizes
image by image, :func:`.resize.resize_each`, which costs less arithmetic there). An image whose
decoded size is not the one its header gave has its box drawn again by the rank, from its seed.

Worker side.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset

from .crops import Crops, centre_box, crop_box
from .data import IMAGENET_MEAN, IMAGENET_STD, Sample
from .resize import resize_batch, resize_each
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
    indices (evaluation, seed 0). Items for :func:`collate`; the built-in worker's loaders use
    :class:`EncodedImages`, which also draws each image's box.
    """

    def __init__(self, samples: Sequence[Sample]):
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, 0)
        path, label = self.samples[index]
        return torch.frombuffer(bytearray(_read(path)), dtype=torch.uint8), label, seed, str(path)


def _read(path) -> bytes:
    """A file's bytes, read with three system calls (an ``open()`` file object costs as much again).

    Raises:
        DataError: naming the file that cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            data = os.read(fd, size)
            if len(data) < size:  # a short read: the rest, until the end
                parts = [data]
                while True:
                    part = os.read(fd, 1 << 20)
                    if not part:
                        break
                    parts.append(part)
                data = b"".join(parts)
            return data
        finally:
            os.close(fd)
    except OSError as exc:
        raise DataError(f"cannot read image {path}: {exc}") from None


#: Chooses :class:`DeviceDecoder`'s resize where the code does not: ``batch`` or ``each``.
RESIZE_ENV = "NBDDP_DECODE_RESIZE"

#: Columns of :attr:`EncodedBatch.info`, one row an image.
HEIGHT, WIDTH, TOP, LEFT, BOX_H, BOX_W, FLIP, PIXELS = range(8)


class EncodedBatch:
    """A batch of images as a loader process packs it: encoded bytes end to end in one ``uint8``
    tensor, with offsets, seeds and paths; what the loader knows of each image in ``info``.

    One tensor, not one per image: a loader process hands each tensor over through shared
    memory, one file descriptor each, and a batch of small ones is what that handles worst.
    ``.to(device)`` keeps the bytes where they are: the decoder reads them from (pinned) CPU
    memory, as nvJPEG does, and what it decodes is already on the device.

    ``info`` (``int64 [N, 8]``, or None when the loader drew nothing: :func:`collate`): each image's
    height and width as its header gives them (0: unknown), its box (top, left, height, width),
    its flip, and 1 where the loader decoded it itself (a PNG...: its ``3 x H x W`` pixels are in
    ``pixels``, end to end in image order, and it has no bytes in ``blob``).
    """

    def __init__(self, blob: torch.Tensor, offsets: list, seeds: list, paths: list,
                 info: Optional[torch.Tensor] = None, pixels: Optional[torch.Tensor] = None):
        self.blob, self.offsets, self.seeds, self.paths = blob, offsets, seeds, paths
        self.info, self.pixels = info, pixels

    @classmethod
    def of(cls, data: Sequence[torch.Tensor], seeds: list, paths: list) -> "EncodedBatch":
        offsets = [0]
        for d in data:
            offsets.append(offsets[-1] + d.numel())
        blob = torch.cat(list(data)) if data else torch.empty(0, dtype=torch.uint8)
        return cls(blob, offsets, seeds, paths)

    @property
    def data(self) -> list:
        """Each image's bytes (views into the one tensor; empty for an image the loader decoded)."""
        return list(self.blob.split([b - a for a, b in zip(self.offsets, self.offsets[1:])]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def to(self, device, non_blocking: bool = False) -> "EncodedBatch":
        return self

    def pin_memory(self) -> "EncodedBatch":
        pixels = self.pixels.pin_memory() if self.pixels is not None else None
        return EncodedBatch(self.blob.pin_memory(), self.offsets, self.seeds, self.paths, self.info, pixels)


def collate(items) -> tuple:
    """``(EncodedBatch, labels)`` from :class:`FileBytes` items (the decoder draws their boxes)."""
    data, labels, seeds, paths = zip(*items)
    return EncodedBatch.of(data, list(seeds), list(paths)), torch.tensor(labels, dtype=torch.long)


def is_jpeg(data) -> bool:
    """Whether ``data`` (bytes or a ``uint8`` tensor) starts as a JPEG does."""
    if isinstance(data, torch.Tensor):
        return data.numel() >= 3 and bytes(data[:3].tolist()) == _JPEG_MAGIC
    return data[:3] == _JPEG_MAGIC


# Start-of-frame markers (baseline, extended, progressive, lossless...; not DHT, JPG, DAC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data) -> Optional[Tuple[int, int]]:
    """``(height, width)`` from a JPEG's frame header, reading its markers only; None if not found."""
    if data[:3] != _JPEG_MAGIC:
        return None
    i, n = 2, len(data)
    while i + 9 <= n:
        if data[i] != 0xFF:
            return None  # not a marker where one must be: let the decoder say what is wrong
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker in _SOF:
            h, w = (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8]
            return (h, w) if h and w else None  # a height of 0 comes later (DNL): the decoder knows
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
        elif marker in (0xD9, 0xDA):  # end of image, or a scan before any frame header
            return None
        else:
            i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


class EncodedImages(Dataset):
    """The decode pipeline's dataset in a loader process: a batch of keys in, an :class:`EncodedBatch` out.

    For each image: its bytes read, its size read from a JPEG's header, its box and flip drawn
    (:class:`nbddp.tasks.classification.crops.Crops`); an image of another format is decoded here
    (torchvision's decoder, on the CPU), its pixels sent instead of its bytes. Keys are
    ``(index, seed)`` (training) or indices (evaluation). ``__getitems__`` (a ``DataLoader`` calls
    it with a batch's keys) packs the batch; pass :func:`packed` as the loader's ``collate_fn``.

    Raises:
        DataError: a file that cannot be read, or (not a JPEG) decoded, named.
    """

    def __init__(self, samples: Sequence[Sample], crops: Crops):
        self.samples, self.crops = [(str(p), c) for p, c in samples], crops

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        return self.__getitems__([key])

    def __getitems__(self, keys) -> tuple:
        parts: List[bytes] = []
        pixels: List[torch.Tensor] = []
        offsets, seeds, paths, labels, rows = [0], [], [], [], []
        box_of = self.crops.box
        for key in keys:
            index, seed = key if isinstance(key, tuple) else (key, 0)
            path, label = self.samples[index]
            data = _read(path)
            size = jpeg_size(data)
            decoded = 0
            if size is None and data[:3] != _JPEG_MAGIC:  # not a JPEG: decoded here
                image = _decode_here(data, path)
                pixels.append(image.reshape(-1))
                size, decoded, data = tuple(image.shape[-2:]), 1, b""
            (top, left, h, w), flip = box_of(seed, *size) if size else ((0, 0, 0, 0), False)
            rows.append((*(size or (0, 0)), top, left, h, w, flip, decoded))
            parts.append(data)
            offsets.append(offsets[-1] + len(data))
            seeds.append(seed)
            paths.append(path)
            labels.append(label)
        # One copy of the batch's bytes, into a buffer the tensor shares (frombuffer wants it writable).
        blob = torch.frombuffer(bytearray().join(parts), dtype=torch.uint8) if offsets[-1] else \
            torch.empty(0, dtype=torch.uint8)
        batch = EncodedBatch(blob, offsets, seeds, paths, torch.tensor(rows, dtype=torch.int64),
                             torch.cat(pixels) if pixels else None)
        return batch, torch.tensor(labels, dtype=torch.long)


def packed(batch):
    """A ``DataLoader``'s ``collate_fn`` for :class:`EncodedImages`: the batch is packed already."""
    return batch


def _decode_here(data: bytes, path) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    try:
        with _quiet():
            image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError as exc:
        raise DataError(f"cannot decode {path}: {exc}. Remove or replace the file "
                        "(check_images=True finds such files before the launch)") from None
    return image[0] if image.dim() == 4 else image  # an animated GIF: its first frame, as PIL opens it


def decode(batch: EncodedBatch, device: torch.device) -> list:
    """Every image of ``batch`` as a ``3 x H x W`` ``uint8`` tensor on ``device``: JPEGs together
    (nvJPEG on a GPU), the pixels the loader decoded moved in one copy, any other one by one on the CPU.

    Raises:
        DataError: naming the file that cannot be decoded.
    """
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    with _quiet():
        return _decode(batch, device, decode_jpeg, decode_image, ImageReadMode.RGB)


def _decode(batch: EncodedBatch, device: torch.device, decode_jpeg, decode_image, rgb) -> list:
    out: list = [None] * len(batch)
    data = batch.data
    if batch.info is None:
        jpegs = [i for i, d in enumerate(data) if is_jpeg(d)]
    else:
        done = batch.info[:, PIXELS].tolist()
        jpegs = [i for i, d in enumerate(done) if not d]
        if batch.pixels is not None:
            _place_pixels(batch, done, out, device)
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


def _place_pixels(batch: EncodedBatch, done: list, out: list, device: torch.device) -> None:
    """The images the loader decoded: views of one copy of their pixels on ``device``."""
    pixels = batch.pixels.to(device, non_blocking=True)
    sizes = batch.info[:, HEIGHT:WIDTH + 1].tolist()
    at = 0
    for i, (d, (h, w)) in enumerate(zip(done, sizes)):
        if d:
            out[i] = pixels[at:at + 3 * h * w].view(3, h, w)
            at += 3 * h * w


def _one(batch: EncodedBatch, i: int, device: torch.device, fn, mode) -> torch.Tensor:
    try:
        img = fn(batch.data[i], mode=mode, **({"device": device} if fn.__name__ == "decode_jpeg" else {}))
    except RuntimeError as exc:
        raise DataError(f"cannot decode {batch.paths[i]}: {exc}. Remove or replace the file "
                        "(check_images=True finds such files before the launch)") from None
    return img.to(device, non_blocking=True)


class DeviceDecoder:
    """The decode pipeline's batch transform: an :class:`EncodedBatch` in, a normalised
    ``N x 3 x S x S`` float batch on the rank's device out.

    Args:
        device: where to decode and augment (``cuda:i``: nvJPEG; ``cpu``: torchvision's decoder).
        image_size: ``S``.
        train: random resized crop and flip per image (seeded by its key); else the centre crop.
        crop_scale, hflip: as in :class:`nbddp.TrainConfig`.
        batched: resize the batch in a few calls (:func:`.resize.resize_batch`) rather than image
            by image; default: ``$NBDDP_DECODE_RESIZE`` (``batch`` or ``each``) if set, else on any
            device but the CPU. (The variable lets a GPU session compare both in one run: a batched
            resize of whole padded photos, with the boxes drawn in the rank, measured 0.87x of the
            image-by-image one on an H100.)

    The boxes are the loader's (``batch.info``); an image without one (a batch from
    :func:`collate`, a size the header did not give) has its box drawn here, from its seed.
    """

    #: The engine may decode the next batch while the device runs this step: each image's crop
    #: comes from its own seed, never from the rank's random state.
    prepare_ahead = True

    def __init__(self, device, image_size: int, train: bool, crop_scale: float = 0.08, hflip: bool = True,
                 batched: Optional[bool] = None):
        self.device, self.image_size, self.train = torch.device(device), image_size, train
        self.crops = Crops(image_size, train, crop_scale, hflip)
        if batched is None:
            chosen = os.environ.get(RESIZE_ENV, "").strip().lower()
            if chosen not in ("", "batch", "each"):
                raise ValueError(f"{RESIZE_ENV}={chosen!r}: use 'batch' or 'each' (or leave it unset)")
            batched = chosen == "batch" if chosen else self.device.type != "cpu"
        self.batched = batched
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1) * 255

    def boxes(self, batch: EncodedBatch, images: list) -> tuple:
        """``(boxes, flips, sizes)`` of the decoded ``images`` (``int64 [N, 4]``, ``bool [N]``, ``int64 [N, 2]``,
        on the CPU): the loader's boxes, or drawn here, from each seed, where it had none for the size
        the image has."""
        sizes = torch.tensor([(img.shape[-2], img.shape[-1]) for img in images], dtype=torch.int64).view(-1, 2)
        if batch.info is None:
            boxes, flips = torch.zeros(len(images), 4, dtype=torch.int64), torch.zeros(len(images), dtype=torch.bool)
            redraw = range(len(images))
        else:
            boxes, flips = batch.info[:, TOP:BOX_W + 1], batch.info[:, FLIP].bool()
            redraw = (batch.info[:, HEIGHT:WIDTH + 1] != sizes).any(1).nonzero().flatten().tolist()
            if redraw:
                boxes = boxes.clone()
        for i in redraw:
            box, flip = self.crops.box(int(batch.seeds[i]), *sizes[i].tolist())
            boxes[i] = torch.tensor(box)
            flips[i] = flip
        return boxes, flips, sizes

    def __call__(self, batch: EncodedBatch) -> torch.Tensor:
        images = decode(batch, self.device)
        boxes, flips, sizes = self.boxes(batch, images)
        if self.batched:
            out = resize_batch(images, boxes, flips, self.image_size, self.device, sizes)
        else:
            out = resize_each(images, boxes, flips, self.image_size, self.device)
        return (out - self.mean) / self.std


def decode_loaders(samples_train: Sequence[Sample], samples_val: Sequence[Sample], order, batch_size: int,
                   val_sampler, loader_kw: dict, *, train_crops: Crops, val_crops: Crops,
                   generator: Optional[torch.Generator] = None):
    """``(train_loader, val_loader)`` of packed batches (:class:`EncodedImages`; the training one in
    ``order``'s seeded keys), each image's box drawn by ``train_crops`` / ``val_crops``."""
    from torch.utils.data import DataLoader

    train = DataLoader(EncodedImages(samples_train, train_crops), batch_size=batch_size, sampler=order,
                       drop_last=True, collate_fn=packed, generator=generator, **loader_kw)
    val = DataLoader(EncodedImages(samples_val, val_crops), batch_size=batch_size, sampler=val_sampler,
                     collate_fn=packed, **loader_kw)
    return train, val


__all__ = ["FileBytes", "EncodedBatch", "EncodedImages", "collate", "decode", "crop_box", "centre_box",
           "DeviceDecoder", "decode_loaders", "is_jpeg", "jpeg_size", "packed"]
