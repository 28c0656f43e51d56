"""Tests of nbddp.tasks.classification.data: scanning, splitting, image decoding, transforms and samplers; data and
weights paths (links cannot loop or duplicate, special files and /proc are refused).

Fast and process-free: trees are built in ``tmp_path`` with PIL.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nbddp.tasks.classification.data import (
    IMAGE_EXTENSIONS,
    ImageListDataset,
    ShardSampler,
    build_transforms,
    check_batch_fits,
    check_images,
    describe_dataset,
    load_rgb,
    rank_share,
    scan_class_folders,
    split_samples,
)
from nbddp.contract.checkpoint import load_state_dict_file
from nbddp.contract.errors import DataError, WeightsError
from nbddp.tasks.classification.models import check_weights_file
from conftest import make_tree

DIGITS = Path(__file__).resolve().parents[1] / "data" / "digits"


def _png(path: Path, color=(10, 20, 30), size=(8, 8), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)
    return path


# ---------------------------------------------------------------------------- scanning
def test_scan_ignores_hidden_folders_and_non_images(tmp_path):
    root = make_tree(tmp_path / "d", {"cat": 3, "dog": 2})
    _png(root / ".ipynb_checkpoints" / "x.png")
    _png(root / "__pycache__" / "y.png")
    _png(root / "cat" / ".ipynb_checkpoints" / "000-checkpoint.png")
    _png(root / "cat" / ".hidden.png")
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "LICENSE.txt").write_text("licence")
    _png(root / "dog" / "upper.JPG")  # upper-case extension counts

    classes, samples = scan_class_folders(root)

    assert classes == ["cat", "dog"]
    names = sorted(Path(p).name for p, _ in samples)
    assert names == ["000.png", "000.png", "001.png", "001.png", "002.png", "upper.JPG"]
    assert samples == sorted(samples)
    assert all(label == (0 if "/cat/" in p else 1) for p, label in samples)


def test_scan_finds_images_in_nested_subfolders(tmp_path):
    root = make_tree(tmp_path / "d", {"a": 1, "b": 1})
    _png(root / "a" / "more" / "deep.png")
    _, samples = scan_class_folders(root)
    assert sum(1 for _, label in samples if label == 0) == 2


def test_image_extensions_cover_common_formats():
    assert {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"} <= IMAGE_EXTENSIONS


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="does not exist") as e:
        scan_class_folders(missing)
    assert str(missing) in str(e.value) and "make_digits" in str(e.value)


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "flower_photos.tgz"
    f.write_bytes(b"x")
    with pytest.raises(DataError, match="is a file, not a folder") as e:
        scan_class_folders(f)
    assert str(f) in str(e.value)


def test_no_class_folders_mentions_loose_images(tmp_path):
    _png(tmp_path / "a.png")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    with pytest.raises(DataError, match="no class folders") as e:
        scan_class_folders(tmp_path)
    assert str(tmp_path) in str(e.value) and "1 image file" in str(e.value)


def test_empty_classes_are_all_listed(tmp_path):
    root = make_tree(tmp_path, {"full": 2, "empty_a": 0, "empty_b": 0})
    (root / "empty_b" / "readme.txt").write_text("no images here")
    with pytest.raises(DataError) as e:
        scan_class_folders(root)
    msg = str(e.value)
    assert "'empty_a'" in msg and "'empty_b'" in msg and "'full'" not in msg
    assert str(root) in msg


def test_single_class_suggests_the_inner_folder(tmp_path):
    make_tree(tmp_path / "flower_photos", {"daisy": 1, "roses": 1})
    with pytest.raises(DataError, match="at least 2") as e:
        scan_class_folders(tmp_path)  # one level too high: one "class"
    assert str(tmp_path / "flower_photos") in str(e.value)


# ---------------------------------------------------------------------------- splitting
def _samples(counts: dict[int, int]) -> list[tuple[str, int]]:
    return [(f"/d/{c}/{i:04d}.png", c) for c, n in counts.items() for i in range(n)]


def test_split_is_deterministic_and_order_independent():
    samples = _samples({0: 50, 1: 30, 2: 7})
    shuffled = samples[:]
    random.Random(123).shuffle(shuffled)
    random.seed(999)  # the global random state must not matter
    a = split_samples(samples, 0.2, seed=1)
    random.seed(5)
    b = split_samples(shuffled, 0.2, seed=1)
    assert a == b
    assert split_samples(samples, 0.2, seed=2)[1] != a[1]


def test_split_fractions_disjoint_and_complete():
    counts = {0: 50, 1: 30, 2: 7, 3: 2, 4: 1}
    samples = _samples(counts)
    train, val = split_samples(samples, 0.2, seed=0)
    assert train == sorted(train) and val == sorted(val)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(samples)
    n_val = {c: sum(1 for _, label in val if label == c) for c in counts}
    assert n_val == {0: 10, 1: 6, 2: 1, 3: 1, 4: 0}  # >=1 each side for n>=2; singleton trains


def test_split_keeps_a_training_image_at_full_fraction():
    train, val = split_samples(_samples({0: 4, 1: 3}), 1.0, seed=0)
    assert {label for _, label in train} == {0, 1}
    assert len(val) == 5


def test_split_rejects_bad_fraction():
    with pytest.raises(ValueError, match="val_fraction"):
        split_samples(_samples({0: 4}), 0.0, seed=0)


# ---------------------------------------------------------------------------- image modes
def test_grayscale_palette_rgba_16bit_become_rgb(tmp_path):
    gray = _png(tmp_path / "l.png", 100, mode="L")
    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 200, 10, 20] + [0] * 762)
    pal.save(tmp_path / "p.png")
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # fully transparent black
    rgba.putpixel((0, 0), (10, 200, 30, 255))
    rgba.save(tmp_path / "rgba.png")
    Image.fromarray(np.full((4, 4), 32896, np.uint16)).save(tmp_path / "i16.png")  # 128 * 257
    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")

    assert load_rgb(gray).getpixel((1, 1)) == (100, 100, 100)
    assert load_rgb(tmp_path / "p.png").getpixel((1, 1)) == (200, 10, 20)
    rgb = load_rgb(tmp_path / "rgba.png")
    assert rgb.getpixel((0, 0)) == (10, 200, 30) and rgb.getpixel((2, 2)) == (255, 255, 255)
    assert load_rgb(tmp_path / "i16.png").getpixel((1, 1)) == (128, 128, 128)  # not clipped to 255
    r, g, b = load_rgb(tmp_path / "cmyk.jpg").getpixel((1, 1))
    assert r > 200 and g < 60 and b < 60
    _, val_tf = build_transforms(8, hflip=False)
    for name in ("l.png", "p.png", "rgba.png", "i16.png", "cmyk.jpg"):
        im = load_rgb(tmp_path / name)
        assert im.mode == "RGB"
        assert val_tf(im).shape == (3, 8, 8)


def test_palette_transparency_composited_on_white(tmp_path):
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([0, 0, 0, 50, 60, 70] + [0] * 762)
    pal.putpixel((0, 0), 1)
    pal.info["transparency"] = 0
    pal.save(tmp_path / "t.png", transparency=0)
    pal.save(tmp_path / "t.gif", transparency=0)
    for name in ("t.png", "t.gif"):
        im = load_rgb(tmp_path / name)
        assert im.getpixel((0, 0)) == (50, 60, 70)
        assert im.getpixel((3, 3)) == (255, 255, 255)


# ---------------------------------------------------------------------------- corrupt files
def _corrupt_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    good = _png(tmp_path / "good.png")
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(random.Random(0).randbytes(500))
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    full = tmp_path / "full.png"
    Image.fromarray(noise).save(full)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    return good, garbage, truncated


def test_check_images_reports_corrupt_and_truncated(tmp_path):
    good, garbage, truncated = _corrupt_files(tmp_path)
    bad = check_images([good, garbage, truncated])
    assert [p for p, _ in bad] == [str(garbage), str(truncated)]
    assert all(err for _, err in bad)
    assert check_images([good, garbage, truncated], max_errors=1) == bad[:1]


def test_check_images_catches_truncated_jpeg(tmp_path):
    noise = np.random.default_rng(1).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    full = tmp_path / "full.jpg"
    Image.fromarray(noise).save(full, quality=95)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    assert check_images([full]) == []
    assert [p for p, _ in check_images([cut])] == [str(cut)]


def test_check_images_decodes_a_file_once_until_it_changes(tmp_path, monkeypatch):
    """A relaunch from the same kernel does not decode again the images it found readable: each
    launch's preflight would otherwise read the whole folder (flowers: 3,670 decodes) every time."""
    from nbddp.tasks.classification import images

    good, garbage, truncated = _corrupt_files(tmp_path)
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(good.read_bytes())
    decoded = []
    real = images._decode_check
    monkeypatch.setattr(images, "_decode_check", lambda p: (decoded.append(p), real(p))[1])
    assert check_images([good, photo]) == [] and len(decoded) == 2
    assert check_images([good, photo]) == [] and len(decoded) == 2, "nothing decoded again"
    bad = [p for p, _ in check_images([good, truncated, photo])]
    assert bad == [str(truncated)] and len(decoded) == 3
    assert [p for p, _ in check_images([truncated])] == bad and len(decoded) == 4, "a bad file, every time"
    photo.write_bytes(garbage.read_bytes())  # the same name, other contents: checked again
    assert [p for p, _ in check_images([good, photo])] == [str(photo)] and decoded[-1] == str(photo)


def test_load_rgb_raises_data_error_naming_path(tmp_path):
    _, garbage, truncated = _corrupt_files(tmp_path)
    for path in (garbage, truncated, tmp_path / "missing.png"):
        with pytest.raises(DataError, match="cannot read image") as e:
            load_rgb(path)
        assert str(path) in str(e.value)


# ---------------------------------------------------------------------------- dataset, transforms
def test_dataset_and_transform_shapes(tmp_path):
    root = make_tree(tmp_path, {"a": 2, "b": 2})
    _png(root / "a" / "wide.png", size=(60, 20))
    _, samples = scan_class_folders(root)
    train_tf, val_tf = build_transforms(24, crop_scale=0.5, hflip=True)
    for tf in (train_tf, val_tf):
        ds = ImageListDataset(samples, tf)
        assert len(ds) == 5
        for i in range(len(ds)):
            x, y = ds[i]
            assert isinstance(x, torch.Tensor) and x.shape == (3, 24, 24) and x.dtype == torch.float32
            assert y == samples[i][1]
    assert ImageListDataset(samples, None)[0][0].mode == "RGB"


def test_transform_structure():
    train_tf, val_tf = build_transforms(224, crop_scale=0.3, hflip=False)
    names = [type(t).__name__ for t in train_tf.transforms]
    assert names == ["RandomResizedCrop", "ToTensor", "Normalize"]
    assert train_tf.transforms[0].scale == (0.3, 1.0)
    assert [type(t).__name__ for t in val_tf.transforms] == [
        "Resize", "CenterCrop", "ToTensor", "Normalize"
    ]
    assert val_tf.transforms[0].size == 256
    assert "RandomHorizontalFlip" in [type(t).__name__ for t in build_transforms(32)[0].transforms]


# ---------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_sampler_covers_every_index_once(world):
    for n in range(1, 51):
        shards = [list(ShardSampler(n, r, world)) for r in range(world)]
        flat = [i for s in shards for i in s]
        assert sorted(flat) == list(range(n)), (n, world)
        lengths = [len(ShardSampler(n, r, world)) for r in range(world)]
        assert lengths == [len(s) for s in shards]
        assert max(lengths) - min(lengths) <= 1


def test_shard_sampler_rejects_bad_rank():
    with pytest.raises(ValueError):
        ShardSampler(10, 2, 2)


def test_rank_share_and_batch_fit():
    assert rank_share(10, 4) == 3 and rank_share(8, 4) == 2 and rank_share(1, 1) == 1
    assert check_batch_fits(100, 4, 25) == 1
    assert check_batch_fits(1438, 2, 16) == 719 // 16
    with pytest.raises(DataError) as e:
        check_batch_fits(45, 4, 32)
    msg = str(e.value)
    assert "batch_size=32" in msg and "12 images" in msg and "batch_size <= 12" in msg


# ---------------------------------------------------------------------------- class names, summary
def test_class_indices_format(tmp_path):
    from nbddp.contract import rundir

    assert rundir.class_indices(["daisy", "roses"]) == {"0": "daisy", "1": "roses"}
    path = rundir.write_class_indices(tmp_path / "run", ["daisy", "roses"])
    assert path == tmp_path / "run" / "class_indices.json"
    assert json.loads(path.read_text()) == {"0": "daisy", "1": "roses"}
    assert rundir.read_class_indices(tmp_path / "run") == ["daisy", "roses"]


def test_describe_dataset(tmp_path):
    root = make_tree(tmp_path, {"a": 10, "b": 5})
    d = describe_dataset(root, 0.2, seed=0)
    assert d["classes"] == ["a", "b"]
    assert d["counts"] == {"a": 10, "b": 5}
    assert d["val_counts"] == {"a": 2, "b": 1} and d["train_counts"] == {"a": 8, "b": 4}
    assert (d["n_images"], d["n_train"], d["n_val"]) == (15, 12, 3)
    json.dumps(d)


# ---------------------------------------------------------------------------- bundled data
def test_bundled_digits():
    classes, samples = scan_class_folders(DIGITS)
    assert classes == [str(i) for i in range(10)]
    assert len(samples) == 1797
    im = Image.open(samples[0][0])
    assert im.mode == "L" and im.size == (32, 32)
    assert check_images([p for p, _ in samples[:50]]) == []


def test_make_digits_is_byte_identical(tmp_path):
    pytest.importorskip("sklearn")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_digits", DIGITS.parent / "make_digits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import sklearn.datasets

    digits = sklearn.datasets.load_digits()
    for index in (0, 1, 1796):
        label = int(digits.target[index])
        expected = (DIGITS / str(label) / f"{index:04d}.png").read_bytes()
        assert mod.digit_png(digits.images[index]) == expected


def test_cached_dataset_decodes_once_and_still_augments(tmp_path, monkeypatch):
    import nbddp.tasks.classification.data as D
    import nbddp.tasks.classification.images as images
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        Image.new("RGB", (16, 16), (200, 10, 10)).save(tmp_path / c / "x.png")
    _, samples = D.scan_class_folders(tmp_path)
    calls = []
    real = D.load_rgb
    monkeypatch.setattr(images, "load_rgb", lambda p: calls.append(p) or real(p))
    train_tf, _ = D.build_transforms(8, crop_scale=0.2)
    ds = D.ImageListDataset(samples, train_tf, cache=True)
    first = [ds[i][0] for i in range(2)] + [ds[i][0] for i in range(2)]
    assert len(calls) == 2, "each image decoded once"
    assert first[0].shape == (3, 8, 8)


# ---------------------------------------------------------------------------- links and special files
@pytest.fixture
def data(tmp_path):
    return make_tree(tmp_path / "data", per_class=4)


def test_link_to_its_own_class_folder_adds_no_sample(data):
    _, plain = scan_class_folders(data)
    (data / "a" / "again").symlink_to(".")
    with pytest.warns(UserWarning, match=r"already scanned.*counted once: a/again"):
        classes, samples = scan_class_folders(data)
    assert samples == plain and len(samples) == 12


@pytest.mark.timeout(60)  # today's walk is exponential here: it would hang, not fail
def test_two_loop_links_finish_at_once(data):
    _, plain = scan_class_folders(data)
    (data / "a" / "x").symlink_to(".")
    (data / "a" / "y").symlink_to(".")
    (data / "b" / "up").symlink_to("..")  # back to the data folder: every class again
    with pytest.warns(UserWarning, match=r"3 folder link"):
        assert scan_class_folders(data)[1] == plain


def test_link_to_another_class_keeps_its_images_in_that_class(data):
    _, plain = scan_class_folders(data)
    (data / "a" / "more").symlink_to("../b")
    (data / "a" / "b_copy.png").symlink_to("../b/000.png")  # a file reached twice
    with pytest.warns(UserWarning) as record:
        assert scan_class_folders(data)[1] == plain
    text = " ".join(str(w.message) for w in record)
    assert "a/more" in text and "a/b_copy.png" in text


def test_a_class_folder_that_is_another_class_is_refused(data):
    (data / "d").symlink_to("b")
    with pytest.raises(DataError, match=r"'b' and 'd' in .* are the same folder"):
        scan_class_folders(data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/proc/self", "/proc", "/sys"])
def test_pseudo_filesystems_are_refused(path):
    with pytest.raises(DataError, match=r"pseudo-filesystem.*not a folder of images"):
        scan_class_folders(path)


@pytest.mark.timeout(60)
def test_link_into_proc_is_refused(data):
    (data / "a" / "p").symlink_to("/proc/self")
    with pytest.raises(DataError, match=r"a/p.*pseudo-filesystem"):
        scan_class_folders(data)


def test_fifo_named_like_an_image_is_refused(data):
    os.mkfifo(data / "b" / "pipe.png")
    with pytest.raises(DataError, match=r"b/pipe\.png is a FIFO.*not an image file"):
        scan_class_folders(data)


def test_fifo_as_data_path_is_refused(tmp_path):
    os.mkfifo(tmp_path / "data")
    with pytest.raises(DataError, match=r"is a FIFO"):
        scan_class_folders(tmp_path / "data")


@pytest.mark.timeout(60)  # today's open() of a FIFO waits for a writer forever
def test_fifo_weights_are_refused(tmp_path):
    fifo = tmp_path / "weights.pth"
    os.mkfifo(fifo)
    with pytest.raises(WeightsError, match=r"weights\.pth is a FIFO.*not a weights file"):
        check_weights_file(fifo, "resnet18", 3)
    with pytest.raises(WeightsError, match=r"is a FIFO"):
        load_state_dict_file(fifo)


@pytest.mark.timeout(60)
def test_proc_file_as_weights_is_refused():
    with pytest.raises(WeightsError, match=r"pseudo-filesystem"):
        load_state_dict_file("/proc/self/environ")
