"""What the ONNX export of a classifier costs: the export (dynamo exporter), and the check in ONNX Runtime.

    python bench/onnx_export.py [--models resnet18,resnet50] [--image-size 32] [--repeats 3] [--threads 2]

One process, CPU, the path ``nbddp.export_onnx`` and ``TrainConfig(export_onnx=True)`` take
(:func:`nbddp.tasks.classification.onnx_export.export_classifier`): a randomly initialised torchvision
classifier of 10 classes, 16 noise images to check on. Per model, the median of ``--repeats`` after one
warm-up (the first export of a process also imports the exporter): ``export`` (``torch.export``, the
translation, the file written), ``check`` (ONNX Runtime's session, both runtimes on the 16 images, the
comparison), and the file's size.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(model_name: str, image_size: int, repeats: int) -> dict:
    from nbddp.tasks.classification.models import build_model
    from nbddp.tasks.classification.onnx_export import CHECK_IMAGES, export_classifier, random_images

    model = build_model(model_name, 10)
    images = random_images(CHECK_IMAGES, int(image_size / 0.875))
    exports, checks, first = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            path, record = export_classifier(model, [str(c) for c in range(10)], image_size, Path(tmp), images,
                                             model_name=model_name, on="noise images")
            if i == 0:
                first = time.perf_counter() - t0
                continue
            exports.append(record["export"]["seconds"])
            checks.append(record["check"]["seconds"])
        size_mb = path.stat().st_size / 1e6
    return {"model": model_name, "image_size": image_size, "first_s": round(first, 2),
            "export_s": round(statistics.median(exports), 2), "check_s": round(statistics.median(checks), 2),
            "max_abs_diff": record["check"]["max_abs_diff"], "onnx_mb": round(size_mb, 1),
            "exporter": record["export"]["exporter"], "opset": record["export"]["opset"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{'model':<20} {'size':>5} {'first s':>8} {'export s':>9} {'check s':>8} {'MB':>7}  largest diff")
    for name in args.models.split(","):
        row = measure(name.strip(), args.image_size, args.repeats)
        rows.append(row)
        print(f"{row['model']:<20} {row['image_size']:>5} {row['first_s']:>8} {row['export_s']:>9} {row['check_s']:>8} "
              f"{row['onnx_mb']:>7}  {row['max_abs_diff']:.2g} ({row['exporter']}, opset {row['opset']})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
