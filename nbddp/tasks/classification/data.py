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

import itertools
import math
import os
import random
import stat
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
from PIL import Image, ImageOps
from torch.utils.data import Dataset, Sampler
from torchvision import transforms as T

from ...contract.errors import DataError
from ...contract.paths import PathLike, pseudo_filesystem, special_file_kind

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


# ---------------------------------------------------------------------------- reading images
def _decode_check(path: str) -> None:
    # verify() checks the container (PNG chunk CRCs...) without decoding, but is a no-op for
    # JPEG and misses pixel data cut short, so the image is also decoded. draft() lets libjpeg
    # decode at 1/8 scale, which still reads every byte, so truncation is caught cheaply.
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        im.draft("RGB", (max(1, im.width // 8), max(1, im.height // 8)))
        im.load()


def check_images(paths: Sequence[PathLike], max_errors: int = 20) -> list[tuple[str, str]]:
    """Find images that PIL cannot read.

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
            try:
                _decode_check(os.fspath(p))
            except Exception as err:  # PIL raises OSError, SyntaxError, ValueError...
                bad.append((os.fspath(p), f"{type(err).__name__}: {err}"))
                if len(bad) >= max_errors:
                    break
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


# ---------------------------------------------------------------------------- loader processes
def loader_context() -> Optional[str]:
    """Start method of nbddp's DataLoader workers: ``"fork"`` where the platform has it.

    A forked worker is a copy of the rank with torch already imported: its first batch comes in
    milliseconds, where a spawned or forkserver-started one first imports torch (seconds each).
    Workers never touch CUDA, so forking a rank that uses a GPU is safe.
    """
    import multiprocessing

    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


class DieWithParent:
    """``worker_init_fn`` that ends a DataLoader worker when the process that started it dies.

    A rank killed with SIGKILL (the kernel died, the OOM killer) cannot end its workers itself;
    with Linux's parent-death signal they follow it at once, under any launcher.
    """

    def __init__(self):
        self.parent = os.getpid()  # the loader's process, recorded where the loader is built

    def __call__(self, worker_id: int) -> None:
        from ...rank.runtime import set_parent_death_signal

        set_parent_death_signal(self.parent)


def loader_processes(num_workers: int) -> dict:
    """The DataLoader keyword arguments that start ``num_workers`` worker processes well."""
    if num_workers <= 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "multiprocessing_context": loader_context(), "worker_init_fn": DieWithParent()}


def item_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of one sample's augmentation: a function of (seed, epoch, sample index) alone."""
    # splitmix64 over the three numbers: nearby inputs give unrelated seeds.
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


class SeededSampler(Sampler):
    """Wraps a sampler to yield ``(index, seed)`` pairs for :class:`SeededDataset`.

    The seed depends on ``(seed, epoch, index)`` only, where the epoch is the wrapped sampler's
    (``DistributedSampler.set_epoch``). So each image's random crop is the same whichever worker
    process draws it, however many workers there are, and whether the workers persist between
    epochs or not: a resumed run sees exactly what an uninterrupted one sees.
    """

    def __init__(self, sampler: Sampler, seed: int):
        self.sampler, self.seed = sampler, seed

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = getattr(self.sampler, "epoch", 0)
        return ((i, item_seed(self.seed, epoch, i)) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class SkipSampler(Sampler):
    """Wraps a sampler so that one pass can leave out its first items: a resumed epoch's batches already done.

    ``skip(n)`` drops the first ``n`` items of the *next* pass only; ``len()`` is what remains of
    it, so a ``DataLoader`` (or :class:`nbddp.tasks.classification.tensor_data.TensorBatches`) over this sampler has
    exactly the remaining steps, and a ``drop_last`` loader that skips ``steps * batch_size``
    items yields the very batches an uninterrupted pass would have yielded after ``steps``. The
    pass ends at the next ``set_epoch`` or the next iteration, after which nothing is skipped.
    Everything else (``set_epoch``, ``epoch``) is the wrapped sampler's.

    Example:
        >>> sampler = SkipSampler(DistributedSampler(ds, num_replicas=2, rank=0))
        >>> sampler.set_epoch(3)
        >>> sampler.skip(5 * batch_size)        # epoch 3 resumes at its step 5
        >>> loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True)
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._skip = 0
        self._state = "done"  # "armed" (next pass skips), "active" (this pass skips), "done"

    def skip(self, n: int) -> None:
        """Leave out the first ``n`` items of the next pass (``0``: leave out nothing)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"SkipSampler.skip({n!r}): need an integer >= 0")
        self._skip, self._state = n, "armed" if n else "done"

    @property
    def skipping(self) -> int:
        """Items the next (or current) pass leaves out."""
        return self._skip if self._state != "done" else 0

    @property
    def epoch(self) -> int:
        return getattr(self.sampler, "epoch", 0)

    def set_epoch(self, epoch: int) -> None:
        if self._state == "active":
            self._state = "done"  # a new epoch is a new pass
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        if self._state == "active":
            self._state = "done"  # a second pass over the same epoch skips nothing
        n = self.skipping
        if self._state == "armed":
            self._state = "active"
        it = iter(self.sampler)
        return itertools.islice(it, n, None) if n else it

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skipping)


class SeededDataset(Dataset):
    """Reads ``(index, seed)`` keys: seeds torch and ``random`` with ``seed``, then returns ``dataset[index]``.

    In the rank's own process (``num_workers=0``) the global random state is restored after the
    item, so data loading leaves the training randomness alone.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        import torch
        from torch.utils.data import get_worker_info

        index, seed = key
        in_worker = get_worker_info() is not None
        if not in_worker:
            saved = torch.get_rng_state(), random.getstate()
        # The CPU generator only, which the image transforms draw from: torch.manual_seed would
        # also reseed every GPU generator (the training's dropout, in a GPU rank without loader
        # workers) and, before CUDA starts, record a Python stack per call (5-8% of a CPU step).
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        try:
            return self.dataset[index]
        finally:
            if not in_worker:
                torch.set_rng_state(saved[0])
                random.setstate(saved[1])


def resize_size(image_size: int) -> int:
    """Side the evaluation resize gives the shorter edge before the centre crop (224 -> 256)."""
    return int(image_size / 0.875)


def loader_workers(world_size: int, at_least: int = 0) -> int:
    """Data-loading processes per rank: the rank's share of the cores, less the rank itself (at most 16)."""
    from ...contract.system import cpu_cores

    return max(at_least, min(16, cpu_cores() // max(world_size, 1) - 1))


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


# ---------------------------------------------------------------------------- distribution
class ShardSampler(Sampler[int]):
    """Exact, disjoint shards of a dataset for distributed evaluation.

    Rank ``r`` gets indices ``r, r + W, r + 2W, ...``: no padding and no duplicates, so the
    shards together hold every index exactly once (their lengths differ by at most one).
    Summing correct counts and sample counts over ranks then gives the exact accuracy.

    Why not ``DistributedSampler``: it pads the index list by repeating its first samples until
    the length divides by the world size, so some images are scored twice while the reference
    script divides by ``len(dataset)``: the accuracy is off, and can even exceed 100% on a tiny
    set. (Its ``drop_last=True`` instead skips samples.) Neither is an exact evaluation.

    Args:
        dataset_len: number of items in the dataset.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of processes.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size or dataset_len < 0:
            raise ValueError(
                f"ShardSampler(dataset_len={dataset_len}, rank={rank}, world_size={world_size}): "
                "need dataset_len >= 0, world_size >= 1 and 0 <= rank < world_size"
            )
        self.indices = range(rank, dataset_len, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


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
    "load_rgb",
    "rank_share",
    "scan_class_folders",
    "split_samples",
]
