"""A worker function's convention and arguments, checked in the kernel before a process starts.

Code written for another launcher fails in every rank at once, in ways that read badly from a
notebook: a ``Context`` where a rank number was expected, ``TypeError: main() got multiple
values for argument 'save_every'``, torch's "trying to initialize the default process group
twice". Each of these can be read from the function's signature and source (``ast`` for a
file, never executing it), so the kernel says which convention the code follows and how to
launch it instead.

Shared: the kernel reads conventions before a launch; nothing here runs user code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .errors import ConfigError
from .targets import find_def

#: The conventions ``spawn_train(..., call=)`` accepts for a function.
CTX, MP_SPAWN, TORCHRUN = "ctx", "mp.spawn", "torchrun"
CALLS = (CTX, MP_SPAWN, TORCHRUN)
#: A script that starts its own processes (``mp.spawn`` in its main block): nbddp runs it in one
#: launcher process, as ``python script.py`` would, and watches the processes it starts. Chosen
#: by the kernel from the script's source (:func:`script_spawns`), never passed by the user.
SPAWNS = "spawns"

#: Marks a module target in a spec string: ``"-m pkg.train"``.
MODULE_PREFIX = "-m "

#: First parameter names that say "I am called as fn(rank, ...)", as mp.spawn calls.
RANK_NAMES = ("rank", "local_rank", "gpu", "gpu_id", "device_id", "world_size", "proc_id", "process_id")

_WHAT_CALL_PASSES = {CTX: "ctx", MP_SPAWN: "rank"}
_NO_DEFAULT = inspect.Parameter.empty


def is_script(spec: str) -> bool:
    """True for a whole program: ``"path/train.py"`` (no ``:function``) or ``"-m pkg.train"``."""
    return spec.startswith(MODULE_PREFIX) or (spec.endswith(".py") and ":" not in spec.rpartition("/")[2])


def makes_own_group(call: str, spec: str) -> bool:
    """True when the user's code sets up the process group itself (nbddp must not)."""
    return call != CTX or is_script(spec)


class _Default:
    """A default read from source, shown as ``...``: only its presence matters here."""

    def __repr__(self) -> str:
        return "..."


_DEFAULT = _Default()


def check_call(target: Union[str, Callable[..., Any]], call: str, args: Sequence[Any], kwargs: Dict[str, Any],
               label: str) -> None:
    """Refuse a function launched with a convention it was not written for, or arguments it cannot take.

    Args:
        target: the function, or its spec (``"/abs/file.py:fn"``, ``"pkg.mod:fn"``).
        call: ``"ctx"``, ``"mp.spawn"`` or ``"torchrun"``.
        args, kwargs: what ``spawn_train`` passes after the convention's first argument.
        label: the function as the user named it, for the messages.

    Raises:
        ConfigError: naming the mismatch and the ``spawn_train`` call that fits.
    """
    found = _function(target)
    if found is None:
        return  # bound by an import or an assignment: nothing to read without running it
    sig, node, source_file = found
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0].name if positional else None
    if call == CTX and first in RANK_NAMES:
        raise ConfigError(
            f"{label}({first}, ...) looks like an mp.spawn function: it takes the rank first, and nbddp would pass "
            f"a Context there. Launch it with spawn_train({label!r}, ..., call='mp.spawn') (it is then called as "
            f"{label}(rank, *args) and sets up its own process group), or take ctx first.")
    if call == CTX and calls_init_process_group(node, source_file):
        raise ConfigError(
            f"{label} calls torch.distributed.init_process_group itself, but with call='ctx' nbddp has made the "
            "process group before calling it (the second initialisation fails in every rank). Launch it with "
            "call='torchrun' (called as fn(*args), its group from the environment, env://) or call='mp.spawn' "
            "(called as fn(rank, *args)); or drop the call and use ctx.")
    leading = [_WHAT_CALL_PASSES[call]] if call in _WHAT_CALL_PASSES else []
    try:
        sig.bind(*leading, *args, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"{label}{sig} cannot be called with {_describe(call, args, kwargs)}: {exc}. "
                          f"{_fix(call)}") from None


def calls_init_process_group(node: ast.AST, source_file: Optional[str] = None) -> bool:
    """True when the function, or a function of the same file it calls, calls ``init_process_group``."""
    module = _module_tree(source_file)
    defs = {n.name: n for n in (module.body if module else []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    todo, seen = [node], set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Call):
                name = sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", None)
                if name == "init_process_group":
                    return True
                if name in defs:
                    todo.append(defs[name])
    return False


#: What starts processes of its own: a script calling it in every rank of a torchrun-style
#: launch would run world_size processes per rank.
SPAWNERS = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")


@dataclass(frozen=True)
class SpawnCall:
    """A spawn call that every ``__main__`` run of a script reaches (read from its source)."""

    line: int                # its line in the script
    spawner: str             # "torch.multiprocessing.spawn" or "...start_processes"
    fn: Optional[str]        # the function it spawns, when the script defines it at the top level
    passed: Optional[str]    # its ``args=`` as written
    flag: Optional[str]      # the command-line flag it is behind (``multiprocessing_distributed``), if any


def script_spawns(tree: ast.Module, argv: Sequence[str] = ()) -> Optional[SpawnCall]:
    """The spawn call every ``__main__`` run of a script (or of the module ``python -m`` runs)
    reaches with ``argv``, or ``None``.

    ``python multigpu.py`` that ends in ``mp.spawn(main, args=(...), nprocs=world_size)`` starts
    its own processes: nbddp runs such a script as it is, in one launcher process (``call``
    :data:`SPAWNS`), and watches the processes it starts (:mod:`nbddp.rank.spawned`). Found: a
    call in the main block or in a function of the file it calls, and one behind a flag that
    ``argv`` sets (``if args.multiprocessing_distributed:`` with ``--multiprocessing-distributed``).
    A call behind any other condition is refused when a rank of a torchrun-style launch reaches
    it (:func:`nbddp.rank.calls.refuse_nested_spawn`).
    """
    found = _spawn_in_main(tree, _flags(argv))
    return None if found is None else SpawnCall(*found)


def _spawn_in_main(tree: ast.Module, flags: frozenset = frozenset()) -> Optional[tuple]:
    """``(line, what it calls, spawned function's name or None, its args= as written or None, the
    flag it is behind or None)`` of a spawn call every ``__main__`` run reaches, or every run with
    ``flags`` (the ``--long-options`` its command line sets, as attribute names) reaches."""
    aliases = _import_aliases(tree)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    main = [st for st in tree.body if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for st in list(main):
        if isinstance(st, ast.If) and _is_main_test(st.test):
            main.extend(st.body)
    # (statement, depth, the names its function's parameters were given: run_demo(demo_basic, 2))
    todo, seen = [(st, 0, {}) for st in main], set()
    while todo:
        st, depth, bound = todo.pop(0)
        for call, flag in _calls_reached(st, flags):
            name = _dotted(call.func, aliases)
            if name in SPAWNERS:
                first = call.args[0] if call.args else None
                fn = bound.get(first.id, first.id) if isinstance(first, ast.Name) else None
                passed = next((ast.unparse(k.value) for k in call.keywords if k.arg == "args"), None)
                return call.lineno, name, fn if fn in defs else None, passed, flag
            local = call.func.id if isinstance(call.func, ast.Name) else None
            if local in defs and depth < 2 and local not in seen:
                seen.add(local)
                params = [a.arg for a in defs[local].args.posonlyargs + defs[local].args.args]
                given = {p: a.id for p, a in zip(params, call.args) if isinstance(a, ast.Name)}
                todo.extend((sub, depth + 1, given) for sub in defs[local].body)
    return None


def _flags(argv: Sequence[str]) -> frozenset:
    """The long options a command line sets, as argparse names their attributes (``--a-b`` -> ``a_b``)."""
    return frozenset(a[2:].split("=", 1)[0].replace("-", "_") for a in argv
                     if isinstance(a, str) and a.startswith("--") and len(a) > 2)


def _calls_reached(st: ast.stmt, flags: frozenset, flag: Optional[str] = None) -> List[tuple]:
    """``(call, flag)``: the calls a statement always makes, and those behind ``if <x>.<flag>:`` for a
    flag the command line sets (with the flag)."""
    found = [(c, flag) for c in _unconditional_calls(st)]
    if isinstance(st, ast.If) and isinstance(st.test, ast.Attribute) and st.test.attr in flags:
        found += [pair for sub in st.body for pair in _calls_reached(sub, flags, st.test.attr)]
    elif isinstance(st, (ast.With, ast.AsyncWith, ast.Try)):
        found += [pair for sub in st.body if isinstance(sub, ast.If) for pair in _calls_reached(sub, flags, flag)]
    return found


def _unconditional_calls(st: ast.stmt) -> List[ast.Call]:
    """The calls a statement always makes: its own expression, and those in ``with``/``try`` bodies."""
    if isinstance(st, (ast.Expr, ast.Assign, ast.AnnAssign, ast.Return)) and isinstance(st.value, ast.Call):
        return [st.value]
    if isinstance(st, (ast.With, ast.AsyncWith, ast.Try)):
        return [c for sub in st.body for c in _unconditional_calls(sub)]
    return []


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and \
        any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides)


def _import_aliases(tree: ast.Module) -> Dict[str, str]:
    """Local name -> what it imports: ``{"mp": "torch.multiprocessing", "spawn": "torch.multiprocessing.spawn"}``."""
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _dotted(func: ast.expr, aliases: Dict[str, str]) -> Optional[str]:
    """The full dotted name a call's function refers to, through the file's imports."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    return ".".join([aliases.get(func.id, func.id), *reversed(parts)])


def _function(target: Union[str, Callable[..., Any]]):
    """``(signature, ast node, file)`` of a target, or None when no ``def`` can be read."""
    if callable(target) and not isinstance(target, str):
        try:
            sig = inspect.signature(target)
            source = textwrap.dedent(inspect.getsource(target))
            node = ast.parse(source).body[0]
        except (TypeError, ValueError, OSError, SyntaxError, IndexError):
            return None
        return sig, node, getattr(getattr(target, "__code__", None), "co_filename", None)
    where, _, qualname = target.rpartition(":")
    if not where.endswith(".py"):
        import importlib

        obj: Any = importlib.import_module(where)  # resolve_target imported it already
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return _function(obj)
    module = _module_tree(where)
    node = find_def(module, qualname) if module else None
    return None if node is None else (_signature_of(node), node, where)


def _module_tree(path: Optional[str]) -> Optional[ast.Module]:
    import linecache

    if not path:
        return None
    lines = linecache.getlines(path) or (Path(path).read_text().splitlines(True) if Path(path).is_file() else [])
    try:
        return ast.parse("".join(lines))
    except SyntaxError:
        return None


def _signature_of(node: ast.FunctionDef) -> inspect.Signature:
    """The signature a ``def`` declares, without evaluating its defaults."""
    P = inspect.Parameter
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    has_default = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    params = [P(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                default=_DEFAULT if d else _NO_DEFAULT) for i, (arg, d) in enumerate(zip(positional, has_default))]
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [P(arg.arg, P.KEYWORD_ONLY, default=_DEFAULT if d is not None else _NO_DEFAULT)
               for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _describe(call: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    parts = ([_WHAT_CALL_PASSES[call]] if call in _WHAT_CALL_PASSES else []) + [f"args[{i}]" for i in range(len(args))]
    parts += [f"{k}=..." for k in kwargs]
    return f"({', '.join(parts)})" if parts else "no arguments"


def _fix(call: str) -> str:
    first = {CTX: "after ctx, ", MP_SPAWN: "after the rank, ", TORCHRUN: ""}[call]
    return (f"spawn_train passes its positional arguments {first}in order, and kwargs={{...}} by name: give each "
            "required parameter exactly once" + (" (for an mp.spawn function pass call='mp.spawn')" if call == CTX else ""))


__all__ = ["RANK_NAMES", "check_call", "calls_init_process_group"]
