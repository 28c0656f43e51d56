"""The built-in worker's data in a rank: the class folders read and split, and the loaders of its
three pipelines (``pil``: PIL images per item in loader processes; ``decode``: file bytes decoded
and augmented on the device batch by batch; ``tensor``: every image decoded once, kept on the device).

Worker side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler

from . import data as D
from . import data_record
from .loading import PassAhead
from ...contract import rundir
from ...contract.config import TrainConfig


@dataclass
class Loaders:
    """This rank's loaders; the transforms are batch transforms run on the device (tensor and decode pipelines), else None."""

    sampler: D.SkipSampler  # the training order: set_epoch every epoch, skip(n) to resume in the middle of one
    train: D.EpochLoader    # start_epoch(e) begins epoch e's pass ahead of its first step
    val: Any                # its loader processes persist, its pass begun near the epoch's end (PassAhead)
    train_transform: Optional[Callable] = None
    val_transform: Optional[Callable] = None

    def start_epoch(self, epoch: int) -> None:
        """Begin epoch ``epoch``'s training pass now: its first batches load while the rank evaluates and saves."""
        self.train.start(epoch)


@dataclass
class TaskData:
    classes: List[str]
    num_classes: int
    train_samples: list
    val_samples: list
    loaders: Loaders


def make_loaders(cfg: TrainConfig, ctx, train_s, val_s) -> Loaders:
    """The loaders of the configured pipeline: decoded tensors on the device, or PIL images per item."""
    if cfg.data_pipeline == "tensor":
        return _tensor_loaders(cfg, ctx, train_s, val_s)
    if cfg.data_pipeline == "decode":
        return _decode_loaders(cfg, ctx, train_s, val_s)
    cuda = ctx.device.type == "cuda"
    train_tf, val_tf = D.build_transforms(cfg.image_size, cfg.crop_scale, cfg.hflip)
    train_ds = D.ImageListDataset(train_s, train_tf, cache=cfg.cache_images)
    val_ds = D.ImageListDataset(val_s, val_tf, cache=cfg.cache_images)
    workers = cfg.num_workers
    if workers is None:
        # On CPU the ranks already use every core for compute; on GPU feed them from the rest.
        workers = D.loader_workers(ctx.world_size, at_least=1) if cuda else 0
    # DistributedSampler gives each rank a disjoint shard, reshuffled by set_epoch every epoch.
    sampler = DistributedSampler(train_ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=cfg.seed)
    # Each image's augmentation is seeded by (seed, epoch, index): the same with any number of
    # workers, and with workers that persist between epochs (their own seeds are drawn once).
    # A resumed epoch leaves out the batches done before the checkpoint (SkipSampler).
    order = D.SkipSampler(D.SeededSampler(sampler, cfg.seed))
    # Forked (not spawned: no torch import per worker), dying with the rank, and kept between
    # epochs: re-creating them costs a fork and the first batches' latency every epoch.
    common = dict(pin_memory=cuda, persistent_workers=cfg.persistent_workers and workers > 0,
                  **D.loader_processes(workers))
    # drop_last: a tiny final batch gives noisy BatchNorm statistics and uneven step counts.
    # Its own generator: a DataLoader draws its workers' base seed whenever it starts a pass,
    # from torch's global generator by default, which training draws from too (dropout); a run
    # resumed in the middle of an epoch starts a pass where an uninterrupted one does not.
    train_loader = DataLoader(D.SeededDataset(train_ds), batch_size=cfg.batch_size, sampler=order, drop_last=True,
                              generator=torch.Generator().manual_seed(cfg.seed), **common)
    val_loader = DataLoader(val_ds, batch_size=cfg.batch_size,
                            sampler=D.ShardSampler(len(val_ds), ctx.rank, ctx.world_size), **common)
    return Loaders(order, *_evaluation_ahead(train_loader, order, val_loader))


def _evaluation_ahead(train_loader, order, val_loader) -> tuple:
    """``(train, val)``: the evaluation's pass begins while the epoch's last steps run, where loader processes read it.

    Begun by the evaluation itself, its first batch would wait for one loader process to read a
    whole batch alone (1.2-1.6 s an evaluation of the PIL pipeline on one H100, against 0.05 s
    for the tensor pipeline's). Without loader processes there is nothing to begin ahead.
    """
    if val_loader.num_workers == 0:
        return D.EpochLoader(train_loader, order), val_loader
    val = PassAhead(val_loader)
    return D.EpochLoader(train_loader, order, near_end=val.start), val


def _decode_loaders(cfg: TrainConfig, ctx, train_s, val_s) -> Loaders:
    """Loader processes read the files' bytes and draw each image's box; each batch is decoded and
    augmented on the device (:mod:`nbddp.tasks.classification.decode_data`), every image seeded by
    (seed, epoch, image) as in the PIL pipeline."""
    from . import decode_data as DD
    from .crops import Crops

    cuda = ctx.device.type == "cuda"
    workers = cfg.num_workers
    if workers is None:  # reading bytes is light: a few processes feed a GPU
        workers = min(4, D.loader_workers(ctx.world_size, at_least=1)) if cuda else 0
    sampler = DistributedSampler(range(len(train_s)), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=cfg.seed)
    order = D.SkipSampler(D.SeededSampler(sampler, cfg.seed))
    common = dict(pin_memory=cuda, persistent_workers=cfg.persistent_workers and workers > 0,
                  **D.loader_processes(workers))
    train_loader, val_loader = DD.decode_loaders(
        train_s, val_s, order, cfg.batch_size, D.ShardSampler(len(val_s), ctx.rank, ctx.world_size), common,
        train_crops=Crops(cfg.image_size, True, cfg.crop_scale, cfg.hflip), val_crops=Crops(cfg.image_size, False),
        generator=torch.Generator().manual_seed(cfg.seed))
    return Loaders(order, *_evaluation_ahead(train_loader, order, val_loader),
                    DD.DeviceDecoder(ctx.device, cfg.image_size, True, cfg.crop_scale, cfg.hflip),
                    DD.DeviceDecoder(ctx.device, cfg.image_size, False))


def _tensor_loaders(cfg: TrainConfig, ctx, train_s, val_s) -> Loaders:
    from . import tensor_data as TD

    workers = D.loader_workers(ctx.world_size) if cfg.num_workers is None else cfg.num_workers
    train_cache = TD.TensorCache(train_s, cfg.image_size, ctx.device, workers)
    val_cache = TD.TensorCache(val_s, cfg.image_size, ctx.device, workers)
    order = D.SkipSampler(DistributedSampler(train_cache, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                             seed=cfg.seed))
    train_loader = TD.TensorBatches(train_cache, order, cfg.batch_size, drop_last=True)
    val_loader = TD.TensorBatches(val_cache, D.ShardSampler(len(val_cache), ctx.rank, ctx.world_size),
                                  cfg.batch_size)
    return Loaders(order, D.EpochLoader(train_loader, order), val_loader,
                    TD.BatchAugment(cfg.image_size, cfg.crop_scale, cfg.hflip), TD.CenterCropNormalize(cfg.image_size))


def load_data(cfg: TrainConfig, ctx, clock=None) -> TaskData:
    """The class folders read and split, and this rank's loaders; ``clock`` (a ``startup.LaunchClock``) notes both."""
    classes, samples = D.scan_class_folders(cfg.data_path)
    train_s, val_s = D.split_samples(samples, cfg.val_fraction, cfg.seed)
    if clock is not None:
        clock.mark("data_scan")
    if ctx.is_main:
        rundir.write_class_indices(ctx.run_dir, classes)
        data_record.write(ctx.run_dir, data_record.describe(str(cfg.data_path), classes, samples, cfg.val_fraction,
                                                            cfg.seed))
        print(f"data: {len(classes)} classes, {len(train_s)} train / {len(val_s)} val images; "
              f"{ctx.world_size} x {ctx.device.type} ({ctx.backend})", flush=True)
    loaders = make_loaders(cfg, ctx, train_s, val_s)
    if clock is not None:
        clock.mark("cache_build")
    return TaskData(classes, cfg.num_classes or len(classes), train_s, val_s, loaders)


__all__ = ["Loaders", "TaskData", "make_loaders", "load_data"]
