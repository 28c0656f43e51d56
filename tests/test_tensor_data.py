"""The tensor data path: decode once, batches augmented on the device (nbddp.tasks.classification.tensor_data)."""


import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from nbddp import ConfigError, DataError, TrainConfig, spawn_train
from nbddp.tasks.classification import data as D
from nbddp.tasks.classification.tensor_data import (BatchAugment, CenterCropNormalize, TensorBatches, TensorCache, cache_bytes,
                               load_size)


def batch(n=6, side=36, seed=0):
    return torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def reference_normalize(x):
    return T.Normalize(D.IMAGENET_MEAN, D.IMAGENET_STD)(x.float() / 255)


def test_whole_square_crop_is_the_image_and_flips_are_exact():
    # crop_scale=1 leaves only the whole square (any other aspect ratio overflows it), and an
    # output of the same size samples exactly the pixel centres.
    x = batch(16)
    out = BatchAugment(36, crop_scale=1.0, hflip=True, generator=torch.Generator().manual_seed(1))(x)
    plain, flipped = reference_normalize(x), reference_normalize(x.flip(-1))
    kinds = []
    for i in range(len(x)):
        if torch.allclose(out[i], plain[i], atol=1e-4):
            kinds.append("plain")
        elif torch.allclose(out[i], flipped[i], atol=1e-4):
            kinds.append("flipped")
        else:
            pytest.fail(f"image {i} is neither the image nor its mirror")
    assert set(kinds) == {"plain", "flipped"}, kinds


def test_crop_boxes_follow_random_resized_crop():
    aug = BatchAugment(32, crop_scale=0.25, generator=torch.Generator().manual_seed(0))
    top, left, h, w = aug.boxes(20000, 36).unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 36).all() and (left + w <= 36).all()
    area = h * w / 36**2
    assert area.min() >= 0.25 - 0.06 and area.max() <= 1.0  # rounding to whole pixels
    ratio = w / h
    assert ratio.min() >= 0.75 - 0.1 and ratio.max() <= 4 / 3 + 0.1
    assert 0.5 < area.mean() < 0.75, "area fraction roughly uniform in [0.25, 1]"


def test_a_known_box_lands_where_it_should():
    # One box, no randomness: the output must be the box's pixels (same size: no resampling).
    x = batch(1, 36)
    aug = BatchAugment(12, hflip=False)
    aug.boxes = lambda n, side: torch.tensor([[5.0, 7.0, 12.0, 12.0]])
    out = aug(x)
    assert torch.allclose(out, reference_normalize(x[:, :, 5:17, 7:19]), atol=1e-4)


def test_augmentation_is_reproducible_from_the_global_seed():
    x = batch()
    aug = BatchAugment(32, crop_scale=0.08)
    torch.manual_seed(7)
    a = aug(x)
    torch.manual_seed(7)
    b = aug(x)
    c = aug(x)
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert a.shape == (6, 3, 32, 32) and a.dtype == torch.float32


def test_centre_crop_matches_the_pil_evaluation_transform(tmp_path):
    # Square images: the cache (resize to S, centre S square) then the centre crop gives the
    # pixels of the PIL pipeline's Resize(S) + CenterCrop(size).
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(3):
        p = tmp_path / f"{i}.png"
        Image.fromarray(torch.randint(0, 256, (40, 40, 3), generator=g, dtype=torch.uint8).numpy()).save(p)
        samples.append((str(p), i % 2))
    cache = TensorCache(samples, 32, torch.device("cpu"))
    assert cache.images.shape == (3, 3, load_size(32), load_size(32)) and cache.labels.tolist() == [0, 1, 0]
    _, val_tf = D.build_transforms(32)
    ours = CenterCropNormalize(32)(cache.images)
    for i, (path, _) in enumerate(samples):
        assert torch.allclose(ours[i], val_tf(D.load_rgb(path)), atol=1e-5)


def test_batches_follow_the_sampler(tmp_path):
    cache = TensorCache.__new__(TensorCache)
    cache.images = torch.arange(10).view(10, 1, 1, 1).expand(10, 3, 2, 2).to(torch.uint8)
    cache.labels = torch.arange(10)
    order = [3, 1, 4, 0, 5, 9, 2]
    full = TensorBatches(cache, order, batch_size=3)
    assert len(full) == 3 and [y.tolist() for _, y in full] == [[3, 1, 4], [0, 5, 9], [2]]
    dropped = TensorBatches(cache, order, batch_size=3, drop_last=True)
    assert len(dropped) == 2 and len(list(dropped)) == 2
    x, y = next(iter(full))
    assert torch.equal(x[:, 0, 0, 0].long(), y)


def test_corrupt_image_is_named_when_the_cache_is_built(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    with pytest.raises(DataError, match="bad.png"):
        TensorCache([(str(bad), 0)], 32, torch.device("cpu"))


def test_config_names_an_unknown_pipeline():
    with pytest.raises(ConfigError, match="data_pipeline='fast'.*'pil'.*'tensor'"):
        TrainConfig(data_pipeline="fast")


def test_a_cache_that_does_not_fit_is_refused_before_any_process(tree, runs_dir, monkeypatch):
    from nbddp.tasks.classification import planning as classification

    monkeypatch.setattr(classification, "_available_memory", lambda: 1_000_000)
    cfg = TrainConfig(data_path=str(tree), model="resnet18", image_size=224, epochs=1, batch_size=4, nprocs=2,
                      runs_dir=str(runs_dir), data_pipeline="tensor")
    need = cache_bytes(36, 224) * 2
    assert need > 500_000
    with pytest.raises(ConfigError, match=r"data_pipeline='tensor' would keep .* GiB.*use data_pipeline='pil'"):
        spawn_train(cfg, echo=False)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_builtin_worker_evaluates_exactly_with_the_tensor_pipeline(tree, runs_dir):
    """On the small tree; that it learns the digits is bench/digits.py --pipeline tensor (a minute here)."""
    from conftest import small_cfg

    cfg = small_cfg(tree, runs_dir, epochs=1, crop_scale=0.5, hflip=False, name="tensor", data_pipeline="tensor",
                    check_images=False)
    result = spawn_train(cfg, echo=False)
    n_val = len(D.split_samples(D.scan_class_folders(tree)[1], 0.2, 0)[1])
    assert all(m["val_images"] == n_val for m in result.metrics), "exact evaluation on this path too"
    assert result.weights_path and result.weights_path.exists()


def test_tensor_batches_after_a_skip_are_the_rest_of_the_pass(tmp_path):
    from torch.utils.data import DistributedSampler

    from conftest import make_tree

    tree = make_tree(tmp_path / "data", per_class=6, size=12)
    _, samples = D.scan_class_folders(tree)
    cache = TensorCache(samples, 8, torch.device("cpu"))

    def batches(skip):
        sampler = D.SkipSampler(DistributedSampler(cache, num_replicas=2, rank=1, shuffle=True, seed=3))
        sampler.set_epoch(2)
        sampler.skip(skip)
        loader = TensorBatches(cache, sampler, batch_size=2, drop_last=True)
        return len(loader), [b for b in loader]

    n, full = batches(0)
    assert n == len(full) == 4
    n, rest = batches(3 * 2)
    assert n == len(rest) == 1
    assert torch.equal(rest[0][0], full[3][0]) and torch.equal(rest[0][1], full[3][1])
