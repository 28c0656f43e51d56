"""``TrainConfig``: the one object that crosses from the notebook to the workers.

A frozen dataclass of plain values. Widgets produce it, code can build it, it is saved as
``run_dir/config.json`` and read back by ``python -m nbddp train --config``. Validation runs in
the kernel, before any process starts, and every message names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional, Union

from . import rundir
from .rundir import NAME_RULE, name_problem
from .errors import ConfigError
from .gpus import IDLE, IDLE_RULE

_BOOL_FIELDS = ("scale_lr", "compile", "sync_bn", "freeze_layers", "amp", "channels_last", "hflip", "check_images",
                "cache_images", "persistent_workers")
DATA_PIPELINES = ("pil", "tensor")
OPTIMIZERS = ("sgd", "adamw")

#: Smallest process-group timeout accepted: every rank must start (spawn, import torch) and reach
#: the rendezvous within it, which takes seconds on a cold start.
MIN_TIMEOUT_S = 5.0


def _normal_gpus(gpus: Any) -> Any:
    """A tuple of int ids, or ``"idle"``; anything else is left as it came for :meth:`TrainConfig.validate` to name."""
    if isinstance(gpus, str):
        word = gpus.strip().lower()
        return () if not word else IDLE if word == IDLE else gpus  # "" was always "no GPU"
    try:
        return tuple(int(g) for g in (gpus or ()))
    except (TypeError, ValueError):
        return gpus


def utf8_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be written to logs, JSON and TensorBoard as text, or ``None``.

    A name read from the disk whose bytes are not UTF-8 arrives as a string with surrogate
    escapes (``'\\udcff'``); it opens fine but fails in the worker the first time it is written
    to a UTF-8 file.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = os.fsencode(path)
        return (f"is not valid UTF-8 (byte {raw[exc.start:exc.start + 1]!r} near {path[:exc.start][-20:]!r}); "
                "rename the folder or file to a UTF-8 name (convmv or a file manager can)")
    return None


@dataclass(frozen=True)
class TrainConfig:
    """Everything the built-in classification worker needs, as plain values.

    Args:
        data_path: class-folder tree ``root/<class>/<image>``.
        model: torchvision classification model name (``resnet34``, ``resnet18``, ...).
        num_classes: number of outputs; ``None`` takes the number of class folders.
        image_size: side of the square training crop, in pixels.
        epochs: number of passes over the training split.
        batch_size: images per process per step (the global batch is ``batch_size * world``).
        lr: base learning rate (multiplied by the world size when ``scale_lr``).
        lrf: final learning rate as a fraction of ``lr`` at the end of the cosine schedule.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        scale_lr: multiply ``lr`` by the number of processes, as the reference script does.
        optimizer: ``"sgd"`` (momentum ``momentum``, the reference) or ``"adamw"`` (decoupled
            ``weight_decay``, torch's default betas; ``momentum`` is not used).
        grad_accum_steps: batches per optimizer step (gradient accumulation): each rank adds
            up the gradients of ``k`` batches of ``batch_size`` (DDP synchronises only the
            ``k``-th), so one step sees ``batch_size * world * k`` images at the memory cost of
            ``batch_size``. When the batches of an epoch do not divide by ``k``, the last group
            is shorter and still steps, averaging the batches it has.
        warmup_epochs: epochs of linear learning-rate warm-up (``lr/(w+1)``, ``2lr/(w+1)``...)
            before the cosine schedule, which then runs over the remaining epochs; 0: none.
        label_smoothing: label smoothing of the training loss (``F.cross_entropy``), in [0, 1);
            the validation loss stays the plain cross-entropy.
        compile: ``torch.compile`` the training model (the DDP wrapper, as PyTorch advises, so
            its optimiser splits the graph at the gradient buckets); the first epoch's metrics
            report the compile time (``compile_s``). Checkpoints and exports are unchanged.
        early_stop_patience: stop every rank together once validation accuracy has not
            improved for this many epochs (the export keeps the best epoch); 0: off.
        sync_bn: synchronise BatchNorm statistics across ranks (refused with ``freeze_layers``).
        freeze_layers: train only the classifier head.
        weights: weights file (``.pth`` / ``.safetensors`` / a run's export) to start from.
        val_fraction: fraction of each class held out for validation.
        seed: seed of the split, the initial weights and the augmentation.
        num_workers: DataLoader worker processes per rank (``None``: derived from the cores).
        amp: mixed precision on GPU (bf16 where supported, else fp16 with a grad scaler).
        channels_last: NHWC memory format on GPU.
        crop_scale: smallest area fraction kept by the random resized crop.
        hflip: random horizontal flips (turn off for digits and text).
        nprocs: number of CPU processes when ``gpus`` is empty.
        gpus: GPU ids as ``list_gpus()`` and ``nvidia-smi`` show them, one process each (rank r runs
            on ``gpus[r]``; workers get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and the kernel's own
            ``CUDA_VISIBLE_DEVICES`` words for these GPUs), or ``"idle"``: the GPUs idle at
            launch (:data:`nbddp.gpus.IDLE_RULE`), picked in the kernel before any worker starts
            (the run's ``config.json`` then records the ids it ran on).
        runs_dir: folder that holds one sub-folder per run.
        name: short name appended to the run folder.
        resume: ``True`` continues the newest run of this ``name``; a path continues that run.
            A checkpoint written in the middle of an epoch (a Stop, an Interrupt,
            ``checkpoint_every_s``) continues at the step it was written after, with the same
            weights an uninterrupted run would have.
        checkpoint_every_s: besides the checkpoint at the end of each epoch, write one in the
            middle of an epoch at most this often (seconds; ``0`` turns it off), so a killed run
            loses at most that much work. Rank 0 keeps the time and every rank agrees in the
            step's existing all-reduce, so it costs nothing between checkpoints.
        check_images: open every image in the kernel before launching (names corrupt files).
        cache_images: decode each image once and keep it in memory (small datasets; the
            random augmentation still runs every epoch). For ``data_pipeline="pil"``.
        data_pipeline: ``"pil"`` (the reference: per-image PIL transforms in DataLoader
            workers, random crops of the full image) or ``"tensor"`` (decode once into a uint8
            tensor on the rank's device, then crop, flip and normalise whole batches there: GPU-side
            augmentation, no loader processes; for datasets that fit in memory, see
            :mod:`nbddp.tensor_data`).
        persistent_workers: keep DataLoader workers alive between epochs (``num_workers > 0``),
            so no epoch pays for starting them again. Resumed runs stay exact either way: each
            image's augmentation is seeded by (seed, epoch, image), not by the worker.
        timeout_s: process-group timeout in seconds (a hung collective fails after this).
    """

    data_path: str = "data/digits"
    model: str = "resnet34"
    num_classes: Optional[int] = None
    image_size: int = 224
    epochs: int = 10
    batch_size: int = 16
    lr: float = 0.001
    lrf: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-3
    scale_lr: bool = True
    optimizer: str = "sgd"
    grad_accum_steps: int = 1
    warmup_epochs: int = 0
    label_smoothing: float = 0.0
    compile: bool = False
    early_stop_patience: int = 0
    sync_bn: bool = False
    freeze_layers: bool = False
    weights: Optional[str] = None
    val_fraction: float = 0.2
    seed: int = 0
    num_workers: Optional[int] = None
    amp: bool = False
    channels_last: bool = False
    crop_scale: float = 0.08
    hflip: bool = True
    nprocs: int = 1
    gpus: Union[tuple, str] = ()
    runs_dir: str = "runs"
    name: str = "train"
    resume: Union[bool, str] = False
    checkpoint_every_s: float = 600.0
    check_images: bool = True
    cache_images: bool = False
    data_pipeline: str = "pil"
    persistent_workers: bool = True
    timeout_s: float = 300.0

    def __post_init__(self):
        # Normalise containers and paths so the config stays hashable, JSON-able and picklable.
        object.__setattr__(self, "gpus", _normal_gpus(self.gpus))
        for name in ("data_path", "runs_dir"):
            object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if self.weights is not None:
            object.__setattr__(self, "weights", os.fspath(self.weights))
        if isinstance(self.resume, os.PathLike):
            object.__setattr__(self, "resume", os.fspath(self.resume))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field's type and range; raises ``ConfigError`` naming the field."""

        def bad(name: str, why: str) -> None:
            raise ConfigError(f"TrainConfig.{name}={getattr(self, name)!r}: {why}")

        self._validate_types(bad)
        self._validate_numbers(bad)
        self._validate_recipe(bad)
        self._validate_choices(bad)

    def _validate_types(self, bad) -> None:
        """Flags, paths and counts."""
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False (a string such as 'False' is not a bool)")
        if not isinstance(self.resume, (bool, str)):
            bad("resume", "must be True/False or the path of a run folder")
        for name in ("data_path", "runs_dir", "weights", "resume"):
            v = getattr(self, name)
            if isinstance(v, str) and utf8_problem(v):
                bad(name, utf8_problem(v))
        ints = {"image_size": 8, "epochs": 1, "batch_size": 1, "nprocs": 1, "seed": 0}
        for name, low in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                bad(name, f"must be an integer >= {low}")
        if self.num_classes is not None and (
            isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2
        ):
            bad("num_classes", "must be an integer >= 2, or None to count the class folders")
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 0):
            bad("num_workers", "must be an integer >= 0, or None to derive it from the cores")

    def _validate_numbers(self, bad) -> None:
        """Rates, fractions and times: finite, in range."""
        floats = {
            "lr": (0.0, math.inf, False),
            "lrf": (0.0, 1.0, True),
            "momentum": (0.0, 1.0, True),
            "weight_decay": (0.0, math.inf, True),
            "val_fraction": (0.0, 1.0, False),
            "crop_scale": (0.0, 1.0, True),
            "timeout_s": (0.0, math.inf, False),
        }
        for name, (low, high, low_ok) in floats.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number")
            if v < low or (v == low and not low_ok) or v > high:
                bad(name, f"must be in {'[' if low_ok else '('}{low}, {high}]")
        every = self.checkpoint_every_s
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not math.isfinite(every) or every < 0:
            bad("checkpoint_every_s", "must be a finite number of seconds >= 0: how often, at most, a checkpoint "
                "is written in the middle of an epoch (0 writes them at the end of epochs only)")
        if self.timeout_s < MIN_TIMEOUT_S:
            bad("timeout_s", f"must be at least {MIN_TIMEOUT_S:g} seconds: every rank has to start and reach the "
                "process group within it (a smaller value fails at start-up with a connection error)")
        if self.crop_scale == 0:
            bad("crop_scale", "must be > 0 (the smallest area fraction the random crop keeps)")

    def _validate_choices(self, bad) -> None:
        """Named choices, GPUs, the run's name, and settings that exclude each other."""
        if self.data_pipeline not in DATA_PIPELINES:
            bad("data_pipeline", f"must be one of {DATA_PIPELINES}: 'pil' (per-image transforms, the reference) "
                "or 'tensor' (decoded once, batches augmented on the device)")
        if not isinstance(self.model, str) or not self.model:
            bad("model", "must be a torchvision classification model name such as 'resnet34'")
        if self.gpus != IDLE:
            if not isinstance(self.gpus, tuple):
                bad("gpus", f"must be GPU ids as nvidia-smi shows them, e.g. (0, 1), or {IDLE!r} for the "
                    f"GPUs idle at launch ({IDLE_RULE})")
            if any(g < 0 for g in self.gpus):
                bad("gpus", "GPU ids are >= 0")
            if len(set(self.gpus)) != len(self.gpus):
                bad("gpus", "lists a GPU twice; each process needs its own GPU")
        if self.sync_bn and self.freeze_layers:
            bad(
                "sync_bn",
                "is refused while freeze_layers=True: frozen BatchNorm layers keep their statistics, "
                "so there is nothing to synchronise. Turn one of them off.",
            )
        if name_problem(self.name):
            bad("name", f"{NAME_RULE}; e.g. name='digits-resnet34'")

    def _validate_recipe(self, bad: Callable[[str, str], None]) -> None:
        """The training recipe: optimizer, accumulation, warm-up, label smoothing, early stopping."""
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"must be one of {OPTIMIZERS}: 'sgd' (with momentum, the reference) or 'adamw'")

        def count(name: str, low: int, meaning: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                bad(name, f"must be an integer >= {low} ({meaning})")

        count("grad_accum_steps", 1, "1: an optimizer step every batch; k: every k batches, an effective batch "
              "of batch_size x processes x k")
        count("warmup_epochs", 0, "0: no warm-up; w: w epochs of linear warm-up before the cosine schedule")
        count("early_stop_patience", 0, "0: off; n: stop once validation accuracy has not improved for n epochs")
        if self.warmup_epochs >= self.epochs:
            bad("warmup_epochs", f"is not less than epochs={self.epochs}: the warm-up would take the whole run "
                "and the cosine schedule none; use fewer warm-up epochs or more epochs")
        v = self.label_smoothing
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v < 1.0):
            bad("label_smoothing", "must be a number in [0, 1): 0 turns it off, 0.1 is a common value")

    # ------------------------------------------------------------------ derived values
    @property
    def world_size(self) -> int:
        """Number of processes: one per GPU, or ``nprocs`` CPU processes.

        Raises:
            ConfigError: for ``gpus="idle"``, whose GPUs (and so processes) are picked at launch.
        """
        if self.gpus == IDLE:
            raise ConfigError(f"TrainConfig.gpus={IDLE!r} picks its GPUs at launch, so its number of processes "
                              "is known only then; choose GPU ids (or nproc_per_node/gpus_per_node for cluster "
                              "commands) where the count is needed now")
        return len(self.gpus) if self.gpus else self.nprocs

    @property
    def device_type(self) -> str:
        return "cuda" if self.gpus else "cpu"

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ cluster commands
    def torchrun_command(self, **kwargs: Any) -> str:
        """The exact ``torchrun`` command for this run; see :func:`nbddp.cluster.torchrun_command`."""
        from .cluster import torchrun_command

        return torchrun_command(self, **kwargs)

    def sbatch_script(self, **kwargs: Any) -> str:
        """An ``sbatch`` script for this run; see :func:`nbddp.cluster.sbatch_script`."""
        from .cluster import sbatch_script

        return sbatch_script(self, **kwargs)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["gpus"] = self.gpus if isinstance(self.gpus, str) else list(self.gpus)
        return d

    def save(self, path: Union[str, Path]) -> Path:
        return rundir.atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**d)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "TrainConfig":
        """Read a ``config.json`` (or a run folder that holds one); errors name the file."""
        data = read_config_file(path)
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{_config_file(path)}: {exc}. Correct the file") from None


def _config_file(path: Union[str, Path]) -> Path:
    path = Path(path)
    return rundir.config_path(path) if path.is_dir() else path


def read_config_file(path: Union[str, Path]) -> dict:
    """The fields stored in a ``config.json`` (or a run folder that holds one), not yet validated.

    Raises:
        ConfigError: the file is missing, not JSON, or not a JSON object.
    """
    path = _config_file(path)
    if not path.is_file():
        raise ConfigError(f"no config file at {path}; pass a run folder or its config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); pass a config.json that nbddp wrote") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not an object of TrainConfig fields")
    return data


__all__ = ["TrainConfig"]
