"""Worker targets: ``"package.module:function"``, ``"path/to/file.py:function"`` or a function.

A function from a file or a module travels to a spawned child by name: this module turns
whatever the user passed into a spec string that every child can load by itself (a function
defined in a notebook cell travels by value instead, :mod:`nbddp.contract.cells`). The kernel checks the spec (file exists, function defined) without
running the user's file; the child loads it fresh, so edits to the file count at every launch.
:func:`worker_signature` reads a worker's keyword parameters the same way (``ast`` on the file),
for the panel's form.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import inspect
import sys
import sysconfig
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple, Union

from .errors import ConfigError
from .safe_path import add_after_stdlib

_NOTEBOOK_FIX = (
    "A function of __main__ travels to the ranks by value when spawn_train or TrainingPanel is "
    "given the function itself (nbddp.contract.cells); by name, it must live in a file. Put it in its own "
    "cell that starts with\n"
    "    %%writefile my_worker.py\n"
    "run that cell, then launch with\n"
    "    spawn_train(\"my_worker.py:train\", ...)"
)


def resolve_target(target: Union[str, Callable[..., Any]]) -> str:
    """Turn a target into a spec string and check it, in the kernel, before anything starts.

    Args:
        target: ``"pkg.module:fn"``, ``"path/file.py:fn"`` or a module-level function.

    Returns:
        ``"pkg.module:fn"`` or ``"/absolute/path/file.py:fn"``.

    Raises:
        ConfigError: the target cannot be loaded by a spawned process; the message says why
            and how to fix it.
    """
    if callable(target) and not isinstance(target, str):
        return _spec_from_function(target)
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(
            f"worker target {target!r} is not of the form 'file.py:function' or "
            "'package.module:function'"
        )
    where, _, qualname = target.rpartition(":")
    if not where or not qualname or not all(p.isidentifier() for p in qualname.split(".")):
        raise ConfigError(f"worker target {target!r}: '{qualname}' is not a function name")
    if where.endswith(".py") or os.sep in where or "/" in where:
        return _check_file_target(Path(where), qualname)
    return _check_module_target(where, qualname)


def _spec_from_function(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    if module in (None, "__main__", "__mp_main__"):
        raise ConfigError(f"worker function {qualname!r} is defined in the notebook (__main__).\n{_NOTEBOOK_FIX}")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ConfigError(
            f"worker function {qualname!r} is a lambda or nested function, which spawned "
            "processes cannot import. Define it at module level in a file."
        )
    mod = sys.modules.get(module)
    mod_file = getattr(mod, "__file__", None)
    if module.startswith("nbddp_user_") and mod_file:
        # Loaded from a file by us earlier: keep pointing at the file, not the synthetic name.
        return _check_file_target(Path(mod_file), qualname)
    return _check_module_target(module, qualname)


def _check_module_target(module: str, qualname: str) -> str:
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import error is a user error here
        raise ConfigError(
            f"worker module {module!r} cannot be imported in the kernel: {type(exc).__name__}: {exc}. "
            "Check the name, or pass a file path such as 'my_worker.py:train'."
        ) from exc
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"module {module!r} has no function {qualname!r}")
    if not callable(obj):
        raise ConfigError(f"{module}:{qualname} is not callable")
    return f"{module}:{qualname}"


def _check_file_target(path: Path, qualname: str) -> str:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(
            f"worker file {path} does not exist. Write it first (e.g. with %%writefile in a "
            "notebook cell) or fix the path; relative paths start at the kernel's working "
            f"directory {os.getcwd()}."
        )
    # Parse, do not execute: the kernel must not run the user's training code by itself.
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        raise ConfigError(f"worker file {path} has a syntax error at line {exc.lineno}: {exc.msg}") from exc
    top = qualname.split(".")[0]
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if top not in names:
        found = sorted(n for n in names if not n.startswith("_"))
        raise ConfigError(
            f"worker file {path} defines no top-level {top!r}; it defines: {', '.join(found) or 'nothing'}"
        )
    return f"{path}:{qualname}"


def load_target(spec: str) -> Callable[..., Any]:
    """Import the function a spec names (runs in the worker process).

    A file target is compiled from the bytes on disk at every launch, never from
    ``__pycache__``: its bytecode is trusted on mtime and size alone, so a file rewritten with
    the same size within the same second (``%%writefile`` under "Run All") would run stale.
    Its folder's other modules, imported by it, are compiled from source too (see
    :func:`from_source_in_user_folders`).
    """
    where, _, qualname = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        # The file's folder goes on sys.path so the worker can import its sibling modules; after
        # the standard library, as Jupyter puts the notebook's (a json.py there stays a sibling).
        add_after_stdlib(str(path.parent))
        from_source_in_user_folders(str(path.parent))
        name = "nbddp_user_" + "".join(c if c.isalnum() else "_" for c in path.stem)
        obj: Any = _exec_file(name, path)
    else:
        from_source_in_user_folders()
        obj = importlib.import_module(where)
    return _attribute(obj, qualname)


def _attribute(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _exec_file(name: str, path: Path) -> types.ModuleType:
    """The module ``name`` made by running ``path``'s source as it is on disk now."""
    source = path.read_bytes()
    mod_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(mod_spec)
    module.__cached__ = None  # no bytecode file stands for it
    # Registered before exec so pickling and dataclasses inside the file work.
    sys.modules[name] = module
    try:
        exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """Compiles a module from its source every time, never from ``__pycache__``."""

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        return compile(self.get_data(path), path, "exec", dont_inherit=True)


def _installed(folder: str) -> bool:
    """A folder of the installed Python (its standard library, site-packages): caches are fine there."""
    real = os.path.realpath(folder)
    if "site-packages" in real or "dist-packages" in real:
        return True
    return any(real == r or real.startswith(r + os.sep) for r in _installed_roots())


@functools.lru_cache(maxsize=None)
def _installed_roots() -> frozenset:
    """The installed Python's folders (asked once: the path hook asks for every package folder)."""
    paths = sysconfig.get_paths()
    return frozenset(os.path.realpath(p) for p in (paths.get("stdlib"), paths.get("platstdlib"),
                                                   paths.get("purelib"), paths.get("platlib")) if p)


def from_source_in_user_folders(*folders: str) -> None:
    """``folders`` (a script's own) and every folder of the user's (the kernel's working directory
    that a rank starts in, ``PYTHONPATH`` entries of your own, and the folders of the packages in
    them) import their modules from source, never from ``__pycache__``: a module a worker, a
    script, ``-m`` module or a notebook cell's function imports runs as it is on disk now, like
    the worker file itself. Folders of the installed Python keep their caches.

    A package's submodules (``mypkg.sub``) are found through the package's ``__path__``, never
    through ``sys.path``, so replacing the finders of ``sys.path`` folders is not enough: a path
    hook, first in ``sys.path_hooks``, gives every user folder the import machinery meets a
    source-only finder; the finders cached before it (the warm server's, made at its start) are
    replaced for the user's folders.
    """
    if _source_path_hook not in sys.path_hooks:
        sys.path_hooks.insert(0, _source_path_hook)
    for key, finder in list(sys.path_importer_cache.items()):
        if isinstance(key, str) and not _is_source_finder(finder) and _user_folder(key or os.getcwd()):
            del sys.path_importer_cache[key]  # made before the hook: found again through it
    for entry in (*folders, *sys.path):
        folder = entry or os.getcwd()  # "" is the working directory (importlib's own reading)
        if _user_folder(folder):
            sys.path_importer_cache[folder] = _source_finder(folder)


def _user_folder(folder: str) -> bool:
    return os.path.isdir(folder) and not _installed(folder)


def _is_source_finder(finder: Any) -> bool:
    return isinstance(finder, importlib.machinery.FileFinder) and \
        any(loader is _SourceLoader for _, loader in getattr(finder, "_loaders", ()))


def _source_path_hook(entry: str) -> importlib.machinery.FileFinder:
    """``sys.path_hooks`` entry: a source-only finder for a user folder; others go to the next hook."""
    folder = entry or os.getcwd()
    if not _user_folder(folder):
        raise ImportError("not a user folder")  # importlib's signal to try the next hook
    return _source_finder(folder)


def _source_finder(folder: str) -> importlib.machinery.FileFinder:
    """A finder for ``folder`` whose modules are compiled from their source.

    Their cached bytecode has the same weakness as the worker file's: a module rewritten with
    the same size in the same second would run as it was. The user's own folders are small, so
    compiling them at every launch costs little; installed packages keep their caches.
    """
    machinery = importlib.machinery
    return machinery.FileFinder(
        folder, (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
        (_SourceLoader, machinery.SOURCE_SUFFIXES), (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES))


# ------------------------------------------------------------------------ signatures
_SIMPLE_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class WorkerParam:
    """One parameter of a worker function after ``ctx``, as its source declares it.

    Attributes:
        name: the parameter's name.
        has_default: the signature gives a default.
        literal: the default is a plain value (``ast.literal_eval`` reads it), held in ``default``.
        default: that value (``None`` otherwise).
        default_text: the default as written (``"torch.device('cpu')"``), for display.
        kind: ``int``, ``float``, ``str`` or ``bool`` from a plain annotation, else ``None``.
        choices: the values of a ``typing.Literal[...]`` annotation, else ``None``.
        keyword: False for a positional-only parameter (cannot be passed in ``kwargs``).
    """

    name: str
    has_default: bool
    literal: bool = False
    default: Any = None
    default_text: str = ""
    kind: Optional[type] = None
    choices: Optional[Tuple[Any, ...]] = None
    keyword: bool = True


@dataclass(frozen=True)
class WorkerSignature:
    """The parameters a worker takes besides ``ctx`` (``*args`` left out)."""

    qualname: str
    params: List[WorkerParam]
    var_kwargs: bool  # ``**kwargs``: any keyword is accepted


def worker_signature(spec: str) -> Optional[WorkerSignature]:
    """Read the parameters of the worker a spec (from :func:`resolve_target`) names.

    A file target is parsed with ``ast``, never executed: the kernel must not import the user's
    training code (nor torch and CUDA through it). A module target was already imported by
    :func:`resolve_target`, so its function is inspected.

    Returns:
        The signature, or ``None`` when it cannot be read (the name is bound by an import or
        an assignment, not a ``def``).
    """
    where, _, qualname = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        node = find_def(ast.parse(Path(where).read_text(), filename=where), qualname)
        return None if node is None else _signature_from_ast(node, qualname)
    try:
        # Looked up, not loaded: load_target's source-only import hook is for a rank. Installed in
        # the kernel, it would change how every later import of the user's session behaves.
        sig = inspect.signature(_attribute(importlib.import_module(where), qualname))
    except (TypeError, ValueError):
        return None
    return signature_from_inspect(sig, qualname)


def find_def(tree: ast.Module, qualname: str) -> Optional[ast.AST]:
    body: list = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in reversed(body) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)  # the last definition wins, as at run time
        if node is None:
            return None
        body = node.body
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _signature_from_ast(node: ast.FunctionDef, qualname: str) -> WorkerSignature:
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if i == 0:
            continue  # ctx
        params.append(_param_from_ast(arg, default, keyword=i >= len(a.posonlyargs)))
    params += [_param_from_ast(arg, default, keyword=True) for arg, default in zip(a.kwonlyargs, a.kw_defaults)]
    return WorkerSignature(qualname, params, a.kwarg is not None)


def _param_from_ast(arg: ast.arg, default: Optional[ast.expr], keyword: bool) -> WorkerParam:
    kind, choices = _annotation(arg.annotation)
    if default is None:
        return WorkerParam(arg.arg, False, kind=kind, choices=choices, keyword=keyword)
    text = ast.unparse(default)
    try:
        value, literal = ast.literal_eval(default), True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value, literal = None, False
    return WorkerParam(arg.arg, True, literal, value, text, kind, choices, keyword)


def _annotation(node: Optional[ast.expr]) -> Tuple[Optional[type], Optional[tuple]]:
    """``(int/float/str/bool or None, Literal choices or None)`` from an annotation's syntax."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None, None
    if isinstance(node, ast.Name):
        return _SIMPLE_TYPES.get(node.id), None
    if isinstance(node, ast.Subscript):
        head = node.value
        name = head.id if isinstance(head, ast.Name) else head.attr if isinstance(head, ast.Attribute) else ""
        if name == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            try:
                return None, tuple(ast.literal_eval(e) for e in elts)
            except (ValueError, TypeError, SyntaxError):
                return None, None
    return None, None


def signature_from_inspect(sig: inspect.Signature, qualname: str) -> WorkerSignature:
    params, var_kwargs = [], False
    P = inspect.Parameter
    for i, p in enumerate(sig.parameters.values()):
        if p.kind == P.VAR_KEYWORD:
            var_kwargs = True
        if i == 0 and p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) or p.kind in (P.VAR_POSITIONAL,
                                                                                          P.VAR_KEYWORD):
            continue
        ann = p.annotation
        if isinstance(ann, str):
            try:
                kind, choices = _annotation(ast.parse(ann, mode="eval").body)
            except SyntaxError:
                kind, choices = None, None
        elif typing.get_origin(ann) is typing.Literal:
            kind, choices = None, typing.get_args(ann)
        else:
            kind, choices = next((t for t in _SIMPLE_TYPES.values() if ann is t), None), None
        has_default = p.default is not P.empty
        params.append(WorkerParam(p.name, has_default, has_default, p.default if has_default else None,
                                  repr(p.default) if has_default else "", kind, choices,
                                  p.kind != P.POSITIONAL_ONLY))
    return WorkerSignature(qualname, params, var_kwargs)
