"""The documentation site (mkdocs.yml, docs/): it builds with every warning an error (broken
links and anchors, missing snippets, pages outside the nav), every public function and class
has a docstring and a rendered entry in the API reference, every module has an API page, every
benchmark result is on a page, and the architecture page's code tree is the tree.

The build needs the docs extra (`pip install -e ".[docs]"`): without it these tests skip
locally, and under CI (`CI=true`) a missing docs toolchain is an error.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_API = {"shardwise.cli", "shardwise.__main__"}  # the generated CLI reference documents them
TOOLCHAIN = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "mkdocs_click",
             "griffe")


def _need(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI"):
            raise RuntimeError(f"the docs tests need the docs extra ({exc.name} is missing): "
                               "pip install -e '.[docs]'") from None
        pytest.skip(f"no docs toolchain ({exc.name}): pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `mkdocs build --strict` writes it."""
    for module in TOOLCHAIN:
        _need(module)
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def public_objects(package_dir: Path, package: str = "shardwise") -> list[tuple[str, bool]]:
    """(path, has a docstring) of every public function and class of every module of
    `package`, read as mkdocstrings reads them (griffe, statically) with its `public` filter:
    the names in `__all__`, or without one those not starting with `_`; imports excluded."""
    griffe = _need("griffe")
    found = []

    def walk(module) -> None:
        if module.path in NOT_API:
            return
        for member in module.members.values():
            if member.is_alias:  # an import: documented where it is defined
                continue
            if member.is_module:  # every module has its own page entry, exported or not
                walk(member)
            elif (member.is_function or member.is_class) and member.is_public:
                found.append((member.path, bool(member.docstring)))

    walk(griffe.load(package, search_paths=[str(package_dir)], resolve_aliases=False))
    return found


def test_every_public_function_and_class_has_a_docstring():
    objects = public_objects(ROOT / "src")
    assert len(objects) > 300, len(objects)  # the walk reached every module
    undocumented = [path for path, documented in objects if not documented]
    assert not undocumented, undocumented


def test_the_docstring_check_sees_an_undocumented_function(tmp_path):
    """The walk itself: an undocumented public function in a subpackage is found, a private
    one, an import and a name left out of `__all__` are not."""
    pkg = tmp_path / "shardwise"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Top."""\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from os import path\n\n\ndef bare(): pass\n\n\n"
                                      "def _private(): pass\n\n\ndef told():\n    '''Doc.'''\n")
    (pkg / "sub" / "b.py").write_text("__all__ = ['listed']\n\n\ndef listed(): pass\n\n\n"
                                      "def unlisted(): pass\n")
    assert sorted(public_objects(tmp_path)) == [("shardwise.sub.a.bare", False),
                                               ("shardwise.sub.a.told", True),
                                               ("shardwise.sub.b.listed", False)]


def test_every_module_has_an_api_page():
    """Each module is on a page of the API reference (`::: shardwise.…`), so a new module
    cannot be left out of it."""
    on_pages = {line.removeprefix("::: ").strip()
                for page in (DOCS / "api").glob("*.md")
                for line in page.read_text(encoding="utf-8").splitlines()
                if line.startswith("::: ")}
    modules = {".".join(p.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(
        ".__init__") for p in (ROOT / "src/shardwise").rglob("*.py")}
    docless = {"shardwise.estimate"}  # an empty __init__: its modules have their own entries
    inside = {m for m in modules if m.rpartition(".")[0] in NOT_API}  # the cli package's modules
    assert modules - NOT_API - inside - docless - on_pages == set()
    assert on_pages - modules == set()


def test_every_public_function_and_class_is_rendered(site):
    """mkdocstrings wrote an entry (an anchor named by its path) for each of them."""
    anchors = {m for page in (site / "api").rglob("*.html")
               for m in re.findall(r'id="(shardwise\.[\w.]+)"', page.read_text("utf-8"))}
    missing = [path for path, _ in public_objects(ROOT / "src") if path not in anchors]
    assert not missing, missing


def test_the_site_has_its_pages(site):
    pages = {p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in ("getting-started", "concepts", "howto", "cli", "api", "accuracy",
                 "architecture", "changelog"):
        assert page in pages, page
    cli = (site / "cli" / "index.html").read_text("utf-8")
    from shardwise.cli import cli as group

    for command in group.commands:  # mkdocs-click documented every command
        assert f"shardwise {command}" in cli, command


def test_every_benchmark_result_is_on_a_page():
    """Each file the benchmarks write (benchmarks/results.py) is included by a page."""
    included = {m for page in DOCS.rglob("*.md")
                for m in re.findall(r'--8<-- "(docs/generated/[\w-]+\.md)"',
                                    page.read_text(encoding="utf-8"))}
    written = {p.relative_to(ROOT).as_posix() for p in (DOCS / "generated").glob("*.md")}
    assert written - included == set()


def test_the_code_tree_and_import_rules_are_current():
    """docs/architecture.md's tree and import rules are what scripts/generate_docs.py writes
    from the source and tests/test_layers.py now."""
    from scripts import generate_docs

    page = generate_docs.ARCHITECTURE.read_text(encoding="utf-8")
    assert {b.name for b in generate_docs.blocks(page)} >= set(generate_docs.GENERATED_PAGES)
    stale = generate_docs.stale_pages(page)
    assert not stale, "run `python scripts/generate_docs.py`:\n" + "\n".join(stale)


def test_the_layers_svg_is_current():
    """docs/layers.svg draws the layer picture below and every import between two of its
    modules as the source has them now (`scripts/generate_docs.py --only layers`)."""
    from scripts import generate_docs

    assert generate_docs.LAYERS_SVG.read_text("utf-8") == generate_docs.layer_svg(), \
        "run `python scripts/generate_docs.py --only layers`"


def test_the_layer_picture_names_every_package():
    """The architecture page's layer picture names each top-level module of src/shardwise
    once, and nothing else."""
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    picture = page.split("top-level modules of src/shardwise -->\n```text\n", 1)[1]
    picture = picture.split("```", 1)[0]
    named = [name for line in picture.splitlines() if (m := re.match(r"\w+ {2,}(.+?) {3,}", line))
             for name in m[1].split()]
    modules = {p.stem if p.is_file() else p.name for p in (ROOT / "src/shardwise").iterdir()
               if (p.suffix == ".py" or (p / "__init__.py").exists()) and not p.name.startswith("__")}
    assert sorted(named) == sorted(modules)


def test_the_site_makes_no_external_request(site):
    """Every stylesheet, script and font the built pages load comes from the site itself
    (mkdocs-material's Google Fonts are off: `theme.font: false`), so it works offline."""
    external = re.compile(r'<(?:link|script)\b[^>]*\b(?:href|src)="(https?:)?//[^"]*"')
    found = {m[0] for page in site.rglob("*.html")
             for m in external.finditer(page.read_text("utf-8"))
             if 'rel="canonical"' not in m[0] and 'rel="alternate"' not in m[0]}
    assert not found, sorted(found)[:5]


def test_the_howto_examples_are_current():
    """The how-to pages' example blocks print what their commands print now (a refusal's
    figures included: `exit=2` blocks show stderr)."""
    from scripts import generate_docs

    pages = [p for p in generate_docs.HOWTO if "[start:example-" in p.read_text("utf-8")]
    assert pages
    stale = [s for p in pages for s in generate_docs.stale_examples(p.read_text("utf-8"))]
    assert not stale, "run `python scripts/generate_docs.py`:\n" + "\n".join(stale)
