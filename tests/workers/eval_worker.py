"""Distributed evaluation of a fixed-seed model, to compare with a single process."""

import torch

from nbddp.tasks.classification import data as D
from nbddp.rank.engine import evaluate
from nbddp.tasks.classification.models import build_model


def val_loader(root, rank, world, image_size=32, batch_size=4):
    classes, samples = D.scan_class_folders(root)
    _, val_tf = D.build_transforms(image_size)
    ds = D.ImageListDataset(samples, val_tf)
    return len(classes), torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=D.ShardSampler(len(ds), rank, world))


def seeded_model(num_classes):
    torch.manual_seed(123)
    model = build_model("resnet18", num_classes)
    model.eval()
    return model


def exact_eval(ctx, root):
    n, loader = val_loader(root, ctx.rank, ctx.world_size)
    r = evaluate(seeded_model(n), loader, ctx.device, gather_predictions=True)
    return {"accuracy": r.accuracy, "loss": r.loss, "count": r.count, "predictions": r.predictions}


def buffers_after_sync(ctx):
    """Each rank's BatchNorm statistics drift apart; after the sync all equal rank 0's."""
    from nbddp.rank.dist import sync_buffers_from_main

    model = seeded_model(3)
    model.train()
    torch.manual_seed(ctx.rank)  # a different batch per rank, as after a training step
    model(torch.randn(4, 3, 32, 32))
    def gather():
        out = [torch.empty_like(model.bn1.running_mean) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(out, model.bn1.running_mean)
        return out

    before = gather()
    sync_buffers_from_main(model)
    after = gather()
    return {"differed": not torch.equal(before[0], before[1]),
            "equal_after": all(torch.equal(before[0], g) for g in after)}


class _HangOn:
    """A loader that hangs (in Python) at its first batch on one rank."""

    def __init__(self, loader, hang: bool):
        self.loader, self.hang, self.sampler = loader, hang, loader.sampler

    def __iter__(self):
        for batch in self.loader:
            while self.hang:
                import time

                time.sleep(0.5)
            yield batch


def hang_in_eval(ctx, root, rank: int = 1):
    """Both ranks evaluate with heartbeats; ``rank`` hangs in its first validation batch."""
    n, loader = val_loader(root, ctx.rank, ctx.world_size)
    ctx.heartbeat(epoch=0, step=5)  # as after an epoch's training steps
    evaluate(seeded_model(n), _HangOn(loader, ctx.rank == rank), ctx.device, ctx=ctx)
    return "not reached"


def warn_once(ctx):
    """A warning from the worker's own code and one raised through a wrapper frame."""
    import functools
    import warnings

    def wrapped(func):
        @functools.wraps(func)
        def inner(*args, **kwargs):
            return func(*args, **kwargs)
        return inner

    @wrapped
    def deprecated():
        warnings.warn("old API, use the new one", FutureWarning, stacklevel=2)

    warnings.warn("a worker warning\nwith a second line", UserWarning)
    deprecated()
    return 1
