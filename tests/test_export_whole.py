"""An export folder is whole or absent, and load_model refuses files that do not belong together."""

import errno
import json
import shutil

import pytest
import safetensors.torch
import torch

from nbddp import ConfigError, WeightsError
from nbddp.checkpoint import export_weights
from nbddp.inference import load_model
from nbddp.models import build_model

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
