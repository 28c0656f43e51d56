"""nbddp.contract.checkpoint: atomic writes, weights-only loads, exports (single process, CPU)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import load_file, save_file

from nbddp.contract.checkpoint import (
    atomic_save,
    cleanup_temp_files,
    export_weights,
    file_digest,
    load_checkpoint,
    load_state_dict_file,
    to_plain,
)
from nbddp.contract.config import TrainConfig
from nbddp.contract.errors import WeightsError

REPO = Path(__file__).resolve().parents[1]


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------- atomic_save
def test_atomic_save_keeps_old_file_when_torch_save_fails(tmp_path, monkeypatch):
    ckpt = tmp_path / "last.pt"
    atomic_save({"epoch": 1}, ckpt)

    def half_written_save(obj, f):
        f.write(b"PK\x03\x04 half a zip archive")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_written_save)
    with pytest.raises(OSError, match="No space left"):
        atomic_save({"epoch": 2}, ckpt)
    monkeypatch.undo()

    assert load_checkpoint(ckpt) == {"epoch": 1}
    assert _files(tmp_path) == ["last.pt"]  # the temp file is gone


def test_atomic_save_keeps_old_file_when_pickling_fails(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    ckpt = tmp_path / "last.pt"
    atomic_save({"w": torch.ones(3)}, ckpt)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_save({"w": torch.zeros(3), "bad": Unpicklable()}, ckpt)
    assert torch.equal(load_checkpoint(ckpt)["w"], torch.ones(3))
    assert _files(tmp_path) == ["last.pt"]


def test_crash_between_write_and_rename_leaves_old_file_and_cleanable_temp(tmp_path):
    ckpt = tmp_path / "last.pt"
    atomic_save({"epoch": 1}, ckpt)
    # A real crash: a child process dies (os._exit, no cleanup handlers) right before the rename.
    script = textwrap.dedent(
        f"""
        import os, torch
        from nbddp.contract.checkpoint import atomic_save
        os.replace = lambda *a, **k: os._exit(3)
        atomic_save({{"epoch": 2}}, {str(ckpt)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr

    temps = [p for p in tmp_path.iterdir() if p.name != "last.pt"]
    assert len(temps) == 1 and temps[0].name.startswith(".last.pt.tmp-")
    assert torch.load(temps[0], weights_only=True) == {"epoch": 2}  # fully written, never renamed
    assert load_checkpoint(ckpt) == {"epoch": 1}

    assert cleanup_temp_files(tmp_path) == temps
    assert _files(tmp_path) == ["last.pt"]


def test_cleanup_keeps_temp_files_of_live_writers(tmp_path):
    (tmp_path / "export").mkdir()
    live = tmp_path / f".last.pt.tmp-{os.getpid()}-abcd"  # this process: maybe mid-write
    dead = tmp_path / "export" / ".model.pth.tmp-999999999-abcd"  # no such pid
    for p in (live, dead):
        p.write_bytes(b"x")
    assert cleanup_temp_files(tmp_path) == [dead]
    assert live.exists() and not dead.exists()
    assert cleanup_temp_files(tmp_path / "missing") == []


# ---------------------------------------------------------------------------- load_checkpoint
def test_truncated_checkpoint_raises_weights_error_naming_path(tmp_path):
    good = tmp_path / "good.pt"
    atomic_save({"w": torch.randn(1000)}, good)
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(WeightsError, match="truncated or corrupt") as info:
        load_checkpoint(bad)
    assert str(bad) in str(info.value)

    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(WeightsError, match="empty.pt"):
        load_checkpoint(empty)


def test_missing_checkpoint_raises_weights_error(tmp_path):
    with pytest.raises(WeightsError, match="not found") as info:
        load_checkpoint(tmp_path / "nope.pt")
    assert str(tmp_path / "nope.pt") in str(info.value)


def test_malicious_pickle_is_refused_and_never_executed(tmp_path):
    pwned = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    evil = tmp_path / "evil.pth"
    torch.save({"model": {"fc.weight": torch.ones(1)}, "x": Exploit()}, evil)

    with pytest.raises(WeightsError, match="not weights-only safe") as info:
        load_checkpoint(evil)
    assert str(evil) in str(info.value) and "system" in str(info.value)
    with pytest.raises(WeightsError, match="not weights-only safe"):
        load_state_dict_file(evil)
    assert not pwned.exists()


# ---------------------------------------------------------------------------- to_plain
def test_to_plain_makes_weights_only_loadable_values(tmp_path):
    rng = np.random.get_state()
    obj = {
        "path": Path("runs/a"),
        "np": (np.float64(0.5), np.int64(3), np.bool_(True), np.str_("x")),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "strings": np.array(["a", "b"]),
        "ns": argparse.Namespace(lr=0.1, out=Path("/tmp/x")),
        "config": TrainConfig(data_path=Path("data/x"), gpus=(0, 1)),
        "set": {3, 1, 2},
        "numpy_rng": rng,
        "t": torch.arange(3),
    }
    plain = to_plain(obj)
    assert plain["path"] == "runs/a" and type(plain["path"]) is str
    assert plain["np"] == (0.5, 3, True, "x") and [type(v) for v in plain["np"]] == [float, int, bool, str]
    assert torch.equal(plain["array"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert plain["strings"] == ["a", "b"]
    assert plain["ns"] == {"lr": 0.1, "out": "/tmp/x"}
    assert plain["config"]["data_path"] == "data/x" and plain["config"]["gpus"] == (0, 1)
    assert plain["set"] == [1, 2, 3]

    atomic_save(plain, tmp_path / "state.pt")
    back = load_checkpoint(tmp_path / "state.pt")  # weights_only=True succeeds
    assert back["np"] == (0.5, 3, True, "x")
    np.random.set_state(back["numpy_rng"])  # the saved RNG state restores the same stream
    restored = np.random.rand(3)
    np.random.set_state(rng)
    assert np.array_equal(restored, np.random.rand(3))


def test_to_plain_names_what_it_cannot_convert():
    with pytest.raises(TypeError, match=r"obj\['cfg'\]\[1\] is a .*object"):
        to_plain({"cfg": [1, object()]})


# ---------------------------------------------------------------------------- state dicts & export
def test_export_weights_writes_loadable_files(tmp_path):
    torch.manual_seed(0)
    trained = torchvision.models.resnet18(num_classes=3)
    ddp_style = {f"module.{k}": v for k, v in trained.state_dict().items()}
    classes = {"cat": 0, "dog": 1, "bird": 2}  # ImageFolder's class_to_idx

    paths = export_weights(ddp_style, tmp_path / "export", classes, extra={"model": "resnet18", "image_size": 64})

    assert set(paths) == {"pth", "safetensors", "class_indices", "meta"}
    assert _files(tmp_path / "export") == ["class_indices.json", "meta.json", "model.pth", "model.safetensors"]
    sd = torch.load(paths["pth"], weights_only=True)
    assert not any(k.startswith("module.") for k in sd)
    fresh = torchvision.models.resnet18(num_classes=3)
    fresh.load_state_dict(sd, strict=True)
    for k, v in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    st = load_file(str(paths["safetensors"]))
    assert st.keys() == sd.keys() and all(torch.equal(st[k], sd[k]) for k in sd)
    assert json.loads(paths["class_indices"].read_text()) == {"0": "cat", "1": "dog", "2": "bird"}
    meta = json.loads(paths["meta"].read_text())
    files = meta.pop("files")  # what load_model checks: the SHA-256 of every other file
    assert meta == {"model": "resnet18", "image_size": 64, "num_classes": 3}
    assert files == {k: file_digest(v) for k, v in [(p.name, p) for key, p in paths.items() if key != "meta"]}


def test_export_handles_shared_and_strided_tensors(tmp_path):
    base = torch.randn(4, 4)
    sd = {"a.weight": base, "b.weight": base, "c.weight": base.t()}  # tied and transposed
    paths = export_weights(sd, tmp_path, ["x", "y"])
    assert "meta" not in paths
    st = load_file(str(paths["safetensors"]))
    assert torch.equal(st["c.weight"], base.t()) and torch.equal(st["b.weight"], base)


def test_load_state_dict_file_accepts_every_layout(tmp_path):
    sd = {"fc.weight": torch.randn(2, 3), "fc.bias": torch.randn(2)}
    atomic_save({f"_orig_mod.module.{k}": v for k, v in sd.items()}, tmp_path / "wrapped.pth")
    atomic_save({"model": {f"module.{k}": v for k, v in sd.items()}, "epoch": 4}, tmp_path / "last.pt")
    save_file(sd, str(tmp_path / "plain.safetensors"))
    export_weights(sd, tmp_path / "run" / "export", ["a", "b"])

    for source in ("wrapped.pth", "last.pt", "plain.safetensors", "run", "run/export"):
        got = load_state_dict_file(tmp_path / source)
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd), source

    (tmp_path / "empty_run").mkdir()
    with pytest.raises(WeightsError, match="export/model.safetensors"):
        load_state_dict_file(tmp_path / "empty_run")
    atomic_save({"epoch": 3, "lr": 0.1}, tmp_path / "not_weights.pt")
    with pytest.raises(WeightsError, match="not a model state_dict"):
        load_state_dict_file(tmp_path / "not_weights.pt")


def test_a_background_save_writes_a_snapshot_and_reports_its_error_later(tmp_path):
    from nbddp.contract.checkpoint import BackgroundSaver

    saver, path = BackgroundSaver(), tmp_path / "last.pt"
    w = torch.zeros(1000)
    done = []
    saver.save({"w": w, "history": [1.0], "rng": (3, (1, 2))}, path, then=done.append)
    w += 1.0  # the optimizer's next in-place step: not in the file being written
    saver.wait()
    assert load_checkpoint(path)["w"].sum() == 0 and len(done) == 1 and not saver.writing

    def full(obj, p):
        raise OSError(28, "No space left on device", str(p))

    saver.save({"w": w}, path, write=full)
    with pytest.raises(OSError, match="No space left"):
        saver.save({"w": w}, path)  # the next checkpoint reports the last one's failure, before writing
    saver.wait()  # reported once
    assert load_checkpoint(path)["w"].sum() == 0, "the failed write left the previous checkpoint"


def test_a_save_in_the_callers_thread_is_on_disk_at_once_and_reports_its_error_as_a_background_one(tmp_path):
    from nbddp.contract.checkpoint import BackgroundSaver

    saver, path = BackgroundSaver(background=False), tmp_path / "last.pt"
    done = []
    saver.save({"w": torch.zeros(10)}, path, then=done.append)
    assert load_checkpoint(path)["w"].sum() == 0 and len(done) == 1 and not saver.writing  # no wait needed

    def full(obj, p):
        raise OSError(28, "No space left on device", str(p))

    saver.save({"w": torch.ones(10)}, path, write=full)  # as in the background: raised by the next save or wait
    with pytest.raises(OSError, match="No space left"):
        saver.wait()
    saver.wait()  # reported once
    assert load_checkpoint(path)["w"].sum() == 0, "the failed write left the previous checkpoint"


def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    """A process killed while its writer thread is inside torch.save: the old file loads, the temp file is cleanable."""
    path = tmp_path / "last.pt"
    code = textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from nbddp.contract.checkpoint import BackgroundSaver, atomic_save
        atomic_save({{"step": 1, "w": torch.ones(3)}}, {str(path)!r})
        def slow_save(obj, f, *a, **k):
            f.write(b"partial")
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
        torch.save = slow_save
        BackgroundSaver().save({{"step": 2, "w": torch.zeros(3)}}, {str(path)!r})
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait()
    assert load_checkpoint(path)["step"] == 1
    assert cleanup_temp_files(tmp_path) and not [p for p in tmp_path.iterdir() if p.name != "last.pt"]
