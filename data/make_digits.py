"""Write the scikit-learn digits as a class-folder tree of PNG files.

The 1,797 8x8 handwritten digits of ``sklearn.datasets.load_digits()`` ship inside
scikit-learn (no download), which makes them the bundled smoke-test data set of nbddp: the
same class-folder layout as the flower photos, small enough to train on a laptop CPU.

Usage::

    python data/make_digits.py                 # writes data/digits
    python data/make_digits.py --out /tmp/dig  # somewhere else

Output: ``<out>/<digit>/<index:04d>.png`` with class folders ``"0"`` .. ``"9"``; each file is
an 8-bit grayscale PNG (0..16 scaled to 0..255, white strokes on black), 32x32 pixels.

Upscaling uses **nearest neighbour**: every source pixel becomes an exact 4x4 block, so no
values are invented, the 8x8 original can be recovered exactly, and the files compress to a
few hundred bytes. Smoothing here would add nothing, because the training transforms resize
the images again (bilinear) to ``image_size``.

The output is deterministic: the same scikit-learn data and Pillow/zlib give byte-identical
files on every run (PNG carries no timestamp unless asked to). Files whose bytes are
unchanged are not rewritten.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
from PIL import Image

SIZE = 32  # 4x the 8x8 source: an exact integer factor, see the module docstring.


def digit_png(pixels: np.ndarray) -> bytes:
    """Encode one 8x8 array of values 0..16 as a 32x32 8-bit grayscale PNG."""
    gray = np.rint(pixels.astype(np.float64) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(gray).resize((SIZE, SIZE), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    # A fixed compress level keeps the bytes independent of Pillow's default.
    image.save(buf, format="PNG", compress_level=9)
    return buf.getvalue()


def write_digits(out: Path) -> int:
    """Write every digit under ``out``; returns the number of images."""
    from sklearn.datasets import load_digits  # only this script needs scikit-learn

    digits = load_digits()
    for index, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        path = out / str(int(label)) / f"{index:04d}.png"
        data = digit_png(pixels)
        if path.is_file() and path.read_bytes() == data:
            continue  # keep the mtime of unchanged files (no spurious rebuilds or syncs)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return len(digits.images)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parent / "digits"
    parser.add_argument("--out", type=Path, default=default, help=f"output folder (default {default})")
    args = parser.parse_args(argv)
    n = write_digits(args.out)
    print(f"wrote {n} digit images under {args.out}")


if __name__ == "__main__":
    main()
