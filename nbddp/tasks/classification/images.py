"""Reading the images of the built-in classification task: any mode to 8-bit RGB, EXIF orientation
applied, every unreadable file a ``DataError`` naming it; the dataset of ``(path, class)`` samples.

Runs in the kernel (preflight checks, predictions) and in a rank alike.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from ...contract.errors import DataError
from ...contract.paths import PathLike

Sample = tuple[str, int]


def _decode_check(path: str) -> None:
    # verify() checks the container (PNG chunk CRCs...) without decoding, but is a no-op for
    # JPEG and misses pixel data cut short, so the image is also decoded. draft() lets libjpeg
    # decode at 1/8 scale, which still reads every byte, so truncation is caught cheaply.
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        im.draft("RGB", (max(1, im.width // 8), max(1, im.height // 8)))
        im.load()


# Files this process found readable, each as the hash of its path and its identity on disk (device,
# inode, size, modification and change times): a relaunch from the same kernel decodes only what is
# new or was written since. ~70 bytes a file.
_readable: set = set()


def _identity(path: str) -> Optional[int]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return hash((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def check_images(paths: Sequence[PathLike], max_errors: int = 20) -> list[tuple[str, str]]:
    """Find images that PIL cannot read.

    A file found readable before by this process, and not written since (same inode, size and
    times), is not decoded again: every launch's preflight calls this on the whole folder.

    Args:
        paths: image files to check.
        max_errors: stop after this many bad files (enough to see the pattern, and fast).

    Returns:
        ``(path, error)`` for each unreadable, corrupt or truncated file, in ``paths`` order.
    """
    bad: list[tuple[str, str]] = []
    with warnings.catch_warnings():
        # A huge photo warns (DecompressionBombWarning); only an error makes it unusable.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        for p in paths:
            path = os.fspath(p)
            identity = _identity(path)
            if identity is not None and identity in _readable:
                continue
            try:
                _decode_check(path)
            except Exception as err:  # PIL raises OSError, SyntaxError, ValueError...
                bad.append((path, f"{type(err).__name__}: {err}"))
                if len(bad) >= max_errors:
                    break
            else:
                if identity is not None and identity == _identity(path):  # not written while it was read
                    _readable.add(identity)
    return bad


def _sixteen_bit_to_l(im: Image.Image) -> Image.Image:
    # PIL's own convert() clips 16-bit values at 255, turning a 16-bit photo almost all white;
    # rescale the full 0..65535 range to 0..255 instead ("I" is how 16-bit PNG/TIFF may decode).
    arr = np.asarray(im, dtype=np.float64) / 257.0
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8))


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode.startswith("I;16") or im.mode == "I":
        im = _sixteen_bit_to_l(im)
    if _has_alpha(im):
        # Composite on white: the colour stored under transparent pixels is arbitrary (often
        # black), so dropping alpha would show garbage; white is how viewers show the image.
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")  # L, 1, P, CMYK (naive, no ICC), YCbCr... and a copy of RGB


def load_rgb(path: PathLike) -> Image.Image:
    """Open an image as 8-bit RGB, whatever its mode.

    Grayscale (``L``, ``1``) is replicated to three channels; palette (``P``) is expanded;
    16-bit (``I;16*``, and ``I``, assumed to hold 16-bit values) is scaled from 0..65535 to
    0..255; images with alpha (``RGBA``, ``LA``, palette or grayscale with a transparency key)
    are **composited on white**; ``CMYK`` uses PIL's conversion. The EXIF orientation is
    applied, so a phone photo is seen the way it was labelled.

    Args:
        path: image file.

    Returns:
        A loaded ``PIL.Image`` in mode ``RGB`` (the file is closed).

    Raises:
        DataError: ``cannot read image <path>: <error>`` for a missing, corrupt or truncated file.
    """
    try:
        with Image.open(path) as im:
            im.load()
            im = ImageOps.exif_transpose(im) or im
            return _to_rgb(im)
    except Exception as err:
        raise DataError(f"cannot read image {os.fspath(path)}: {err}") from err


class ImageListDataset(Dataset):
    """A map-style dataset over ``(path, class_index)`` pairs.

    Args:
        samples: ``(path, class_index)`` pairs.
        transform: applied to the RGB ``PIL.Image`` (e.g. from :func:`build_transforms`);
            ``None`` returns the image itself.

    Items are ``(transform(image), class_index)``.
    """

    def __init__(self, samples: Sequence[Sample], transform: Optional[Callable] = None, cache: bool = False):
        self.samples = [(os.fspath(p), int(c)) for p, c in samples]
        self.targets = [c for _, c in self.samples]
        self.transform = transform
        # Decode once, keep the RGB image: random augmentation still differs every epoch, but
        # small datasets (digits, flowers at low resolution) stop paying JPEG/PNG decoding.
        # Each DataLoader worker holds its own cache, so use it with few workers.
        self._cache: Optional[dict] = {} if cache else None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        if self._cache is None:
            image = load_rgb(path)
        else:
            image = self._cache.get(index)
            if image is None:
                image = self._cache[index] = load_rgb(path)
        if self.transform is not None:
            image = self.transform(image)
        return image, label
