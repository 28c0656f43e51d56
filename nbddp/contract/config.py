"""``TrainConfig``: the one object that crosses from the notebook to the workers.

A frozen dataclass of plain values. Widgets produce it, code can build it, it is saved as
``run_dir/config.json`` and read back by ``python -m nbddp train --config``. Validation runs in
the kernel, before any process starts, and every message names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional, Union

from . import rundir
from .rundir import NAME_RULE, name_problem
from .errors import ConfigError
from .fieldspec import GROUPS, RESUME_FREE, RESUME_MORE, Check, Widget, spec, specs, utf8_problem
from .gpus import IDLE, IDLE_RULE
from .observe import TRACKERS

DATA_PIPELINES = ("pil", "tensor", "decode")
OPTIMIZERS = ("sgd", "adamw")
OOM_POLICIES = ("fail", "halve")
#: How a launch spreads the model over its ranks: ``ddp`` (every rank holds the whole model, its
#: gradients and optimizer state) or ``fsdp`` (each rank holds a shard of them: FSDP2's fully_shard).
STRATEGIES = ("ddp", "fsdp")
#: The environment variable that tells a rank its launch's strategy (``ctx.strategy``); torchrun and
#: srun commands export it too.
STRATEGY_ENV = "NBDDP_STRATEGY"
_STRATEGY_WHY = ("'ddp' (every rank holds the whole model, its gradients and optimizer state) or 'fsdp' (each rank "
                 "holds a shard of them: models beyond one device's memory)")
#: The models the panel suggests (any torchvision classification model name works).
COMMON_MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "mobilenet_v3_small", "mobilenet_v3_large",
                 "efficientnet_b0", "efficientnet_b1", "regnet_y_400mf", "convnext_tiny", "densenet121", "vgg16_bn")
#: Why ``sync_bn`` and ``freeze_layers`` exclude each other.
FREEZE_REASON = "frozen BatchNorm layers keep their statistics, so there is nothing to synchronise"
_BOOL = Check("bool")
_PATH = Check("path")  # written to logs, JSON and TensorBoard: must be UTF-8

# Why resume refuses a change of a field (FieldSpec.resume_why): continuing with it would mix two runs.
_DATA = "the images and their augmentation, which the checkpoint's weights and scores were made on"
_SPLIT = ("the split into training and validation images (and, for seed, the initial weights and the "
          "augmentation): a new split would validate on images the run trained on")
_MODEL = "the model the checkpoint's weights belong to"
_START = "the weights the run started from"
_OPTIM = "the optimizer and its hyper-parameters, whose state the checkpoint continues"
_SCHEDULE = "the learning-rate schedule the checkpoint's scheduler continues"
_STEPS = "the steps of an epoch, which the checkpoint's optimizer state and position count"
_LOSS = "the loss the run minimises"
_NUMERICS = "the arithmetic of the training steps and the grad scaler's state in the checkpoint"
_FEWER_EPOCHS = ("no epoch would be left to train: the run has already trained that many; give more epochs, or "
                 "use the run's export as it is")

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


def _normal_trackers(value: Any) -> Any:
    """A tuple of lower-case tracker names from a tuple, a list or ``"mlflow,wandb"``; else as it came."""
    if isinstance(value, str):
        value = [w for w in value.replace(" ", ",").split(",") if w]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(dict.fromkeys(v.strip().lower() for v in value))
    return value


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
        strategy: ``"ddp"`` (every rank holds the whole model) or ``"fsdp"`` (FSDP2: each rank
            holds a shard of the parameters, gradients and optimizer state; every ResNet stage
            is sharded, then the root). Checkpoints keep the whole model, so a run resumes on
            another number of ranks, and a run may switch strategy when resumed; the export is one
            plain state dict either way.
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
            launch (:data:`nbddp.contract.gpus.IDLE_RULE`), picked in the kernel before any worker starts
            (the run's ``config.json`` then records the ids it ran on).
        runs_dir: folder that holds one sub-folder per run.
        name: short name appended to the run folder.
        resume: ``True`` continues the newest run of this ``name``; a path continues that run.
            A checkpoint written in the middle of an epoch (a Stop, an Interrupt,
            ``checkpoint_every_s``) continues at the step it was written after, with the same
            weights an uninterrupted run would have.
        allow_changed_data: resume even though images were added to or removed from the class
            folders since the run was made (its ``data.json`` records them): the split is made
            again from the images now and a warning says what changed. Without it such a resume
            is refused, since validation images may have been trained on.
        checkpoint_every_s: besides the checkpoint at the end of each epoch, write one in the
            middle of an epoch at most this often (seconds; ``0`` turns it off), so a killed run
            loses at most that much work. Rank 0 keeps the time and every rank agrees in the
            step's existing all-reduce, so it costs nothing between checkpoints.
        check_images: open every image in the kernel before launching (names corrupt files).
        cache_images: decode each image once and keep it in memory (small datasets; the
            random augmentation still runs every epoch). For ``data_pipeline="pil"``.
        data_pipeline: ``"decode"``: loader workers read the files' bytes, and each batch is
            decoded (nvJPEG on GPUs, PNG per image on the CPU) and augmented on the rank's
            device (:mod:`nbddp.tasks.classification.decode_data`): for photo folders too large to keep decoded.
            ``"pil"`` (the reference: per-image PIL transforms in DataLoader
            workers, random crops of the full image) or ``"tensor"`` (decode once into a uint8
            tensor on the rank's device, then crop, flip and normalise whole batches there: GPU-side
            augmentation, no loader processes; for datasets that fit in memory, see
            :mod:`nbddp.tasks.classification.tensor_data`).
        persistent_workers: keep DataLoader workers alive between epochs (``num_workers > 0``),
            so no epoch pays for starting them again. Resumed runs stay exact either way: each
            image's augmentation is seeded by (seed, epoch, image), not by the worker.
        timeout_s: process-group timeout in seconds (a hung collective fails after this).
        max_restarts: restart a run that failed in a way a restart heals (a rank killed or
            crashed, a hang, a collective timeout, a GPU/NCCL error) up to this many times, from
            its last checkpoint in the same run folder (:mod:`nbddp.kernel.restarts` has the rule).
        oom: ``"fail"`` (out of memory ends the run) or ``"halve"`` (restart with half the
            per-rank batch and twice ``grad_accum_steps``: the same global batch and schedule;
            the run's ``config.json`` keeps the new values).
        trackers: where the run's metrics also go besides TensorBoard: ``("mlflow",)``,
            ``("wandb",)`` or both (``"mlflow,wandb"`` on the command line); see ``spawn_train``.
        export_onnx: at the end, beside the exported weights, also write ``export/model.onnx`` and
            ``export/preprocessing.json`` (rank 0, on the CPU), checked with ONNX Runtime on held-out
            images (see :func:`nbddp.export_onnx`); needs ``pip install 'nbddp[onnx]'``.
    """

    data_path: str = spec("data/digits", help="class-folder tree root/<class>/<image>", check=_PATH, metavar="DIR",
                          widget=Widget("text", "Data folder", "paths", placeholder="root/<class>/<image>",
                                        required="type the folder that holds one sub-folder per class",
                                        attr="data_input"), resume_why=_DATA)
    model: str = spec("resnet34", group="choices", help="torchvision classification model name (resnet34, ...)",
                      widget=Widget("combo", "Model", options=COMMON_MODELS,
                                    placeholder="torchvision name, e.g. resnet34"), resume_why=_MODEL)
    num_classes: Optional[int] = spec(None, help="number of outputs (default: the number of class folders)",
                                      check=Check("int", low=2, none="count the class folders"), resume_why=_MODEL)
    image_size: int = spec(224, help="side of the square training crop, in pixels", check=Check("int", low=8),
                           widget=Widget("int", "Image size", low=8, high=4096, step=32), resume_why=_DATA)
    epochs: int = spec(10, help="passes over the training split", check=Check("int", low=1),
                       widget=Widget("int", "Epochs", low=1, high=100_000),
                       resume=RESUME_MORE, resume_why=_FEWER_EPOCHS)
    batch_size: int = spec(16, help="images per process per step", check=Check("int", low=1),
                           widget=Widget("int", "Batch / process", low=1, high=65_536), resume_why=_STEPS)
    lr: float = spec(0.001, group="numbers", help="base learning rate", check=Check("number", 0.0, low_open=True),
                     widget=Widget("float", "Learning rate", step=0.0001), resume_why=_OPTIM)
    lrf: float = spec(0.1, group="numbers", help="final learning rate, as a fraction of lr",
                      check=Check("number", 0.0, 1.0), resume_why=_SCHEDULE)
    momentum: float = spec(0.9, group="numbers", help="SGD momentum", check=Check("number", 0.0, 1.0),
                           resume_why=_OPTIM)
    weight_decay: float = spec(5e-3, group="numbers", help="weight decay", check=Check("number", 0.0),
                               resume_why=_OPTIM)
    scale_lr: bool = spec(True, help="multiply lr by the number of processes", check=_BOOL, resume_why=_OPTIM)
    optimizer: str = spec("sgd", group="recipe", help="sgd (momentum, the reference) or adamw",
                          check=Check("choice", values=OPTIMIZERS,
                                      why="'sgd' (with momentum, the reference) or 'adamw'"),
                          widget=Widget("choice", "Optimizer", "advanced"), resume_why=_OPTIM)
    grad_accum_steps: int = spec(1, group="recipe", help="batches per optimizer step (gradient accumulation; "
                                 "default 1)",
                                 check=Check("int", low=1, why="1: an optimizer step every batch; k: every k batches, "
                                             "an effective batch of batch_size x processes x k"),
                                 widget=Widget("int", "Accumulate", "advanced", low=1, high=4096,
                                               attr="grad_accum_input"), resume_why=_STEPS)
    warmup_epochs: int = spec(0, group="recipe", help="epochs of linear learning-rate warm-up before the cosine "
                              "schedule (default 0)",
                              check=Check("int", low=0, why="0: no warm-up; w: w epochs of linear warm-up before "
                                          "the cosine schedule"),
                              widget=Widget("int", "Warm-up epochs", "advanced", low=0, high=100_000,
                                            attr="warmup_input"), resume_why=_SCHEDULE)
    label_smoothing: float = spec(0.0, group="recipe", help="label smoothing of the training loss, in [0, 1) "
                                  "(default 0)",
                                  check=Check("number", 0.0, 1.0, high_open=True, why="must be a number in [0, 1): "
                                              "0 turns it off, 0.1 is a common value"),
                                  widget=Widget("float", "Label smoothing", "advanced", low=0.0, high=0.99, step=0.05),
                                  resume_why=_LOSS)
    compile: bool = spec(False, help="torch.compile the training model; the first epoch reports compile_s",
                         check=_BOOL, widget=Widget("check", "torch.compile (the first epoch reports the compile "
                                                    "time)", "advanced"), resume=RESUME_FREE)
    early_stop_patience: int = spec(0, group="recipe", help="stop once validation accuracy has not improved for N "
                                    "epochs (default 0: off)",
                                    check=Check("int", low=0, why="0: off; n: stop once validation accuracy has not "
                                                "improved for n epochs"),
                                    widget=Widget("int", "Early stop after", "advanced", low=0, high=100_000,
                                                  attr="early_stop_input"), resume=RESUME_FREE)
    sync_bn: bool = spec(False, help="synchronise BatchNorm statistics across processes", check=_BOOL,
                         widget=Widget("check", "SyncBN (BatchNorm statistics over all processes)", "options"),
                         resume_why=_MODEL)
    strategy: str = spec("ddp", group="choices", help="ddp (every process holds the whole model) or fsdp (each "
                         "holds a shard of parameters, gradients and optimizer state)",
                         check=Check("choice", values=STRATEGIES, why=_STRATEGY_WHY),
                         widget=Widget("choice", "Strategy", "options",
                                       attr="strategy_input"),
                         resume=RESUME_FREE)
    freeze_layers: bool = spec(False, help="train only the classifier head", check=_BOOL,
                               widget=Widget("check", "Freeze layers (train only the head)", "options",
                                             attr="freeze_toggle"), resume_why=_MODEL)
    weights: Optional[str] = spec(None, help="weights file (.pth / .safetensors / a run's export) to start from",
                                  check=_PATH, metavar="FILE",
                                  widget=Widget("text", "Weights file", "paths",
                                                placeholder="optional: .pth / .safetensors / run folder"),
                                  resume_why=_START)
    val_fraction: float = spec(0.2, group="numbers", help="fraction of each class held out for validation",
                               check=Check("number", 0.0, 1.0, low_open=True), resume_why=_SPLIT)
    seed: int = spec(0, help="seed of the split, the initial weights and the augmentation", check=Check("int", low=0),
                     resume_why=_SPLIT)
    num_workers: Optional[int] = spec(None, help="DataLoader processes per rank (default: from the cores)",
                                      check=Check("int", low=0, none="derive it from the cores"), resume=RESUME_FREE)
    amp: bool = spec(False, help="mixed precision on GPU", check=_BOOL,
                     widget=Widget("check", "AMP (mixed precision)", "options", gpu_only=True), resume_why=_NUMERICS)
    channels_last: bool = spec(False, help="NHWC memory format on GPU", check=_BOOL, resume=RESUME_FREE)
    crop_scale: float = spec(0.08, group="numbers", help="smallest area fraction kept by the random resized crop",
                             check=Check("number", 0.0, 1.0), resume_why=_DATA)
    hflip: bool = spec(True, help="random horizontal flips", check=_BOOL, resume_why=_DATA)
    nprocs: int = spec(1, help="CPU processes when no GPU is given", check=Check("int", low=1), launch=True,
                       resume=RESUME_FREE)
    gpus: Union[tuple, str] = spec((), group="choices", launch=True, metavar="IDS",
                                   help="GPU ids, e.g. 0,1 ('all' = every GPU; 'idle' = the GPUs idle at launch: at "
                                   "least 90% memory free, at most 10% busy; default: all, else CPU)",
                                   resume=RESUME_FREE)
    runs_dir: str = spec(rundir.RUNS_DIR, help="folder that holds one sub-folder per run", check=_PATH, metavar="DIR",
                         resume=RESUME_FREE)
    name: str = spec("train", group="choices", help="short name appended to the run folder", resume=RESUME_FREE)
    resume: Union[bool, str] = spec(False, check=_PATH, launch=True, metavar="RUN",
                                    help="'true' (newest run of --name) or a run folder", resume=RESUME_FREE)
    allow_changed_data: bool = spec(False, check=_BOOL, launch=True, resume=RESUME_FREE,
                                    help="resume on class folders whose images changed since the run was made "
                                    "(the split is made again and the run says what changed)")
    checkpoint_every_s: float = spec(600.0, group="numbers", help="seconds between checkpoints in the middle of an "
                                     "epoch (0: at the end of epochs only)",
                                     check=Check("number", 0.0, why="must be a finite number of seconds >= 0: how "
                                                 "often, at most, a checkpoint is written in the middle of an epoch "
                                                 "(0 writes them at the end of epochs only)"), resume=RESUME_FREE)
    check_images: bool = spec(True, help="open every image in the kernel before launching", check=_BOOL,
                              resume=RESUME_FREE)
    cache_images: bool = spec(False, help="decode each image once and keep it in memory (pil pipeline)", check=_BOOL,
                              resume=RESUME_FREE)
    data_pipeline: str = spec("pil", group="choices", help="pil: per-image transforms (reference); tensor: decode "
                              "once, augment batches on the device; decode: read bytes, decode and augment each batch "
                              "on the device (nvJPEG on GPUs)",
                              check=Check("choice", values=DATA_PIPELINES, why="'pil' (per-image transforms, the "
                                          "reference), 'tensor' (decoded once, batches augmented on the device) or "
                                          "'decode' (file bytes decoded and augmented batch by batch on the device)"),
                              widget=Widget("choice", "Data pipeline", "options", attr="pipeline_input"),
                              resume_why=_DATA)
    persistent_workers: bool = spec(True, help="keep DataLoader workers alive between epochs", check=_BOOL,
                                    resume=RESUME_FREE)
    timeout_s: float = spec(300.0, group="numbers", help="process-group timeout in seconds",
                            check=Check("number", 0.0, low_open=True), resume=RESUME_FREE)
    max_restarts: int = spec(0, help="restarts from the last checkpoint after a failure a restart heals (a rank "
                             "killed, a hang, a GPU error; default 0)",
                             check=Check("int", low=0, why="0: a failure ends the run; n: up to n restarts from "
                                         "the last checkpoint"),
                             widget=Widget("int", "Restarts", "advanced", low=0, high=100), resume=RESUME_FREE,
                             launch=True)
    oom: str = spec("fail", group="choices", help="out of memory: fail, or halve the per-rank batch and restart "
                    "(same global batch)",
                    check=Check("choice", values=OOM_POLICIES, why="'fail' (out of memory ends the run) or 'halve' "
                                "(restart with half the batch per rank and twice the gradient accumulation)"),
                    widget=Widget("choice", "Out of memory", "advanced"), resume=RESUME_FREE, launch=True)

    trackers: tuple = spec((), group="choices", metavar="NAMES", resume=RESUME_FREE,
                           help="where the run's metrics, settings and exported weights also go, besides "
                           "TensorBoard: mlflow, wandb or mlflow,wandb (one tracker run per run folder)",
                           widget=Widget("combo", "Trackers", "advanced", options=("", "mlflow", "wandb", "mlflow,wandb"),
                                         placeholder="mlflow, wandb"))
    export_onnx: bool = spec(False, help="also write export/model.onnx and preprocessing.json at the end, checked "
                             "with ONNX Runtime on held-out images (needs pip install 'nbddp[onnx]')", check=_BOOL,
                             widget=Widget("check", "Export ONNX too (checked with ONNX Runtime)", "options"),
                             resume=RESUME_FREE)

    def __post_init__(self):
        # Normalise containers and paths so the config stays hashable, JSON-able and picklable.
        object.__setattr__(self, "gpus", _normal_gpus(self.gpus))
        object.__setattr__(self, "trackers", _normal_trackers(self.trackers))
        for name in ("data_path", "runs_dir"):
            object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if self.weights is not None:
            object.__setattr__(self, "weights", os.fspath(self.weights))
        if isinstance(self.resume, os.PathLike):
            object.__setattr__(self, "resume", os.fspath(self.resume))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field's type and range; raises ``ConfigError`` naming the field.

        Group by group (:data:`nbddp.contract.fieldspec.GROUPS`): first each field's own
        :class:`~nbddp.contract.fieldspec.Check`, from its declaration, then the group's rules that no
        single field's check can say (a field against another, a special message).
        """

        def bad(name: str, why: str) -> None:
            raise ConfigError(f"TrainConfig.{name}={getattr(self, name)!r}: {why}")

        rules = {"types": self._validate_types, "numbers": self._validate_numbers,
                 "recipe": self._validate_recipe, "choices": self._validate_choices}
        declared = specs(self)
        for group in GROUPS:
            for f, s in declared:
                why = s.check.problem(getattr(self, f.name)) if s.group == group and s.check else None
                if why:
                    bad(f.name, why)
            rules[group](bad)

    def _validate_types(self, bad: Callable[[str, str], None]) -> None:
        """Flags, paths and counts: the one rule beside the fields' own checks."""
        if not isinstance(self.resume, (bool, str)):
            bad("resume", "must be True/False or the path of a run folder")

    def _validate_numbers(self, bad: Callable[[str, str], None]) -> None:
        """Rates, fractions and times: the limits beside their ranges."""
        if self.timeout_s < MIN_TIMEOUT_S:
            bad("timeout_s", f"must be at least {MIN_TIMEOUT_S:g} seconds: every rank has to start and reach the "
                "process group within it (a smaller value fails at start-up with a connection error)")
        if self.crop_scale == 0:
            bad("crop_scale", "must be > 0 (the smallest area fraction the random crop keeps)")

    def _validate_recipe(self, bad: Callable[[str, str], None]) -> None:
        """The training recipe: the warm-up against the epochs."""
        if self.warmup_epochs >= self.epochs:
            bad("warmup_epochs", f"is not less than epochs={self.epochs}: the warm-up would take the whole run "
                "and the cosine schedule none; use fewer warm-up epochs or more epochs")

    def _validate_choices(self, bad: Callable[[str, str], None]) -> None:
        """The model, GPUs, the run's name, and settings that exclude each other."""
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
            bad("sync_bn", f"is refused while freeze_layers=True: {FREEZE_REASON}. Turn one of them off.")
        if name_problem(self.name):
            bad("name", f"{NAME_RULE}; e.g. name='digits-resnet34'")
        if not isinstance(self.trackers, tuple) or any(t not in TRACKERS for t in self.trackers):
            bad("trackers", f"must be tracker names from {sorted(TRACKERS)}, e.g. ('mlflow',) or 'mlflow,wandb'")

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
    # ``cluster`` writes text from any config-like dataclass and imports nothing of this module, so
    # the arrow goes one way; imported here, at the call, so a rank never loads it.
    def torchrun_command(self, **kwargs: Any) -> str:
        """The exact ``torchrun`` command for this run; see :func:`nbddp.contract.cluster.torchrun_command`."""
        from . import cluster

        return cluster.torchrun_command(self, **kwargs)

    def sbatch_script(self, **kwargs: Any) -> str:
        """An ``sbatch`` script for this run; see :func:`nbddp.contract.cluster.sbatch_script`."""
        from . import cluster

        return cluster.sbatch_script(self, **kwargs)

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


def check_strategy(strategy: Any, what: str = "strategy") -> str:
    """``strategy`` when it is one of :data:`STRATEGIES`; a ``ConfigError`` naming the choices otherwise."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ConfigError(f"{what}={strategy!r}: use {_STRATEGY_WHY}")
    return strategy


__all__ = ["TrainConfig", "utf8_problem", "STRATEGIES", "check_strategy"]
