"""resume with a changed config: a change that would mix two runs is refused, naming the field and
why; more epochs (and settings that change nothing the run computes) are taken."""

import json
import re
from pathlib import Path

import pytest

from nbddp import ConfigError, TrainConfig, spawn_train
from nbddp.rank.engine import warmup_cosine_lambda
from nbddp.contract.fieldspec import RESUME_FREE, RESUME_MORE, spec_of, specs
from nbddp.tasks.classification import data_record
from nbddp.tasks.classification.planning import resume_changes
import conftest


def small_cfg(tree, runs_dir, **kw):
    """conftest's small run, one epoch long."""
    return conftest.small_cfg(tree, runs_dir, **{"epochs": 1, "name": "r", "check_images": False, "num_workers": 0,
                                                 **kw})


@pytest.fixture
def first_run(tree, runs_dir):
    cfg = small_cfg(tree, runs_dir)
    return cfg, spawn_train(cfg, echo=False)


def test_a_new_lr_or_seed_is_refused_naming_the_field_and_why(first_run):
    cfg, first = first_run
    with pytest.raises(ConfigError, match=r"(?s)cannot resume .*1 setting differs.*lr 0\.01 -> 0\.02: the optimizer"):
        spawn_train(cfg.replace(lr=0.02, resume=True), echo=False)
    with pytest.raises(ConfigError, match=r"(?s)seed 0 -> 1: the split into training and validation"):
        spawn_train(cfg.replace(seed=1, resume=True), echo=False)
    with pytest.raises(ConfigError) as info:  # every changed field at once, one per line
        spawn_train(cfg.replace(val_fraction=0.3, batch_size=2, epochs=3, resume=str(first.run_dir)), echo=False)
    text = str(info.value)
    assert "2 settings differ" in text and "val_fraction 0.2 -> 0.3" in text and "batch_size 4 -> 2" in text
    assert "epochs" not in text.split("\n", 1)[1].split("Set them back")[0]  # more epochs are taken
    # The refused launches left the run as it was.
    assert json.loads((first.run_dir / "config.json").read_text())["lr"] == 0.01


def test_a_resume_on_changed_images_is_refused_before_any_rank_starts_or_taken_when_allowed(first_run):
    """Images added to the class folders would deal the split afresh (validation images of the
    continued run trained on): refused in the kernel, naming the change per class and both ways
    on; allow_changed_data=True resumes, makes the split again and says what changed."""
    cfg, first = first_run
    record = json.loads((first.run_dir / "data.json").read_text())
    assert record["counts"] == {"a": 12, "b": 12, "c": 12} and len(record["files"]) == 36
    tree = Path(cfg.data_path)
    for i in range(2):
        (tree / "a" / f"extra{i}.png").write_bytes((tree / "a" / f"{i:03d}.png").read_bytes())
    (tree / "b" / "000.png").unlink()
    launches = sorted(first.run_dir.glob(".nbddp/launch.json"))
    before = [p.stat().st_mtime_ns for p in launches]
    with pytest.raises(ConfigError) as info:
        spawn_train(cfg.replace(epochs=2, resume=True), echo=False)
    text = str(info.value)
    assert "class 'a': 2 images added (12 -> 14)" in text and "class 'b': 1 image removed (12 -> 11)" in text
    assert "class 'c'" not in text and re.search(r"\d+ of the \d+ validation images were trained on", text)
    assert "resume=False" in text and "allow_changed_data=True" in text
    assert [p.stat().st_mtime_ns for p in launches] == before  # no rank started
    with pytest.warns(UserWarning, match=r"(?s)changed data.*class 'a': 2 images added.*split is made again"):
        resumed = spawn_train(cfg.replace(epochs=2, resume=True, allow_changed_data=True), echo=False)
    assert resumed.run_dir == first.run_dir
    assert json.loads((first.run_dir / "data.json").read_text())["counts"] == {"a": 14, "b": 11, "c": 12}


def test_a_missing_or_edited_data_record_is_refused_as_changed_data_or_taken_when_allowed(first_run):
    """data.json sits in the run folder, which a group member may write: an edited record (the same
    images, other bytes) and a deleted one cannot say whether the images changed, so the resume is
    refused as on changed data, never let through unchecked; allow_changed_data=True takes it."""
    cfg, first = first_run
    shown = first.run_dir / "data.json"
    shown.write_text(json.dumps(json.loads(shown.read_text()), indent=1))
    with pytest.raises(ConfigError, match=r"(?s)data.json was changed since the run wrote it.*resume=False.*"
                                          r"allow_changed_data=True"):
        spawn_train(cfg.replace(epochs=2, resume=True), echo=False)
    shown.unlink()
    with pytest.raises(ConfigError, match=r"(?s)data.json is missing, so nbddp cannot tell whether the images"):
        spawn_train(cfg.replace(epochs=2, resume=True), echo=False)
    with pytest.warns(UserWarning, match=r"data.json is missing, so what changed .* cannot be told"):
        resumed = spawn_train(cfg.replace(epochs=2, resume=True, allow_changed_data=True), echo=False)
    assert resumed.run_dir == first.run_dir
    assert data_record.read(first.run_dir) == (json.loads(shown.read_text()), None)  # written anew, with its digest


def test_fewer_epochs_are_taken_while_some_are_left_and_free_settings_pass(tree, runs_dir):
    cfg = small_cfg(tree, runs_dir)
    refused, taken = resume_changes({**cfg.to_dict(), "epochs": 3, "num_workers": 4, "name": "x"}, cfg, done=1)
    assert refused == [f"epochs 3 -> 1: {spec_of(TrainConfig.__dataclass_fields__['epochs']).resume_why}"]
    assert "no epoch would be left to train" in refused[0] and taken == []
    refused, taken = resume_changes({**cfg.to_dict(), "epochs": 3}, cfg.replace(epochs=2), done=1)
    assert refused == [] and taken == ["epochs 3 -> 2"]
    refused, taken = resume_changes({**cfg.to_dict(), "epochs": 0, "lr": 0.5, "optimizer": "sgd"}, cfg)
    assert taken == ["epochs 0 -> 1"] and [r.split(":")[0] for r in refused] == ["lr 0.5 -> 0.01"]


def test_more_epochs_rebuild_the_schedule_and_say_so(first_run):
    cfg, first = first_run
    more = cfg.replace(epochs=2, checkpoint_every_s=0.0, resume=True)  # and a setting that may change
    resumed = spawn_train(more, echo=False)
    assert resumed.run_dir == first.run_dir
    log = (resumed.run_dir / "logs" / "rank0.log").read_text()
    assert "epochs 1 -> 2: the learning-rate schedule was rebuilt for 2 epochs" in log
    epoch1 = [m for m in resumed.metrics if m.get("epoch") == 1][-1]
    base = cfg.lr * 2  # scale_lr with two processes
    assert epoch1["lr"] == pytest.approx(base * warmup_cosine_lambda(2, cfg.lrf)(1))
    assert json.loads((resumed.run_dir / "config.json").read_text())["epochs"] == 2


def test_every_field_declares_what_resume_does_with_a_change():
    rules = {f.name: s.resume for f, s in specs(TrainConfig)}
    assert rules["epochs"] == RESUME_MORE
    assert {n for n, r in rules.items() if r == RESUME_FREE} >= {"checkpoint_every_s", "num_workers", "name",
                                                                "runs_dir", "resume", "timeout_s"}
    assert {n for n, r in rules.items() if r not in (RESUME_FREE, RESUME_MORE)} >= {
        "data_path", "val_fraction", "seed", "model", "optimizer", "lr", "momentum", "weight_decay", "lrf",
        "warmup_epochs", "batch_size"}


def test_the_readme_table_says_what_resume_does_with_every_field():
    """The resume table (docs/builtin-worker.md) names each field once, in the row of its declared rule."""
    from conftest import ROOT

    text = (ROOT / "docs" / "builtin-worker.md").read_text()
    table = text[text.index("| a change of | resume | why |"):]
    table = table[:table.index("\n\n")]
    row_of = {}
    for row in table.splitlines()[2:]:
        names, rule = row.split("|")[1:3]
        for name in re.findall(r"`(\w+)`", names):
            assert name not in row_of, f"{name} is in two rows of the README's resume table"
            row_of[name] = rule.strip()
    expected = {RESUME_FREE: "taken", RESUME_MORE: "while epochs are left"}
    for f, s in specs(TrainConfig):
        assert f.name in row_of, f"README's resume table does not say what resume does with `{f.name}`"
        assert row_of[f.name] == expected.get(s.resume, "refused"), (f.name, row_of[f.name], s.resume)


def test_a_resume_takes_the_checkpoints_settings_over_a_planted_config_json(tmp_path):
    # config.json is a file of a (maybe shared) run folder: anyone who may write it can replace it. The
    # checkpoint's own copy, the user's alone, decides; the refusal never points at the planted values.
    from dataclasses import asdict

    from nbddp.tasks.classification.planning import _check_config_changes

    cfg = conftest.small_cfg(tmp_path / "data", tmp_path / "runs", epochs=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({**asdict(cfg), "lr": 0.5, "model": "planted"}))
    _check_config_changes(run_dir, {"config": asdict(cfg), "epoch": 0, "step": 0}, cfg)  # taken
    with pytest.raises(ConfigError, match=r"(?s)lr 0\.01 -> 0\.02.*as its checkpoint records them") as err:
        _check_config_changes(run_dir, {"config": asdict(cfg), "epoch": 0, "step": 0}, cfg.replace(lr=0.02))
    assert "planted" not in str(err.value) and "0.5" not in str(err.value)
