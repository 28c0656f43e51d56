"""Decoding and augmenting photos: the PIL pipeline against the decode pipeline, side by side.

    python bench/decode.py [--images 400] [--image-size 224] [--batch 32] [--repeats 3] [--device cpu|cuda]

A flowers-like folder (JPEGs of 320x240, generated once into a temp folder, as bench/gpu.py
makes them). One process, no loader workers, so the figure is the work per image itself:

- **pil**: ``data.load_rgb`` then the reference transforms (``RandomResizedCrop``, flip,
  ``ToTensor``, ``Normalize``) image by image, then a stack: what a PIL loader worker does.
- **decode**: ``torchvision.io.read_file`` per image (what a decode loader worker does), then
  ``decode_data.DeviceDecoder`` per batch on ``--device`` (torchvision's decoder on the CPU,
  nvJPEG on a GPU): decode, seeded crop, flip, resize, normalise.

Images per second, median of ``--repeats`` passes, and the ratio decode / pil.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main(argv=None) -> dict:
    import torch

    from gpu import _flowers_like
    from nbddp.tasks.classification import data as D
    from nbddp.tasks.classification.decode_data import DeviceDecoder, FileBytes, collate

    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # a loader worker's share; the decoder on a GPU does not use it
    with tempfile.TemporaryDirectory() as tmp:
        root = _flowers_like(Path(tmp) / "flowers", a.images)
        _, samples = D.scan_class_folders(root)
        train_tf, _ = D.build_transforms(a.image_size)
        ds, decoder = FileBytes(samples), DeviceDecoder(a.device, a.image_size, train=True)
        batches = [range(i, min(i + a.batch, len(samples))) for i in range(0, len(samples), a.batch)]

        def pil():
            for b in batches:
                torch.stack([train_tf(D.load_rgb(samples[i][0])) for i in b])

        def decode():
            for b in batches:
                x = decoder(collate([ds[(i, D.item_seed(0, 0, i))] for i in b])[0])
            if x.device.type == "cuda":
                torch.cuda.synchronize()

        rates = {"pil": [], "decode": []}
        for _ in range(a.repeats):
            for name, fn in (("pil", pil), ("decode", decode)):
                t0 = time.perf_counter()
                fn()
                rates[name].append(len(samples) / (time.perf_counter() - t0))
    out = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    out["decode_vs_pil"] = round(out["decode"] / out["pil"], 2)
    out.update(images=len(samples), image_size=a.image_size, device=a.device, torch=torch.__version__)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
