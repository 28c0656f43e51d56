"""The fault matrix, injected through nbddp's per-rank start-up hook (``NBDDP_RANK_HOOK``).

``NBDDP_FAULT`` lists ``"<where>:<rank>:<action>"`` items, comma-separated; :func:`install` runs
first thing in every rank (``nbddp.rank.process.run_rank_hook``) and arms the items of its own rank by
wrapping what the rank calls at that point. ``conftest.fault_env(spec)`` builds the environment
that turns it on. Nothing here is in nbddp's own code paths.

where:
    ``entry``         at once, in the hook: before the rank's log, process group or worker
    ``start``         just before the process group is set up (inside nbddp's error handling)
    ``run``           after the process group is up, just before the worker function is called
    ``step<E>.<S>``   at the top of training step S of epoch E, once its heartbeat is written
                      and before its batch moves to the device
    ``epoch<E>``      once the ranks agreed that epoch E's checkpoint was saved and it is on
                      disk (``last.pt`` holds epoch E)
    ``nan<E>.<S>``    (action ``on``) the loss of step S of epoch E is NaN on this rank alone
    ``diskfull<E>``   (action ``on``) saving epoch E's ``last.pt`` fails with ENOSPC

action: ``raise`` (RuntimeError), ``oom`` (``torch.OutOfMemoryError``), ``exit3`` (``os._exit(3)``),
``sigkill``, ``hang``, ``stop`` (at a
``step``: the stop request a Stop or an Interrupt makes, seen by this rank at that very step, so
every rank leaves the epoch after it), or ``on``.

Under torchrun/srun, and with ``max_restarts``, the faults apply to the first attempt only, so
that a restart can recover.
"""

import errno
import os
import re
import signal
import sys
import time
from pathlib import Path

FAULT_ENV = "NBDDP_FAULT"
_ACTIONS = ("raise", "exit3", "sigkill", "hang", "stop", "oom")
_FLAGS = ("nan", "diskfull")

#: The rank's Context, recorded when the rank creates it: where training is (epoch, step, phase).
_rank_ctx = None


def _act(action: str, rank: int) -> None:
    if action == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if action == "oom":  # what the CUDA caching allocator raises (a RuntimeError), on the CPU
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank {rank})")
    if action == "exit3":
        os._exit(3)
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        while True:
            time.sleep(1)
    if action == "stop":
        from nbddp.contract.protocol import write_stop_request

        write_stop_request(_rank_ctx.run_dir, "stop")  # what RunHandle.stop() writes
        _rank_ctx._stop_checked = 0.0  # looked at in this step's agreement, not up to 0.2 s later


def _parse(spec: str, rank: int) -> dict:
    """``{where: action}`` of this rank's items; refuses what it does not know."""
    mine = {}
    for item in filter(None, (i.strip() for i in spec.split(","))):
        where, f_rank, action = item.split(":")
        kind = re.match(r"[a-z]+", where).group(0)
        known = (action == "on") if kind in _FLAGS else (action in _ACTIONS)
        if not known or kind not in ("entry", "start", "run", "step", "epoch", *_FLAGS):
            raise ValueError(f"{FAULT_ENV}: cannot inject {item!r}")
        if int(f_rank) == rank:
            mine[where] = action
    return mine


def _training_at(epoch: int, step: int) -> bool:
    """This rank is in training step ``step`` of epoch ``epoch`` (its last heartbeat says so)."""
    ctx = _rank_ctx
    return ctx is not None and ctx.phase == "train" and (ctx.epoch, ctx.step) == (epoch, step)


def install(rank: int) -> None:
    """The rank hook: arm this rank's faults from ``$NBDDP_FAULT``."""
    if any(os.environ.get(v, "0") != "0" for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT",
                                                      "NBDDP_RESTART_COUNT")):
        return  # a launcher's restart (or nbddp's own, max_restarts): let it recover
    faults = _parse(os.environ.get(FAULT_ENV, ""), rank)
    if "entry" in faults:
        _act(faults.pop("entry"), rank)
    if faults:
        _record_context()
    for where, action in faults.items():
        kind, numbers = re.fullmatch(r"([a-z]+)([\d.]*)", where).groups()
        at = tuple(int(n) for n in numbers.split(".")) if numbers else ()
        _ARM[kind](rank, action, *at)


def _record_context() -> None:
    from nbddp.rank import runtime

    init = runtime.Context.__init__

    def recording_init(self, *args, **kwargs):
        global _rank_ctx
        init(self, *args, **kwargs)
        _rank_ctx = self

    runtime.Context.__init__ = recording_init


def _wrap_run_rank(wrap) -> None:
    """Replace ``run_rank`` (spawn_train's and elastic's) by ``wrap(run_rank)``."""
    from nbddp.rank import runtime

    faulty_run_rank = wrap(runtime.run_rank)
    for module in (runtime, sys.modules.get("nbddp.rank.elastic")):
        if module is not None:
            module.run_rank = faulty_run_rank


def _arm_start(rank: int, action: str) -> None:
    """Wrap the process-group set-up that ``run_rank`` receives."""

    def wrap(run_rank):
        def faulty_run_rank(ctx, init_process_group, *args, **kwargs):
            def init():
                _act(action, rank)
                init_process_group()

            return run_rank(ctx, init, *args, **kwargs)

        return faulty_run_rank

    _wrap_run_rank(wrap)


def _arm_run(rank: int, action: str) -> None:
    """Wrap the worker function ``run_rank`` runs: called after the process group is up."""
    from nbddp.contract.targets import load_target

    def wrap(run_rank):
        def faulty_run_rank(ctx, init_process_group, target, *args, **kwargs):
            def faulty_target(*a, **kw):
                fn = load_target(target) if isinstance(target, str) else target
                _act(action, rank)
                return fn(*a, **kw)

            return run_rank(ctx, init_process_group, faulty_target, *args, **kwargs)

        return faulty_run_rank

    _wrap_run_rank(wrap)


def _arm_step(rank: int, action: str, epoch: int, step: int) -> None:
    """The engine's first act of a step after its heartbeat is moving the batch to the device."""
    from nbddp.rank import engine

    prepare = engine._prepare

    def faulty_prepare(*args, **kwargs):
        if _training_at(epoch, step):
            _act(action, rank)
        return prepare(*args, **kwargs)

    engine._prepare = faulty_prepare


def _arm_nan(rank: int, action: str, epoch: int, step: int) -> None:
    """The training loss of that step is NaN on this rank (evaluation's losses are untouched)."""
    import torch.nn.functional as F

    cross_entropy = F.cross_entropy

    def nan_cross_entropy(*args, **kwargs):
        loss = cross_entropy(*args, **kwargs)
        return loss * float("nan") if _training_at(epoch, step) else loss

    F.cross_entropy = nan_cross_entropy


def _arm_diskfull(rank: int, action: str, epoch: int) -> None:
    """Rank 0's save of epoch ``epoch``'s ``last.pt`` fails as on a full disk."""
    from nbddp.contract import rundir
    from nbddp.tasks.classification import worker as classification

    save = classification.save_run_checkpoint

    def full_save(obj, path, *args, **kwargs):
        if Path(path) == rundir.checkpoint_path(_rank_ctx.run_dir, rundir.LAST) and obj.get("epoch") == epoch:
            raise OSError(errno.ENOSPC, f"No space left on device (injected) writing {path}")
        return save(obj, path, *args, **kwargs)

    classification.save_run_checkpoint = full_save


def _arm_epoch(rank: int, action: str, epoch: int) -> None:
    """After the ranks agreed on epoch ``epoch``'s checkpoint and it is on disk (rank 0 writes it in the
    background: the fault waits for the write), the next epoch not begun."""
    from nbddp.tasks.classification import worker as classification

    agree_on_error = classification.agree_on_error

    def faulty_agree_on_error(*args, **kwargs):
        agree_on_error(*args, **kwargs)
        # ctx.log(epoch=...) of this epoch's metrics set the epoch; the epoch's own save comes
        # after its evaluation (a checkpoint in the middle of the epoch is in its training phase).
        if _rank_ctx.epoch == epoch and _rank_ctx.phase != "train":
            if _rank_ctx.background_writer is not None:
                _rank_ctx.background_writer.wait()
            _act(action, rank)

    classification.agree_on_error = faulty_agree_on_error


_ARM = {"start": _arm_start, "run": _arm_run, "step": _arm_step, "nan": _arm_nan, "diskfull": _arm_diskfull,
        "epoch": _arm_epoch}
