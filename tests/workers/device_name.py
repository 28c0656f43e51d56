"""A per-rank start-up hook (``NBDDP_RANK_HOOK``) that names a CPU rank's device as a GPU of nbddp's peak table.

Only the name the MFU looks up changes (``nbddp.rank.flops.device_name``); the rank still trains
on its CPU. ``$NBDDP_FAKE_DEVICE_NAME`` is the name (default: an H100 SXM's).
"""


def install(rank):
    import os

    from nbddp.rank import flops

    name = os.environ.get("NBDDP_FAKE_DEVICE_NAME", "NVIDIA H100 80GB HBM3")
    flops.device_name = lambda device: name
