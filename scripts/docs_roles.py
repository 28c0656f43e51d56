"""A griffe extension for the documentation site: the docstrings' Sphinx roles become links.

nbddp's docstrings are Google-style with Sphinx cross-reference roles (``:class:`RunHandle```,
``:func:`~nbddp.kernel.procs.cleanup```), which Markdown would print as they are. Each role
becomes an *optional* cross-reference of mkdocs-autorefs: a link where the site documents its
target, plain code where it does not (an internal module), so a role never breaks the strict build.

mkdocs.yml loads it as ``extensions: [scripts/docs_roles.py:SphinxRoles]``.
"""

from __future__ import annotations

import html
import re
from typing import Any

from griffe import Extension, Object

#: ``:class:`~a.b.C``` and the like: the role, a ``~`` (show the last part only), the target.
ROLE = re.compile(r":(?:py:)?(?:mod|class|meth|func|data|attr|exc|obj):`(?P<tilde>~?)(?P<target>[^`<>]+?)(?:\(\))?`")


def _public_names() -> dict:
    """``nbddp.X`` -> the dotted path of the module that defines X (the package's lazy exports)."""
    try:
        import nbddp  # imports nothing heavy: every public name loads on first use

        import nbddp.ui  # its names are lazy too: each in the module _WHERE says

        where = {name: f"ui{module}" for name, module in nbddp.ui._WHERE.items()}
        return {f"nbddp.{name}": f"nbddp.{where.get(name, module)}.{name}" for name, module in nbddp._EXPORTS.items()}
    except Exception:  # noqa: BLE001 - the links then stay plain code; the build goes on
        return {}


class SphinxRoles(Extension):
    """Rewrite each object's Sphinx roles as optional autorefs before its docstring is parsed."""

    def __init__(self) -> None:
        super().__init__()
        self.public = _public_names()

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = ROLE.sub(lambda m: self._link(m, obj), obj.docstring.value)

    def _link(self, match: re.Match, obj: Object) -> str:
        target = match["target"].strip()
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
        identifier = self._resolve(target, obj)
        return (f'<autoref identifier="{html.escape(identifier)}" optional>'
                f"<code>{html.escape(shown)}</code></autoref>")

    def _resolve(self, target: str, obj: Object) -> str:
        """The full dotted path of ``target`` as written in ``obj``'s docstring."""
        if target.startswith("nbddp."):
            first = ".".join(target.split(".")[:2])
            if first in self.public:  # nbddp.Context.prepare -> nbddp.rank.runtime.Context.prepare
                return self.public[first] + target[len(first):]
            return target
        head, _, rest = target.partition(".")
        module = obj.module
        if head in module.members or f"nbddp.{head}" not in self.public:
            return f"{module.path}.{target}"  # RunHandle.subscribe, written in nbddp.kernel.handle
        return self.public[f"nbddp.{head}"] + ("." + rest if rest else "")  # RunHandle, written elsewhere
