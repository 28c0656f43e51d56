"""Class-folder image data for the built-in classification worker.

The layout is the one of ``torchvision.datasets.ImageFolder`` and of the reference
``train_multi_GPU`` scripts::

    root/<class name>/<image>.jpg

Everything here runs in a worker process as well as in the kernel (preflight), so this module
must not import ipywidgets or IPython. Every ``DataError`` message names the path and the fix,
because it is what the user reads in the notebook.

Example:
    >>> classes, samples = scan_class_folders("data/digits")
    >>> train, val = split_samples(samples, val_fraction=0.2, seed=0)
    >>> train_tf, val_tf = build_transforms(32, hflip=False)
    >>> ds = ImageListDataset(val, val_tf)
    >>> sampler = ShardSampler(len(ds), rank=0, world_size=2)
"""

from __future__ import annotations

import math
import os
import random
import stat
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Optional, Sequence

from torchvision import transforms as T

from ...contract.errors import DataError
from ...contract.paths import PathLike, pseudo_filesystem, special_file_kind
# Reading images and loading them in a rank live in their own modules; their names stay here too.
from .images import ImageListDataset, check_images, load_rgb
from .loading import (DieWithParent, EpochLoader, SeededDataset, SeededSampler, ShardSampler, SkipSampler,
                      item_seed, loader_context, loader_processes, loader_workers)

Sample = tuple[str, int]

#: File extensions read as images (compared in lower case, so ``.JPG`` counts).
IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
)

#: Channel statistics of ImageNet, which the torchvision pretrained weights expect.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Names skipped like hidden ones (see _is_hidden): never a class, never scanned. Jupyter's
# checkpoint folder, the classic trap, needs no entry: ".ipynb_checkpoints" is hidden (a leading
# "."). As a class it would sort first and shift every label index by one.
_IGNORED_DIRS = {"__pycache__"}


def _is_hidden(name: str) -> bool:
    return name.startswith(".") or name in _IGNORED_DIRS


def is_image_file(name: str) -> bool:
    """True for a non-hidden file name whose extension is in :data:`IMAGE_EXTENSIONS`."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


# ---------------------------------------------------------------------------- scanning
def _refuse_pseudo(path: Path, what: str, st: os.stat_result) -> None:
    kind = pseudo_filesystem(path, st)
    if kind is not None:
        raise DataError(
            f"{what} {path} is on the {kind} pseudo-filesystem (the kernel's view of processes and "
            "devices), not a folder of images: scanning it would never end. Set data_path to a "
            "folder laid out as <root>/<class>/<image>, and remove links that lead into /proc, "
            "/sys or /dev."
        )


def _check_root(root: Path) -> None:
    where = f"{root} (resolved to {root.resolve()})" if not root.is_absolute() else str(root)
    if not root.exists():
        raise DataError(
            f"data folder {where} does not exist. Set data_path to a folder laid out as "
            "<root>/<class>/<image>; `python data/make_digits.py` writes the bundled "
            "data/digits, and data/README.md says how to fetch the flower photos."
        )
    st = root.stat()
    special = special_file_kind(st)
    if special:
        raise DataError(
            f"data_path {where} is {special}, not a folder: reading it would wait forever. Point "
            "data_path at the folder that holds one sub-folder per class."
        )
    if not root.is_dir():
        raise DataError(
            f"data_path {where} is a file, not a folder. Point data_path at the folder that holds "
            "one sub-folder per class; if this is an archive, extract it first "
            f"(e.g. `tar xzf {root.name} -C data/`)."
        )
    _refuse_pseudo(root, "data_path", st)


def _class_dirs(root: Path) -> list[str]:
    names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not _is_hidden(e.name))
    if not names:
        loose = sum(1 for e in os.scandir(root) if e.is_file() and is_image_file(e.name))
        hint = (
            f" It holds {loose} image file(s) directly: move them into one sub-folder per class."
            if loose
            else ""
        )
        raise DataError(
            f"no class folders in {root}: expected <root>/<class>/<image> with one sub-folder "
            f"per class (hidden folders such as .ipynb_checkpoints are ignored).{hint}"
        )
    return names


class _Walk:
    """One scan of a data folder: every folder read once, every file counted once.

    Links are followed (datasets are often assembled from links), but a folder or file is
    identified by its (device, inode): a link back to a folder already scanned (``again -> .``,
    ``up -> ..``, or another class's folder) is skipped instead of read again. So the cost of
    a scan is bounded by the number of distinct folders and files, however the links loop,
    and no image lands in two classes, or in both training and validation.
    """

    def __init__(self, root: Path, class_dirs: dict[str, Path]):
        self.root = root
        self.dirs: set[tuple[int, int]] = set()
        self.files: set[tuple[int, int]] = set()
        self.skipped_dirs: list[str] = []
        self.skipped_files: list[str] = []
        # Every class folder (and the root) counts as scanned from the start, so a link into
        # another class is skipped rather than taking its images into this class.
        self.dirs.add(self._key(root.stat()))
        owner: dict[tuple[int, int], str] = {}
        for name, path in class_dirs.items():
            st = path.stat()
            _refuse_pseudo(path, "class folder", st)
            key = self._key(st)
            if key == self._key(root.stat()):
                raise DataError(f"class folder {path} is a link to the data folder {root} itself; remove it.")
            if key in owner:
                raise DataError(
                    f"class folders {owner[key]!r} and {name!r} in {root} are the same folder (a link): "
                    "their images would get two labels. Remove one of them."
                )
            owner[key] = name
            self.dirs.add(key)

    @staticmethod
    def _key(st: os.stat_result) -> tuple[int, int]:
        return st.st_dev, st.st_ino

    def _shown(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def images(self, folder: Path, links: list[str]) -> list[str]:
        """Images below ``folder`` in real sub-folders; links met on the way go to ``links``."""
        # Recursive like ImageFolder, so photos kept in sub-folders of a class still count; hidden
        # folders (e.g. .ipynb_checkpoints inside a class) are pruned so no copy is read twice.
        return self._walk([str(folder)], links)

    def linked_images(self, links: list[str]) -> list[str]:
        """Images reached through ``links``, once every real folder is scanned.

        Real locations win: an image linked from class ``a`` but stored in class ``b`` stays
        in ``b``, whichever class comes first.
        """
        found: list[str] = []
        folders = []
        for path in links:
            try:
                st = os.stat(path)
            except OSError:
                continue  # a dangling link
            if stat.S_ISDIR(st.st_mode):
                if self._enter(path, st):
                    folders.append(path)
            else:
                found.extend(self._file(path, st))
        return found + self._walk(folders, None)

    def _enter(self, path: str, st: os.stat_result) -> bool:
        if self._key(st) in self.dirs:
            self.skipped_dirs.append(self._shown(path))
            return False
        _refuse_pseudo(Path(path), "folder", st)
        self.dirs.add(self._key(st))
        return True

    def _file(self, path: str, st: os.stat_result) -> list[str]:
        special = special_file_kind(st)
        if special:
            raise DataError(
                f"{path} is {special}, not an image file: reading it could wait forever. Remove it "
                "from the data folder."
            )
        if self._key(st) in self.files:
            self.skipped_files.append(self._shown(path))
            return []
        self.files.add(self._key(st))
        return [path]

    def _walk(self, folders: list[str], links: Optional[list[str]]) -> list[str]:
        # links=None: follow links at once (the second pass); else set them aside.
        found: list[str] = []
        stack = list(reversed(folders))
        while stack:
            current = stack.pop()
            try:
                entries = sorted(os.scandir(current), key=lambda e: e.name)
            except OSError:
                continue  # unreadable folder: skipped, as os.walk does
            subdirs = []
            for entry in entries:
                if entry.name.startswith(".") or entry.name in _IGNORED_DIRS:
                    continue
                try:
                    st = entry.stat()  # follows links
                except OSError:
                    continue  # a dangling link
                is_dir = stat.S_ISDIR(st.st_mode)
                if not is_dir and not is_image_file(entry.name):
                    continue
                if links is not None and entry.is_symlink():
                    links.append(entry.path)
                elif is_dir:
                    if self._enter(entry.path, st):
                        subdirs.append(entry.path)
                else:
                    found.extend(self._file(entry.path, st))
            stack.extend(reversed(subdirs))
        return found

    def warn(self) -> None:
        def listed(items: list[str]) -> str:
            return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")

        if self.skipped_dirs:
            warnings.warn(
                f"{len(self.skipped_dirs)} folder link(s) in {self.root} lead to folders already "
                f"scanned, so their images are counted once: {listed(self.skipped_dirs)}. Remove the "
                "links to silence this.", stacklevel=3)
        if self.skipped_files:
            warnings.warn(
                f"{len(self.skipped_files)} image(s) in {self.root} are the same file as one already "
                f"counted (links or hard links: {listed(self.skipped_files)}); each is counted once, "
                "in the first class it was found in.", stacklevel=3)


def scan_class_folders(root: PathLike) -> tuple[list[str], list[Sample]]:
    """List the classes and images of a class-folder tree.

    Classes are the sorted names of the non-hidden sub-folders of ``root`` (names starting with
    ``.`` and ``__pycache__`` are skipped); the class index is the position in that list, so it
    matches ``ImageFolder`` and the reference script's ``class_indices.json``. Images are the
    files with an extension in :data:`IMAGE_EXTENSIONS` anywhere below a class folder; hidden
    files and other files (``LICENSE.txt``, ``.DS_Store``) are ignored. Links are followed, but
    each folder is read and each file counted once (a warning names the links skipped), so
    looping links neither hang the scan nor duplicate images.

    Args:
        root: folder laid out as ``root/<class>/<image>``.

    Returns:
        ``(classes, samples)`` where ``samples`` is the sorted list of ``(path, class_index)``.

    Raises:
        DataError: the folder is missing or a file, holds no class folders, has class folders
            without images (all of them are named), or has fewer than two classes; a path is on
            a pseudo-filesystem (``/proc``, ``/sys``), an image name is a FIFO, socket or
            device, or two class folders are the same folder.
    """
    root = Path(root)
    _check_root(root)
    classes = _class_dirs(root)
    walk = _Walk(root, {name: root / name for name in classes})
    links: list[list[str]] = [[] for _ in classes]
    found = [walk.images(root / name, links[i]) for i, name in enumerate(classes)]
    found = [paths + walk.linked_images(links[i]) for i, paths in enumerate(found)]
    samples: list[Sample] = []
    empty = []
    for index, name in enumerate(classes):
        paths = found[index]
        if not paths:
            empty.append(name)
        samples.extend((p, index) for p in paths)
    walk.warn()
    if empty:
        raise DataError(
            f"{len(empty)} class folder(s) in {root} hold no images: {', '.join(map(repr, empty))}. "
            f"Add images ({', '.join(sorted(IMAGE_EXTENSIONS))}) or remove those folders; "
            "an empty class would still get an output and a label index."
        )
    if len(classes) < 2:
        only = classes[0]
        raise DataError(
            f"{root} holds only one class folder ({only!r}); classification needs at least 2. "
            f"If {root / only} is the folder that holds the class folders, set "
            f"data_path={str(root / only)!r}."
        )
    return classes, sorted(samples)


# ---------------------------------------------------------------------------- splitting
def _n_val(n: int, val_fraction: float) -> int:
    if n < 2:
        return 0  # a single image cannot be in both splits; training needs it more
    # Nearest count, but never all or nothing: every class must be seen in training and measured.
    return min(max(int(math.floor(n * val_fraction + 0.5)), 1), n - 1)


def split_samples(
    samples: Sequence[Sample], val_fraction: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """Split samples into training and validation sets, class by class.

    The split depends only on the samples and ``seed`` (one ``random.Random(seed)`` shuffles
    each class's sorted list, classes in label order), never on the global random state or on
    the input order, so every rank and the kernel compute the same split without talking.

    Args:
        samples: ``(path, class_index)`` pairs, e.g. from :func:`scan_class_folders`.
        val_fraction: fraction of each class held out, in ``(0, 1]``. Rounded to the nearest
            count and clamped so a class with at least 2 images has at least one image in
            each split; a class with a single image goes to training only.
        seed: seed of the split.

    Returns:
        ``(train, val)``, both sorted, disjoint, and together equal to ``samples``.
    """
    if not 0.0 < val_fraction <= 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1]")
    by_class: dict[int, list[str]] = defaultdict(list)
    for path, label in samples:
        by_class[label].append(path)
    rng = random.Random(seed)
    train: list[Sample] = []
    val: list[Sample] = []
    for label in sorted(by_class):
        paths = sorted(by_class[label])
        rng.shuffle(paths)
        k = _n_val(len(paths), val_fraction)
        val.extend((p, label) for p in paths[:k])
        train.extend((p, label) for p in paths[k:])
    return sorted(train), sorted(val)


def resize_size(image_size: int) -> int:
    """Side the evaluation resize gives the shorter edge before the centre crop (224 -> 256)."""
    return int(image_size / 0.875)


def build_transforms(
    image_size: int, crop_scale: float = 0.08, hflip: bool = True
) -> tuple[Callable, Callable]:
    """Training and evaluation transforms of the reference script, with ImageNet normalisation.

    Args:
        image_size: side of the square output, in pixels.
        crop_scale: smallest area fraction the random resized crop keeps.
        hflip: add random horizontal flips (turn off for digits and text).

    Returns:
        ``(train_tf, val_tf)``: train is RandomResizedCrop + optional flip; val is
        Resize(``resize_size(image_size)``) + CenterCrop, both ending in ToTensor + Normalize.
    """
    norm = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    train = [T.RandomResizedCrop(image_size, scale=(crop_scale, 1.0))]
    if hflip:
        train.append(T.RandomHorizontalFlip())
    val = [T.Resize(resize_size(image_size)), T.CenterCrop(image_size)]
    return T.Compose(train + norm), T.Compose(val + norm)


def rank_share(n_train: int, world_size: int) -> int:
    """Training samples each rank sees per epoch under ``DistributedSampler(drop_last=False)``.

    That sampler pads to a multiple of the world size, so every rank gets ``ceil(n / W)``.
    """
    return math.ceil(n_train / world_size)


def check_batch_fits(n_train: int, world_size: int, batch_size: int) -> int:
    """Refuse a batch size that no rank can fill.

    The training loaders drop the last partial batch (a batch of one breaks BatchNorm, and
    uneven step counts would hang DDP), so a rank whose share is smaller than one batch would
    run zero steps per epoch.

    Returns:
        The number of optimizer steps per epoch on each rank.

    Raises:
        DataError: naming ``batch_size``, the per-rank share and the fix.
    """
    share = rank_share(n_train, world_size)
    if share < batch_size:
        raise DataError(
            f"batch_size={batch_size} is larger than each rank's share of the training split "
            f"({share} images = ceil({n_train} train images / {world_size} processes)); the last "
            f"partial batch is dropped, so no training step would run. Use batch_size <= {share}, "
            "fewer processes, a smaller val_fraction, or more images."
        )
    return share // batch_size


def check_val_split(root: PathLike, n_val: int, n_classes: int) -> None:
    """Refuse a split with no validation image: accuracy could not be measured.

    Without it every epoch would report accuracy 0.0 and the "best" weights exported would be
    chosen on nothing. :func:`split_samples` puts a class's only image in training, so this
    happens when every class holds a single image.

    Raises:
        DataError: naming the folder and the fix.
    """
    if n_val == 0:
        raise DataError(
            f"{root}: the train/validation split leaves no validation image ({n_classes} classes with a single "
            "image each; an image cannot be in both splits), so accuracy could not be measured. Add images so "
            "that each class has at least 2 images."
        )


def check_class_names(root: PathLike, classes: Sequence[str]) -> None:
    """Refuse class folder names that are not valid UTF-8.

    A class name becomes a label in ``class_indices.json``, the export and every prediction; a
    name whose bytes are not UTF-8 arrives as a string with surrogate escapes that cannot be
    written or printed as text.

    Raises:
        DataError: naming the folders (as bytes) and the fix.
    """
    bad = []
    for name in classes:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            bad.append(os.fsencode(name))
    if bad:
        listing = ", ".join(repr(b) for b in bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise DataError(
            f"{len(bad)} class folder(s) in {root} have names that are not valid UTF-8: {listing}. Class names "
            "become labels in class_indices.json and in predictions; rename the folders to UTF-8 names "
            "(convmv -f <old encoding> -t utf-8 does it for a whole tree)."
        )


# ---------------------------------------------------------------------------- class names
def describe_dataset(root: PathLike, val_fraction: float, seed: int) -> dict:
    """Summary of a class-folder tree and its split, as plain JSON-able values.

    Returns:
        ``{"root", "classes", "counts" (class -> images), "train_counts", "val_counts",
        "n_images", "n_train", "n_val"}``.

    Raises:
        DataError: as :func:`scan_class_folders`.
    """
    classes, samples = scan_class_folders(root)
    train, val = split_samples(samples, val_fraction, seed)

    def per_class(items: Sequence[Sample]) -> dict[str, int]:
        c = Counter(label for _, label in items)
        return {name: c.get(i, 0) for i, name in enumerate(classes)}

    return {
        "root": os.fspath(root),
        "classes": list(classes),
        "counts": per_class(samples),
        "train_counts": per_class(train),
        "val_counts": per_class(val),
        "n_images": len(samples),
        "n_train": len(train),
        "n_val": len(val),
    }


__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DieWithParent",
    "EpochLoader",
    "ImageListDataset",
    "SeededDataset",
    "SeededSampler",
    "ShardSampler",
    "SkipSampler",
    "build_transforms",
    "check_batch_fits",
    "check_images",
    "describe_dataset",
    "is_image_file",
    "item_seed",
    "loader_context",
    "loader_processes",
    "loader_workers",
    "load_rgb",
    "rank_share",
    "scan_class_folders",
    "split_samples",
]
