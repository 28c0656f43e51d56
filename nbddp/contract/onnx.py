"""A model as an ONNX file that is checked, not hoped: write it, then run it with ONNX Runtime and compare.

Both sides use it: the kernel (``nbddp.export_onnx``, ``nbddp.predict`` on a ``.onnx`` file) and rank 0
of the built-in worker at the end of a ``TrainConfig(export_onnx=True)`` run. It needs the ``onnx``
extra (``onnx``, ``onnxscript``, ``onnxruntime``), imported only when used, so ``import nbddp`` and a
rank that does not export never load them.

Three rules:

* **The dynamo exporter first** (``torch.onnx.export(..., dynamo=True)``: ``torch.export``, then the
  translation to ONNX). The legacy TorchScript exporter is tried only where that fails, and the
  result says so (:attr:`Written.exporter`, a warning, the dynamo exporter's reason). A model that
  neither takes gets :class:`~nbddp.contract.errors.ExportError`: each exporter's reason in one
  paragraph, not the exporters' pages of logs.
* **Written atomically**: the file is complete at its name or absent, never half written.
* **Compared as deployed** (:func:`compare`): ONNX Runtime's logits against PyTorch's on the same images,
  the top-1 labels equal and every logit within ``atol + rtol * |logit|`` (:data:`ATOL`, :data:`RTOL`),
  else an ``ExportError`` naming the largest difference, with the file kept for a look.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import secrets
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import ConfigError, ExportError
from .rundir import TMP_MARK, atomic_write

#: The extra that brings what this module needs, as the error says it.
EXTRA = "pip install 'nbddp[onnx]'"
#: The import names of the extra's packages: writing needs the first two, running the third.
WRITE_MODULES = ("onnx", "onnxscript")
RUN_MODULES = ("onnxruntime",)
#: The names of the graph's input and output (the service feeds ``input`` and reads ``logits``).
INPUT_NAME, OUTPUT_NAME = "input", "logits"
#: The check's tolerance: every logit within ``ATOL + RTOL * |PyTorch's logit|`` (float32 on the CPU on
#: both sides; what the two runtimes differ by is rounding, ~1e-6 for a ResNet).
ATOL, RTOL = 1e-3, 1e-3
#: Beyond this size a protobuf cannot hold the weights: they go to ``<name>.data`` beside the graph.
_PROTOBUF_LIMIT = 1_900_000_000


def missing_modules(modules: Sequence[str] = WRITE_MODULES + RUN_MODULES) -> List[str]:
    """The packages of the ``onnx`` extra that this Python cannot import."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(what: str, modules: Sequence[str] = WRITE_MODULES + RUN_MODULES) -> None:
    """Raise :class:`ExportError` naming ``pip install 'nbddp[onnx]'`` when a package of the extra is missing.

    Args:
        what: what needs them, for the message (``"nbddp.export_onnx"``).
        modules: the import names needed.
    """
    missing = missing_modules(modules)
    if missing:
        raise ExportError(f"{what} needs {' and '.join(missing)}, not installed in this Python. Install the "
                          f"extra with:  {EXTRA}  (onnx, onnxscript and onnxruntime)")


@dataclass
class Written:
    """What :func:`write` did: the file, the exporter that made it, the opset, the time it took.

    Attributes:
        path: the ``.onnx`` file.
        exporter: ``"dynamo"`` or ``"torchscript"`` (the legacy exporter, used where dynamo failed).
        opset: the ONNX opset of the graph.
        seconds: the export's wall time.
        files: the files written (the graph, and ``<name>.data`` for weights beyond 2 GB).
        dynamo_failure: why the dynamo exporter failed, where the legacy one was used.
    """

    path: Path
    exporter: str
    opset: int
    seconds: float
    files: List[Path] = field(default_factory=list)
    dynamo_failure: Optional[str] = None


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP's and ``torch.compile``'s wrappers; refuses FSDP shards with the fix.

    Raises:
        ExportError: the model's parameters are FSDP shards (DTensor), which no exporter takes.
    """
    while True:  # DistributedDataParallel's module, torch.compile's original, in any nesting
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            break
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ExportError(
            "this model's parameters are FSDP shards (DTensor), which no ONNX exporter takes: export the "
            "consolidated weights instead. In the worker, state = ctx.full_state_dict(model) (rank 0), then "
            "load it into the same model built without fully_shard and export that one; a TrainConfig run "
            "does it itself (export_onnx=True, or nbddp.export_onnx(run_dir)).")
    return model


def write(model: torch.nn.Module, example: torch.Tensor, path: os.PathLike, opset: Optional[int] = None,
          dynamic_batch: bool = True) -> Written:
    """Export ``model`` (in eval mode, on the CPU) to ``path`` with one input and one output.

    Args:
        model: a plain module (see :func:`plain_module`) on the CPU, in eval mode.
        example: an input batch ``[N, ...]`` on the CPU; with ``dynamic_batch`` one of 1 is doubled,
            since ``torch.export`` takes a dimension seen as 1 for a constant.
        path: the ``.onnx`` file to write (its folder is created).
        opset: the ONNX opset; ``None``: the exporter's default.
        dynamic_batch: the batch dimension is free (``"batch"``); else it is the example's.

    Raises:
        ExportError: neither exporter takes the model (their reasons, one paragraph).
    """
    require("exporting to ONNX", WRITE_MODULES)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if dynamic_batch and example.shape[0] == 1:
        example = torch.cat([example, example])
    t0 = time.perf_counter()
    try:
        files = _write_dynamo(model, example, path, opset, dynamic_batch)
        exporter, dynamo_failure = "dynamo", None
    except Exception as exc:  # noqa: BLE001 - any failure of the exporter: the legacy one is tried next
        dynamo_failure = reason(exc)
        try:
            legacy_warnings = _write_legacy(model, example, path, opset, dynamic_batch)
        except Exception as legacy_exc:  # noqa: BLE001 - both failed: one paragraph says why
            raise ExportError(
                f"cannot export {type(model).__name__} to ONNX. The dynamo exporter (torch.export) failed: "
                f"{dynamo_failure} The legacy TorchScript exporter failed too: {reason(legacy_exc)} Change the "
                "model's forward where these point (see https://pytorch.org/docs/stable/generated/exportdb/ for "
                "what torch.export takes), or export a model that wraps the part you serve.") from None
        files, exporter = [path], "torchscript"
        said = f" It warned: {legacy_warnings}" if legacy_warnings else ""
        warnings.warn(f"{path} was written by the legacy TorchScript exporter, because the dynamo exporter "
                      f"failed: {dynamo_failure}{said}", stacklevel=3)
    return Written(path, exporter, graph_opset(path), time.perf_counter() - t0, files, dynamo_failure)


@contextlib.contextmanager
def _quiet():
    """The exporters' progress lines and logs off the cell: what matters is said by the result or error."""
    import logging

    sink = io.StringIO()
    levels = {name: logging.getLogger(name).level for name in ("torch", "onnxscript", "onnx_ir")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield sink
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _write_dynamo(model, example, path: Path, opset, dynamic_batch) -> List[Path]:
    shapes = ({0: torch.export.Dim("batch")},) if dynamic_batch else None
    with _quiet():
        program = torch.onnx.export(model, (example,), dynamo=True, input_names=[INPUT_NAME],
                                    output_names=[OUTPUT_NAME], opset_version=opset, dynamic_shapes=shapes)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size < _PROTOBUF_LIMIT:
        atomic_write(path, program.model_proto.SerializeToString())
        return [path]
    return _write_with_data(lambda dest: program.save(str(dest), external_data=True), path)


def _write_with_data(save, path: Path) -> List[Path]:
    """A graph whose weights go to ``<name>.data`` beside it: both are written in a temporary folder
    (the graph names its data file), then moved in, the data first, so the graph at ``path`` always
    finds its own data."""
    import shutil

    work = path.parent / f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    work.mkdir()
    try:
        save(work / path.name)
        moved = []
        for item in sorted(work.iterdir(), key=lambda p: p.name == path.name):  # the graph last
            os.replace(item, path.parent / item.name)
            moved.append(path.parent / item.name)
        return moved
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_legacy(model, example, path: Path, opset, dynamic_batch) -> str:
    """The TorchScript exporter (a trace); returns what it warned about the trace, in one line."""
    axes = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}} if dynamic_batch else None
    buffer = io.BytesIO()
    with _quiet(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        torch.onnx.export(model, (example,), buffer, dynamo=False, input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME], opset_version=opset, dynamic_axes=axes)
    atomic_write(path, buffer.getvalue())
    traced = {_first_line(str(w.message)) for w in caught if issubclass(w.category, torch.jit.TracerWarning)}
    return " ".join(sorted(traced))


def graph_opset(path: os.PathLike) -> int:
    """The default-domain opset of an ONNX file (its weights are not read)."""
    import onnx

    proto = onnx.load(os.fspath(path), load_external_data=False)
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


_CODE_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s+(.+)')


def reason(exc: BaseException) -> str:
    """An exporter's failure in a sentence or two: the innermost error's type and first line, and the
    line of the model's code it points at, when it names one."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    inner = chain[-1]
    text = f"{type(inner).__name__}: {_first_line(str(inner)) or 'no message'}"
    for err in chain:
        found = _CODE_LINE.search(str(err))
        if found:
            file, line, func, code = found.groups()
            text += f" (at {os.path.basename(file)}:{line} in {func}: `{code.strip()}`)"
            break
    return text.rstrip(".") + "."


def _first_line(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # the exporters' colours
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


# ---------------------------------------------------------------------------- running it
def session(path: os.PathLike, threads: Optional[int] = None):
    """An ONNX Runtime session of ``path`` on the CPU (quiet; ``threads`` intra-op threads, default ORT's)."""
    require("running an ONNX file", RUN_MODULES)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings are about graph optimisations
    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT's errors (InvalidGraph, NoSuchFile...) are not one class
        raise ExportError(f"ONNX Runtime cannot load {path}: {_first_line(str(exc))}") from None


def run(sess, batch: np.ndarray) -> np.ndarray:
    """The logits of ``batch`` (``float32 [N, ...]``), in chunks of the graph's batch when it is fixed."""
    spec = sess.get_inputs()[0]
    fixed = spec.shape[0] if isinstance(spec.shape[0], int) and spec.shape[0] > 0 else None
    if fixed is None or fixed == len(batch):
        return sess.run(None, {spec.name: np.ascontiguousarray(batch, dtype=np.float32)})[0]
    out = []
    for i in range(0, len(batch), fixed):
        chunk = batch[i:i + fixed]
        pad = fixed - len(chunk)
        if pad:  # a graph of a fixed batch: the last chunk is padded, its extra rows dropped
            chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
        out.append(sess.run(None, {spec.name: np.ascontiguousarray(chunk, dtype=np.float32)})[0][:len(chunk) - pad])
    return np.concatenate(out)


@dataclass
class Check:
    """What :func:`compare` found: images, the largest difference, the tolerance, the time it took."""

    images: int
    max_abs_diff: float
    atol: float
    rtol: float
    top1_equal: bool
    passed: bool
    seconds: float
    on: str = "held-out images"
    what: str = ""  # what differs, when it failed

    def to_dict(self) -> dict:
        keys = ("images", "on", "top1_equal", "max_abs_diff", "atol", "rtol", "passed", "seconds")
        return {**{k: getattr(self, k) for k in keys}, **({"what": self.what} if not self.passed else {})}


def compare(onnx_logits: np.ndarray, torch_logits: np.ndarray, names: Optional[Sequence[str]] = None,
            atol: float = ATOL, rtol: float = RTOL) -> Tuple[bool, str, float, bool]:
    """Compare ONNX Runtime's logits with PyTorch's: ``(passed, what differs, largest difference, top-1 equal)``.

    The top-1 labels must be equal (where PyTorch's two best logits are within the tolerance of each
    other, either is right: a tie), and every logit within ``atol + rtol * |PyTorch's logit|``.
    """
    a, b = np.asarray(onnx_logits, np.float64), np.asarray(torch_logits, np.float64)
    if a.shape != b.shape:
        return False, f"ONNX Runtime gave logits of shape {list(a.shape)}, PyTorch {list(b.shape)}", float("inf"), False
    if a.size == 0:
        return True, "", 0.0, True
    diff = np.abs(a - b)
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    largest = float(diff.max())
    top_b = np.sort(b, axis=1)[:, -2:] if b.shape[1] > 1 else np.concatenate([b, b - np.inf], 1)
    tie = (top_b[:, 1] - top_b[:, 0]) <= atol + rtol * np.abs(top_b[:, 1])
    flipped = [i for i in range(len(a)) if a[i].argmax() != b[i].argmax() and not tie[i]]
    label = (lambda i: names[i] if names is not None and i < len(names) else str(i))
    within = bool((diff <= atol + rtol * np.abs(b)).all())
    if not flipped and within:
        return True, "", largest, True
    i, j = int(worst[0]), int(worst[1])
    what = (f"the largest difference is {diff[i, j]:.3g} on image {i}, class {label(j)} (ONNX Runtime "
            f"{a[i, j]:.6g}, PyTorch {b[i, j]:.6g}; tolerance {atol:g} + {rtol:g}·|logit|)")
    if flipped:
        k = flipped[0]
        what += (f"; the top-1 label differs on {len(flipped)} of {len(a)} images (image {k}: ONNX Runtime "
                 f"{label(int(a[k].argmax()))}, PyTorch {label(int(b[k].argmax()))})")
    return False, what, largest, not flipped


__all__ = ["ATOL", "RTOL", "EXTRA", "INPUT_NAME", "OUTPUT_NAME", "Check", "Written", "compare", "missing_modules",
           "plain_module", "reason", "require", "run", "session", "write", "graph_opset"]
