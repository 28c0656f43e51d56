"""The built-in classification task's plan, run in the kernel before any process starts.

``plan(cfg)`` checks every input it can (data, weights, sizes, the run to resume) through
:func:`preflight` and returns the ``LaunchPlan`` whose target is :mod:`.worker`'s ``train``.
It reads the task's data and model code (shared by both sides) and the contract, never a
rank's runtime.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from . import data as D
from . import data_record
from ...contract import rundir
from ...contract.checkpoint import load_checkpoint
from ...contract.config import TrainConfig, read_config_file
from ...contract.errors import ConfigError, DataError
from ...contract.fieldspec import RESUME_FREE, RESUME_MORE, specs
from .models import build_model, check_weights_file
from ...contract.plans import LaunchPlan, run_to_resume

# ------------------------------------------------------------------------------ kernel side
TARGET = "nbddp.tasks.classification.worker:train"


def plan(cfg: TrainConfig) -> LaunchPlan:
    """What the launcher runs for ``cfg``, after :func:`preflight` checked every input.

    A config's ``nprocs`` counts CPU processes: with GPUs, the world is one process per GPU.
    """
    planned = time.time()
    run_dir = preflight(cfg)  # data, weights, batch vs world size; resume folder if any
    gpus = tuple(cfg.gpus)
    # The worker reports the launch's fixed costs (.startup): the kernel's share starts here.
    return LaunchPlan(target=TARGET, args=(cfg,), gpus=gpus, nprocs=None if gpus else cfg.nprocs,
                      name=cfg.name, runs_dir=str(cfg.runs_dir), timeout_s=cfg.timeout_s, run_dir=run_dir,
                      config=cfg, kwargs={"planned": {"planned": planned, "checked": time.time()}})


def preflight(cfg: TrainConfig) -> Optional[Path]:
    """Check everything that can be checked before a process starts.

    Returns:
        The run folder to continue when ``cfg.resume`` is set, else ``None`` (a new run).

    Raises:
        DataError / ConfigError / WeightsError naming the problem and its fix.
    """
    classes, samples = D.scan_class_folders(cfg.data_path)
    if cfg.num_classes is not None and cfg.num_classes != len(classes):
        raise ConfigError(
            f"TrainConfig.num_classes={cfg.num_classes} but {cfg.data_path} has {len(classes)} class "
            f"folders ({', '.join(classes[:12])}{'...' if len(classes) > 12 else ''}). Set num_classes=None "
            "to use the folders, or point data_path at the right folder.")
    D.check_class_names(cfg.data_path, classes)
    train, val = D.split_samples(samples, cfg.val_fraction, cfg.seed)
    D.check_val_split(cfg.data_path, len(val), len(classes))
    D.check_batch_fits(len(train), cfg.world_size, cfg.batch_size)
    if cfg.check_images:
        bad = D.check_images([p for p, _ in samples])
        if bad:
            listing = "\n".join(f"  {p}: {e}" for p, e in bad)
            raise DataError(f"{len(bad)} image(s) in {cfg.data_path} cannot be read; delete or replace them:\n{listing}")
    if cfg.data_pipeline == "tensor":
        _check_cache_fits(cfg, len(samples))
    if cfg.weights:
        check_weights_file(cfg.weights, cfg.model, len(classes))
    else:
        from .models import classification_model_names

        if cfg.model not in classification_model_names():
            build_model(cfg.model, len(classes))  # raises ConfigError with close matches
    _check_batch_norm_batch(cfg, len(classes))
    _check_writable(Path(cfg.runs_dir))
    if cfg.export_onnx:
        _check_onnx_extra()
    if not cfg.resume:
        return None
    run_dir = find_resume_dir(cfg, classes)
    data_record.check_resume(run_dir, str(cfg.data_path), classes, samples, cfg.val_fraction, cfg.seed,
                             cfg.allow_changed_data)
    return run_dir


def _check_onnx_extra() -> None:
    """``export_onnx=True`` without the packages it needs is refused now, not after the training."""
    from ...contract import onnx as ox

    missing = ox.missing_modules()
    if missing:
        raise ConfigError(f"TrainConfig.export_onnx=True needs {' and '.join(missing)}, not installed in this "
                          f"Python. Install the extra with:  {ox.EXTRA}  (or set export_onnx=False and export "
                          "later with nbddp.export_onnx(run_dir))")


def _check_batch_norm_batch(cfg: TrainConfig, num_classes: int) -> None:
    """Refuse ``batch_size=1`` where a BatchNorm layer in training would see one value per channel.

    BatchNorm in training mode normalises each channel over the batch and the feature map; with
    one image and a 1x1 map (a ResNet's last stage at a small ``image_size``) that is a single
    value and the worker fails with "Expected more than 1 value per channel". The model is run
    on the meta device, which computes shapes only, to find the smallest count. (The training
    loaders drop the last partial batch, so only ``batch_size=1`` can give a one-image batch.)
    """
    if cfg.batch_size > 1 or cfg.freeze_layers or (cfg.sync_bn and cfg.world_size > 1):
        return  # frozen BatchNorm runs in eval mode; synchronised BatchNorm counts every rank's batch
    from torch.nn.modules.batchnorm import _BatchNorm

    try:
        with torch.device("meta"):
            model = build_model(cfg.model, num_classes)
    except Exception:  # noqa: BLE001 - the worker builds it again and reports any failure there
        return
    counts: list = []

    def count(module, inputs):
        x = inputs[0]
        counts.append((x.numel() // x.shape[1], name_of[module]))

    name_of = {m: n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    hooks = [m.register_forward_pre_hook(count) for m in name_of]
    try:
        with torch.no_grad():
            model.train()(torch.empty(1, 3, cfg.image_size, cfg.image_size, device="meta"))
    except Exception:  # noqa: BLE001 - a model the meta device cannot run: nothing to conclude
        pass
    finally:
        for h in hooks:
            h.remove()
    single = [name for n, name in counts if n <= 1]
    if single:
        raise ConfigError(
            f"TrainConfig.batch_size=1: {cfg.model} has BatchNorm layers, and at image_size={cfg.image_size} one "
            f"image gives {single[0]!r}{f' and {len(single) - 1} more' if len(single) > 1 else ''} a single value "
            "per channel to normalise, which fails in training. Use batch_size >= 2, a larger image_size, or "
            "freeze_layers=True (frozen BatchNorm keeps its statistics).")


def _available_memory() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_cache_fits(cfg: TrainConfig, n_images: int) -> None:
    """The tensor pipeline decodes every image into host memory on every rank, then keeps it on each rank's device."""
    from .tensor_data import cache_bytes

    per_rank = cache_bytes(n_images, cfg.image_size)
    need = per_rank * cfg.world_size
    free = _available_memory()
    if free is not None and need > free // 2:
        raise ConfigError(
            f"TrainConfig.data_pipeline='tensor' would keep {need / 2**30:.1f} GiB of decoded images "
            f"({n_images} images at {cfg.image_size} px, on each of {cfg.world_size} ranks), more than half "
            f"of the {free / 2**30:.1f} GiB available: use data_pipeline='pil' for this dataset, or a smaller image_size")
    if cfg.gpus:
        _check_cache_fits_gpus(cfg, n_images, per_rank)


def _check_cache_fits_gpus(cfg: TrainConfig, n_images: int, per_rank: int) -> None:
    # Every GPU rank holds the whole cache (train and validation) next to the model, its
    # gradients, optimizer state and activations: half the free memory is the cache's share.
    # Free memory comes from NVML / nvidia-smi: the kernel never initialises CUDA.
    from ...contract.gpus import list_gpus

    free = {g.index: g.memory_free_mib for g in list_gpus()}
    short = [(i, free[i]) for i in cfg.gpus if free.get(i) is not None and per_rank > free[i] * 2**20 // 2]
    if short:
        which = ", ".join(f"GPU {i} has {_size(mib * 2**20)} free" for i, mib in short)
        raise ConfigError(
            f"TrainConfig.data_pipeline='tensor' would keep {_size(per_rank)} of decoded images on each "
            f"GPU ({n_images} images at {cfg.image_size} px), more than half of the free memory ({which}), "
            "leaving too little for training: use data_pipeline='pil' for this dataset, a smaller image_size, "
            "or GPUs with more free memory (nvidia-smi shows what holds it)")


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".nbddp-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"TrainConfig.runs_dir={str(folder)!r} is not writable ({exc}); choose another folder") from exc


def _check_same_run(run_dir: Path, ckpt: dict, cfg: TrainConfig, classes: Optional[list]) -> None:
    """Refuse to continue a checkpoint with another model, optimizer, other classes, or any setting whose
    change would mix two runs (the fields' ``resume`` rule, against the run's ``config.json``)."""
    trained = ckpt.get("config", {}).get("model")
    if trained not in (None, cfg.model):
        raise ConfigError(f"cannot resume {run_dir}: it trained {trained!r}, the config says {cfg.model!r}. "
                          f"Set model={trained!r} to continue it, or start a new run (resume=False)")
    optimizer = ckpt.get("config", {}).get("optimizer", "sgd")  # runs from before the field used SGD
    if optimizer != cfg.optimizer:
        raise ConfigError(f"cannot resume {run_dir}: it trained with optimizer={optimizer!r}, the config says "
                          f"{cfg.optimizer!r}, whose state the checkpoint does not hold. Set optimizer={optimizer!r} "
                          "to continue it, or start a new run (resume=False)")
    _check_classes(run_dir, ckpt, cfg, classes)
    _check_config_changes(run_dir, ckpt, cfg)


def _recorded_config(run_dir: Path, ckpt: dict) -> dict:
    """The settings the run was launched with, as its checkpoint records them, else its ``config.json``.

    The checkpoint is the user's alone (checked as it is loaded); ``config.json`` is a file of the run
    folder that anyone who may write a shared run folder can replace: it is read only for a checkpoint
    of an older nbddp that records no settings.
    """
    recorded = ckpt.get("config")
    if isinstance(recorded, dict):
        return recorded
    try:
        return read_config_file(run_dir)
    except ConfigError:
        return {}


def _same_value(name: str, was: Any, now: Any) -> bool:
    if was == now or (isinstance(was, list) and tuple(was) == now):
        return True
    # A path written another way (relative, through a link) names the same data.
    return (name in ("data_path", "weights") and isinstance(was, str) and isinstance(now, str)
            and os.path.realpath(was) == os.path.realpath(now))


def resume_changes(recorded: dict, cfg: TrainConfig, done: Optional[int] = None) -> tuple:
    """``(refused, taken)``: the fields of ``cfg`` that differ from the ``recorded`` run's, as messages.

    Each field's :attr:`~nbddp.contract.fieldspec.FieldSpec.resume` says whether a change is refused
    (``same``), taken as a length with some of it left to run (``more``: ``epochs``, larger than
    the recorded one or than ``done``, the epochs the checkpoint has trained) or taken (``free``).
    A field the recorded config lacks (an older nbddp) counts as its default.
    """
    refused, taken = [], []
    split = _batch_split(recorded, cfg)
    if split:  # the same images per optimizer step, in smaller batches (an out-of-memory restart)
        taken.append(split)
    for f, s in specs(TrainConfig):
        if s.resume == RESUME_FREE or (split and f.name in ("batch_size", "grad_accum_steps")):
            continue
        was = recorded.get(f.name, f.default)
        now = getattr(cfg, f.name)
        if _same_value(f.name, was, now):
            continue
        change = f"{f.name} {was!r} -> {now!r}"
        grows = s.resume == RESUME_MORE and isinstance(was, (int, float)) and (now > was or done is not None
                                                                              and now > done)
        (taken if grows else refused).append(change if grows else f"{change}: {s.resume_why}")
    return refused, taken


def _batch_split(recorded: dict, cfg: TrainConfig) -> Optional[str]:
    """The change of ``batch_size`` and ``grad_accum_steps`` that keeps their product and divides the
    batch (what ``oom="halve"`` does), as a message; ``None`` for any other change or none."""
    was_b = recorded.get("batch_size", cfg.batch_size)
    was_k = recorded.get("grad_accum_steps", 1)
    if (not isinstance(was_b, int) or not isinstance(was_k, int) or was_b == cfg.batch_size
            or was_b * was_k != cfg.batch_size * cfg.grad_accum_steps or was_b % cfg.batch_size):
        return None
    return (f"batch_size {was_b} -> {cfg.batch_size} and grad_accum_steps {was_k} -> {cfg.grad_accum_steps}: "
            "the same images per optimizer step")


def _check_config_changes(run_dir: Path, ckpt: dict, cfg: TrainConfig) -> None:
    """Refuse settings that would continue the run as another one (see :func:`resume_changes`)."""
    # Epochs the checkpoint has trained: a mid-epoch checkpoint continues its own epoch.
    epoch = ckpt.get("epoch")
    done = None if not isinstance(epoch, int) else (epoch if ckpt.get("step") else epoch + 1)
    refused, _ = resume_changes(_recorded_config(run_dir, ckpt), cfg, done)
    if refused:
        listing = "\n".join(f"  {line}" for line in refused)
        raise ConfigError(
            f"cannot resume {run_dir}: {len(refused)} setting{'s differ' if len(refused) > 1 else ' differs'} from "
            f"the run it continues, which would mix two runs:\n{listing}\nSet them back to continue it (as its checkpoint "
            "records them), or start a new run (resume=False). Epochs (while some are left), "
            "checkpoint_every_s, num_workers, the GPUs and the timeouts may change.")


def _check_classes(run_dir: Path, ckpt: dict, cfg: TrainConfig, classes: Optional[list]) -> None:
    old = ckpt.get("classes")
    if classes is None or not isinstance(old, (list, tuple)) or list(old) == list(classes):
        return
    old, new = list(old), list(classes)
    parts = [f"{len(old)} classes in the checkpoint, {len(new)} in {cfg.data_path}" if len(old) != len(new)
             else f"{len(old)} classes in both"]
    missing = [c for c in old if c not in new]
    added = [c for c in new if c not in old]
    if missing:
        parts.append(f"missing from data_path: {', '.join(map(repr, missing))}")
    if added:
        parts.append(f"new in data_path: {', '.join(map(repr, added))}")
    if not missing and not added:
        parts.append(f"in another order ({old} then, {new} now)")
    was = ckpt.get("config", {}).get("data_path")
    raise ConfigError(
        f"cannot resume {run_dir}: its checkpoint was trained on other classes ({'; '.join(parts)}), so its "
        f"outputs would mean other things. Point data_path at the data it was trained on"
        f"{f' ({was!r})' if was else ''}, or start a new run (resume=False).")


def find_resume_dir(cfg: TrainConfig, classes: Optional[list] = None) -> Path:
    """The run folder ``cfg.resume`` points at, checked to hold a loadable last checkpoint.

    Args:
        cfg: the config; ``resume=True`` takes the newest run named exactly ``cfg.name`` in
            ``cfg.runs_dir`` (by recorded start, see :func:`nbddp.contract.rundir.run_started`), a path takes that run.
        classes: the class names found in ``cfg.data_path``; when given, a checkpoint trained on
            other classes is refused.

    Raises:
        ConfigError: no such run, no checkpoint, or a checkpoint of another model or other classes.
        WeightsError: the checkpoint is truncated, corrupt or not weights-only safe.
    """
    run_dir = run_to_resume(cfg.resume, cfg.runs_dir, cfg.name, checkpoint=rundir.LAST, what="TrainConfig.resume")
    last = rundir.checkpoint_path(run_dir, rundir.LAST)
    if not last.exists():
        raise ConfigError(f"TrainConfig.resume={cfg.resume!r}: no checkpoint at {last}; nothing to resume")
    ckpt = load_checkpoint(last, run_dir=run_dir)  # weights-only, yours alone: a tampered or swapped file is refused
    _check_same_run(run_dir, ckpt, cfg, classes)
    return run_dir.resolve()
