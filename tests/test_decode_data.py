"""data_pipeline="decode": file bytes read by the loader, each batch decoded and augmented on the device.

On this CPU the device is the CPU: the code the GPU runs (batched decode_jpeg, the per-image
crops from (seed, epoch, image) seeds, normalisation on the device) runs here with
``device="cpu"``, the switch the GPU path uses.
"""

from pathlib import Path

import pytest
import torch

from nbddp import DataError, spawn_train
from nbddp.tasks.classification.data import SeededSampler, item_seed
from nbddp.tasks.classification.decode_data import DeviceDecoder, FileBytes, centre_box, collate, crop_box, is_jpeg
from conftest import make_tree, small_cfg


def jpeg_and_png_tree(root: Path) -> Path:
    """The test tree with every other image re-saved as JPEG (of another size): a mixed folder."""
    from PIL import Image

    make_tree(root, size=24)
    for i, path in enumerate(sorted(root.rglob("*.png"))):
        if i % 2 == 0:
            Image.open(path).resize((30, 20)).save(path.with_suffix(".jpg"), quality=95)
            path.unlink()
    return root


def test_a_mixed_batch_decodes_and_augments_the_same_for_the_same_seeds(tmp_path):
    from nbddp.tasks.classification.data import scan_class_folders

    _, samples = scan_class_folders(jpeg_and_png_tree(tmp_path / "data"))
    assert {Path(p).suffix for p, _ in samples} == {".jpg", ".png"}
    ds = FileBytes(samples)
    keys = [(i, item_seed(0, 1, i)) for i in range(8)]
    batch, labels = collate([ds[k] for k in keys])
    assert all(d.dtype == torch.uint8 and d.dim() == 1 for d in batch.data), "only bytes cross the loader"
    assert sum(is_jpeg(d) for d in batch.data) == 4 and labels.tolist() == [s[1] for s in samples[:8]]
    train = DeviceDecoder("cpu", 16, train=True, crop_scale=0.3)
    x = train(batch)
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.float32 and x.device.type == "cpu"
    assert torch.equal(x, train(collate([ds[k] for k in keys])[0])), "the crop is a function of the key alone"
    other = train(collate([ds[(i, item_seed(0, 2, i))] for i in range(8)])[0])
    assert not torch.equal(x, other), "another epoch, other crops"
    # Evaluation: the centre, deterministic; normalised with ImageNet's statistics.
    val = DeviceDecoder("cpu", 16, train=False)(collate([ds[i] for i in range(8)])[0])
    assert val.shape == (8, 3, 16, 16) and -3 < float(val.min()) and float(val.max()) < 3
    # The sampler's keys are what the loader gives the dataset.
    assert list(SeededSampler(range(3), 5))[1] == (1, item_seed(5, 0, 1))


def test_crop_boxes_stay_inside_the_image_and_follow_their_seed():
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        top, left, h, w = crop_box(240, 320, (0.08, 1.0), (3 / 4, 4 / 3), g)
        assert 0 <= top and 0 <= left and top + h <= 240 and left + w <= 320 and h > 0 and w > 0
    a = crop_box(240, 320, (0.08, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(7))
    assert a == crop_box(240, 320, (0.08, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(7))
    # The reference's evaluation: shorter side to 256, centre 224: 210 px of a 240-px side.
    assert centre_box(240, 320, 224) == (15, 55, 210, 210)


def test_a_file_that_does_not_decode_is_named(tmp_path):
    root = jpeg_and_png_tree(tmp_path / "data")
    bad = next(root.rglob("*.jpg"))
    bad.write_bytes(bad.read_bytes()[:40])  # a JPEG cut short
    from nbddp.tasks.classification.data import scan_class_folders

    _, samples = scan_class_folders(root)
    index = next(i for i, (p, _) in enumerate(samples) if Path(p) == bad)
    batch, _ = collate([FileBytes(samples)[index]])
    with pytest.raises(DataError, match=rf"cannot decode .*{bad.name}"):
        DeviceDecoder("cpu", 16, train=True)(batch)


def test_the_built_in_worker_trains_on_the_decode_pipeline(tmp_path, runs_dir):
    tree = jpeg_and_png_tree(tmp_path / "data")
    result = spawn_train(small_cfg(tree, runs_dir, data_pipeline="decode", image_size=16, name="decode"), echo=False)
    assert len(result.metrics) == 2 and result.weights_path is not None
    assert all(m["images_per_s"] > 0 for m in result.metrics)


def test_the_draws_read_ahead_are_torchs_and_the_pil_pipelines():
    """A box drawn from one read of the generator's stream is the box torch's generator draws call by
    call, and the one the PIL pipeline's RandomResizedCrop draws for the same key."""
    import torchvision.transforms as T

    from nbddp.tasks.classification.crops import Crops, SeedDraws
    from nbddp.tasks.classification.data import SeededDataset

    class Params(torch.utils.data.Dataset):  # what the PIL pipeline's transforms draw for an item
        def __getitem__(self, i):
            box = T.RandomResizedCrop.get_params(torch.empty(3, 240, 320), (0.08, 1.0), (3 / 4, 4 / 3))
            return box, bool(torch.rand(1) < 0.5)

    crops = Crops(224, train=True, crop_scale=0.08, hflip=True)
    for i in range(300):
        seed = item_seed(7, 3, i)
        g = torch.Generator().manual_seed(seed)
        by_calls = crop_box(240, 320, (0.08, 1.0), (3 / 4, 4 / 3), g), bool(torch.rand(1, generator=g) < 0.5)
        draws = SeedDraws(seed)
        assert (crop_box(240, 320, (0.08, 1.0), (3 / 4, 4 / 3), draws), draws.rand() < 0.5) == by_calls, seed
        assert crops.box(seed, 240, 320) == by_calls == SeededDataset(Params())[(i, seed)], seed
    for scale in [(0.01, 0.02), (0.9, 1.0)]:  # every try fails, or the first one succeeds
        for seed in range(50):
            g = torch.Generator().manual_seed(seed)
            assert crop_box(500, 40, scale, (3 / 4, 4 / 3), SeedDraws(seed)) == crop_box(500, 40, scale, (3 / 4, 4 / 3), g)


def test_a_jpegs_size_comes_from_its_header(tmp_path):
    import io

    from PIL import Image

    from nbddp.tasks.classification.decode_data import jpeg_size

    image = Image.new("RGB", (37, 21), (10, 200, 30))
    for options in ({}, {"progressive": True}, {"exif": Image.Exif(), "comment": b"x" * 3000}):
        buf = io.BytesIO()
        image.save(buf, "JPEG", **options)
        assert jpeg_size(buf.getvalue()) == (21, 37), options
    png = io.BytesIO()
    image.save(png, "PNG")
    assert jpeg_size(png.getvalue()) is None and jpeg_size(buf.getvalue()[:40]) is None


def _packed_and_collated(samples, keys, image_size, train):
    from nbddp.tasks.classification.crops import Crops
    from nbddp.tasks.classification.decode_data import EncodedImages

    packed, labels = EncodedImages(samples, Crops(image_size, train, crop_scale=0.3)).__getitems__(keys)
    collated, same_labels = collate([FileBytes(samples)[k] for k in keys])
    assert labels.tolist() == same_labels.tolist()
    return packed, collated


def test_the_loader_draws_every_box_and_the_rank_decodes_once_and_resizes_the_batch_in_a_few_calls(tmp_path,
                                                                                                   monkeypatch):
    import torch.nn.functional as F
    import torchvision.io

    from nbddp.tasks.classification import crops as C
    from nbddp.tasks.classification import resize as R
    from nbddp.tasks.classification.data import scan_class_folders

    _, samples = scan_class_folders(jpeg_and_png_tree(tmp_path / "data"))
    keys = [(i, item_seed(0, 1, i)) for i in range(12)]
    for train in (True, False):
        packed, collated = _packed_and_collated(samples, keys if train else list(range(12)), 16, train)
        assert packed.pixels is not None and packed.info[:, 7].tolist().count(1) == 6, "the PNGs came decoded"
        # The same augmentation as before: the rank drawing from each seed and resizing image by image.
        before = DeviceDecoder("cpu", 16, train=train, crop_scale=0.3, batched=False)(collated)
        calls = {"decode_jpeg": 0, "interpolate": 0, "box": 0}
        decode_jpeg, interpolate, box = torchvision.io.decode_jpeg, F.interpolate, C.Crops.box

        def counting(name, fn):
            def call(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return call

        monkeypatch.setattr(torchvision.io, "decode_jpeg", counting("decode_jpeg", decode_jpeg))
        monkeypatch.setattr(R.F, "interpolate", counting("interpolate", interpolate))
        monkeypatch.setattr(C.Crops, "box", counting("box", box))
        after = DeviceDecoder("cpu", 16, train=train, crop_scale=0.3, batched=True)(packed)
        monkeypatch.undo()
        assert calls == {"decode_jpeg": 1, "interpolate": 0, "box": 0}, calls
        assert after.shape == before.shape and torch.allclose(after, before, atol=1e-4), (after - before).abs().max()


def test_the_batched_resize_is_the_antialiased_bilinear_one_in_chunks_too(monkeypatch):
    from nbddp.tasks.classification import resize as R
    from nbddp.tasks.classification.crops import Crops

    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in [(20, 30), (24, 24), (240, 320), (7, 5), (100, 40), (3, 300)]]
    for size, train in [(16, True), (64, True), (64, False)]:
        drawn = [Crops(size, train, 0.08, True).box(i + 1, *img.shape[-2:]) for i, img in enumerate(images)]
        boxes, flips = torch.tensor([b for b, _ in drawn]), torch.tensor([f for _, f in drawn])
        each = R.resize_each(images, boxes, flips, size, torch.device("cpu"))
        for chunk in (R.CHUNK_ELEMENTS, 3 * 30 * 30):  # one call, or one per image or two
            monkeypatch.setattr(R, "CHUNK_ELEMENTS", chunk)
            batch = R.resize_batch(images, boxes, flips, size, torch.device("cpu"))
            assert torch.allclose(batch, each, atol=1e-3), (size, train, chunk, (batch - each).abs().max())


def test_an_image_the_loader_cannot_decode_is_named(tmp_path):
    from nbddp.tasks.classification.crops import Crops
    from nbddp.tasks.classification.data import scan_class_folders
    from nbddp.tasks.classification.decode_data import EncodedImages

    root = jpeg_and_png_tree(tmp_path / "data")
    bad = next(root.rglob("*.png"))
    bad.write_bytes(bad.read_bytes()[:30])  # a PNG cut short
    _, samples = scan_class_folders(root)
    index = next(i for i, (p, _) in enumerate(samples) if Path(p) == bad)
    with pytest.raises(DataError, match=rf"cannot decode .*{bad.name}"):
        EncodedImages(samples, Crops(16, True)).__getitems__([(index, 1)])


def test_the_host_side_benchmark_runs_the_pipeline_as_the_worker_builds_it():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "bench" / "decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.main(["--host", "--images", "40", "--batch", "8", "--repeats", "1"])
    assert r["images_per_epoch"] == 40 and min(r["loader"], r["rank"], r["together"], r["together_wall"]) > 0


def test_the_resize_is_chosen_by_device_or_by_its_variable(monkeypatch):
    from nbddp.tasks.classification.decode_data import RESIZE_ENV

    assert not DeviceDecoder("cpu", 8, True).batched and DeviceDecoder("cpu", 8, True, batched=True).batched
    monkeypatch.setenv(RESIZE_ENV, "batch")
    assert DeviceDecoder("cpu", 8, True).batched and not DeviceDecoder("cpu", 8, True, batched=False).batched
    monkeypatch.setenv(RESIZE_ENV, "each")
    assert not DeviceDecoder("meta", 8, True).batched
    monkeypatch.setenv(RESIZE_ENV, "both")
    with pytest.raises(ValueError, match="NBDDP_DECODE_RESIZE='both': use 'batch' or 'each'"):
        DeviceDecoder("cpu", 8, True)
