"""A rank start-up hook (NBDDP_RANK_HOOK) that watches when the built-in worker's evaluation batches are read.

Every image a loader reads (PIL or decode pipeline) is noted in the file ``$NBDDP_PROBE``, one line
appended by whichever process reads it: ``item <pid> <dataset id> <index>``. Each epoch's
evaluation (not the final pass) first notes ``eval-begin <dataset id>`` and waits (up to
``$NBDDP_PROBE_WAIT_S``) for an item of its dataset read since the last ``eval-end``: it notes
``ahead yes`` or ``ahead no`` (once one is ``no``, the later ones no longer wait). It then
evaluates on the loader it was given and once more on a new pass of the ``DataLoader`` itself,
begun by nobody ahead, and notes both results, ``given <accuracy> <loss> <count>`` and
``fresh ...`` (floats as hex: exact), then ``eval-end``.
"""

import os
import time


def install(rank: int) -> None:
    from nbddp.tasks.classification import decode_data, images
    from nbddp.tasks.classification import worker as W

    path = os.environ["NBDDP_PROBE"]
    wait_s = float(os.environ.get("NBDDP_PROBE_WAIT_S", "30"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def note(text: str) -> None:
        os.write(fd, f"{text}\n".encode())

    image_item, encoded_items, evaluate = (images.ImageListDataset.__getitem__,
                                           decode_data.EncodedImages.__getitems__, W.evaluate)

    def image(self, index):
        note(f"item {os.getpid()} {id(self)} {index}")
        return image_item(self, index)

    def encoded(self, keys):
        for key in keys:
            note(f"item {os.getpid()} {id(self)} {key[0] if isinstance(key, tuple) else key}")
        return encoded_items(self, keys)

    missed = []

    def read_since_last_evaluation(dataset_id: str) -> bool:
        with open(path) as f:
            lines = [line.split() for line in f]
        ends = [i for i, line in enumerate(lines) if line[0] == "eval-end"]
        since = lines[ends[-1] + 1:] if ends else lines
        return any(line[0] == "item" and line[2] == dataset_id for line in since)

    def result(tag: str, ev) -> str:
        return f"{tag} {float(ev.accuracy).hex()} {float(ev.loss).hex()} {ev.count}"

    def probed_evaluate(model, loader, *args, **kwargs):
        if kwargs.get("gather_predictions"):  # the final pass
            return evaluate(model, loader, *args, **kwargs)
        dataset_id = str(id(loader.dataset))
        note(f"eval-begin {dataset_id}")
        deadline = time.monotonic() + (0 if missed else wait_s)
        seen = read_since_last_evaluation(dataset_id)
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = read_since_last_evaluation(dataset_id)
        if not seen:
            missed.append(1)
        note(f"ahead {'yes' if seen else 'no'}")
        given = evaluate(model, loader, *args, **kwargs)
        fresh = evaluate(model, getattr(loader, "loader", loader), *args, **kwargs)
        note(result("given", given))
        note(result("fresh", fresh))
        note("eval-end")
        return given

    images.ImageListDataset.__getitem__ = image
    decode_data.EncodedImages.__getitems__ = encoded
    W.evaluate = probed_evaluate
