"""Export: export_run, prediction and confusion-matrix figures (matplotlib Agg), on fake and real runs;
an export folder is whole or absent, and load_model refuses files that do not belong together."""

import errno
import json
import os
import shutil
import subprocess
import sys

os.environ.setdefault("MPLBACKEND", "Agg")  # before anything imports pyplot

import pytest
import safetensors.torch
import torch
import torchvision

from nbddp import ConfigError, TrainConfig, WeightsError
from nbddp.contract.checkpoint import atomic_save, export_weights, load_state_dict_file
from nbddp.tasks.classification.data import scan_class_folders, split_samples
from nbddp.contract.rundir import write_class_indices
from nbddp.kernel.export import confusion_matrix, export_run, load_val_predictions, per_class_accuracy
from nbddp.kernel.inference import load_model, predict
from nbddp.tasks.classification.models import build_model
from nbddp.ui import plot_confusion_matrix, show_predictions
from conftest import make_tree

RIGHT, WRONG = "#1b7f3b", "#c62828"


@pytest.fixture
def fake_run(tmp_path):
    """A run folder as the built-in worker leaves it, written here without training."""
    data = make_tree(tmp_path / "data")
    classes, samples = scan_class_folders(data)
    _, val = split_samples(samples, 0.2, 0)
    run = tmp_path / "runs" / "20260101-000000-fake"
    cfg = TrainConfig(data_path=str(data), model="resnet18", image_size=32, epochs=2, nprocs=2, runs_dir=str(run.parent))
    cfg.save(run / "config.json")
    write_class_indices(run, classes)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3)
    history = [{"epoch": 0, "val_accuracy": 0.5}, {"epoch": 1, "val_accuracy": 0.25}]
    # Same layout as tasks/classification/worker.py: best.pt is small, last.pt carries the history.
    atomic_save({"model": model.state_dict(), "epoch": 0, "accuracy": 0.5, "classes": classes,
                 "config": cfg.to_dict()}, run / "checkpoints" / "best.pt")
    atomic_save({"model": model.state_dict(), "epoch": 1, "best_accuracy": 0.5, "best_epoch": 0,
                 "config": cfg.to_dict(), "classes": classes, "history": history}, run / "checkpoints" / "last.pt")
    preds = [{"path": p, "label": y, "pred": (y + i) % 3 if i % 2 else y} for i, (p, y) in enumerate(val)]
    (run / "val_predictions.json").write_text(json.dumps(preds))
    return run, model, classes


def test_export_run_writes_the_four_files(fake_run, tmp_path):
    run, model, classes = fake_run
    paths = export_run(run, tmp_path / "out")
    assert {k: p.name for k, p in paths.items()} == {"pth": "model.pth", "safetensors": "model.safetensors",
                                                     "class_indices": "class_indices.json", "meta": "meta.json"}
    sd = torch.load(paths["pth"], weights_only=True)
    fresh = torchvision.models.resnet18(num_classes=3)
    fresh.load_state_dict(sd, strict=True)  # a plain torchvision state_dict
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    st = load_state_dict_file(paths["safetensors"])
    assert st.keys() == sd.keys() and all(torch.equal(st[k], sd[k]) for k in sd)
    assert json.loads(paths["class_indices"].read_text()) == {"0": "a", "1": "b", "2": "c"}
    meta = json.loads(paths["meta"].read_text())
    assert {k: meta[k] for k in ("model", "num_classes", "image_size", "epoch", "val_accuracy", "which")} == \
        {"model": "resnet18", "num_classes": 3, "image_size": 32, "epoch": 0, "val_accuracy": 0.5, "which": "best"}
    loaded, names = load_model(tmp_path / "out")  # the inference side reads the folder back
    assert names == classes and loaded.nbddp_meta["image_size"] == 32

    last = json.loads(export_run(run, tmp_path / "last", which="last")["meta"].read_text())
    assert (last["epoch"], last["val_accuracy"], last["which"]) == (1, 0.25, "last")


def test_export_run_errors_name_the_problem(fake_run, tmp_path):
    run, _, _ = fake_run
    with pytest.raises(ConfigError, match="'best' or 'last'"):
        export_run(run, tmp_path / "out", which="newest")
    (run / "checkpoints" / "best.pt").unlink()
    with pytest.raises(WeightsError, match=r"no checkpoint at .*best\.pt.*last\.pt.*which='last'"):
        export_run(run, tmp_path / "out")
    (run / "checkpoints" / "last.pt").unlink()
    with pytest.raises(WeightsError, match="before it finished an epoch"):
        export_run(run, tmp_path / "out", which="last")
    with pytest.raises(WeightsError, match="run folder not found"):
        export_run(tmp_path / "nowhere", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_confusion_matrix_and_per_class_accuracy():
    m = confusion_matrix([0, 0, 1, 1, 2], [0, 1, 1, 1, 0], 3)
    assert m.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 0]]
    assert per_class_accuracy([0, 0, 1, 1, 2], [0, 1, 1, 1, 0], ["a", "b", "c"]) == {"a": 0.5, "b": 1.0, "c": 0.0}
    assert per_class_accuracy([0], [0], ["a", "b"]) == {"a": 1.0, "b": None}
    with pytest.raises(ValueError, match="0..2"):
        confusion_matrix([3], [0], 3)


def _title_colors(fig):
    return [ax.title.get_color() for ax in fig.axes if ax.images]


def test_prediction_grid_and_confusion_figure(fake_run, tmp_path):
    from matplotlib.figure import Figure

    run, _, classes = fake_run
    recs = load_val_predictions(run)
    # Recorded predictions (no model): right ones green, wrong ones red.
    fig = show_predictions(None, None, run, n=4)
    assert isinstance(fig, Figure) and len([ax for ax in fig.axes if ax.images]) == 4
    assert set(_title_colors(fig)) <= {RIGHT, WRONG} and WRONG in _title_colors(fig)
    assert "pred: " in fig.axes[0].get_title() and "true: " in fig.axes[0].get_title()

    # A model and (path, label) pairs: the grid shows what predict() says.
    export_run(run, tmp_path / "out")
    model, names = load_model(tmp_path / "out")
    pairs = [(r["path"], r["label"]) for r in recs]
    fig = show_predictions(model, names, pairs, n=16)
    shown = [ax for ax in fig.axes if ax.images]
    assert len(shown) == len(pairs) <= 16
    preds = predict(model, [p for p, _ in pairs])
    expect = [RIGHT if names.index(p.label) == y else WRONG for p, (_, y) in zip(preds, pairs)]
    assert _title_colors(fig) == expect
    fig.savefig(tmp_path / "grid.png")  # renders under Agg

    cm_fig = plot_confusion_matrix(run)
    assert isinstance(cm_fig, Figure) and "accuracy" in cm_fig.axes[0].get_title()
    counts = confusion_matrix([r["label"] for r in recs], [r["pred"] for r in recs], 3)
    texts = [t.get_text() for t in cm_fig.axes[0].texts]
    assert texts == [str(v) for v in counts.flatten()]
    norm = plot_confusion_matrix(counts, classes, normalize=True)
    assert [t.get_text() for t in norm.axes[0].texts][0].startswith(("0.", "1."))
    norm.savefig(tmp_path / "cm.png")


@pytest.mark.timeout(120)
def test_export_of_a_real_run_predicts_like_the_workers(tmp_path, small_run):
    cfg, result = small_run
    paths = export_run(result.run_dir, tmp_path / "exported")
    torchvision.models.get_model(cfg.model, num_classes=3).load_state_dict(torch.load(paths["pth"], weights_only=True),
                                                                       strict=True)
    meta = json.loads(paths["meta"].read_text())
    assert meta["epoch"] == result.value["best_epoch"] and meta["val_accuracy"] == pytest.approx(result.value["best_accuracy"])
    model, classes = load_model(tmp_path / "exported")
    recs = load_val_predictions(result.run_dir)
    assert [classes.index(p.label) for p in predict(model, [r["path"] for r in recs])] == [r["pred"] for r in recs]
    assert show_predictions(model, classes, result.run_dir, n=6).axes


def test_import_nbddp_pulls_in_no_plotting_or_widgets():
    code = ("import sys, nbddp, nbddp.kernel.export, nbddp.ui; from nbddp.ui import show_tensorboard; "
            "print(sorted(m for m in ('matplotlib', 'ipywidgets', 'IPython') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_relative_image_paths_resolve_from_the_launch_folder(fake_run, tmp_path, monkeypatch):
    run, _, _ = fake_run
    recs = load_val_predictions(run)
    rel = [dict(r, path=os.path.relpath(r["path"], tmp_path)) for r in recs]  # "data/a/003.png"
    (run / "val_predictions.json").write_text(json.dumps(rel))
    # Launched from tmp_path with the default runs_dir="runs": run is tmp_path/runs/<run>.
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(dict(cfg, runs_dir="runs")))
    monkeypatch.chdir(run)  # the notebook now runs somewhere else
    assert [r["path"] for r in load_val_predictions(run)] == [str(tmp_path / r["path"]) for r in rel]
    assert show_predictions(None, None, run, n=2).axes


# ------------------------------------------------------------------ an export is whole or absent
MODEL = "shufflenet_v2_x0_5"  # small: a few MB per file


def export(out, classes, seed=0):
    torch.manual_seed(seed)
    sd = build_model(MODEL, len(classes)).state_dict()
    return export_weights(sd, out, classes, extra={"model": MODEL, "image_size": 32})


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_disk_full_mid_export_keeps_the_old_export_whole(tmp_path, monkeypatch):
    out = tmp_path / "exported"
    export(out, ["a", "b"])
    before = snapshot(out)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export(out, ["a", "b", "c"], seed=1)
    assert snapshot(out) == before, "a failed export must leave the old one untouched"
    assert [p.name for p in tmp_path.iterdir()] == ["exported"], "no temporary folder left behind"
    model, classes = load_model(out)
    assert classes == ["a", "b"]

    monkeypatch.undo()
    export(out, ["a", "b", "c"], seed=1)
    model, classes = load_model(out)
    assert classes == ["a", "b", "c"] and model.fc.out_features == 3
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]


def test_load_model_refuses_files_of_two_exports(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    export(old, ["a", "b"])
    export(new, ["a", "b", "c"], seed=1)

    mixed = tmp_path / "mixed_pth"  # what the interrupted export left before this fix
    shutil.copytree(old, mixed)
    shutil.copy(new / "model.pth", mixed / "model.pth")
    with pytest.raises(WeightsError, match=r"do not belong together.*model\.pth.*export_run"):
        load_model(mixed)

    mixed = tmp_path / "mixed_classes"
    shutil.copytree(old, mixed)
    shutil.copy(new / "class_indices.json", mixed / "class_indices.json")
    with pytest.raises(WeightsError, match=r"do not belong together.*class_indices\.json"):
        load_model(mixed)


def test_export_without_manifest_is_checked_by_shape(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    export(old, ["a", "b"])
    export(new, ["a", "b", "c"], seed=1)
    for folder in (old, new):  # as written by an older nbddp: no list of files in meta.json
        meta = json.loads((folder / "meta.json").read_text())
        meta.pop("files", None)
        meta.pop("num_classes", None)
        (folder / "meta.json").write_text(json.dumps(meta))
    assert load_model(old)[1] == ["a", "b"]
    shutil.copy(new / "class_indices.json", old / "class_indices.json")
    with pytest.raises(WeightsError, match=r"do not belong together.*3 classes.*class_indices\.json"):
        load_model(old)


def test_export_refuses_a_folder_holding_other_files(tmp_path):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"notes\.txt.*empty or new folder"):
        export(out, ["a", "b"])
    assert snapshot(out) == {"notes.txt": b"mine"}
