"""The Quickstart run end to end: ResNet34 learns the bundled digits, and its export predicts the same.

    python bench/digits.py [--epochs 6] [--model resnet34] [--pipeline pil] [--min-accuracy 0.90]
    python bench/digits.py --model resnet18 --epochs 2 --pipeline tensor --min-accuracy 0.7
    python bench/digits.py --model resnet18 --epochs 2 --pipeline tensor --min-accuracy 0.7 --strategy fsdp

The run of ``bash dev.sh train``: data/digits (10 classes, 1797 images of 32 px), ResNet34 from
scratch at image_size 32, 2 CPU ranks (gloo), batch 32, lr 0.01, crop_scale 0.5, no flip, 6 epochs.
It takes minutes on 2 CPU cores, which is why it is a benchmark and not a test: tests/ checks the
same files and records on a small run (tests/test_classification.py), this script checks that the
model really learns. The second command is the tensor data pipeline's (decoded once, augmented in
batches; tests/test_tensor_data.py runs it on the small tree): ResNet18, 2 epochs, at least 0.7
(chance is 0.1). Prints the validation accuracy of each epoch and the wall time, then checks:

- the best validation accuracy reaches ``--min-accuracy``, and the train loss falls;
- every epoch counts each of the 359 validation images once, and the best epoch's evaluation
  scores exactly the weights rank 0 saved;
- the export is a plain torchvision state_dict (strict load) with its safetensors twin and the
  class names, and reloaded here it predicts what the workers' last evaluation recorded;
- the last checkpoint and TensorBoard have every epoch; no worker process is left.

Exits 1 if a check fails, naming it.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

DIGITS = ROOT / "data" / "digits"
VAL_IMAGES = 359  # 20% of 1797, split per class


def run(epochs: int, model: str, pipeline: str, runs_dir: Path, strategy: str = "ddp"):
    from nbddp import TrainConfig, spawn_train

    cfg = TrainConfig(data_path=str(DIGITS), model=model, image_size=32, epochs=epochs, batch_size=32,
                      lr=0.01, nprocs=2, crop_scale=0.5, hflip=False, runs_dir=str(runs_dir), name="digits",
                      data_pipeline=pipeline, check_images=pipeline == "pil", strategy=strategy)
    t0 = time.perf_counter()
    result = spawn_train(cfg, echo=False)
    return result, time.perf_counter() - t0


def checks(result, epochs: int, model_name: str, min_accuracy: float) -> list:
    """(what, passed) for every check in the module docstring."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nbddp.contract.checkpoint import load_checkpoint, load_state_dict_file
    from nbddp.kernel.inference import load_model, predict
    from nbddp.tasks.classification.models import build_model
    from nbddp.kernel.procs import live_workers

    out = []
    m, v = result.metrics, result.value
    out.append((f"best val accuracy {v['best_accuracy']:.3f} >= {min_accuracy}", v["best_accuracy"] >= min_accuracy))
    out.append(("one record per epoch", [r["epoch"] for r in m] == list(range(epochs))))
    out.append(("the train loss falls", m[-1]["train_loss"] < m[0]["train_loss"]))
    out.append((f"each epoch counts the {VAL_IMAGES} val images once", all(r["val_images"] == VAL_IMAGES for r in m)))
    out.append(("the best epoch's accuracy is that of the weights saved",
                m[v["best_epoch"]]["val_accuracy"] == v["final_accuracy"]))

    export = result.run_dir / "export"
    sd = torch.load(export / "model.pth", weights_only=True)
    build_model(model_name, 10).load_state_dict(sd, strict=True)
    st = load_state_dict_file(export / "model.safetensors")
    out.append(("export: plain state_dict, safetensors twin",
                not any(k.startswith("module.") for k in sd) and all(torch.equal(sd[k], st[k]) for k in sd)))
    out.append(("export: class names", json.loads((export / "class_indices.json").read_text())
                == {str(i): str(i) for i in range(10)}))
    model, classes = load_model(result.run_dir)
    recorded = json.loads((result.run_dir / "val_predictions.json").read_text())
    preds = predict(model, [r["path"] for r in recorded])
    out.append(("reloaded here, it predicts what the workers recorded",
                [classes.index(p.label) for p in preds] == [r["pred"] for r in recorded]))

    ck = load_checkpoint(result.run_dir / "checkpoints" / "last.pt")
    out.append(("last checkpoint at the last epoch", ck["epoch"] == epochs - 1 and ck["config"]["model"] == model_name))
    ea = EventAccumulator(str(result.run_dir / "tensorboard"))
    ea.Reload()
    out.append(("TensorBoard: an accuracy point per epoch", len(ea.Scalars("accuracy")) == epochs))
    out.append(("no worker left", not live_workers(result.run_dir)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--model", default="resnet34")
    p.add_argument("--pipeline", choices=["pil", "tensor"], default="pil")
    p.add_argument("--min-accuracy", type=float, default=0.90)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp",
                   help="fsdp: every ResNet stage sharded over the 2 ranks (TrainConfig.strategy)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result, wall = run(a.epochs, a.model, a.pipeline, Path(tmp) / "runs", a.strategy)
        print(f"## {a.model} on data/digits, {a.epochs} epochs, {a.pipeline} pipeline, 2 CPU ranks: {wall:.0f} s\n")
        print("| epoch | train loss | val accuracy | seconds |\n|---|---|---|---|")
        for r in result.metrics:
            print(f"| {r['epoch']} | {r['train_loss']:.3f} | {r['val_accuracy']:.3f} | {r['seconds']:.1f} |")
        results = checks(result, a.epochs, a.model, a.min_accuracy)
    print()
    for what, ok in results:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
