"""Checkpoint and weights files: atomic writes, weights-only loads, exports.

Used by the notebook kernel and by the workers, so it imports nothing from the UI.

Two rules hold everywhere in this module:

* Every file is written atomically (temp file in the same folder, fsync, ``os.replace``), so a
  crash or a failing ``torch.save`` never leaves a half-written checkpoint in place of a good one.
* Every file is read with ``torch.load(..., weights_only=True)`` and never retried with
  ``weights_only=False``: unpickling arbitrary objects can run arbitrary code. That is why
  checkpoints hold only plain values (see :func:`to_plain`).

A run's checkpoints are the user's alone: written ``0600`` into a ``0700`` ``checkpoints/``
whatever the umask, and read on resume only through descriptors checked to be the user's and
writable by no one else (:func:`load_checkpoint` with ``run_dir``), so a group member of a
group-writable project folder can neither rewrite one nor swap in her own. A write is never cut by
an Interrupt (:func:`uninterrupted`): the stop takes effect once the file is whole.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import os
import hashlib
import pickle
import secrets
import shutil
import signal
import stat
import threading
import time
import warnings
from pathlib import Path
from typing import AbstractSet, Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .errors import ConfigError, WeightsError
from .paths import PathLike, pseudo_filesystem, special_file_kind
from .private import PRIVATE_FILE_MODE, _aside, open_private_below, owner, private_folder
from .rundir import (TMP_MARK, CLASS_INDICES, EXPORT, EXPORT_DEPLOY_FILES, EXPORT_FILES, EXPORT_META, EXPORT_PTH,  # noqa: F401
                     EXPORT_SAFETENSORS, fsync_dir, temp_writer_alive, atomic_write, atomic_write_text,
                     cleanup_temp_files, write_class_indices)


#: Where :func:`resolve_weights_path` looks inside a folder, first match wins: a run's export
#: (safetensors first: it cannot hold code and loads without unpickling), then an export folder.
WEIGHTS_SEARCH_ORDER = (
    f"{EXPORT}/{EXPORT_SAFETENSORS}",
    f"{EXPORT}/{EXPORT_PTH}",
    EXPORT_SAFETENSORS,
    EXPORT_PTH,
)

#: Prefixes that wrappers add in front of every key: DDP / DataParallel and ``torch.compile``.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")

#: Why a run's checkpoint must be the user's alone, for the refusal's message.
CHECKPOINT_IS_PRIVATE = ("nbddp resumes only from checkpoints that are yours alone, since loading one can run "
                         "code as you (a sharded checkpoint's files are pickles) or put another's weights in your run")


# ---------------------------------------------------------------------------- no Interrupt inside a write
@contextlib.contextmanager
def uninterrupted(stop_requested: Optional[Callable[[], bool]] = None):
    """A checkpoint write that an Interrupt cannot cut: SIGINT is held until the body ends, then delivered.

    The rank's SIGINT handler (a ``KeyboardInterrupt`` between two statements) is swapped for one
    that only notes the signal; once the body is done, the handler is put back and called for a
    signal that came meanwhile, so the ``KeyboardInterrupt`` is raised right after the write, never
    inside it (torch's ``CheckpointException``, a temporary folder left behind). A body that fails
    while a stop was asked for (``stop_requested()``: a peer that took its ``KeyboardInterrupt``
    outside its write left the collective) was cut by the stop: it raises ``KeyboardInterrupt`` too,
    its own error as the context. Outside the main thread (where no handler can be set, and none
    runs) it is a plain block.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous, held = signal.getsignal(signal.SIGINT), []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    except Exception as exc:
        signal.signal(signal.SIGINT, previous)
        if held or (stop_requested is not None and stop_requested()):
            raise KeyboardInterrupt(f"the checkpoint being written was dropped at the stop ({type(exc).__name__}: "
                                    f"{_first_sentence(str(exc)) or 'no details'}); the previous one is kept") from exc
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, held[0])  # the rank's own handler (or Python's): its KeyboardInterrupt, now
    elif held and previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)


# ---------------------------------------------------------------------------- atomic writes
def atomic_save(obj: Any, path: PathLike, mode: int = 0o666) -> Path:
    """``torch.save(obj, path)`` that never leaves a half-written file at ``path``.

    The object is written to ``.<name>.tmp-<pid>-<token>`` in the same folder, flushed and
    fsynced, then renamed over ``path`` with ``os.replace`` (atomic on POSIX and Windows) and
    the folder is fsynced. On any exception the temp file is removed, the exception propagates
    and the previous file at ``path`` is untouched. Missing parent folders are created.

    Args:
        obj: what to save; keep it weights-only loadable (see :func:`to_plain`).
        path: destination file.
        mode: the new file's mode, less the umask (:data:`PRIVATE_FILE_MODE` for a run's checkpoints).

    Returns:
        ``path`` as a ``Path``.
    """
    # Look torch.save up at call time (not ``from torch import save``) so tests can patch it.
    return atomic_write(path, lambda f: torch.save(obj, f), mode=mode)


def save_run_checkpoint(obj: Any, path: PathLike) -> Path:
    """:func:`atomic_save` of a run's checkpoint: ``0600`` in its ``checkpoints/`` folder made ``0700``.

    A ``checkpoints`` folder that is not the user's (a link, another user's folder swapped in) is
    moved aside with a warning and made anew; one of the user's that others may open is narrowed
    (what others put in it meanwhile is refused file by file when it is read).
    """
    path = Path(path)
    private_folder(path.parent, "the run's checkpoints", replace=True)
    return atomic_save(obj, path, mode=PRIVATE_FILE_MODE)


# ---------------------------------------------------------------------------- off the step's path
class BackgroundSaver:
    """Checkpoints written from a background thread: training goes on while the file is written.

    :meth:`save` first waits for the previous write (and raises its error: a full disk is never
    lost, only reported at the next checkpoint or at :meth:`wait`), then takes a snapshot of the
    state — CPU tensors cloned, GPU tensors copied into pinned CPU memory (kept for the next
    checkpoint of the same shapes), containers rebuilt — so that the optimizer's next in-place
    step cannot change what is being written, and hands it to a thread that writes it with
    ``write`` (default :func:`atomic_save`: temp file, fsync, rename). A crash during a write
    leaves the previous checkpoint whole. Call :meth:`wait` before the run ends or reads the file.

    With ``background=False`` (CPU ranks) the file is written at once, in the caller's thread,
    with the same error flow (a failure is raised by the next :meth:`save` or :meth:`wait`). A
    writer thread only pays where the training leaves the CPU idle (on a GPU): next to CPU
    training it competes for the cores and for the GIL, which the step's many short operations
    re-take each time (measured on 2 cores: the epochs it overlapped ran at 0.7x instead of
    losing the ~1 s the write takes).
    """

    def __init__(self, background: bool = True):
        self.background = background
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._pinned: dict = {}
        self._in_caller = False  # a write in the caller's thread is under way

    def save(self, obj: Any, path: PathLike, write: Optional[Callable[[Any, PathLike], Any]] = None,
             then: Optional[Callable[[float], None]] = None) -> None:
        """Write ``obj`` to ``path`` in the background; ``then(seconds)`` runs once it is on disk."""
        self.wait()
        if not self.background:  # nothing changes obj while it is written: no snapshot
            self._in_caller = True
            try:
                with uninterrupted():
                    self._write(obj, path, write or atomic_save, then)
            finally:
                self._in_caller = False
            return
        snapshot = self._snapshot(obj, ())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory are done
        self._thread = threading.Thread(target=self._write, args=(snapshot, path, write or atomic_save, then),
                                        name="nbddp-checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, snapshot: Any, path: PathLike, write: Callable[[Any, PathLike], Any],
               then: Optional[Callable[[float], None]]) -> None:
        t0 = time.perf_counter()
        try:
            write(snapshot, path)
            if then is not None:
                then(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - raised by the next save or wait
            self._error = exc

    def wait(self) -> None:
        """Block until the last write is on disk; raise its error, if it failed.

        An Interrupt meanwhile waits for the write too (the process would end under it)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            with uninterrupted():
                thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def writing(self) -> bool:
        return self._in_caller or (self._thread is not None and self._thread.is_alive())

    def _snapshot(self, obj: Any, key: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type == "cpu":
                return t.clone()
            buf = self._pinned.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return buf.copy_(t, non_blocking=True)
        if isinstance(obj, dict):
            return type(obj)((k, self._snapshot(v, key + (k,))) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._snapshot(v, key + (i,)) for i, v in enumerate(obj))
        return obj  # numbers, strings, None: immutable


# ---------------------------------------------------------------------------- plain values
def to_plain(obj: Any) -> Any:
    """Convert ``obj`` to values that ``torch.load(weights_only=True)`` accepts.

    Paths become ``str``; numpy scalars become Python numbers and numpy arrays CPU tensors;
    dataclasses (``TrainConfig``), ``argparse.Namespace`` and mappings become ``dict``; tuples
    (namedtuples included) stay tuples, lists and sets become lists; tensors are detached and
    moved to the CPU; enums become their value. Use it on configs and RNG states before saving.

    Example:
        >>> state = {"config": to_plain(cfg), "numpy_rng": to_plain(np.random.get_state())}

    Raises:
        TypeError: an object of another type, with where it sits (e.g. ``obj['cfg'][2]``).
    """
    return _plain(obj, "obj")


def _plain(obj: Any, where: str) -> Any:
    if obj is None or type(obj) in (bool, int, float, complex, str, bytes):
        return obj
    if isinstance(obj, enum.Enum):
        return _plain(obj.value, where)
    # Subclasses (np.float64 is a float, np.str_ a str) pickle as their own class, which the
    # weights-only unpickler refuses: rebuild the exact builtin type.
    for builtin in (bool, int, float, complex, str, bytes):
        if isinstance(obj, builtin):
            return builtin(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (torch.dtype, torch.device)):
        return obj  # both are on the weights-only allow-list
    if isinstance(obj, np.generic):
        return _plain(obj.item(), where)
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "biufc":
            return torch.from_numpy(np.ascontiguousarray(obj).copy())
        return _plain(obj.tolist(), where)  # strings, objects: no tensor dtype for them
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        return {f.name: _plain(getattr(obj, f.name), f"{where}.{f.name}") for f in fields}
    if isinstance(obj, argparse.Namespace):
        return _plain(vars(obj), where)
    if isinstance(obj, Mapping):
        return {_plain(k, f"{where} key {k!r}"): _plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, bytearray):
        return bytes(obj)
    if isinstance(obj, (list, set, frozenset)):
        items = list(obj)
        if isinstance(obj, (set, frozenset)):
            with contextlib.suppress(TypeError):
                items = sorted(items)  # a stable order when the items allow one
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(items)]
    raise TypeError(
        f"to_plain: {where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a "
        "weights-only checkpoint cannot hold; convert it to a tensor, number, string, list or dict"
    )


# ---------------------------------------------------------------------------- loading
def _first_sentence(text: str) -> str:
    """The first sentence of a (long, multi-line) torch error message."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    head, dot, _ = line.partition(". ")
    return head + dot.strip()


def _blocked_global(message: str) -> str:
    """The sentence of torch's weights-only error that names the refused class, if any."""
    for line in message.splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return _first_sentence(line)
    return ""


def _nearby_files_hint(path: Path) -> str:
    """What to check when ``path`` does not exist: the files next to it, or the working dir."""
    if path.parent.is_dir():
        nearby = sorted(p.name for p in path.parent.iterdir() if p.suffix in (".pt", ".pth", ".safetensors"))
        if nearby:
            return f"Check the path; {path.parent} holds: {', '.join(nearby[:8])}."
    return f"Check the path (relative paths start from {os.getcwd()})."


def open_in_run(path: PathLike, run_dir: PathLike):
    """``path``, a file below ``run_dir``, opened to read only if it is the user's alone (binary file object).

    Every folder from the run folder down and the file are checked on the descriptors read
    (:func:`nbddp.contract.private.open_private_below`).

    Raises:
        NotPrivate: naming the file or folder that is not the user's alone, and what to do.
        FileNotFoundError: it is missing.
    """
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(run_dir))
    # Unbuffered: torch reads a checkpoint in large pieces, and a buffer would copy each once more.
    return os.fdopen(open_private_below(Path(run_dir), relative, CHECKPOINT_IS_PRIVATE), "rb", buffering=0)


def _load_weights_only(path: PathLike, what: str = "checkpoint", run_dir: Optional[PathLike] = None) -> Any:
    """``torch.load`` with weights_only=True; every failure becomes a ``WeightsError``.

    With ``run_dir``, the file is read only through descriptors checked to be the user's alone."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"{what} file not found: {path}. {_nearby_files_hint(path)}")
    if path.is_dir():
        raise WeightsError(f"{path} is a folder, not a {what} file; pass the file inside it.")
    source = open_in_run(path, run_dir) if run_dir is not None else contextlib.nullcontext(path)
    try:
        # weights_only=True is the whole point: never retry with False, even on failure.
        with source as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise _corrupt_error(path, what, e) from e
        blocked = _blocked_global(str(e))
        raise WeightsError(
            f"{path} is not weights-only safe: it holds Python objects other than tensors and "
            f"plain containers{' (' + blocked + ')' if blocked else ''}. nbddp never unpickles "
            "such files because that can run arbitrary code. If the file was saved with "
            "torch.save(model), re-save model.state_dict(); if it holds numpy arrays, Path or "
            "Namespace objects, re-save it through nbddp.contract.checkpoint.to_plain. Do that only in a "
            "separate Python, and only if you trust where the file came from."
        ) from None
    except Exception as e:  # RuntimeError (zip), EOFError (empty), KeyError (garbage)...
        raise _corrupt_error(path, what, e) from e


def _corrupt_error(path: Path, what: str, e: BaseException) -> WeightsError:
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            return WeightsError(
                f"{what} file {path} is empty (0 bytes): it was created but never written, e.g. "
                "by a crash or a full disk. Use another checkpoint or export, or start without it."
            )
    return WeightsError(
        f"cannot read {what} {path}: the file is truncated or corrupt "
        f"({type(e).__name__}: {_first_sentence(str(e)) or 'no details'}). It was probably cut "
        "short (a crash or a full disk during a non-atomic save, or an incomplete copy); use "
        "another checkpoint or export, or start without it."
    )


def load_checkpoint(path: PathLike, run_dir: Optional[PathLike] = None) -> dict:
    """Load a checkpoint dict on the CPU, weights-only.

    Args:
        path: the checkpoint file.
        run_dir: the run folder ``path`` is in, when resuming that run: the file and every folder
            from the run folder down must then be the user's and writable by no one else, checked
            on the descriptors read (:func:`open_in_run`).

    Raises:
        WeightsError: the file is missing, truncated or corrupt, not weights-only safe (it
            would need to unpickle arbitrary objects), or does not hold a dict.
        NotPrivate: with ``run_dir``, the file or a folder on its way is not the user's alone.
    """
    obj = _load_weights_only(path, "checkpoint", run_dir)
    if not isinstance(obj, dict):
        raise WeightsError(
            f"{path} holds a {type(obj).__name__}, not a checkpoint dict; pass a file written by "
            "nbddp (or torch.save of a dict)."
        )
    return obj


# ---------------------------------------------------------------------------- state dicts
def strip_wrapper_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove leading ``module.`` (DDP, DataParallel) and ``_orig_mod.`` (torch.compile) from keys.

    Prefixes are removed repeatedly and in any order (``module._orig_mod.fc.weight`` becomes
    ``fc.weight``), so a state_dict saved from a wrapped model loads into a bare one.

    Raises:
        WeightsError: two keys collapse onto the same name.
    """
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        new = key
        while new.startswith(WRAPPER_PREFIXES):
            new = new.split(".", 1)[1]
        if new in out:
            raise WeightsError(f"two keys become {new!r} once wrapper prefixes are removed (one is {key!r})")
        out[new] = value
    return out


def extract_state_dict(obj: Any, source: str = "the state_dict") -> dict[str, torch.Tensor]:
    """The model state_dict inside ``obj``: ``obj`` itself, or its ``"model"`` entry.

    ``"state_dict"`` and ``"model_state_dict"`` entries (other libraries' checkpoints) are also
    accepted. Keys lose their wrapper prefixes (see :func:`strip_wrapper_prefixes`).

    Raises:
        WeightsError: ``obj`` is not a mapping of names to tensors; names ``source``.
    """
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict", "model_state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj:
        raise WeightsError(
            f"{source} is not a model state_dict (got {type(obj).__name__}"
            f"{', empty' if isinstance(obj, Mapping) else ''}); save model.state_dict(), or a dict "
            "with the state_dict under 'model'."
        )
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise WeightsError(
            f"{source} is not a model state_dict: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} "
            f"not a name -> tensor pair (first: {bad[0]!r}: {type(obj[bad[0]]).__name__}). Save "
            "model.state_dict(), or a dict with the state_dict under 'model'."
        )
    return strip_wrapper_prefixes(obj)


def resolve_weights_path(path: PathLike) -> Path:
    """The weights file ``path`` names: the file itself, or the first of
    :data:`WEIGHTS_SEARCH_ORDER` found inside a folder (a run folder or an export folder).

    Raises:
        WeightsError: nothing exists at ``path``, it is a FIFO, socket or device or lies on a
            pseudo-filesystem (``/proc``), or a folder holds none of the candidates.
    """
    path = Path(path)
    if not path.exists():
        raise WeightsError(
            f"weights file not found: {path}. {_nearby_files_hint(path)} Pass a .safetensors / "
            ".pth file, a run folder or an export folder."
        )
    st = path.stat()
    # Refused before anything opens them: a FIFO waits for a writer forever, /dev/zero and
    # /proc files never end or are no files at all.
    special = special_file_kind(st)
    if special:
        raise WeightsError(
            f"{path} is {special}, not a weights file: reading it could wait or run forever. Pass a "
            ".safetensors / .pth file, a run folder or an export folder.")
    kind = pseudo_filesystem(path, st)
    if kind is not None:
        raise WeightsError(
            f"{path} is on the {kind} pseudo-filesystem (the kernel's view of processes and devices), "
            "not a weights file. Pass a .safetensors / .pth file, a run folder or an export folder.")
    if not path.is_dir():
        return path
    for candidate in WEIGHTS_SEARCH_ORDER:
        if (path / candidate).is_file():
            return path / candidate
    raise WeightsError(
        f"{path} is a folder without weights: looked for {', '.join(WEIGHTS_SEARCH_ORDER)}. "
        "Pass the weights file itself, or a run folder whose training finished its export."
    )


def _is_safetensors(path: Path) -> bool:
    if path.suffix == ".safetensors":
        return True
    # A renamed file: safetensors starts with an 8-byte header length, then the JSON header.
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read(9)[8:9] == b"{"
    return False


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise _corrupt_error(path, "weights file", e) from e


def load_state_dict_file(path: PathLike) -> dict[str, torch.Tensor]:
    """Load model weights as a ``{name: tensor}`` dict on the CPU, whatever the file layout.

    Accepts a ``.safetensors`` file, a ``.pth``/``.pt`` state_dict, a full checkpoint dict
    with the state_dict under ``"model"``, or a folder: a run folder or an export folder, where
    the first of ``export/model.safetensors``, ``export/model.pth``, ``model.safetensors``,
    ``model.pth`` is used (:data:`WEIGHTS_SEARCH_ORDER`). Leading ``module.`` / ``_orig_mod.``
    are removed from the keys. ``.pth`` files are read weights-only.

    Raises:
        WeightsError: missing file, truncated or corrupt file, a file that is not weights-only
            safe, or a file that holds no state_dict; the message names the file.
    """
    file = resolve_weights_path(path)
    if _is_safetensors(file):
        return strip_wrapper_prefixes(_load_safetensors(file))
    return extract_state_dict(_load_weights_only(file, "weights"), str(file))


# ---------------------------------------------------------------------------- export
def _class_names(classes: Union[Sequence[str], Mapping[Any, Any]]) -> list[str]:
    """Class names ordered by index, from a list, ``{index: name}`` or ``{name: index}``."""
    if isinstance(classes, Mapping):
        items = list(classes.items())
        if all(isinstance(i, int) and not isinstance(i, bool) for _, i in items):
            pairs = [(i, name) for name, i in items]  # ImageFolder's class_to_idx
        else:
            try:  # {"0": "cat"} as in class_indices.json
                pairs = [(int(i), name) for i, name in items]
            except (TypeError, ValueError):
                raise ConfigError(
                    f"classes mapping must be {{index: name}} or {{name: index}}, got {classes!r}"
                ) from None
        pairs.sort(key=lambda pair: pair[0])
        indices = [i for i, _ in pairs]
        if indices != list(range(len(pairs))):
            raise ConfigError(f"class indices must be 0..{len(pairs) - 1} without gaps, got {indices}")
        names = [name for _, name in pairs]
    elif isinstance(classes, Sequence) and not isinstance(classes, str):
        names = list(classes)
    else:
        raise ConfigError(
            f"classes must be a list of names or a name/index mapping, got {type(classes).__name__}"
        )
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"classes must be non-empty strings, got {names!r}")
    if len(set(names)) != len(names):
        raise ConfigError(f"classes contains duplicate names: {names!r}")
    return names


def _export_tensors(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    tensors = extract_state_dict(state_dict, "the state_dict to export")
    # One fresh, contiguous CPU copy per tensor: safetensors refuses shared or strided storage,
    # and torch.save of a view would write the whole underlying storage.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


# What else an export folder may hold and a new export may drop: Jupyter's autosave copies.
_REPLACEABLE = {".ipynb_checkpoints"}


def file_digest(path: PathLike) -> str:
    """SHA-256 of a file's bytes, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _foreign_link(path: Path) -> Optional[Tuple[Path, int]]:
    """The first link on the way to ``path`` that neither the user nor root made, and its owner; else None.

    A link of the user's own (an export folder kept elsewhere) is followed; one another user put in
    a folder the group may write (a run folder) would take the export wherever she chose.
    """
    path = Path(os.path.abspath(path))
    for step in [*reversed(path.parents), path]:
        try:
            st = os.lstat(step)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode) and owner(st) not in (0, os.getuid()):
            return step, owner(st)
    return None


def _export_target(out_dir: Path) -> Path:
    """The real folder to replace, after refusing one that holds more than an export."""
    found = _foreign_link(out_dir)
    if found is not None and found[0] == Path(os.path.abspath(out_dir)):
        with contextlib.suppress(FileNotFoundError):  # the export folder's own name: a folder made in its place
            aside = _aside(found[0])
            warnings.warn(f"{out_dir} is a symbolic link that uid {found[1]} made, so the export was not written "
                          f"where it leads: it was moved to {aside.name} and the export made in its place.",
                          stacklevel=3)
    elif found is not None:
        raise ConfigError(f"{found[0]} is a symbolic link that uid {found[1]} made: an export to {out_dir} would go "
                          f"wherever it leads, so nbddp does not write there. Remove the link (or export elsewhere).")
    target = Path(os.path.realpath(out_dir))  # a link of the user's to a folder: replace the folder, keep the link
    if target.exists() and not target.is_dir():
        raise ConfigError(f"export folder {out_dir} is a file; pass a folder path (it is created if needed)")
    if target.is_dir():
        foreign = sorted(e.name for e in os.scandir(target)
                         if e.name not in EXPORT_FILES + EXPORT_DEPLOY_FILES and e.name not in _REPLACEABLE
                         and TMP_MARK not in e.name)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConfigError(
                f"export folder {out_dir} holds files that are not part of an export ({shown}); an export "
                "replaces its folder as a whole, so nbddp will not write there. Export into an empty or "
                f"new folder, e.g. {str(Path(out_dir) / EXPORT)!r}.")
    return target


def _remove_stale_export_dirs(target: Path) -> None:
    """Remove what an export (or a sharded checkpoint) that died between its writes and its swap left.

    Such a folder holds files only. One that holds a folder is never one: in a folder the group may
    write, a group member may rename any folder of yours that she may move (the group's to write)
    to that name, and its sub-folders may be yours alone, beyond what she could remove herself.
    """
    for stale in target.parent.glob(f".{target.name}{TMP_MARK}*"):
        if stale.is_dir() and not stale.is_symlink() and not temp_writer_alive(stale) and _files_only(stale):
            shutil.rmtree(stale, ignore_errors=True)


def _files_only(folder: Path, allowed: AbstractSet[str] = frozenset()) -> bool:
    try:
        return all(entry.is_file(follow_symlinks=False) or entry.name in allowed for entry in os.scandir(folder))
    except OSError:
        return False


def _swap_in(new: Path, target: Path) -> None:
    """Put the complete folder ``new`` at ``target``; a previous ``target`` goes away whole.

    Two renames in one parent folder: at every moment ``target`` is the old export, nothing,
    or the new export, never a mix of their files. The previous one is removed only if it holds
    files only, as an export or a sharded checkpoint does (see :func:`_remove_stale_export_dirs`:
    what a group member renamed to ``target`` while this one was written is kept, renamed).
    """
    if not target.exists():
        os.rename(new, target)
    else:
        old = new.with_name(new.name + "-old")
        os.rename(target, old)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(old, target)
            raise
        if _files_only(old, allowed=_REPLACEABLE):
            shutil.rmtree(old, ignore_errors=True)
    fsync_dir(target.parent)


def export_weights(
    state_dict: Mapping[str, Any],
    out_dir: PathLike,
    classes: Union[Sequence[str], Mapping[Any, Any]],
    extra: Optional[Mapping[str, Any]] = None,
) -> dict[str, Path]:
    """Write a model's weights for inference and for later fine-tuning, as one whole folder.

    Files written in ``out_dir``:

    * ``model.pth``: a plain state_dict (no ``module.`` prefix, contiguous CPU tensors).
    * ``model.safetensors``: the same tensors in safetensors format.
    * ``class_indices.json``: ``{"0": "classname", ...}``, the reference script's format.
    * ``meta.json`` (only with ``extra``): ``extra`` as JSON (model name, image_size...), with
      ``num_classes`` filled in from ``classes`` when missing, and ``files``: the SHA-256 of
      each other file, which :func:`nbddp.load_model` checks.

    The files are written into a temporary sibling folder that then replaces ``out_dir`` whole,
    so a failure (disk full, an interrupt) leaves the previous export untouched and never a mix
    of two exports. For that reason ``out_dir`` may hold nothing but an export.

    Args:
        state_dict: the model's state_dict (from a bare or DDP-wrapped model), or a checkpoint
            dict holding it under ``"model"``.
        out_dir: destination folder, created if needed.
        classes: class names in index order, ``{index: name}``, or ``{name: index}``.
        extra: metadata for ``meta.json``.

    Returns:
        ``{"pth": ..., "safetensors": ..., "class_indices": ..., "meta": ...}`` (no ``"meta"``
        without ``extra``).

    Raises:
        ConfigError: ``out_dir`` is a file, or holds files that are not part of an export, or a
            link on the way to it is another user's (one at ``out_dir`` itself is moved aside, with
            a warning: a group member may put one in a run folder).
    """
    from safetensors import torch as safetensors_torch

    out_dir = Path(out_dir)
    names = _class_names(classes)
    tensors = _export_tensors(state_dict)
    target = _export_target(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_export_dirs(target)
    # mkdir (not mkdtemp) so the folder gets the umask's usual permissions, not 0o700.
    work = target.with_name(f".{target.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(work)
    try:
        atomic_save(tensors, work / EXPORT_PTH)
        # "format": "pt" is what other safetensors readers (transformers...) expect. Looked up
        # at call time so tests can make this write fail.
        atomic_write(work / EXPORT_SAFETENSORS,
                     lambda f: f.write(safetensors_torch.save(tensors, metadata={"format": "pt"})))
        write_class_indices(work, names)
        if extra is not None:
            meta = to_plain(dict(extra))
            meta.setdefault("num_classes", len(names))
            meta["files"] = {n: file_digest(work / n) for n in EXPORT_FILES if n != EXPORT_META}
            atomic_write_text(work / EXPORT_META, json.dumps(meta, indent=2, default=_json_default) + "\n")
        _swap_in(work, target)
    except BaseException:  # KeyboardInterrupt too: the old export stays, no half folder remains
        shutil.rmtree(work, ignore_errors=True)
        raise
    keys = {"pth": EXPORT_PTH, "safetensors": EXPORT_SAFETENSORS, "class_indices": CLASS_INDICES}
    if extra is not None:
        keys["meta"] = EXPORT_META
    return {k: out_dir / n for k, n in keys.items()}


__all__ = [
    "EXPORT_FILES",
    "WEIGHTS_SEARCH_ORDER",
    "WRAPPER_PREFIXES",
    "atomic_save",
    "atomic_write_text",
    "cleanup_temp_files",
    "export_weights",
    "file_digest",
    "extract_state_dict",
    "load_checkpoint",
    "load_state_dict_file",
    "resolve_weights_path",
    "strip_wrapper_prefixes",
    "to_plain",
]
