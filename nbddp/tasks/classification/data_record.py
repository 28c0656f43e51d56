"""What data a built-in run was made from, and a resume that refuses other data.

Rank 0 writes ``data.json`` in the run folder when it has read the class folders: the images
(paths relative to ``data_path``, each with its class), a digest of that list, and the split
(train and validation images per class). A resume compares the class folders now with it in
the kernel, before any rank starts: images added to or removed from a class change the split
(:func:`nbddp.tasks.classification.data.split_samples` deals the images afresh), so validation images of the
continued run may have been trained on. Such a resume is refused, naming the change per class;
``TrainConfig.allow_changed_data=True`` takes it, makes the split again from the images now and
says what that did.

``data.json`` sits in the run folder, which others may write on a shared server; the digest of its
bytes is kept in the run's private state (``.nbddp/data-record.json``, written by the launch that
wrote the record). A record that is missing, that no longer matches that digest, or that has none
(its last launch ended before it read the data, a run from before the digest) cannot say whether
the images changed: the resume is refused as on changed data, never let through unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import data as D
from ...contract import rundir
from ...contract.errors import ConfigError

#: The record's file name in the run folder, and that of its digest in the run's private state.
DATA_RECORD, DATA_DIGEST = "data.json", "data-record.json"


def _relative(root: str, samples: Sequence[D.Sample]) -> List[Tuple[str, int]]:
    return [(os.path.relpath(path, root), label) for path, label in samples]


def _digest(files: Sequence[Tuple[str, int]]) -> str:
    return hashlib.sha256("\n".join(f"{label}\t{rel}" for rel, label in files).encode()).hexdigest()


def describe(root: str, classes: Sequence[str], samples: Sequence[D.Sample], val_fraction: float,
             seed: int) -> dict:
    """The record of ``samples`` (from :func:`nbddp.tasks.classification.data.scan_class_folders`) and their split."""
    train, val = D.split_samples(samples, val_fraction, seed)

    def per_class(items) -> Dict[str, int]:
        c = Counter(label for _, label in items)
        return {name: c.get(i, 0) for i, name in enumerate(classes)}

    files = _relative(root, samples)
    return {"classes": list(classes), "digest": _digest(files), "val_fraction": val_fraction, "seed": seed,
            "counts": per_class(samples), "train_counts": per_class(train), "val_counts": per_class(val),
            "files": [[rel, label] for rel, label in files]}


def write(run_dir: Path, record: dict) -> Path:
    """Write ``record`` as the run's ``data.json`` (rank 0, once it has read the class folders), and
    the digest of its bytes in the run's private state."""
    text = json.dumps(record) + "\n"
    path = rundir.atomic_write_text(Path(run_dir) / DATA_RECORD, text)
    # Not fsynced (20 ms on rank 0's start): one lost to a power cut makes the next resume ask for
    # allow_changed_data=True, as an unchecked record does.
    rundir.write_json_atomic(rundir.state_path(run_dir, DATA_DIGEST),
                             {"sha256": hashlib.sha256(text.encode()).hexdigest()}, mode=0o600)
    return path


def read(run_dir: Path) -> Tuple[Optional[dict], Optional[str]]:
    """``(record, None)``: the run's ``data.json``, as rank 0 wrote it; else ``(None, what is wrong)``."""
    path = Path(run_dir) / DATA_RECORD
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "is missing"
    except OSError as exc:
        return None, f"cannot be read ({exc})"
    try:
        kept = json.loads(rundir.read_private(rundir.state_path(run_dir, DATA_DIGEST))).get("sha256")
    except (OSError, ValueError, AttributeError):  # NotPrivate included
        kept = None
    if kept is None:
        return None, ("has no digest in the run's private state (its last launch ended before it read the data, "
                      "or the run is from before nbddp kept one)")
    if hashlib.sha256(data).hexdigest() != kept:
        return None, "was changed since the run wrote it"
    try:
        record = json.loads(data)
    except ValueError as exc:
        return None, f"cannot be read ({exc})"
    if not isinstance(record, dict) or not isinstance(record.get("files"), list):
        return None, "is not a data record"
    return record, None


def _changes(was: dict, now: dict) -> List[str]:
    """``"class 'a': 2 images added, 1 removed"`` for every class whose images differ."""
    old: Dict[int, set] = {}
    for rel, label in was.get("files", []):
        old.setdefault(label, set()).add(rel)
    new: Dict[int, set] = {}
    for rel, label in now["files"]:
        new.setdefault(label, set()).add(rel)
    lines = []
    for i, name in enumerate(now["classes"]):
        added, removed = len(new.get(i, set()) - old.get(i, set())), len(old.get(i, set()) - new.get(i, set()))
        parts = [f"{n} image{'s' if n != 1 else ''} {how}" for n, how in ((added, "added"), (removed, "removed")) if n]
        if parts:
            lines.append(f"class {name!r}: {', '.join(parts)} ({was['counts'].get(name, 0)} -> {now['counts'][name]})")
    return lines


def _split_effect(root: str, was: dict, now: dict) -> str:
    """How the split moves: sizes then and now, and how many validation images now were trained on."""
    old_samples = sorted((os.path.join(root, rel), label) for rel, label in was.get("files", []))
    old_train, _ = D.split_samples(old_samples, was["val_fraction"], was["seed"])
    trained = {path for path, _ in old_train}
    new_samples = sorted((os.path.join(root, rel), label) for rel, label in now["files"])
    _, new_val = D.split_samples(new_samples, now["val_fraction"], now["seed"])
    seen = sum(1 for path, _ in new_val if path in trained)
    n_train, n_val = (sum(was[k].values()) for k in ("train_counts", "val_counts"))
    m_train, m_val = (sum(now[k].values()) for k in ("train_counts", "val_counts"))
    return (f"the split goes from {n_train} train / {n_val} validation images to {m_train} / {m_val}, and "
            f"{seen} of the {m_val} validation images were trained on")


def check_resume(run_dir: Path, root: str, classes: Sequence[str], samples: Sequence[D.Sample],
                 val_fraction: float, seed: int, allow_changed: bool) -> None:
    """Refuse (or, with ``allow_changed``, take and say) a resume of ``run_dir`` on other images.

    Raises:
        ConfigError: the class folders hold other images than the run was made from, naming the
            change per class, what it does to the split, and the two ways on; or the run's record
            is missing, changed or unchecked, so no comparison can be made (see the module).
    """
    was, wrong = read(run_dir)
    if was is None:
        _unknown(run_dir, root, wrong, allow_changed)
        return
    now = describe(root, classes, samples, val_fraction, seed)
    if now["digest"] == was.get("digest"):
        return
    listing = "\n".join(f"  {line}" for line in _changes(was, now)) or "  the same counts, other files"
    effect = _split_effect(root, was, now)
    if allow_changed:
        warnings.warn(f"resuming {run_dir} on changed data (allow_changed_data=True):\n{listing}\nThe split is made "
                      f"again from the images now: {effect}.", stacklevel=3)
        return
    raise ConfigError(
        f"cannot resume {run_dir}: the images in {root} changed since the run was made:\n{listing}\n"
        f"Resumed, {effect}, so its accuracy would not be measured on unseen images. Start a new run "
        "(resume=False), or continue on the new images with allow_changed_data=True (the split is made again "
        "and the run says what changed).")


def _unknown(run_dir: Path, root: str, wrong: str, allow_changed: bool) -> None:
    """No record to compare with: taken as changed data (refused, or with ``allow_changed`` said)."""
    record = Path(run_dir) / DATA_RECORD
    if allow_changed:
        warnings.warn(f"resuming {run_dir} with allow_changed_data=True: its data record {record} {wrong}, so what "
                      f"changed in {root} cannot be told; the split is made again from the images now.", stacklevel=4)
        return
    raise ConfigError(
        f"cannot resume {run_dir}: its data record {record} {wrong}, so nbddp cannot tell whether the images in "
        f"{root} changed since the run was made (a changed split would validate on images it trained on). Start a "
        "new run (resume=False), or continue with allow_changed_data=True (the split is made again from the images "
        "now: the same split if they did not change).")
