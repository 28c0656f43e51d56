"""The built-in worker: image classification with DDP (``TrainConfig``).

==================  ======  =============================================================
module              runs    what it does
==================  ======  =============================================================
``planning``        kernel  ``plan(cfg)``: every input checked before a process starts
``worker``          rank    ``train(ctx, cfg)``: the training loop, checkpoints, export
``data``            both    class folders, samplers, transforms, image loading
``tensor_data``     rank    the decoded tensor cache
``decoded_store``   rank    the decoded images kept between launches (private cache folder)
``decode_data``     rank    file bytes decoded and augmented batch by batch on the device
``crops``           both    each image's augmentation box, drawn from its seed (loader processes)
``resize``          rank    the decode pipeline's resize: image by image, or a batch in a few calls
``startup``         both    a launch's fixed costs, one number each
``models``          both    torchvision models, weights files (training and prediction)
==================  ======  =============================================================

Importing this package loads none of them; a name of the module this folder was before
(``nbddp.tasks.classification:train``, ``preflight``, ``plan``) is found in its new module on first
use.
"""

_WHERE = ("planning", "worker")


def __getattr__(name):
    import importlib

    if name.startswith("__"):  # a probe (copy, inspect, doctest), not a name of the old module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    for sub in _WHERE:
        module = importlib.import_module(f"{__name__}.{sub}")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
