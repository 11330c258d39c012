"""Read the facts `stacks.titan_versions` models from torchtitan's own code at a release tag and
write them as a small JSON (benchmarks/torchtitan_v0.1.0_facts.json), so tests check the stack
against that code without a network or torchtitan's dependencies (CI has neither).

Parses with `ast` only, from a git checkout of github.com/pytorch/torchtitan (`git show
TAG:path`): the config dataclasses' defaults and Literal choices (config_manager.py), SDPA's
backend priority (models/attention.py), the llama3 flavor's attention switch (args.py), the
core model families (torchtitan/models/*), the conditions under which llama3's args and
parallelize_llama raise, the pipeline's stage-placement rule, and the tag's commit.

Run: `python scripts/torchtitan_facts.py --repo PATH [--tag v0.1.0] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "torchtitan_v0.1.0_facts.json"
CONFIG = "torchtitan/config_manager.py"
ATTENTION = "torchtitan/models/attention.py"
ARGS = "torchtitan/models/llama3/model/args.py"
PARALLELIZE = "torchtitan/models/llama3/infra/parallelize.py"
PIPELINE = "torchtitan/models/llama3/infra/pipeline.py"
SECTIONS = ("Training", "Parallelism", "ActivationCheckpoint", "Float8", "MX", "Checkpoint")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout


def _value(node: ast.expr | None) -> Any:
    """A default as JSON: a literal, or the literal a `field(default_factory=…)` makes."""
    if node is None:
        return "<required>"
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field":
        factory = next((k.value for k in node.keywords if k.arg == "default_factory"), None)
        if isinstance(factory, ast.Name):
            return {"list": [], "dict": {}}.get(factory.id, factory.id)
        return ast.unparse(node)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _choices(annotation: ast.expr) -> list[Any] | None:
    """The values of a `Literal[...]` annotation (also inside `Literal[...] | None`)."""
    for node in ast.walk(annotation):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "Literal"):
            inner = node.slice
            items = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            return [ast.literal_eval(item) for item in items]
    return None


def config_fields(source: str) -> dict[str, dict[str, Any]]:
    """{section: {field: {"default", "choices"?}}} of the config dataclasses in `SECTIONS`."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in SECTIONS:
            fields: dict[str, Any] = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    entry = {"default": _value(item.value)}
                    choices = _choices(item.annotation)
                    if choices is not None:
                        entry["choices"] = choices
                    fields[item.target.id] = entry
            out[node.name] = fields
    return out


def sdpa_backends(source: str) -> dict[str, Any]:
    """ScaledDotProductAttention's backend list in priority order and the compute capability
    that puts cuDNN first (`_init_backend`)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "_init_backend":
            order = next(
                [e.attr for e in n.value.elts if isinstance(e, ast.Attribute)]
                for n in ast.walk(node) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.List))
            insert = next(n for n in ast.walk(node)
                          if isinstance(n, ast.If) and isinstance(n.test, ast.Call))
            assert isinstance(insert.test, ast.Call)
            capability = [ast.literal_eval(a) for a in insert.test.args]
            first = next(a.attr for a in ast.walk(insert) if isinstance(a, ast.Attribute)
                         and a.attr.endswith("_ATTENTION") and a.attr not in order)
            return {"order": order, "first_at_capability": capability, "first": first}
    raise ValueError("no ScaledDotProductAttention._init_backend")


def model_args(source: str) -> dict[str, Any]:
    """TransformerModelArgs' attention fields and their defaults."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "TransformerModelArgs":
            return {item.target.id: _value(item.value) for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and item.target.id in ("use_flex_attn", "attn_mask_type")}
    raise ValueError("no TransformerModelArgs")


def guards(source: str, function: str) -> list[dict[str, Any]]:
    """Each `raise` in `function` with the branch conditions that lead to it: [(condition
    text, taken)] from the outermost `if`, its line, and the `if`'s line that guards it."""
    out: list[dict[str, Any]] = []

    def walk(body: list[ast.stmt], path: list[list[Any]], if_line: int) -> None:
        for node in body:
            if isinstance(node, ast.Raise):
                out.append({"path": path, "line": node.lineno, "if_line": if_line,
                            "raises": ast.unparse(node.exc) if node.exc else ""})
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                walk(node.body, [*path, [test, True]], node.lineno)
                walk(node.orelse, [*path, [test, False]], if_line)

    fn = next(n for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.FunctionDef) and n.name == function)
    walk(fn.body, [], 0)
    return out


def assignment(source: str, name: str) -> dict[str, Any]:
    """The first `name = …` in `source`: its expression and line."""
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets))
    return {"value": ast.unparse(node.value), "line": node.lineno}


def facts(repo: Path, tag: str) -> dict[str, Any]:
    """Every fact above, read at `tag`."""
    models = sorted({p.split("/")[2] for p in _git(repo, "ls-tree", "-r", "--name-only", tag,
                                                   "torchtitan/models/").split()
                     if p.count("/") > 2})
    return {"repo": "github.com/pytorch/torchtitan", "tag": tag,
            "commit": _git(repo, "rev-list", "-n", "1", tag).strip(),
            "config": config_fields(_git(repo, "show", f"{tag}:{CONFIG}")),
            "sdpa_backends": sdpa_backends(_git(repo, "show", f"{tag}:{ATTENTION}")),
            "llama3_args": model_args(_git(repo, "show", f"{tag}:{ARGS}")),
            "guards": {
                ARGS: guards(_git(repo, "show", f"{tag}:{ARGS}"), "update_from_config"),
                PARALLELIZE: guards(_git(repo, "show", f"{tag}:{PARALLELIZE}"),
                                    "parallelize_llama")},
            "pipeline_stage_style": assignment(_git(repo, "show", f"{tag}:{PIPELINE}"),
                                               "style"),
            "core_models": models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True, help="a torchtitan git checkout")
    parser.add_argument("--tag", default="v0.1.0")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.write_text(json.dumps(facts(args.repo, args.tag), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
