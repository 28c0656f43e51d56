"""ONNX export: a digits run (FSDP, 2 CPU ranks, TrainConfig(export_onnx=True)) writes model.onnx and
preprocessing.json beside its weights, checked with ONNX Runtime; the graph predicts what the model does,
takes any batch, and a recipe that does not match the model is caught. One run serves every test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import nbddp
from nbddp import ExportError, TrainConfig, WeightsError, spawn_train
from nbddp.contract import onnx as ox
from nbddp.contract.checkpoint import file_digest
from nbddp.kernel.export import export_onnx, load_val_predictions
from nbddp.kernel.inference import load_model, predict
from nbddp.tasks.classification.onnx_export import preprocess, recipe
from conftest import ROOT, launcher_env, make_tree

pytestmark = pytest.mark.skipif(bool(ox.missing_modules()), reason="needs the onnx extra: pip install 'nbddp[onnx]'")

DIGITS = ROOT / "data" / "digits"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One epoch of ResNet18 at 32 px on 60 digits of each class (3 steps a rank), sharded over 2 CPU ranks,
    exporting ONNX at its end: the export of an FSDP run is its consolidated weights, so this is the DDP run's
    path too. The held-out images the tests predict are 18 of each class."""
    runs = tmp_path_factory.mktemp("onnx_runs")
    digits = runs.parent / "digits60"
    for folder in sorted(DIGITS.iterdir()):
        (digits / folder.name).mkdir(parents=True)
        for image in sorted(folder.iterdir())[:60]:
            shutil.copyfile(image, digits / folder.name / image.name)
    cfg = TrainConfig(data_path=str(digits), model="resnet18", image_size=32, epochs=1, batch_size=64, lr=0.01,
                      val_fraction=0.3, crop_scale=0.5, hflip=False, nprocs=2, strategy="fsdp", checkpoint_every_s=0,
                      export_onnx=True, runs_dir=str(runs), name="onnx")
    result = spawn_train(cfg, echo=False)
    return result, result.run_dir / "export"


def _record(folder):
    return json.loads((folder / "preprocessing.json").read_text())


def _held_out(result, n=40):
    recs = load_val_predictions(result.run_dir)
    return [recs[round(i * (len(recs) - 1) / (n - 1))]["path"] for i in range(n)]


def test_a_sharded_digits_run_writes_a_checked_onnx_beside_its_weights(run):
    result, export = run
    assert sorted(p.name for p in export.iterdir()) == ["class_indices.json", "meta.json", "model.onnx", "model.pth",
                                                        "model.safetensors", "preprocessing.json"]
    rec = _record(export)
    assert rec["classes"] == [str(d) for d in range(10)] and rec["model"] == "resnet18"
    assert rec["preprocess"] == {"color": "RGB", "resize": 36, "interpolation": "bilinear", "crop": 32, "divide_by": 255,
                                 "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "channel_order": "RGB",
                                 "layout": "NCHW", "dtype": "float32"}
    assert rec["input"] == {"name": "input", "shape": ["batch", 3, 32, 32], "dtype": "float32"}
    assert rec["output"]["shape"] == ["batch", 10]
    assert rec["export"]["exporter"] == "dynamo" and rec["export"]["dynamo_failure"] is None
    assert rec["check"]["passed"] and rec["check"]["top1_equal"] and rec["check"]["images"] == 16
    assert rec["check"]["on"] == "held-out images" and rec["check"]["max_abs_diff"] <= ox.ATOL
    assert rec["files"] == {"model.onnx": file_digest(export / "model.onnx")}
    assert rec["weights"] == {"file": "model.safetensors", "sha256": file_digest(export / "model.safetensors")}
    log = (result.run_dir / "logs" / "rank0.log").read_text()
    assert "ONNX: " in log and "ONNX Runtime agrees with PyTorch on 16 held-out images" in log


def test_onnx_runtime_labels_on_held_out_images_equal_predicts(run):
    result, export = run
    images = _held_out(result)
    model, _ = load_model(result.run_dir)
    in_torch = predict(model, images)
    in_onnx = nbddp.predict(export / "model.onnx", images)
    assert [p.label for p in in_onnx] == [p.label for p in in_torch]
    assert max(abs(a.probability - b.probability) for a, b in zip(in_onnx, in_torch)) < 1e-4
    assert nbddp.predict(str(export / "model.onnx"), images[0])[0].label == in_torch[0].label  # one image, a str path


def test_a_dynamic_batch_of_1_and_of_7_both_run(run):
    result, export = run
    steps = _record(export)["preprocess"]
    from nbddp.tasks.classification.images import load_rgb

    batch = np.stack([preprocess(load_rgb(p), steps) for p in _held_out(result, 7)])
    sess = ox.session(export / "model.onnx")
    one, seven = sess.run(None, {"input": batch[:1]})[0], sess.run(None, {"input": batch})[0]
    assert one.shape == (1, 10) and seven.shape == (7, 10)
    np.testing.assert_allclose(one[0], seven[0], atol=1e-5)


def test_a_mismatched_preprocessing_is_caught_and_the_files_kept(run, tmp_path):
    result, _ = run
    out = tmp_path / "served"
    with pytest.raises(ExportError, match=r"does not predict what the model predicts.*largest difference is "
                                          r"[0-9.e-]+ on image \d+, class \d \(ONNX Runtime .*PyTorch .*tolerance"):
        export_onnx(result.run_dir, out, preprocessing={"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]})
    rec = _record(out)
    assert (out / "model.onnx").is_file() and rec["check"]["passed"] is False and rec["check"]["max_abs_diff"] > ox.ATOL
    assert rec["preprocess"]["mean"] == [0.5, 0.5, 0.5]
    with pytest.raises(WeightsError, match="failed its check at export"):
        predict(out / "model.onnx", _held_out(result, 2))


def test_python_m_nbddp_export_onnx_of_one_image_at_a_time(run, tmp_path, capsys):
    from nbddp.cli import main

    result, _ = run
    out_dir = tmp_path / "cli"
    assert main(["export", str(result.run_dir), "--onnx", "--fixed-batch", "--which", "best", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert f"onnx: {out_dir / 'model.onnx'}" in out and "ONNX Runtime agrees with PyTorch on 16 held-out images" in out
    rec = _record(out_dir)  # the held-out images were found through meta.json's checkpoint
    assert rec["check"]["passed"] and rec["input"]["shape"] == [1, 3, 32, 32]
    images = _held_out(result, 5)  # a graph of one image: predict feeds it one at a time
    assert [p.label for p in predict(out_dir / "model.onnx", images)] == [p.label for p in predict(run[1] / "model.onnx", images)]


def test_preprocessing_json_that_does_not_describe_the_graph_is_refused(run, tmp_path):
    result, export = run
    folder = tmp_path / "copy"
    shutil.copytree(export, folder)
    image = _held_out(result, 2)[:1]
    rec = _record(folder)
    (folder / "preprocessing.json").write_text(json.dumps(dict(rec, preprocess=dict(rec["preprocess"], mean=[0.5]))))
    with pytest.raises(WeightsError, match=r"mean=\[0.5\] must be three numbers"):
        predict(folder / "model.onnx", image)
    (folder / "preprocessing.json").write_text(json.dumps(dict(rec, files={"model.onnx": "0" * 64})))
    with pytest.raises(WeightsError, match="come from different exports"):
        predict(folder / "model.onnx", image)
    (folder / "preprocessing.json").unlink()
    with pytest.raises(WeightsError, match="has no preprocessing.json beside it"):
        predict(folder / "model.onnx", image)


def test_preprocess_is_the_training_transform(tmp_path):
    from PIL import Image

    from nbddp.tasks.classification.data import build_transforms

    rng = np.random.default_rng(0)
    for size, (w, h), mode in ((32, (17, 40), "RGB"), (32, (64, 64), "L"), (224, (500, 333), "RGB"),
                               (64, (73, 73), "RGBA")):
        image = Image.fromarray(rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8).squeeze(), mode)
        want = build_transforms(size)[1](image.convert("RGB")).numpy()
        np.testing.assert_allclose(preprocess(image.convert("RGB"), recipe(size)), want, atol=1e-6)


def test_a_module_exports_and_what_no_exporter_takes_is_one_paragraph(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    path = export_onnx(net, tmp_path / "net.onnx", example_input=torch.randn(1, 4))
    x = torch.randn(5, 4)
    np.testing.assert_allclose(ox.run(ox.session(path), x.numpy()), net(x).detach().numpy(), atol=1e-5)

    class Eig(torch.nn.Module):  # no ONNX operator, in either exporter
        def forward(self, x):
            return torch.linalg.eig(x[:, :2, None].expand(-1, 2, 2))[0].real

    with pytest.raises(ExportError) as err:
        export_onnx(Eig(), tmp_path / "eig.onnx", example_input=torch.randn(2, 4))
    text = str(err.value)
    assert "\n" not in text and len(text) < 1200, text
    assert "dynamo exporter" in text and "legacy TorchScript exporter failed too" in text and "linalg_eig" in text
    with pytest.raises(nbddp.ConfigError, match="pass example_input="):
        export_onnx(net, tmp_path / "x.onnx")


def test_the_legacy_exporter_only_where_dynamo_fails_and_said(tmp_path):
    class Branchy(torch.nn.Module):  # data-dependent control flow: torch.export refuses it, a trace takes it
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            if x.sum() > -1e9:
                return self.fc(x)
            return -self.fc(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = export_onnx(Branchy(), tmp_path / "b.onnx", example_input=torch.randn(2, 4))
    said = [str(w.message) for w in caught if "legacy TorchScript exporter" in str(w.message)]
    assert said and "because the dynamo exporter failed" in said[0] and "x.sum()" in said[0], said
    assert path.is_file()


def test_without_the_extra_one_error_names_the_pip_command(tmp_path):
    tree = make_tree(tmp_path / "data")
    code = f"""
import sys
for name in ("onnx", "onnxscript", "onnxruntime"):
    sys.modules[name] = None  # as if not installed: import fails, find_spec answers None
import torch, nbddp
from nbddp.tasks.classification.planning import preflight
for call in (lambda: nbddp.export_onnx(torch.nn.Linear(2, 2), "m.onnx", example_input=torch.ones(2, 2)),
             lambda: nbddp.predict("model.onnx", []),
             lambda: preflight(nbddp.TrainConfig(data_path={str(tree)!r}, model="resnet18", image_size=32,
                                                 nprocs=2, batch_size=4, runs_dir="runs", export_onnx=True))):
    try:
        call()
    except nbddp.NbddpError as exc:
        print(type(exc).__name__, exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=launcher_env())
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    assert all("pip install 'nbddp[onnx]'" in line for line in lines), lines
    assert lines[0].startswith("ExportError nbddp.export_onnx needs onnx and onnxscript, not installed")
    assert lines[1].startswith("ExportError nbddp.predict on an ONNX file needs onnxruntime")
    assert lines[2].startswith("ConfigError TrainConfig.export_onnx=True needs")
    assert not (tmp_path / "m.onnx").exists()


def test_the_panel_offers_the_export_once_a_run_exported_weights(run, monkeypatch):
    import nbddp.kernel.export as kexport
    from nbddp.ui.run_view import RunView

    result, export = run
    view = RunView(False, lambda: None, (1, None))
    assert view.export_button.disabled and view.export_button in view.parts[0].children
    assert view.export_button not in RunView(True, lambda: None, (1, None)).parts[0].children  # a worker: no export
    calls = []
    monkeypatch.setattr(kexport, "export_onnx", lambda run_dir: calls.append(run_dir) or export / "model.onnx")
    view.result = result
    view.set_busy(False)
    assert not view.export_button.disabled
    view.export_button.click()
    assert calls == [result.run_dir] and "model.onnx" in view.export_note.value and "checked" in view.export_note.value

    def refuse(run_dir):
        raise ExportError("cannot export ResNet to ONNX: because")

    monkeypatch.setattr(kexport, "export_onnx", refuse)
    view.export_button.click()
    assert "ONNX export failed" in view.export_note.value and "because" in view.export_note.value
    assert not view.export_button.disabled


def test_the_comparison_names_the_largest_difference_and_takes_a_tie_for_a_tie():
    torch_logits = np.array([[1.0, 2.0, 3.0], [0.0, 5.0, 1.0]])
    assert ox.compare(torch_logits + 1e-4, torch_logits)[0]
    flipped = torch_logits.copy()
    flipped[0] = [3.1, 2.0, 3.0]
    passed, what, largest, top1 = ox.compare(flipped, torch_logits, ["zero", "one", "two"])
    assert not passed and not top1 and largest == pytest.approx(2.1)
    assert what.startswith("the largest difference is 2.1 on image 0, class zero (ONNX Runtime 3.1, PyTorch 1;")
    assert "the top-1 label differs on 1 of 2 images (image 0: ONNX Runtime zero, PyTorch two)" in what
    # PyTorch's two best within the tolerance of each other: either label is right.
    assert ox.compare(np.array([[1.0, 3.0004, 3.0003]]), np.array([[1.0, 3.0, 3.0005]]))[0]
