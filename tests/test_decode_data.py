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
