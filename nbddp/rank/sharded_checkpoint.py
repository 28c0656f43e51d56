"""Checkpoints that hold modules and optimizers: ``ctx.save_checkpoint({"model": model, "optimizer": opt, ...})``.

A state that names modules and optimizers is written with ``torch.distributed.checkpoint``
(DCP): every rank writes its own shard of the parameters and optimizer state, in parallel, into
``checkpoints/<name>.dcp/`` (a folder: DCP's ``.metadata``, one ``.distcp`` file per rank, and
``extra.pt``, the state's plain values, weights-only). Loading reads the shards a rank needs
for the current sharding, so a run saved on 2 ranks resumes on 1 or 3: DCP reshards.

Atomic as a ``.pt`` checkpoint is: every rank writes into a temporary sibling folder, the ranks
agree that every write succeeded, then rank 0 swaps the folder in with two renames (the old
checkpoint, then the new, never a mix), so a half-written checkpoint is never ``last``.

Private whatever the umask, since DCP's files are pickles (``.metadata`` is read by a plain
``pickle.load``, and a shard's non-tensor entries by ``torch.load(weights_only=False)``): the
folders are made ``0700`` and the files ``0600`` (:class:`_PrivateFiles`), and a load opens every
file through descriptors checked to be the user's and writable by no one else, from the run folder
down; anything else is refused by name before a byte of it is unpickled.

Modules are stored under their state dict keys without wrapper prefixes (DDP's ``module.``,
compile's ``_orig_mod.``) and optimizers by parameter name (``get_state_dict``), so a DDP run's
checkpoint loads into a sharded model and back. This module never imports the kernel side.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..contract import rundir
from ..contract.errors import ConfigError, WeightsError
from ..contract.private import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, NotPrivate, private_folder

#: The suffix of a sharded checkpoint's folder: ``checkpoints/last.dcp/``.
DCP_SUFFIX = ".dcp"
#: The plain values of the state (step, epoch, config...), beside the shards.
EXTRA = "extra.pt"


def dcp_path(run_dir: Any, name: str) -> Path:
    """``checkpoints/<name>.dcp``: the folder of a checkpoint that holds modules and optimizers."""
    return rundir.checkpoints_dir(run_dir) / f"{name}{DCP_SUFFIX}"


def _private_files(run_dir: Path):
    """DCP's file system for this run: written private, read only through checked descriptors."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from ..contract.checkpoint import open_in_run

    class _PrivateFiles(FileSystem):
        """Folders ``0700`` and files ``0600`` whatever the umask; a file read is opened through
        descriptors checked from the run folder down (:func:`nbddp.contract.checkpoint.open_in_run`)."""

        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if mode == "rb":
                with open_in_run(path, run_dir) as stream:
                    yield stream
                return
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
            with os.fdopen(fd, mode) as stream:
                yield stream

        def mkdir(self, path) -> None:
            os.makedirs(path, PRIVATE_DIR_MODE, exist_ok=True)

    return _PrivateFiles()


def _writer(run_dir: Path, folder: Path):
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(folder))
    writer.fs = _private_files(run_dir)
    return writer


def _reader(run_dir: Path, folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(folder))
    reader.fs = _private_files(run_dir)
    return reader


def split_state(state: Dict[str, Any]) -> Tuple[Dict[str, nn.Module], Dict[str, torch.optim.Optimizer], dict]:
    """``(modules, optimizers, rest)`` of a checkpoint's top-level entries."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    return modules, optimizers, rest


def _owner(optimizer: torch.optim.Optimizer, modules: Dict[str, nn.Module], key: str) -> nn.Module:
    """The module whose parameters ``optimizer`` updates (``get_optimizer_state_dict`` names them through it)."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules.values():
        if params & {id(p) for p in module.parameters()}:
            return module
    raise ConfigError(f"checkpoint entry {key!r}: none of the checkpoint's modules ({', '.join(modules) or 'none'}) "
                      "holds the parameters this optimizer updates; put the model it trains in the same dict, e.g. "
                      "{'model': model, 'optimizer': optimizer}")


def _refuse_stateless(modules: Dict[str, nn.Module]) -> None:
    """A module without parameters or buffers has nothing to save (torch: "model state_dict is empty")."""
    for key, module in modules.items():
        if not any(True for _ in module.state_dict()):
            raise ConfigError(f"checkpoint entry {key!r}: this {type(module).__name__} has no parameters or buffers, "
                              "so there is nothing of it to save; leave it out of the checkpoint, or save the model "
                              "that holds the weights")


def _state_dicts(modules: Dict[str, nn.Module], optimizers: Dict[str, torch.optim.Optimizer]) -> dict:
    """Collective: each module's and optimizer's state dict, sharded tensors as shards (nothing gathered)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from .sharding import unwrap

    out: dict = {k: get_model_state_dict(unwrap(m)) for k, m in modules.items()}
    for k, opt in optimizers.items():
        out[k] = get_optimizer_state_dict(unwrap(_owner(opt, modules, k)), opt)
    return out


def _broadcast_name(name: Optional[str]) -> str:
    """Rank 0's choice of a name, known to every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return name
    from .dist import cpu_group

    box = [name]
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    return box[0]


def save(run_dir: Path, name: str, state: Dict[str, Any], is_main: bool) -> Path:
    """Collective: write ``state`` (modules, optimizers, plain values) as ``checkpoints/<name>.dcp``.

    Returns:
        The checkpoint's folder (on every rank).

    Raises:
        The error of the rank whose write failed on that rank; ``PeerError`` on the others. The
        temporary folder is gone either way, and the previous checkpoint stays whole.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..contract.checkpoint import _remove_stale_export_dirs, _swap_in, atomic_save, to_plain
    from .dist import agree_on_error, barrier

    modules, optimizers, rest = split_state(state)
    _refuse_stateless(modules)  # before any rank writes: every rank refuses the same state
    target = dcp_path(run_dir, name)
    made, error = None, None
    if is_main:
        try:
            private_folder(target.parent, "the run's checkpoints", replace=True)
            _remove_stale_export_dirs(target)  # left by a run killed between its writes and its swap
            made = target.with_name(f".{target.name}{rundir.TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
            os.mkdir(made, PRIVATE_DIR_MODE)  # 0700 whatever the umask: the ranks write their shards in it
        except OSError as exc:  # NotPrivate too: every rank learns of it below
            made, error = None, exc
    try:  # from here on, whatever ends the save (a peer gone at a stop included) removes the folder
        work = _broadcast_name(str(made) if made is not None else None)  # None: rank 0 failed, all skip
        try:
            if work is not None:
                extra = to_plain(rest)  # refused (TypeError) before any shard is written
                # Every rank writes its own shard: no rank gathers the model.
                dcp.save(_state_dicts(modules, optimizers), storage_writer=_writer(run_dir, Path(work)))
                if is_main:
                    atomic_save(extra, Path(work) / EXTRA, mode=PRIVATE_FILE_MODE)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every rank learns of it below
            error = _refusal(exc)
        agree_on_error(error, f"saving checkpoint {target.name}")
        if is_main:
            try:
                _swap_in(made, target)
            except OSError as exc:
                error = exc
        agree_on_error(error, f"saving checkpoint {target.name}")
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    barrier()
    return target


def _refusal(exc: BaseException) -> BaseException:
    """A ``NotPrivate`` among the failures DCP's ``CheckpointException`` gathered from every rank (the
    refusal naming a file, on every rank alike), else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, NotPrivate):
                return inner
    return exc


def _incomplete(folder: Path, exc: BaseException) -> WeightsError:
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[-1] if text else 'no details'}"
    return WeightsError(f"cannot read checkpoint {folder} ({detail}); it is incomplete or corrupt (a file missing "
                        "or cut short): use another checkpoint, or start without it. Its files are kept.")


def _metadata(run_dir: Path, folder: Path):
    try:
        return _reader(run_dir, folder).read_metadata()
    except NotPrivate:
        raise
    except Exception as exc:  # noqa: BLE001 - a missing or torn .metadata: one clear error
        raise _incomplete(folder, exc) from None


def _check_same_architecture(run_dir: Path, folder: Path, modules: dict, optimizers: dict) -> None:
    """Refuse a checkpoint of another architecture before reading any shard, naming the differences."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = _metadata(run_dir, folder).state_dict_metadata
    held = sorted({k.split(".", 1)[0] for k in stored})
    for key in list(modules) + list(optimizers):
        if not any(k.startswith(f"{key}.") for k in stored):
            raise ConfigError(f"checkpoint {folder} holds no {key!r} (it holds: {', '.join(held)}); save it under "
                              "that name, or load the entries it holds")
    for key, wanted in modules.items():
        prefix = f"{key}."
        have = {k[len(prefix):]: v for k, v in stored.items()
                if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
        mine = {k: v for k, v in wanted.items() if isinstance(v, torch.Tensor)}
        missing = sorted(set(mine) - set(have))
        unexpected = sorted(set(have) - set(mine))
        shapes = [f"{k}: checkpoint {list(have[k].size)}, model {list(v.size())}" for k, v in mine.items()
                  if k in have and tuple(have[k].size) != tuple(v.size())]
        if missing or unexpected or shapes:
            parts = ([f"{len(missing)} of the model's tensors missing (first: {missing[0]})"] if missing else []) + \
                    ([f"{len(unexpected)} not in the model (first: {unexpected[0]})"] if unexpected else []) + \
                    ([f"{len(shapes)} of other shapes ({shapes[0]})"] if shapes else [])
            raise ConfigError(f"checkpoint {folder} holds another architecture than {key!r}: {'; '.join(parts)}. "
                              "Load it into the model it was saved from (same class and sizes), or start a new run "
                              "(another run folder, or resume=False).")


def load(run_dir: Path, name: str, into: Dict[str, Any]) -> Optional[dict]:
    """Collective: load ``checkpoints/<name>.dcp`` into the modules and optimizers of ``into``, in place.

    Each rank reads the pieces of the shards its current sharding needs (DCP reshards), so the
    world size may differ from the run that saved it.

    Returns:
        The checkpoint's plain values (the rest of the state), or ``None`` when there is no such checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from ..contract.checkpoint import load_checkpoint
    from .sharding import unwrap

    folder = dcp_path(run_dir, name)
    if not folder.is_dir():
        return None
    modules, optimizers, rest = split_state(into)
    if rest:
        raise ConfigError(f"ctx.load_checkpoint({{...}}) loads into modules and optimizers; {', '.join(map(repr, rest))} "
                          "are neither: leave them out, they come back in the returned dict")
    wanted = _state_dicts(modules, optimizers)
    _check_same_architecture(run_dir, folder, {k: wanted[k] for k in modules}, optimizers)
    try:  # every file through the checked reader: a shard's own pickles as well as .metadata
        dcp.load(wanted, storage_reader=_reader(run_dir, folder))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP gathers every rank's failure
        error = _refusal(exc)
        if isinstance(error, NotPrivate):
            raise error from None
        raise _incomplete(folder, _innermost(exc)) from None
    for k, m in modules.items():
        set_model_state_dict(unwrap(m), wanted[k])
    for k, opt in optimizers.items():
        set_optimizer_state_dict(unwrap(_owner(opt, modules, k)), opt, wanted[k])
    extra = folder / EXTRA
    return load_checkpoint(extra, run_dir=run_dir) if extra.is_file() else {}


def _innermost(exc: BaseException) -> BaseException:
    """The first rank's error inside DCP's ``CheckpointException`` (a truncated shard's ``EOFError``), else ``exc``."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        return failure[0] if isinstance(failure, tuple) else failure
    return exc


def load_plain_into(state: dict, into: Dict[str, Any], path: Path) -> dict:
    """A ``.pt`` checkpoint's state dicts loaded into the modules and optimizers of ``into``; returns the rest."""
    from .sharding import load_full_state_dict, unwrap

    modules, optimizers, _ = split_state(into)
    for k in list(modules) + list(optimizers):
        if k not in state:
            raise ConfigError(f"checkpoint {path} holds no {k!r} (it holds: {', '.join(map(str, state))})")
    for k, m in modules.items():
        load_full_state_dict(unwrap(m), state[k])
    for k, opt in optimizers.items():
        opt.load_state_dict(state[k])
    return {k: v for k, v in state.items() if k not in modules and k not in optimizers}


def checkpoint_kinds(run_dir: Path, name: str) -> List[Path]:
    """The checkpoints named ``name`` in the run: its ``.dcp`` folder and its ``.pt`` file, those that exist."""
    return [p for p in (dcp_path(run_dir, name), rundir.checkpoint_path(run_dir, name)) if p.exists()]


__all__ = ["DCP_SUFFIX", "dcp_path", "save", "load", "split_state"]
