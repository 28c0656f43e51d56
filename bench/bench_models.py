"""Model and data shared by every side of the benchmarks, so the comparisons are like for like."""

import torch
import torch.nn as nn


def build(name: str, num_classes: int = 10) -> nn.Module:
    if name == "small_cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(128, num_classes))
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def batches(data: str, image_size: int, batch_size: int, rank: int, world: int, steps: int):
    """``steps`` batches: synthetic tensors already in memory, or real images from a class-folder tree."""
    if data == "synthetic":
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(0, 10, (batch_size,), generator=g)
        for _ in range(steps):
            yield x, y
        return
    import torchvision.transforms as T
    from torch.utils.data import DataLoader, DistributedSampler
    from torchvision.datasets import ImageFolder

    tf = T.Compose([T.RandomResizedCrop(image_size, scale=(0.5, 1.0)), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = ImageFolder(data, transform=tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True)
    yield from repeat_epochs(loader, sampler, steps)


def repeat_epochs(loader, sampler, steps: int):
    """``steps`` batches of ``loader``, starting a new shuffled epoch whenever one ends."""
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for xy in loader:
            yield xy
            done += 1
            if done == steps:
                return
        epoch += 1
