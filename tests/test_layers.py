"""The import rules between the packages, read from the source (AST, every `import`, also
those inside functions), so a lazy import cannot slip past them:

* `runtime/` never imports `emulate/` (teaching code) or `demos/`;
* `ops/` (shared numerics) never imports `runtime/`, `emulate/` or `demos/`;
* `emulate/` never imports `runtime/` or `demos/`;
* the analytic side never imports torch, `ops/`, `emulate/` or `demos/` (`cli` reaches the
  runtime lazily, inside its commands; `test_cli.py` checks that importing it stays
  torch-free);
* `calibration/` (the constants) never imports `estimate/` or `plan/` (the models that use
  them): one direction, estimate → calibration.
"""

import ast
from pathlib import Path

import pytest

import shardwise

SRC = Path(shardwise.__file__).parent
ANALYTIC = ["arch", "hardware", "layout", "layout_checks", "partition", "choices", "units", "errors", "files", "estimate", "schedules",
            "plan", "emit", "report", "calibration"]
RULES = {  # package -> module prefixes it must never import
    "runtime": ["shardwise.emulate", "shardwise.demos"],
    "ops": ["shardwise.runtime", "shardwise.emulate", "shardwise.demos"],
    "emulate": ["shardwise.runtime", "shardwise.demos"],
    **{name: ["torch", "shardwise.runtime", "shardwise.ops", "shardwise.emulate",
              "shardwise.demos"] for name in ANALYTIC},
}
RULES["calibration"] = [*RULES["calibration"], "shardwise.estimate", "shardwise.plan"]


def imported_modules(path: Path, *, executed_only: bool = False) -> set[str]:
    """Every module `path` imports, relative imports resolved against its package;
    `executed_only` skips `if TYPE_CHECKING:` blocks."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text())
    if executed_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = [ast.Pass()]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def files_of(name: str) -> list[Path]:
    folder = SRC / name
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [SRC / f"{name}.py"]


@pytest.mark.parametrize("name", sorted(RULES))
def test_import_rules(name):
    files = files_of(name)
    assert all(f.exists() for f in files), name
    broken = [f"{f.relative_to(SRC)} imports {module}"
              for f in files for module in sorted(imported_modules(f))
              for banned in RULES[name] if module == banned or module.startswith(banned + ".")]
    assert not broken, broken


def test_the_rules_see_a_violation(tmp_path, monkeypatch):
    """The checker itself: a lazy import inside a function and a relative import are found."""
    monkeypatch.setattr("tests.test_layers.SRC", tmp_path / "shardwise")
    bad = tmp_path / "shardwise" / "ops" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from ..runtime import mesh\n    import torch\n")
    assert {"shardwise.runtime", "shardwise.runtime.mesh", "torch"} <= imported_modules(bad)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles():
    """Every import (module level or lazy, inside functions, or by name through importlib)
    between shardwise modules forms no cycle: `python -m shardwise` is the one entry point (no
    module imports the CLI back, as `runtime/train.py`'s `__main__` block once did)."""
    modules = {_module_name(f): f for f in SRC.rglob("*.py")}

    def uses(f: Path) -> set[str]:  # imports, and `import_module("shardwise.…")`-like calls
        named = {arg.value for node in ast.walk(ast.parse(f.read_text()))
                 if isinstance(node, ast.Call) and "import" in ast.unparse(node.func)
                 for arg in node.args if isinstance(arg, ast.Constant)}
        return (imported_modules(f, executed_only=True) | named) & modules.keys()

    graph = {name: sorted(uses(f) - {name}) for name, f in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            assert cycle is None, " → ".join(cycle)


# ------------------------------------------------------------------------- rooms to read
ROOT = SRC.parents[1]
MAX_LINES, MAX_DOCSTRING = 600, 20  # a module to read in one sitting; its docstring a summary


def python_files() -> list[Path]:
    """Every Python file of the package, the benchmarks and the scripts."""
    return sorted(p for folder in (SRC, ROOT / "benchmarks", ROOT / "scripts")
                  for p in folder.rglob("*.py"))


def test_no_file_is_over_600_lines():
    """A file one sitting can read (issue 48): split a larger one along its seams."""
    long = {str(p.relative_to(ROOT)): n for p in python_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_module_docstrings_are_summaries():
    """A module docstring is the contract, the formula and the source — at most 20 lines; the
    derivation goes to a docs/concepts page the docstring links (issue 48)."""
    long = {}
    for path in python_files():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc and len(doc.splitlines()) > MAX_DOCSTRING:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, long
