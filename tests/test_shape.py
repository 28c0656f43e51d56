"""The house rules as facts, read from the code with ``ast``: short functions, classes of one job,
and every run-folder name spelled in one module.

A function body over 60 lines or a class over 400 does more than one thing; a run-folder name
spelled twice drifts apart. These tests name the offender and its length so the fix is plain.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbddp
from nbddp.contract import rundir

PACKAGE = Path(nbddp.__file__).parent
MAX_FUNCTION_BODY = 60
MAX_CLASS = 400


def parsed() -> dict:
    """Each module's file (relative to the package) -> its tree."""
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def body_lines(fn: ast.AST) -> int:
    """Lines of a function's body, its docstring left out."""
    body = fn.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return fn.end_lineno - body[0].lineno + 1


def test_no_function_body_is_over_60_lines():
    long = [f"{name}:{fn.lineno} {fn.name} ({body_lines(fn)} lines)"
            for name, tree in parsed().items() for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(fn) > MAX_FUNCTION_BODY]
    assert not long, f"function bodies over {MAX_FUNCTION_BODY} lines: " + "; ".join(long)


def test_no_class_is_over_400_lines():
    big = [f"{name}:{c.lineno} {c.name} ({c.end_lineno - c.lineno + 1} lines)"
           for name, tree in parsed().items() for c in ast.walk(tree)
           if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > MAX_CLASS]
    assert not big, f"classes over {MAX_CLASS} lines: " + "; ".join(big)


def run_folder_names() -> tuple:
    """rundir's names: files (they hold a dot) and folders (joined to a path with ``/``)."""
    names = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and v
             and " " not in v and "/" not in v}
    names |= {v for v in rundir.EXPORT_FILES}
    files = {n for n in names if "." in n.strip(".")}
    return files, names - files


def test_every_run_folder_name_is_spelled_in_rundir_only():
    files, folders = run_folder_names()
    assert {"export", "logs", "checkpoints"} <= folders and {"config.json", "model.pth"} <= files
    found = []
    for name, tree in parsed().items():
        if name == "contract/rundir.py":
            continue
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            joined = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            operands = [node.left, node.right] if joined else [node]
            for c in operands:
                if not isinstance(c, ast.Constant) or not isinstance(c.value, str) or id(c) in docstrings:
                    continue
                if c.value in files or (joined and c.value in folders):
                    found.append(f"{name}:{c.lineno} {c.value!r}")
    assert not found, "run-folder names spelled outside nbddp/contract/rundir.py: " + "; ".join(sorted(set(found)))
