"""Write what llm-foundry's FP8 benchmark runs ran, read from the code, to a data file.

Composer, Transformer Engine 0.10 and llm-foundry are not installed (TE needs CUDA to import),
so tests/integration/test_composer_fp8.py checks the pytorch-fsdp stack's FP8 recipe
(`shardwise.fp8.RECIPES[("composer", "delayed")]`) against this table, parsed with `ast` from
the sources at the commits the benchmark table names: Composer's `amp_fp8` default recipe
(composer/core/precision.py), TE's `DelayedScaling` defaults and `te.Linear`'s weight casts and
saved tensors, llm-foundry's `fc_type: te` for FP8 runs, which MPT layers it reaches and the
MLP type (not TE's fused LayerNorm-MLP).

Run from the repository root with git clones (bare is fine) of the three repositories:

    python scripts/composer_fp8_facts.py COMPOSER_GIT TE_GIT LLM_FOUNDRY_GIT \\
        > tests/integration/data/composer_te_fp8.json
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from typing import Any

COMPOSER = ("v0.17.2", "v0.21.3")  # llm-foundry 5e85bd62's (the table's) and 4952183768's pins
TE = "v0.10"  # submit_benchmarks.py: pip install TransformerEngine@v0.10 for FP8 runs
FOUNDRY = "495218376830947dce625efabc4d86be7c47cc45"


def _tree(git: str, commit: str, path: str) -> ast.Module:
    text = subprocess.run(["git", "--git-dir", git, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout
    return ast.parse(text)


def _function(tree: ast.AST, name: str) -> ast.AST:
    return next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                and n.name == name)


def composer_default(git: str, tag: str) -> dict[str, str]:
    """The `precision_config` dict `get_precision_context` builds when none is given."""
    fn = _function(_tree(git, tag, "composer/core/precision.py"), "get_precision_context")
    node = next(n for n in ast.walk(fn) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Dict)
                and ast.unparse(n.targets[0]) == "precision_config")
    assert isinstance(node.value, ast.Dict)
    return {ast.literal_eval(k): ast.unparse(v) for k, v in zip(node.value.keys, node.value.values)
            if k is not None}


def te_facts(git: str) -> dict[str, Any]:
    """DelayedScaling's field defaults, the linear-precision override's, and te.Linear's weight
    cast condition and saved tensors."""
    recipe = _tree(git, TE, "transformer_engine/common/recipe.py")
    fields = {ast.unparse(n.target): ast.unparse(n.value)
              for n in _function(recipe, "DelayedScaling").body
              if isinstance(n, ast.AnnAssign) and n.value is not None}
    override = {ast.unparse(n.target): ast.unparse(n.value)
                for n in _function(recipe, "_OverrideLinearPrecision").body
                if isinstance(n, ast.AnnAssign) and n.value is not None}
    linear = _tree(git, TE, "transformer_engine/pytorch/module/linear.py")
    update = next(ast.unparse(n.value) for n in ast.walk(linear) if isinstance(n, ast.Assign)
                  and ast.unparse(n.targets[0]) == "update_fp8_weights")
    saved = next([ast.unparse(a) for a in n.args] for n in ast.walk(linear)
                 if isinstance(n, ast.Call) and ast.unparse(n.func) == "ctx.save_for_backward")
    return {"commit": TE, "DelayedScaling": fields, "_OverrideLinearPrecision": override,
            "update_fp8_weights": update, "save_for_backward": saved}


def foundry_facts(git: str) -> dict[str, Any]:
    """FP8 runs' fc_type, what `te` builds, the MPT modules built with fc_type and how they
    are called, and when the LM head is its own layer."""
    submit = _tree(git, FOUNDRY, "scripts/train/benchmarking/submit_benchmarks.py")
    fp8_sets = {ast.unparse(a.targets[0]): ast.literal_eval(a.value)
                for n in ast.walk(submit) if isinstance(n, ast.If)
                and "precision == 'fp8'" in ast.unparse(n.test)
                for a in n.body if isinstance(a, ast.Assign)}
    fc = _tree(git, FOUNDRY, "llmfoundry/models/layers/fc.py")
    registered = {ast.literal_eval(n.args[0]): ast.unparse(n.keywords[0].value)
                  for n in ast.walk(fc) if isinstance(n, ast.Call)
                  and ast.unparse(n.func) == "fcs.register"}
    built: dict[str, list[str]] = {}
    calls: dict[str, list[list[str]]] = {}
    for path, cls in (("attention.py", "GroupedQueryAttention"), ("ffn.py", "MPTMLP")):
        node = _function(_tree(git, FOUNDRY, f"llmfoundry/models/layers/{path}"), cls)
        built[cls] = [ast.unparse(n.targets[0]) for n in ast.walk(node)
                      if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                      and ast.unparse(n.value.func) == "build_fc"
                      and any(k.arg == "name" and ast.unparse(k.value) == "fc_type"
                              for k in n.value.keywords)]
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and ast.unparse(n.func) in built[cls]:
                calls.setdefault(ast.unparse(n.func), []).append(
                    [k.arg or "**" for k in n.keywords])
    modeling = _tree(git, FOUNDRY, "llmfoundry/models/mpt/modeling_mpt.py")
    head_if = next(ast.unparse(n.test) for n in ast.walk(modeling) if isinstance(n, ast.If)
                   and any("self.lm_head = nn.Linear" in ast.unparse(b) for b in n.body))
    config = _function(_tree(git, FOUNDRY, "llmfoundry/models/mpt/configuration_mpt.py"),
                       "__init__")
    assert isinstance(config, ast.FunctionDef)
    args = config.args
    defaults = dict(zip([a.arg for a in args.args][-len(args.defaults):],
                        [ast.unparse(d) for d in args.defaults]))
    module = _tree(git, FOUNDRY, "llmfoundry/models/mpt/configuration_mpt.py")
    ffn = next(n.value for n in module.body if isinstance(n, ast.AnnAssign)
               and ast.unparse(n.target) == "ffn_config_defaults")
    assert isinstance(ffn, ast.Dict)
    ffn_defaults = {ast.literal_eval(k): ast.unparse(v) for k, v in zip(ffn.keys, ffn.values)
                    if k is not None}
    yamls = {size: "ffn_config" in subprocess.run(
                 ["git", "--git-dir", git, "show",
                  f"{FOUNDRY}:scripts/train/yamls/pretrain/mpt-{size}.yaml"],
                 check=True, capture_output=True, text=True).stdout for size in ("1b", "3b")}
    return {"commit": FOUNDRY, "fp8_sets": fp8_sets, "ffn_type_default":
            ffn_defaults["ffn_type"], "yaml_sets_ffn_config": yamls, "fc_registered": registered,
            "built_with_fc_type": built, "call_keywords": calls, "lm_head_if": head_if,
            "tie_word_embeddings_default": defaults["tie_word_embeddings"]}


def main(argv: list[str]) -> int:
    composer, te, foundry = argv
    out = {"source": "mosaicml/composer, NVIDIA/TransformerEngine, mosaicml/llm-foundry "
                     "(scripts/composer_fp8_facts.py)",
           "composer": {tag: composer_default(composer, tag) for tag in COMPOSER},
           "transformer_engine": te_facts(te), "llm_foundry": foundry_facts(foundry)}
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
