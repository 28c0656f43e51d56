"""The documentation site builds strictly, its API reference covers every public name, and no
relative link of the README or of docs/ is broken.

The site is mkdocs.yml + docs/ (mkdocs-material, mkdocstrings-python: the dev set-up and the
``docs`` extra install them). ``mkdocs build --strict`` fails on a broken link or anchor, a page
missing from the navigation, or a docstring that mkdocstrings cannot read; the build goes into a
temporary folder, so the working tree is left as it was.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
#: ``[text](target)`` and ``![alt](target)``: inline links, the form these files use.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built with ``mkdocs build --strict`` into a temporary folder."""
    if sys.version_info < (3, 11, 5):
        # requirements-dev.txt leaves the site's tools out there: pymdown-extensions needs 3.11.5+.
        pytest.skip("the documentation site's tools need Python 3.11.5+ (pymdown-extensions); "
                    "this is Python " + ".".join(map(str, sys.version_info[:3])))
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.fail("mkdocs and mkdocstrings-python are not installed: pip install -r requirements-dev.txt, "
                    "or pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    said = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("INFO")]
    assert done.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(said)
    return out


def test_site_builds_strictly(site):
    for page in ("index.html", "quickstart/index.html", "api/launch/index.html", "cluster/index.html"):
        assert (site / page).is_file(), f"{page} was not built"


def test_api_reference_documents_every_public_name(site):
    import nbddp

    api = "\n".join(p.read_text() for p in (site / "api").rglob("*.html"))
    missing = []
    for name in nbddp.__all__:
        obj = getattr(nbddp, name)
        where = f"{obj.__module__}.{name}"
        if f'id="{where}"' not in api:
            missing.append(f"{name} (::: {where} in a page of docs/api/)")
    assert not missing, "public names without an entry in the API reference: " + ", ".join(missing)


def test_docstring_roles_become_links(site):
    """The docstrings' Sphinx roles (:class:`X`) are links or code on the site, never raw text."""
    pages = {p.relative_to(site): p.read_text() for p in (site / "api").rglob("*.html")}
    raw = {str(p): sorted(set(re.findall(r":(?:class|func|meth|mod|data|attr|exc):(?:`|<code>)[^`<]*", t)))[:3]
           for p, t in pages.items()}
    raw = {p: found for p, found in raw.items() if found}
    assert not raw, f"Sphinx roles left as text: {raw}"
    launch = pages[Path("api/launch/index.html")]
    # spawn_train's docstring names RunHandle.subscribe and nbddp.Context.prepare by role.
    assert re.search(r'<a [^>]*href="[^"]*#nbddp\.kernel\.handle\.RunHandle\.subscribe"', launch)
    assert re.search(r'<a [^>]*href="[^"]*context/#nbddp\.rank\.runtime\.Context\.prepare"', launch)


def _markdown_files():
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _slug(text: str) -> str:
    """A heading's anchor as Python-Markdown (the site) makes it."""
    from markdown.extensions.toc import slugify

    return slugify(re.sub(r"[`*]", "", text), "-")


def _github_slug(text: str) -> str:
    """A heading's anchor as GitHub makes it (the README and docs read there too)."""
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    body = FENCE.sub("", path.read_text())
    heads = HEADING.findall(body)
    return {_slug(h) for h in heads} | {_github_slug(h) for h in heads}


def _links(path: Path):
    """Every inline link target of ``path`` outside code blocks and code spans."""
    body = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    return LINK.findall(body)


def test_every_relative_link_resolves():
    broken = []
    for md in _markdown_files():
        for target in _links(md):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no {file}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: {dest.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_readme_shows_the_panel_training():
    from PIL import Image

    images = [t for t in _links(ROOT / "README.md") if t.lower().endswith(".png")]
    panel = [t for t in images if "panel-training" in t]
    assert panel, f"the README shows no screenshot of the panel training (its images: {images})"
    with Image.open(ROOT / panel[0]) as im:
        assert im.format == "PNG" and im.width >= 800, f"{panel[0]}: {im.format} {im.width}x{im.height}"


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move the details to a page of docs/ and link it"
