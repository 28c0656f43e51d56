"""The warm forkserver: multiprocessing's forkserver with torch and DDP imported once.

``spawn_train``'s workers fork from it, a fresh interpreter (never a fork of the kernel).
"""

from __future__ import annotations

#: What the forkserver imports once, so that forked workers start with it in memory: torch,
#: the distributed stack, DDP (whose constructor otherwise imports torch._dynamo, 1-2 s) and
#: nbddp's worker side. Never torch.cuda initialisation: the server only imports.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "torchvision", "nbddp.runtime", "nbddp.tasks.classification"]

_prepared = False


def prepare() -> None:
    """Set the preload list of multiprocessing's forkserver (before it starts; idempotent)."""
    global _prepared
    if not _prepared:
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        _prepared = True
