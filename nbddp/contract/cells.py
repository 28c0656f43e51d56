"""Functions from notebook cells, shipped to the ranks by value.

A rank is a fresh interpreter: it cannot import a function defined in a kernel's ``__main__``.
nbddp pickles such a function *by value* with cloudpickle (the library Dask, Ray and PySpark ship
functions with): its code, its closure and the globals it uses, and with them the classes and
helpers of the notebook it refers to (an ``nn.Module`` subclass, a ``Dataset``). Imported modules
and their functions travel by reference and are imported in the rank.

Before anything starts, the kernel refuses what cannot or should not cross: a tensor or module
on a GPU (it would pin the kernel's CUDA context into every rank, or fail to unpickle there), an
open file, socket or lock, and captured data over :data:`MAX_CAPTURED_BYTES`; each refusal names
the variable and the fix. The function's source, with the helpers and imports it uses, is kept in
the run folder (``worker_source.py``) so a run stays readable and can be run again from a file.

Shared side: :func:`ship` runs in the kernel, :func:`load` in a rank.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import pickle
import socket
import textwrap
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .errors import ConfigError

#: Captured data larger than this (pickled) is refused: it is copied to every rank at every
#: launch, and a dataset or model in a global is almost always meant to be loaded in the rank.
MAX_CAPTURED_BYTES = 64 * 2**20

#: Modules whose objects a shipped function may capture by value ("__main__": the notebook).
_BY_VALUE_MODULES = ("__main__", "__mp_main__")

#: Items of a container looked at to estimate its size.
_SAMPLE = 100

_LOCK_TYPES = tuple({type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Semaphore,
                     threading.Event})


@dataclass(frozen=True)
class ShippedFunction:
    """A cell function ready to cross to the ranks.

    Attributes:
        name: its ``__qualname__`` (the run's default name).
        payload: the cloudpickle bytes every rank loads.
        source: a re-runnable file of its source, its notebook helpers and its imports.
    """

    name: str
    payload: bytes
    source: str


def is_cell_function(fn: Any) -> bool:
    """True for a function a rank cannot import: defined in ``__main__`` (a cell), or nested/lambda."""
    if not callable(fn) or isinstance(fn, str) or not hasattr(fn, "__code__"):
        return False
    qualname = getattr(fn, "__qualname__", "")
    return getattr(fn, "__module__", None) in _BY_VALUE_MODULES or "<locals>" in qualname or "<lambda>" in qualname


def ship(fn: Callable[..., Any], max_bytes: int = MAX_CAPTURED_BYTES) -> ShippedFunction:
    """Check and pickle a cell function by value, in the kernel.

    Raises:
        ConfigError: a captured variable cannot or should not cross (naming it and the fix), or
            the captured data is too large.
    """
    import cloudpickle

    name = fn.__qualname__
    captured = list(captured_values(fn))
    for label, value in captured:
        problem = _problem(value)
        if problem:
            raise ConfigError(f"spawn_train({name}): {label} is {problem}")
    # Sized before pickling: pickling 1 GiB takes seconds and several GiB of the kernel's memory.
    sizes = _estimated_sizes(captured)
    if sum(sizes.values()) > max_bytes:
        raise _too_large(name, sum(sizes.values()), max_bytes, sizes)
    try:
        payload = cloudpickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - name the variable that fails, not cloudpickle's frame
        raise ConfigError(f"spawn_train({name}): {_unpicklable(captured) or 'the function'} cannot be sent to the "
                          f"worker processes ({type(exc).__name__}: {exc}). Create it inside the function, "
                          "or pass plain values as arguments.") from exc
    if len(payload) > max_bytes:
        raise _too_large(name, len(payload), max_bytes, sizes)
    return ShippedFunction(name=name, payload=payload, source=source_of(fn, captured))


def _too_large(name: str, size: int, max_bytes: int, sizes: Dict[str, int]) -> ConfigError:
    biggest = ", ".join(f"{label} ({n / 2**20:.1f} MiB)" for label, n in
                        sorted(sizes.items(), key=lambda item: -item[1])[:3] if n)
    return ConfigError(
        f"spawn_train({name}): the function captures {size / 2**20:.1f} MiB of data, over the "
        f"{max_bytes / 2**20:.0f} MiB limit (largest: {biggest or 'unknown'}). It would be copied to every "
        "rank at every launch: load the data or model inside the function (from a file), or pass a path.")


def _estimated_sizes(captured: List[Tuple[str, Any]]) -> Dict[str, int]:
    """Roughly the pickled bytes of each captured value, by label, read without pickling (an
    object captured twice counts once)."""
    seen: set = set()
    return {label: _estimate(value, seen) for label, value in captured}


def _estimate(value: Any, seen: set, depth: int = 0) -> int:
    """The bytes ``value`` holds as far as a quick look tells: arrays, tensors and modules by their
    buffers, bytes and strings by length, containers and plain objects by a sample of their items."""
    if id(value) in seen or depth > 4 or isinstance(value, (type, types.ModuleType, types.FunctionType)):
        return 0
    seen.add(id(value))
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        with contextlib.suppress(Exception):  # a view pickles its whole storage
            return value.untyped_storage().nbytes()
        return value.element_size() * value.nelement()
    if torch is not None and isinstance(value, torch.nn.Module):
        return sum(_estimate(t, seen, depth + 1) for t in itertools.chain(value.parameters(), value.buffers()))
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, pandas Series, and their kin
    if isinstance(nbytes, int) and not isinstance(value, type):
        return nbytes
    if isinstance(value, dict):
        items = list(itertools.chain.from_iterable(itertools.islice(value.items(), _SAMPLE)))
        count = 2 * len(value)
    elif isinstance(value, (list, tuple, set, frozenset)):
        items, count = list(itertools.islice(value, _SAMPLE)), len(value)
    elif depth < 2 and isinstance(getattr(value, "__dict__", None), dict):
        items, count = list(vars(value).values()), len(vars(value))
    else:
        return 8
    if not items:
        return 8
    # The sample stands for every item (one object held twice pickles once: it counts once).
    sampled = sum(max(2, _estimate(item, seen, depth + 1)) for item in items)
    return sampled * count // len(items)


def load(payload: bytes) -> Callable[..., Any]:
    """The function from :func:`ship`'s payload, in a rank (cloudpickle must be importable there)."""
    import cloudpickle  # noqa: F401 - registers what the payload's reconstructors need

    return pickle.loads(payload)


# ------------------------------------------------------------------------------ what it captures
def captured_values(fn: Callable[..., Any]) -> Iterator[Tuple[str, Any]]:
    """``(label, value)`` of everything ``fn`` would carry: closure cells and used globals, also
    those of the notebook functions and classes it uses, which travel with it."""
    seen: set = set()
    todo: List[Tuple[Callable[..., Any], str]] = [(fn, fn.__qualname__)]
    while todo:
        f, owner = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for label, value in _direct_values(f, owner):
            yield label, value
            for inner, inner_owner in _by_value_parts(value, label):
                todo.append((inner, inner_owner))


def _direct_values(f: Any, owner: str) -> Iterator[Tuple[str, Any]]:
    if isinstance(f, type):
        for base in f.__bases__:
            if base is not object:
                yield f"`{base.__name__}` (a base class of {owner})", base
        for attr, value in vars(f).items():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, types.FunctionType):
                yield from _direct_values(value, f"{owner}.{attr}")
            elif not attr.startswith("__"):
                yield f"class attribute `{owner}.{attr}`", value
        return
    code = getattr(f, "__code__", None)
    if code is None:
        return
    for var, cell in zip(code.co_freevars, f.__closure__ or ()):
        try:
            yield f"`{var}` (captured by {owner})", cell.cell_contents
        except ValueError:  # an empty cell: a name assigned later in the enclosing function
            continue
    module_globals = getattr(f, "__globals__", {})
    for var in sorted(_global_names(code)):
        if var in module_globals:
            yield f"`{var}` (a global that {owner} uses)", module_globals[var]


def _global_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _by_value_parts(value: Any, label: str) -> Iterator[Tuple[Any, str]]:
    """Notebook functions and classes travel by value: what they use travels too."""
    if isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) in _BY_VALUE_MODULES:
        yield value, value.__qualname__


# ------------------------------------------------------------------------------ what may not cross
def _problem(value: Any, depth: int = 0) -> Optional[str]:
    """Why ``value`` may not cross to the ranks (a sentence ending with the fix), or None."""
    device = _gpu_device(value)
    if device:
        kind = "a tensor" if _is_tensor(value) else f"a {type(value).__name__}"
        return (f"{kind} on {device}. A GPU tensor or module cannot be shipped to the worker processes (each rank "
                "has its own GPU and CUDA context): create it inside the function, or move it to the CPU first "
                "(`.cpu()`) and to `ctx.device` in the function.")
    if isinstance(value, io.IOBase) and not value.closed or _is_text_file(value):
        return (f"an open file ({getattr(value, 'name', type(value).__name__)!r}). A file handle does not survive "
                "the trip to another process: pass its path and open it inside the function.")
    if isinstance(value, socket.socket):
        return "an open socket. Pass the address and connect inside the function."
    if isinstance(value, _LOCK_TYPES) or type(value).__name__ in ("lock", "RLock", "_RLock"):
        return (f"a {type(value).__name__}, which synchronises the kernel's threads only and cannot be shipped: "
                "create it inside the function, or coordinate ranks with torch.distributed.")
    if depth < 2 and isinstance(value, (list, tuple, set, frozenset, dict)) and len(value) <= 1000:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            inner = _problem(item, depth + 1)
            if inner:
                return f"holding, at [{key!r}], {inner}"
    return None


def _is_tensor(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def _gpu_device(value: Any) -> Optional[str]:
    """The accelerator device a tensor or module lives on, or None (CPU, meta, anything else)."""
    torch = _torch()
    if torch is None:
        return None
    if isinstance(value, torch.Tensor):
        return None if value.device.type in ("cpu", "meta") else str(value.device)
    if isinstance(value, torch.nn.Module):
        for t in list(value.parameters()) + list(value.buffers()):
            if t.device.type not in ("cpu", "meta"):
                return str(t.device)
    return None


def _torch():
    import sys

    return sys.modules.get("torch")  # only a kernel that imported torch can hold a tensor


def _is_text_file(value: Any) -> bool:
    return isinstance(value, io.TextIOWrapper) and not value.closed


def _unpicklable(captured: List[Tuple[str, Any]]) -> Optional[str]:
    import cloudpickle

    for label, value in captured:
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001
            return label
    return None


# ------------------------------------------------------------------------------ its source
def source_of(fn: Callable[..., Any], captured: Optional[List[Tuple[str, Any]]] = None) -> str:
    """A file that defines ``fn`` as the notebook did: imports, constants, helpers, the function.

    What cannot be written as source (a captured object other than a module, a plain constant,
    an importable function or class, a notebook function or class) is listed in a comment.
    ``captured``: :func:`captured_values` of ``fn`` when the caller has them already.
    """
    imports: Dict[str, str] = {}
    constants: Dict[str, str] = {}
    definitions: Dict[str, str] = {}
    opaque: List[str] = []
    order: List[Callable[..., Any]] = []
    for label, value in (captured if captured is not None else captured_values(fn)):
        var = label.split("`")[1] if "`" in label else None
        if var is None or "." in var:
            continue
        if isinstance(value, types.ModuleType):
            imports[var] = (f"import {value.__name__}" if value.__name__ == var
                            else f"import {value.__name__} as {var}")
        elif getattr(value, "__module__", None) in _BY_VALUE_MODULES and isinstance(value, (types.FunctionType, type)):
            order.append(value)
        elif isinstance(value, (types.FunctionType, type, types.BuiltinFunctionType)) and getattr(value, "__module__", None):
            qual = value.__qualname__
            imports[var] = (f"from {value.__module__} import {qual}" if qual == var
                            else f"from {value.__module__} import {qual} as {var}")
        elif isinstance(value, (int, float, str, bool, bytes, type(None))) and len(repr(value)) < 200:
            constants[var] = f"{var} = {value!r}"
        else:
            opaque.append(f"#   {var}: {type(value).__name__} (captured by value)")
    # Classes first (a function's body may use them at any time, a class's bases not), the
    # shipped function last, as a reader expects.
    for f in sorted(order, key=lambda o: not isinstance(o, type)) + [fn]:
        definitions.setdefault(f.__qualname__, _source_text(f))
    parts = [f'"""Worker shipped from a notebook cell: {fn.__qualname__} and what it uses."""']
    if opaque:
        parts.append("# Captured values that are not source (they travelled pickled):\n" + "\n".join(sorted(set(opaque))))
    if imports:
        parts.append("\n".join(sorted(set(imports.values()))))
    if constants:
        parts.append("\n".join(sorted(constants.values())))
    parts.append("\n\n\n".join(definitions.values()))
    return "\n\n".join(parts) + "\n"


def _source_text(obj: Any) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj)).rstrip()
    except (OSError, TypeError):
        pass
    text = _class_source_from_cell(obj) if isinstance(obj, type) else None
    return text or f"# {obj.__qualname__}: source not available (defined by exec or in a console)"


def _class_source_from_cell(cls: type) -> Optional[str]:
    """A notebook class's source, found through its methods' cell (``inspect`` looks for the
    class in ``__main__``'s file, which a kernel does not have)."""
    import ast
    import linecache

    for value in vars(cls).values():
        code = getattr(getattr(value, "__func__", value), "__code__", None)
        if code is None:
            continue
        lines = linecache.getlines(code.co_filename)
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:
            return None
        for node in ast.walk(tree):
            if (isinstance(node, ast.ClassDef) and node.name == cls.__name__
                    and node.lineno <= code.co_firstlineno <= node.end_lineno):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                return textwrap.dedent("".join(lines[start - 1:node.end_lineno])).rstrip()
    return None


__all__ = ["MAX_CAPTURED_BYTES", "ShippedFunction", "is_cell_function", "ship", "load", "captured_values",
           "source_of"]
