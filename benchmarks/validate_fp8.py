"""FP8 against published runs: the FP8 rows of the validation set, and the FP8/BF16 speed-up
shardwise predicts against the one each source published for the same model and layout.

The rows are `validation_runs.json`'s (built and predicted by `validation_rows.py` with the
built-in calibration, nothing fitted here); a row is FP8 when it names a recipe (`fp8`).
A pair is an FP8 row and a BF16 row of the same source with the same model, accelerator,
GPUs, sequence, batch, layout and stack settings; its speed-up is the FP8 run's throughput
over the BF16 run's (step time: BF16's over FP8's), published and predicted. Also the memory
that torchao's float8 README table measured for Llama 3 8B on 8 H100 (bf16 and rowwise) against
`shardwise memory` of the same run; the recipes' bytes; an optimizer-offload example.

Run: `PYTHONPATH=src python benchmarks/validate_fp8.py` (prints the tables and writes
`docs/generated/fp8_validation.md`; `--no-write` to print only).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any

from results import markdown_table, write_result
from validation_rows import Result, evaluate, load

from shardwise.arch import get_model
from shardwise.fp8 import RECIPES
from shardwise.report.builders import memory_payload
from shardwise.stacks import STACKS

PAIR_KEYS = ("source", "model", "accelerator", "gpus", "gpus_per_node", "seq", "global_batch",
             "layout", "stack", "intra", "inter")

# torchao/float8/README.md @ 927cbfb912 ('NVIDIA H100' table): Llama3-8b on 8 H100, batch 1,
# s = 8192, torch.compile, FSDP2, per-op SAC; peak memory (GB) bf16 47.65, rowwise 47.79.
TORCHAO_MEMORY = {"bf16": 47.65, "rowwise": 47.79}


def _speed(result: Result, value: float) -> float:
    """Higher is faster: 1/step time, or the throughput as published."""
    return 1.0 / value if result.row["published"]["quantity"] == "step_time_s" else value


def _summary(errors: list[float]) -> tuple[str, str, str]:
    if not errors:
        return "-", "-", "-"
    return (f"{statistics.median(abs(e) for e in errors):.1%}",
            f"{statistics.median(errors):+.1%}", f"{max(abs(e) for e in errors):.1%}")


def fp8_rows(results: list[Result]) -> list[list[Any]]:
    """Per source and recipe: rows predicted / FP8 rows, median |error|, median signed, max."""
    groups: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in results:
        if r.row.get("fp8"):
            groups[(r.row["source"], r.row["fp8"])].append(r)
    out = []
    for (source, recipe), group in sorted(groups.items()):
        errors = [r.error for r in group if r.error is not None]
        reasons = sorted({r.reason.split(";")[0][:70] for r in group if r.reason})
        out.append([source, recipe, f"{len(errors)}/{len(group)}", *_summary(errors),
                    "; ".join(reasons) or "-"])
    return out


def pairs(results: list[Result]) -> list[dict[str, Any]]:
    """Every (FP8, BF16) pair of predicted rows (the module docstring)."""
    def key(row: dict[str, Any]) -> str:
        return json.dumps([row.get(k) for k in PAIR_KEYS], sort_keys=True)

    bf16 = {key(r.row): r for r in results
            if not r.row.get("fp8") and r.error is not None and r.row.get("dtype") == "bf16"}
    out = []
    for r in results:
        if not r.row.get("fp8") or r.error is None or key(r.row) not in bf16:
            continue
        base = bf16[key(r.row)]
        assert r.predicted is not None and base.predicted is not None
        published = (_speed(r, r.row["published"]["value"])
                     / _speed(base, base.row["published"]["value"]))
        predicted = _speed(r, r.predicted) / _speed(base, base.predicted)
        model = r.row["model"]
        name = model if isinstance(model, str) else model.get("preset") or model["spec"]["name"]
        out.append({"model": name, "accelerator": r.row["accelerator"], "recipe": r.row["fp8"],
                    "source": r.row["source"], "published": published,
                    "predicted": predicted})
    return out


def pair_table(found: list[dict[str, Any]]) -> list[list[Any]]:
    """Per model, accelerator and recipe: pairs, median published and predicted speed-up."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for p in found:
        groups[(p["model"], p["accelerator"], p["recipe"])].append(p)
    rows = []
    for (model, accelerator, recipe), group in sorted(groups.items()):
        pub = statistics.median(p["published"] for p in group)
        pred = statistics.median(p["predicted"] for p in group)
        rows.append([model, accelerator, recipe, len(group), f"{pub:.3f}", f"{pred:.3f}",
                     f"{pred / pub - 1:+.1%}"])
    return rows


def torchao_memory() -> list[list[Any]]:
    """`shardwise memory` of torchao's README run in bf16 and rowwise FP8, against its table."""
    rows = []
    spec = get_model("llama3-8b")
    for name, published in TORCHAO_MEMORY.items():
        out = memory_payload(spec, gpus=8, gpu="h100", seq=8192, global_batch="8",
                             impl="torchtitan", stack_kw={"compile": True},
                             fp8=None if name == "bf16" else name, tp=1, pp=1, dp=None, cp=1,
                             ep=1, zero=3, recompute="op-sac", micro_batch=1)
        peak = max(s["peak"] for s in out["stages"])
        rows.append([name, f"{published:.2f}", f"{peak / 1e9:.2f}"])
    ratio_pub = TORCHAO_MEMORY["rowwise"] / TORCHAO_MEMORY["bf16"]
    ratio = float(rows[1][2]) / float(rows[0][2])
    rows.append(["rowwise / bf16", f"{ratio_pub:.4f}", f"{ratio:.4f}"])
    return rows


def recipe_table() -> list[list[Any]]:
    """Each recipe's bytes per element (`Fp8Recipe.cast_bytes`, `weight_copy_bytes`,
    `saved_input_bytes`, `scaling_state_bytes`) on the generations it runs on, and the stacks
    that run it."""
    rows = []
    for (framework, name), recipe in RECIPES.items():
        stacks = ", ".join(s.name for s in STACKS.values()
                           if s.fp8_framework == framework and name in s.fp8) or "-"
        for generation in recipe.architectures:
            cast = recipe.cast_bytes(generation)
            rows.append([f"`{name}`", framework, generation, stacks,
                         f"{cast.input_fwd:g} + {cast.input_bwd:g}", f"{cast.grad_bwd:g}",
                         f"{cast.weight_fwd + cast.weight_bwd:g} / µb, "
                         f"{cast.weight_step:g} / step",
                         f"{recipe.weight_copy_bytes(generation):g}",
                         f"{recipe.saved_input_bytes():g}" if recipe.saves_fp8_inputs
                         else "bf16", f"{recipe.scaling_state_bytes():g}",
                         "fp8" if recipe.wgrad_fp8 else "bf16",
                         "fp8" if recipe.head_fp8 else "bf16"])
    return rows


def gemm_ratios() -> list[list[Any]]:
    """`calibration.components.fp8_gemm_ratio` of each FP8-capable preset."""
    from shardwise.calibration.components import fp8_gemm_ratio
    from shardwise.hardware import ACCELERATORS

    return [[name, f"{fp8_gemm_ratio(a.calibration_name):.3f}"]
            for name, a in ACCELERATORS.items() if a.peak_fp8 is not None]


def offload_example() -> list[list[Any]]:
    """Llama 3 70B on 64 H100, tp 8, ZeRO-1, SP, selective recompute, on each stack that
    offloads the optimizer at ZeRO-1: GPU memory, host memory per node, optimizer term."""
    from shardwise.estimate.step import estimate_step
    from shardwise.hardware import Cluster
    from shardwise.layout import Layout, TrainSpec

    spec, cluster = get_model("llama3-70b"), Cluster.of(64, "h100")
    layout = Layout(dp=8, tp=8, zero=1, sp=True, recompute="selective")
    rows = []
    for impl in ("megatron-te", "megatron-deepspeed"):
        for offload in ("none", "optimizer"):
            kw = dict(gpus=64, gpu="h100", seq=8192, global_batch="256", impl=impl, tp=8, pp=1,
                      dp=None, cp=1, ep=1, zero=1, sp=True, recompute="selective",
                      micro_batch=1, offload=offload)
            out = memory_payload(spec, **kw)
            step = estimate_step(spec, cluster, layout, TrainSpec(
                seq_len=8192, global_batch=256, impl=impl, offload=offload))
            rows.append([impl, offload, f"{out['stages'][0]['total'] / 2**30:.1f}",
                         f"{out['stages'][0]['optimizer'] / 2**30:.1f}",
                         f"{out['host_bytes_per_node'] / 1e9:.0f}",
                         f"{step.optimizer:.2f}", f"{step.total:.2f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    _, _, rows = load()
    results = [evaluate(r) for r in rows]
    by_row = fp8_rows(results)
    found = pairs(results)
    by_pair = pair_table(found)
    errors = [r.error for r in results if r.row.get("fp8") and r.error is not None]
    ratio_errors = [p["predicted"] / p["published"] - 1 for p in found]
    n_fp8 = sum(1 for r in results if r.row.get("fp8"))
    overall = _summary(errors)
    text = "\n\n".join([
        "### FP8 rows of the validation set",
        f"{len(errors)} of {n_fp8} FP8 rows predicted: median |error| {overall[0]}, median "
        f"signed {overall[1]}, max {overall[2]} (error = predicted / published − 1 in the "
        "published quantity; built-in calibration, not fitted on these rows).",
        markdown_table(["source", "recipe", "predicted", "median abs", "median signed", "max",
                        "not expressible"], by_row, "lllrrrl"),
        "### FP8 / BF16 speed-up, published and predicted",
        f"{len(found)} pairs (an FP8 and a BF16 row of one source, same model, GPUs, layout and "
        "stack); the speed-up is FP8 throughput over BF16 throughput; median per model, "
        f"accelerator and recipe. Over all pairs, the predicted speed-up's error "
        f"(predicted / published − 1): median |error| {_summary(ratio_errors)[0]}, median "
        f"signed {_summary(ratio_errors)[1]}, max {_summary(ratio_errors)[2]}.",
        markdown_table(["model", "accelerator", "recipe", "pairs", "published", "predicted",
                        "error"], by_pair, "lllrrrr"),
        "### Memory: torchao float8 (torchtitan) against bf16",
        "Llama 3 8B, 8 H100, s = 8192, local batch 1, FSDP2, per-op SAC, torch.compile "
        "(torchao/float8/README.md @ 927cbfb912): peak memory in GB (10^9 bytes), published "
        "(`torch.cuda.max_memory_allocated` as torchtitan logs it) and `shardwise memory`'s "
        "modelled peak.",
        markdown_table(["run", "published GB", "shardwise GB"], torchao_memory(), "lrr"),
        "### The recipes' bytes",
        "Bytes per element of each quantised tensor (the input forward + backward, the output "
        "gradient, the weight per micro-batch and per step), held per FP8 weight element, per "
        "saved linear input, and fp32 scaling state per FP8 GEMM; which GEMM runs the weight "
        "gradient and the LM head (`shardwise.fp8`).",
        markdown_table(["recipe", "framework", "GPUs", "stacks", "input", "grad", "weight",
                        "held / weight", "saved input", "state / GEMM", "wgrad", "head"],
                       recipe_table(), "llllrrrrrrll"),
        "### FP8 GEMMs' share of their peak relative to BF16's",
        "`(fp8 / peak_fp8) / (bf16 / peak_bf16)` of ml-engineering's MAMF best shapes "
        "(`calibration.components.fp8_gemm_ratio`; a part without both takes its "
        "generation's mean, 1 where none is measured).",
        markdown_table(["--gpu", "ratio"], gemm_ratios(), "lr"),
        "### Optimizer offload, an example",
        "Llama 3 70B, 64 H100, s = 8192, global batch 256, tp 8 × dp 8, ZeRO-1, SP, "
        "selective recompute: GPU memory of the stage (GiB), its optimizer state (GiB), the "
        "host memory offload needs per 8-GPU node (GB), and the step's optimizer term and "
        "total (s).",
        markdown_table(["stack", "offload", "GPU GiB", "optimizer GiB", "host GB / node",
                        "optimizer s", "step s"], offload_example(), "llrrrrr"),
    ])
    print(text)
    if not args.no_write:
        write_result("fp8_validation", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
