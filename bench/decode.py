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
        if a.device.startswith("cuda"):
            rates.update(_raw_jpeg_decoders(ds, batches, a.device, a.repeats))
    out = {k: round(statistics.median(v), 1) if isinstance(v, list) else v for k, v in rates.items()}
    out["decode_vs_pil"] = round(out["decode"] / out["pil"], 2)
    out.update(images=len(samples), image_size=a.image_size, device=a.device, torch=torch.__version__)
    print(json.dumps(out, indent=2))
    return out


def _raw_jpeg_decoders(ds, batches, device, repeats) -> dict:
    """JPEG decoding alone on the GPU, a batch per call, from bytes read beforehand: torchvision's
    ``decode_jpeg`` (what the decode pipeline uses) and TorchCodec's, which torchvision 0.29 points
    to. TorchCodec's figure is the reason it could not run when it does not import or decode."""
    import torch
    import torchvision.io as tio

    from nbddp.tasks.classification.decode_data import _quiet

    data = [[ds[i][0] for i in b] for b in batches]
    n = sum(len(b) for b in data)
    decoders = {"nvjpeg torchvision": lambda b: tio.decode_jpeg(b, device=device)}
    out = {}
    try:
        from torchcodec.decoders import decode_jpeg as tc_decode_jpeg

        decoders["nvjpeg torchcodec"] = lambda b: tc_decode_jpeg(b, device=device)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the figure says why it is missing
        out["nvjpeg torchcodec"] = f"not available: {type(exc).__name__}: {str(exc)[:300]}"
    for name, fn in list(decoders.items()):
        try:
            with _quiet():
                fn(data[0])  # nvJPEG's handles and buffers
                torch.cuda.synchronize()
                runs = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for b in data:
                        fn(b)
                    torch.cuda.synchronize()
                    runs.append(n / (time.perf_counter() - t0))
            out[name] = runs
        except Exception as exc:  # noqa: BLE001
            out[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    return out


if __name__ == "__main__":
    main()
