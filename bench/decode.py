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

    python bench/decode.py --host [--images 2048] [--batch 256]

**Host side** (``--host``): the decode pipeline as the built-in worker builds it
(``pipelines._decode_loaders``, no loader processes, one CPU thread), with the decoder replaced by
a lookup, over tiny photos (8x6 JPEGs padded with a comment segment to the 20 KB of a
flowers-sized one: the bytes read are real, the pixel work is next to nothing). What is left is
the pipeline's own host work per image: reading the files, drawing the crops, packing them, and
launching the device's work (the batched path a GPU rank runs). Reported per part: the loader's
(what loader processes do, in parallel on a GPU server), the rank's (one thread, serial: what a
GPU cannot hide) and both together on one core, in images per second of the thread's CPU time
(a shared machine's other work does not count; the wall-clock rate is printed beside). The goal: >= 20,000 images/s together, so that
the GPU, not the host, sets the decode pipeline's pace.
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

    if argv is None:
        argv = sys.argv[1:]
    if "--host" in argv:
        return host([a for a in argv if a != "--host"])

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


def _tiny_photos(root: Path, n: int, pad_to: int = 20_000) -> Path:
    """``n`` JPEGs of 8x6 in 5 class folders, each padded to ``pad_to`` bytes with a comment segment."""
    import io

    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for i in range(n):
        folder = root / f"class{i % 5}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = torch.randint(0, 256, (6, 8, 3), dtype=torch.uint8, generator=g).numpy()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        jpeg = buf.getvalue()
        filler = max(0, min(65533, pad_to - len(jpeg) - 4))
        com = b"\xff\xfe" + (filler + 2).to_bytes(2, "big") + b"c" * filler  # COM: skipped by decoders
        (folder / f"{i:05d}.jpg").write_bytes(jpeg[:2] + com + jpeg[2:])
    return root


def host(argv) -> dict:
    """The decode pipeline's host-side rate on one core, the decoder looked up (see the module's doc)."""
    import types

    import torch
    import torchvision.io

    from nbddp import TrainConfig
    from nbddp.tasks.classification import data as D
    from nbddp.tasks.classification import pipelines

    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ctx = types.SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1, is_main=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = _tiny_photos(Path(tmp) / "tiny", a.images)
        _, samples = D.scan_class_folders(root)
        cfg = TrainConfig(data_path=str(root), image_size=a.image_size, batch_size=a.batch, num_workers=0,
                          data_pipeline="decode")
        loaders = pipelines._decode_loaders(cfg, ctx, samples, samples[:a.batch])
        if hasattr(loaders.train_transform, "batched"):
            loaders.train_transform.batched = True  # what a GPU rank runs (a CPU rank resizes image by image)
        # The lookup: every photo is 8x6, so one decoded image per slot of a batch serves all.
        g = torch.Generator().manual_seed(1)
        decoded = [torch.randint(0, 256, (3, 6, 8), dtype=torch.uint8, generator=g) for _ in range(a.batch)]
        real = torchvision.io.decode_jpeg
        torchvision.io.decode_jpeg = lambda data, **kw: decoded[:len(data)] if isinstance(data, list) else decoded[0]
        try:
            rates = {"loader": [], "rank": [], "together": [], "together_wall": []}
            clock = time.thread_time  # CPU time: what the work costs, however busy the machine is
            for epoch in range(a.repeats + 1):
                loaders.sampler.set_epoch(epoch)
                n, t_load, t_rank = 0, 0.0, 0.0
                batches = iter(loaders.train)
                wall = time.perf_counter()
                while True:
                    t0 = clock()
                    try:
                        batch, labels = next(batches)
                    except StopIteration:
                        break
                    t1 = clock()
                    x = loaders.train_transform(batch)
                    t_rank += clock() - t1
                    t_load += t1 - t0
                    n += len(labels)
                wall = time.perf_counter() - wall
                assert x.shape == (a.batch, 3, a.image_size, a.image_size), x.shape
                if epoch:  # the first pass warms the page cache and the allocator
                    rates["loader"].append(n / t_load)
                    rates["rank"].append(n / t_rank)
                    rates["together"].append(n / (t_load + t_rank))
                    rates["together_wall"].append(n / wall)
        finally:
            torchvision.io.decode_jpeg = real
    out = {k: round(statistics.median(v)) for k, v in rates.items()}
    out.update(images_per_epoch=n, batch=a.batch, image_size=a.image_size, torch=torch.__version__)
    print(json.dumps(out, indent=2))
    print(f"host side of the decode pipeline, one core, images per CPU second: loader {out['loader']:,}, "
          f"rank {out['rank']:,}, together {out['together']:,} ({'meets' if out['together'] >= 20000 else 'below'} "
          f"the 20,000 goal); per wall second {out['together_wall']:,}")
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
