"""The notebooks in git are clean: valid, output-free, runnable by a named kernel, titled.

Outputs in git make diffs unreadable and can leak paths, hostnames and data; a missing
kernelspec makes ``pytest --nbmake`` and "Run All" guess the kernel. Executing the notebooks is
nbmake's job (``pytest --nbmake notebooks/``); this test only reads the files, so it is fast.
"""

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _notebooks():
    return sorted(p for p in NOTEBOOKS.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _id(path: Path) -> str:
    return str(path.relative_to(NOTEBOOKS))


def test_there_are_notebooks():
    assert _notebooks(), f"no notebooks found under {NOTEBOOKS}"


@pytest.mark.parametrize("path", _notebooks(), ids=_id)
def test_notebook_is_clean(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)  # raises ValidationError naming the bad field

    kernelspec = nb.metadata.get("kernelspec") or {}
    assert kernelspec.get("name"), f"{_id(path)}: no kernelspec name in the notebook metadata"
    assert kernelspec.get("language", "python") == "python", f"{_id(path)}: kernelspec language is not python"

    dirty = [
        f"cell {i} ({'outputs' if cell.get('outputs') else 'execution_count'})"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{_id(path)} is committed with outputs: {', '.join(dirty)}. Clear them before committing "
        "(JupyterLab: Edit > Clear Outputs of All Cells, then save; or "
        "`jupyter nbconvert --clear-output --inplace <notebook>`)."
    )

    assert nb.cells, f"{_id(path)} has no cells"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.lstrip().startswith("# "), (
        f"{_id(path)}: the first cell must be a markdown title ('# ...'), "
        f"found a {first.cell_type} cell starting {first.source[:40]!r}"
    )
