"""Write the parts of README.md and docs/ that the code produces, between markers that are
also pymdownx.snippets sections (`<!-- --8<-- [start:NAME] [options] -->` … `[end:NAME]`):

* README.md's and docs/howto/*.md's examples (`example-…`): the block's `$ shardwise …` runs
  (COLUMNS=150) and its output replaces the rest. Options: `head=N` / `tail=N` keep the first /
  last N lines, `exit=N` expects that exit code and shows stderr (a refusal), `vary=REGEX` the
  lines whose numbers change run to run (`--check` masks them).
* docs/architecture.md's code tree (`code-tree`: every module with its docstring's first
  sentence), the import rules tests/test_layers.py enforces (`import-rules`) and the layers'
  picture with every import between them (`layers`: docs/layers.svg).
* the pictures (`PICTURES`): Chromium screenshots of the web app and explainers and
  `schedule --svg` Gantt charts; docs/pictures.json stores each screenshot's API calls and a
  hash of their answers and front-end files, so tests/test_readme.py can tell without a
  browser when a picture is older than what it shows.

Run `python scripts/generate_docs.py` (`--no-pictures`: all but pictures); `--check` rewrites
nothing and exits 1 naming each stale block (tests/test_readme.py and test_docs.py do the same).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HOWTO = sorted((ROOT / "docs" / "howto").glob("*.md"))
COLUMNS = "150"
BLOCK = re.compile(r"<!-- --8<-- \[start:(?P<name>[\w-]+)\](?P<options>[^>]*?) -->\n"
                   r"(?P<body>.*?)<!-- --8<-- \[end:(?P=name)\] -->", re.S)
OPTION = re.compile(r'(\w+)=("[^"]*"|\S+)')


@dataclass(frozen=True)
class Block:
    """One generated block of a file: its name, its options and its current text."""

    name: str
    options: dict[str, str]
    body: str


def blocks(text: str) -> list[Block]:
    """The generated blocks of `text`, in order."""
    return [Block(m["name"], {k: v.strip('"') for k, v in OPTION.findall(m["options"])},
                  m["body"]) for m in BLOCK.finditer(text)]


def replace(text: str, name: str, body: str) -> str:
    """`text` with block `name`'s body replaced by `body`."""
    def swap(m: re.Match[str]) -> str:
        if m["name"] != name:
            return m[0]
        return (f"<!-- --8<-- [start:{name}]{m['options']} -->\n{body}"
                f"<!-- --8<-- [end:{name}] -->")
    return BLOCK.sub(swap, text)


# ---------------------------------------------------------------------------- README examples
def command_of(block: Block) -> str:
    """The `shardwise …` command a README example block runs (its first line, after `$ `)."""
    first = block.body.split("```", 2)[1].split("\n")[1]
    if not first.startswith("$ shardwise "):
        raise ValueError(f"block {block.name}: the first line must be `$ shardwise …`")
    return first.removeprefix("$ ")


def run_example(block: Block) -> str:
    """The block's new body: the command, then its output as `head`/`tail` keep it."""
    command = command_of(block)
    argv = [sys.executable, "-m", "shardwise", *shlex.split(command)[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False,
                          env=os.environ | {"COLUMNS": COLUMNS})
    expected = int(block.options.get("exit", 0))
    if done.returncode != expected:
        raise RuntimeError(f"{command} exited {done.returncode}:\n{done.stderr[-2000:]}")
    shown = done.stdout if expected == 0 else done.stderr
    lines = [line.rstrip() for line in shown.rstrip("\n").split("\n")]
    head, tail = int(block.options.get("head", 0)), int(block.options.get("tail", 0))
    if head and len(lines) > head + tail:
        lines = [*lines[:head], "…", *(lines[-tail:] if tail else [])]
    return "```text\n" + "\n".join([f"$ {command}", *lines]) + "\n```\n"


def normalised(body: str, vary: str | None) -> str:
    """`body` as `--check` compares it: trailing spaces dropped; with `vary`, the numbers of
    the lines matching it masked and every run of spaces or table rules shortened to one, as
    a different timing may widen a table's column."""
    lines = [line.rstrip() for line in body.strip().split("\n")]
    if vary:
        pattern = re.compile(vary)
        lines = [re.sub(r"[\d.,]+", "#", line) if pattern.search(line) else line
                 for line in lines]
        lines = [re.sub(r"([ ─━])\1+", r"\1", line) for line in lines]
    return "\n".join(lines)


def stale_examples(text: str, only: str | None = None) -> list[str]:
    """The example blocks of `text` (or only block `only`) whose output differs from a new
    run's, each with the new output."""
    stale = []
    for block in blocks(text):
        if block.name.startswith("example-") and only in (None, block.name):
            new = run_example(block)
            vary = block.options.get("vary")
            if normalised(new, vary) != normalised(block.body, vary):
                stale.append(f"{block.name} is stale; now:\n{new}")
    return stale


# ---------------------------------------------------------------------------- the code tree
def first_sentence(path: Path, width: int) -> str:
    """The first sentence of the module docstring of `path` (empty without one), cut at a word
    to at most `width` characters."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?(?<! al)(?<!e\.g)(?<!i\.e))\.(\s|$)", paragraph)
    sentence = match[1] if match else paragraph
    if len(sentence) <= width:
        return sentence
    return sentence[:width - 1].rsplit(" ", 1)[0].rstrip(",;:(") + "…"


def _listing(folder: Path, indent: str) -> list[tuple[str, Path]]:
    rows = []
    for path in sorted(folder.iterdir(), key=lambda p: (p.is_dir(), p.name)):
        if path.is_dir() and (path / "__init__.py").exists():
            rows.append((f"{indent}{path.name}/", path / "__init__.py"))
            rows += [row for row in _listing(path, indent + "  ")
                     if not row[0].endswith("__init__.py")]
        elif path.suffix == ".py":
            rows.append((f"{indent}{path.name}", path))
    return rows


def import_rules() -> dict[str, list[str]]:
    """tests/test_layers.py's RULES: package → the modules it must never import."""
    spec = importlib.util.spec_from_file_location("test_layers", ROOT / "tests/test_layers.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RULES


def code_tree() -> str:
    """The code-tree block's body: every module with the first sentence of its docstring."""
    src = ROOT / "src/shardwise"
    rows: list[tuple[str, Path | None]] = [
        ("src/shardwise/", src / "__init__.py"),
        *[row for row in _listing(src, "  ") if row[0] != "  __init__.py"]]
    for folder in ("benchmarks", "scripts"):
        rows += [(f"{folder}/", None),
                 *[(f"  {p.name}", p) for p in sorted((ROOT / folder).glob("*.py"))]]
    names = max(len(name) for name, _ in rows) + 2
    tree = "\n".join(f"{name:<{names}}{first_sentence(path, 100 - names) if path else ''}"
                     .rstrip() for name, path in rows)
    return f"```text\n{tree}\n```\n"


def import_rules_table() -> str:
    """The import-rules block's body: tests/test_layers.py's rules, packages with the same
    rule sharing a row."""
    by_rule: dict[tuple[str, ...], list[str]] = {}
    for package, banned in sorted(import_rules().items()):
        by_rule.setdefault(tuple(banned), []).append(package)
    rows = "\n".join("| " + ", ".join(f"`{p}`" for p in packages) + " | "
                     + ", ".join(f"`{m}`" for m in banned) + " |"
                     for banned, packages in by_rule.items())
    return f"| package | never imports |\n| --- | --- |\n{rows}\n"


def layer_rows() -> list[tuple[str, list[str]]]:
    """The architecture page's layer picture: (layer, its top-level modules), top to bottom."""
    page = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    picture = page.split("top-level modules of src/shardwise -->\n```text\n", 1)[1]
    return [(m[1], m[2].split()) for line in picture.split("```", 1)[0].splitlines()
            if (m := re.match(r"(\w+) {2,}(.+?) {3,}", line))]


def package_imports() -> set[tuple[str, str]]:
    """(package, package it imports) over every module of src/shardwise, lazy imports too
    (tests/test_layers.py's reading of the AST)."""
    spec = importlib.util.spec_from_file_location("test_layers", ROOT / "tests/test_layers.py")
    assert spec and spec.loader
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    src = ROOT / "src/shardwise"
    edges = set()
    for path in src.rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[0].startswith("__"):
            continue
        for name in layers.imported_modules(path):
            target = name.split(".")[1] if name.startswith("shardwise.") else ""
            if target not in ("", parts[0]) and ((src / target).is_dir()
                                                 or (src / f"{target}.py").exists()):
                edges.add((parts[0], target))
    return edges


def layer_svg() -> str:
    """docs/layers.svg: the layers' modules as boxes, top to bottom as the page lists them, and
    every import between two of them as a line (hover: which imports which)."""
    rows, edges = layer_rows(), package_imports()
    where: dict[str, tuple[float, float, float]] = {}  # module -> (x centre, y top, width)
    row_h, gap, left = 46, 34, 120
    for r, (_, names) in enumerate(rows):
        x = left
        for name in names:
            width = 14 + 7.2 * len(name)
            where[name] = (x + width / 2, 20 + r * (row_h + gap), width)
            x += width + 14
    width = max(x + w / 2 for x, _, w in where.values()) + 20
    height = 20 + len(rows) * (row_h + gap)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
           f'font-family="monospace" font-size="12">']
    level = {name: r for r, (_, names) in enumerate(rows) for name in names}
    for a, b in sorted(edges):
        if a not in where or b not in where:
            continue
        (xa, ya, _), (xb, yb, _) = where[a], where[b]
        if level[a] == level[b]:  # within a layer: between the boxes' middles
            y1 = y2 = ya + row_h / 2
        else:
            y1, y2 = (ya + row_h, yb) if level[b] > level[a] else (ya, yb + row_h)
        out.append(f'<line x1="{xa:.1f}" y1="{y1}" x2="{xb:.1f}" y2="{y2}" stroke="#9aa0a6" '
                   f'stroke-width="1"><title>{a} imports {b}</title></line>')
    for r, (layer, _) in enumerate(rows):
        out.append(f'<text x="8" y="{20 + r * (row_h + gap) + row_h / 2 + 4}">{layer}</text>')
    for name, (x, y, w) in where.items():
        out.append(f'<rect x="{x - w / 2:.1f}" y="{y}" width="{w:.1f}" height="{row_h}" rx="6" '
                   f'fill="#e8f0fe" stroke="#1a73e8"/><text x="{x:.1f}" y="{y + row_h / 2 + 4}" '
                   f'text-anchor="middle">{name}</text>')
    return "\n".join([*out, "</svg>"]) + "\n"


GENERATED_PAGES = {"code-tree": code_tree, "import-rules": import_rules_table}
LAYERS_SVG = ROOT / "docs/layers.svg"  # layer_svg(), shown on the architecture page


# ---------------------------------------------------------------------------------- pictures
DOCS = ROOT / "docs"
MANIFEST = DOCS / "pictures.json"
# docs/NAME.png ← the page at this address, at 1440×900 (the first screen only)
SCREENSHOTS = {
    "ui-planner": "/planner?model=llama3-405b&gpus=16384&global_batch=16M-tokens",
    "ui-memory": "/memory",
    "ui-schedule": "/schedule?schedule=interleaved&chunks=2",
    **{f"learn-{name}": f"/learn/{name}" for name in (
        "memory-budget", "zero-stages", "ring-allreduce", "tp-mlp", "bubble", "pipeline-grid",
        "ring-attention", "context-wall", "checkpoint-interval", "run-timeline")},
}
THUMBS = ROOT / "src/shardwise/web/static/thumbs"  # the Learn cards' pictures
# docs/NAME.svg ← `shardwise schedule ARGS --svg FILE`
GANTTS = {
    "gantt-1f1b": ["-p", "4", "-m", "8", "--schedule", "1f1b"],
    "gantt-interleaved": ["-p", "4", "-m", "8", "--schedule", "interleaved", "--chunks", "2"],
    "gantt-zb-h1": ["-p", "4", "-m", "8", "--schedule", "zb-h1"],
    "gantt-dualpipe": ["-p", "8", "-m", "20", "--schedule", "dualpipe", "--tf", "2", "--tb", "3",
                       "--tw", "1"],
}
VOLATILE = {"seconds", "evaluation_seconds", "layouts_per_s"}  # a search's timings


def _steady(value: object) -> object:
    """`value` without the keys whose numbers change from run to run (timings)."""
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    return value


def picture_hash(calls: list[dict], statics: list[str], answer) -> str:
    """sha256 of what a screenshot shows: each API call's answer (`answer(call)`, timings left
    out) and each front-end file the page loaded (paths under src/shardwise/web/)."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for call in calls:
        digest.update(json.dumps([call, _steady(answer(call))], sort_keys=True).encode())
    for path in statics:
        digest.update(path.encode() + (ROOT / "src/shardwise/web" / path).read_bytes())
    return digest.hexdigest()


def client_answer(client):
    """A function answering a recorded call through the app (`fastapi.testclient`)."""
    def answer(call: dict):
        if call["method"] == "POST":
            return client.post(call["path"], json=call["body"]).json()
        return client.get(call["path"]).json()
    return answer


def gantt_svg(args: list[str]) -> str:
    """The SVG `shardwise schedule ARGS --svg` writes."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "chart.svg"
        subprocess.run([sys.executable, "-m", "shardwise", "schedule", *args, "--svg", str(out)],
                       check=True, capture_output=True, cwd=ROOT)
        return out.read_text(encoding="utf-8")


def write_pictures() -> None:
    """Write every picture and docs/pictures.json (needs chromium and the ui extra)."""
    import json
    import threading
    import time

    import uvicorn
    from fastapi.testclient import TestClient
    from playwright.sync_api import sync_playwright

    from shardwise.web.app import create_app

    for name, args in GANTTS.items():
        (DOCS / f"{name}.svg").write_text(gantt_svg(args), encoding="utf-8")
    app = create_app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    manifest = {}
    with sync_playwright() as playwright, TestClient(app) as client:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium",
                                             args=["--headless", "--no-sandbox"])
        for name, address in SCREENSHOTS.items():
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            calls: list[dict] = []
            statics: set[str] = set()

            def seen(request, calls=calls, statics=statics) -> None:
                path = request.url.removeprefix(base)
                if path.startswith("/api/"):
                    body = json.loads(request.post_data) if request.post_data else None
                    if body and "link" in body:  # the share link names the server's port
                        body["link"] = body["link"].removeprefix(base)
                    calls.append({"method": request.method, "path": path, "body": body})
                elif path.startswith("/static/"):
                    statics.add(path.removeprefix("/"))
            page.on("request", seen)
            page.goto(base + address, wait_until="networkidle")
            page.wait_for_timeout(300)  # charts drawn after the last answer
            page.screenshot(path=str(DOCS / f"{name}.png"))
            page.close()
            if name.startswith("learn-"):  # the card's thumbnail: the widget, at 0.3 scale
                small = browser.new_page(viewport={"width": 1440, "height": 900},
                                         device_scale_factor=0.3)
                small.goto(base + address, wait_until="networkidle")
                small.wait_for_timeout(300)
                THUMBS.mkdir(exist_ok=True)
                small.screenshot(path=str(THUMBS / f"{name.removeprefix('learn-')}.png"),
                                 clip={"x": 90, "y": 200, "width": 1260, "height": 600})
                small.close()
            calls.sort(key=lambda c: json.dumps(c, sort_keys=True))
            html = "static/" + ("learn/" if "/learn/" in address else "") \
                + address.split("?")[0].rsplit("/", 1)[1] + ".html"
            files = sorted(statics | {html})
            manifest[f"{name}.png"] = {"address": address, "calls": calls, "static": files,
                                       "sha256": picture_hash(calls, files,
                                                              client_answer(client))}
        browser.close()
    server.should_exit = True
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def stale_pictures() -> list[str]:
    """The pictures whose data or front end changed since they were taken, or that are
    missing (needs the ui extra; no browser)."""
    import json

    from fastapi.testclient import TestClient

    from shardwise.web.app import create_app

    stale = [f"{name}.svg" for name, args in GANTTS.items()
             if not (DOCS / f"{name}.svg").exists()
             or (DOCS / f"{name}.svg").read_text(encoding="utf-8") != gantt_svg(args)]
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8")) if MANIFEST.exists() else {}
    with TestClient(create_app()) as client:
        for name, address in SCREENSHOTS.items():
            entry = manifest.get(f"{name}.png")
            if (entry is None or entry["address"] != address
                    or not (DOCS / f"{name}.png").exists()
                    or picture_hash(entry["calls"], entry["static"],
                                    client_answer(client)) != entry["sha256"]):
                stale.append(f"{name}.png")
    return stale


def stale_pages(text: str) -> list[str]:
    """The docs page's generated blocks (code tree, import rules) that differ from what the
    source and tests/test_layers.py give now."""
    return [f"{block.name} is stale; now:\n{GENERATED_PAGES[block.name]()}"
            for block in blocks(text) if block.name in GENERATED_PAGES
            and block.body != GENERATED_PAGES[block.name]()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if stale")
    parser.add_argument("--only", help="one block, e.g. example-plan or code-tree")
    parser.add_argument("--no-pictures", action="store_true",
                        help="leave the screenshots and Gantt charts as they are")
    args = parser.parse_args()
    readme, architecture = README.read_text(encoding="utf-8"), ARCHITECTURE.read_text("utf-8")
    if args.check:
        stale = stale_examples(readme, args.only)
        stale += [s for page in HOWTO for s in stale_examples(page.read_text("utf-8"), args.only)]
        stale += [s for s in stale_pages(architecture)
                  if args.only in (None, s.split(" ", 1)[0])]
        if args.only in (None, "layers") and LAYERS_SVG.read_text("utf-8") != layer_svg():
            stale.append("layers is stale (docs/layers.svg)")
        if not args.no_pictures and args.only in (None, "pictures"):
            stale += [f"{name} is stale" for name in stale_pictures()]
        print("\n".join(stale) or "up to date")
        return 1 if stale else 0
    for block in blocks(readme):
        if block.name.startswith("example-") and args.only in (None, block.name):
            readme = replace(readme, block.name, run_example(block))
    README.write_text(readme, encoding="utf-8")
    for page in HOWTO:
        text = page.read_text(encoding="utf-8")
        for block in blocks(text):
            if block.name.startswith("example-") and args.only in (None, block.name):
                text = replace(text, block.name, run_example(block))
        page.write_text(text, encoding="utf-8")
    for name, generate in GENERATED_PAGES.items():
        if args.only in (None, name):
            architecture = replace(architecture, name, generate())
    ARCHITECTURE.write_text(architecture, encoding="utf-8")
    if args.only in (None, "layers"):
        LAYERS_SVG.write_text(layer_svg(), encoding="utf-8")
    if not args.no_pictures and args.only in (None, "pictures"):
        write_pictures()
    return 0


if __name__ == "__main__":
    sys.exit(main())
