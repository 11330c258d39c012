"""Published end-to-end training runs as shardwise cases: predicted, and compared in the
quantity and FLOP convention each source published (issue 30's validation set).

The rows live in `validation_runs.json` beside this file (data only: sources with citations,
rows with model, accelerator, layout, stack settings and the published figure, what was
assumed). Each row becomes (ModelSpec, Cluster, Layout, TrainSpec) through shardwise's own API —
`get_model`, `Cluster.of`, `Layout.parse`, `TrainSpec(impl=…, compile=…, tp_overlap=…,
dp_overlap=…, attention=…)` — and is predicted with `estimate_step` and the built-in
calibration. A row shardwise cannot express is reported with the reason: the row's own
`not_expressible` (what the API cannot notice, e.g. a checkpointing share the source
leaves unstated) or the `ShardwiseError` building it raised (an FP8 recipe the stack or accelerator does not run, an
unknown model or accelerator, a layout the stack cannot run). Nothing is fitted or tuned here.

Error = (predicted − published) / published, in the published quantity: positive means
shardwise predicts a longer step (step_time_s) or more throughput (every other quantity).

Run: `PYTHONPATH=src python benchmarks/validation_rows.py` (every row, then per-source,
per-family and overall median / max |error|); `--source ID` / `--family NAME` to select,
`--summary` for the tables only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from shardwise.arch import ModelSpec, get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.step import StepEstimate, estimate_step
from shardwise.hardware import Cluster, Link, get_accelerator, get_link
from shardwise.layout import Layout, TrainSpec

DATA = Path(__file__).with_name("validation_runs.json")
_MODEL_FIELDS = {f.name for f in fields(ModelSpec)}
_STACK_KEYS = ("impl", "compile", "tp_overlap", "dp_overlap", "attention")
_MOE_KEYS = ("moe_dispatcher", "moe_overlap", "moe_capacity", "mtp_layers", "cuda_graph",
             "recompute_modules")
"""The row's `stack` keys that become `TrainSpec` fields of the same name as given (the recipe's
MoE settings: dispatcher, EP overlap, capacity factor, MTP depth, CUDA-graph scopes, selective-
recompute modules; the row cites the recipe's line)."""


@dataclass(frozen=True)
class Case:
    """One row built into shardwise's objects (`row`: the row merged with its source's
    defaults)."""

    row: dict[str, Any]
    model: ModelSpec
    cluster: Cluster
    layout: Layout
    train: TrainSpec


def load(path: Path = DATA) -> tuple[dict[str, Any], dict[str, dict[str, Any]],
                                     list[dict[str, Any]]]:
    """(the file, sources by id, rows merged with their source's defaults)."""
    data = json.loads(path.read_text())
    sources = {s["id"]: s for s in data["sources"]}
    return data, sources, [merged(row, sources[row["source"]]) for row in data["rows"]]


def merged(row: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """The row over its source's defaults: `stack` merged key by key, `assumed` lists joined
    (source first), any other field the row's own."""
    defaults = source.get("defaults", {})
    out = {**defaults, **row}
    out["stack"] = {**defaults.get("stack", {}), **row.get("stack", {})}
    out["assumed"] = [*defaults.get("assumed", []), *row.get("assumed", [])]
    return out


def model_of(value: str | dict[str, Any]) -> ModelSpec:
    """A preset name, {'preset': name, field: value…} or {'spec': {ModelSpec fields}}."""
    if isinstance(value, str):
        return get_model(value)
    if "spec" in value:
        unknown = set(value["spec"]) - _MODEL_FIELDS
        if unknown:
            raise ShardwiseError(f"ModelSpec has no field {', '.join(sorted(unknown))}")
        return ModelSpec(**value["spec"]).validate()
    changes = {k: tuple(v) if isinstance(v, list) else v  # JSON lists: the spec's tuples
               for k, v in value.items() if k != "preset"}
    unknown = set(changes) - _MODEL_FIELDS
    if unknown:
        raise ShardwiseError(f"ModelSpec has no field {', '.join(sorted(unknown))}")
    return get_model(value["preset"]).with_(**changes)


def cluster_of(row: dict[str, Any]) -> Cluster:
    """`Cluster.of` with the row's links; a link given as {'like': class, 'bandwidth': B/s}
    becomes the accelerator's own link of that class's name (so it keeps the class's
    calibration) at that line rate."""
    accelerator = get_accelerator(row["accelerator"])
    names: dict[str, str | None] = {}
    own: list[Link] = []
    for side in ("intra", "inter"):
        link = row.get(side)
        if isinstance(link, dict):
            base = get_link(link["like"])
            own.append(Link(base.name, float(link["bandwidth"]), base.latency).validate())
            names[side] = base.name
        else:
            names[side] = link
    if own:
        accelerator = replace(accelerator, links=tuple(own))
    return Cluster.of(row["gpus"], accelerator, row.get("gpus_per_node", 8),
                      names["intra"], names["inter"])


def build(row: dict[str, Any]) -> Case:
    """The row as shardwise objects, validated as `shardwise plan --layout` validates them;
    `ShardwiseError` (the reason) where shardwise cannot express it."""
    if row.get("not_expressible"):
        raise ShardwiseError(row["not_expressible"])
    if row.get("model") is None:
        raise ShardwiseError("the source's model has no shardwise description")
    model = model_of(row["model"])
    cluster = cluster_of(row)
    given = Layout.parse(row["layout"])
    if "dp=" not in row["layout"].replace(" ", ""):
        rest = given.tp * given.pp * given.cp
        if row["gpus"] % rest:
            raise ShardwiseError(f"tp·pp·cp = {rest} does not divide {row['gpus']} GPUs")
        given = given.with_(dp=row["gpus"] // rest)
    stack = row["stack"]
    train = TrainSpec(seq_len=row["seq"], global_batch=row["global_batch"],
                      dtype=row.get("dtype", "bf16"), grad_dtype=row.get("grad_dtype"),
                      fp8=row.get("fp8"), flash_attention=stack.get("flash", True),
                      recompute_share=row.get("recompute_share", 1.0),
                      **{k: stack[k] for k in _STACK_KEYS if stack.get(k) is not None},
                      **{k: tuple(stack[k]) if isinstance(stack[k], list) else stack[k]
                         for k in _MOE_KEYS if stack.get(k) is not None})
    train.validate()
    given.validate(model, cluster, train)
    if train.fp8:  # the recipe runs on this accelerator (one line where it does not)
        from shardwise.estimate.compute import fp8_on
        from shardwise.estimate.uncertainty import generation

        fp8_on(train, cluster.accelerator, generation(cluster.accelerator.calibration_name))
    return Case(row, model, cluster, given, train)


# ------------------------------------------------------------------ the sources' conventions
def _narayanan2021(case: Case) -> float:
    m, s, b = case.model, case.train.seq_len, case.train.global_batch or 0
    l, h, v = m.n_layers, m.d_model, m.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _palm_6n(case: Case) -> float:
    m, s = case.model, case.train.seq_len
    tokens = (case.train.global_batch or 0) * s
    return tokens * (6 * m.count_params().total + 12 * m.n_layers * m.d_model * s)


def _megatron_llama(case: Case) -> float:
    m, s, b = case.model, case.train.seq_len, case.train.global_batch or 0
    L, h = m.n_layers, m.d_model
    per_seq = s * (12 * L * h * h * (1 + m.n_kv_heads / m.n_heads + s / h)
                   + 18 * L * m.d_ff * h + 6 * m.vocab * h)
    return b * per_seq


CONVENTIONS: dict[str, Callable[[Case], float]] = {
    "narayanan2021": _narayanan2021, "palm-6n": _palm_6n, "megatron-llama": _megatron_llama}
"""FLOPs per step under each source's own count (formulas: the file's `conventions`)."""
QUANTITIES = ("step_time_s", "tokens_per_s_per_gpu", "tokens_per_s", "samples_per_s",
              "tflops_per_gpu", "mfu")


def to_published(case: Case, est: StepEstimate) -> float:
    """The prediction in the row's published quantity and convention."""
    published = case.row["published"]
    quantity = published["quantity"]
    gpus = case.cluster.n_gpus
    if quantity == "step_time_s":
        return est.total
    if quantity == "tokens_per_s_per_gpu":
        return est.tokens_per_s / gpus
    if quantity == "tokens_per_s":
        return est.tokens_per_s
    if quantity == "samples_per_s":
        return est.tokens_per_s / case.train.seq_len
    flops = CONVENTIONS[published["convention"]](case) / (est.total * gpus)
    if quantity == "tflops_per_gpu":
        return flops / 1e12
    if quantity == "mfu":
        return flops / (published["peak_tflops"] * 1e12)
    raise ShardwiseError(f"unknown published quantity {quantity!r}; valid: {QUANTITIES}")


@dataclass(frozen=True)
class Result:
    row: dict[str, Any]
    predicted: float | None = None
    error: float | None = None
    reason: str | None = None  # why the row cannot be expressed


def evaluate(row: dict[str, Any]) -> Result:
    """Build, predict and compare one row (a reason instead where it cannot be expressed)."""
    try:
        case = build(row)
        predicted = to_published(case, estimate_step(case.model, case.cluster, case.layout,
                                                     case.train))
    except ShardwiseError as exc:
        return Result(row, reason=str(exc))
    value = row["published"]["value"]
    return Result(row, predicted, (predicted - value) / value)


# --------------------------------------------------------------------------------- features
def features(row: dict[str, Any]) -> list[str]:
    """What a row exercises (from its layout text and stack settings, whether or not it can be
    expressed): the axes above 1, ZeRO/FSDP form, schedule, recompute, overlap, compile,
    attention kernel, dtype."""
    items = dict(part.split("=", 1) for part in row.get("layout", "").split(",") if "=" in part)
    out = []
    for axis in ("tp", "pp", "cp", "ep"):
        if int(items.get(axis, 1)) > 1:
            out.append(axis.upper())
    if "etp" in items:
        out.append("ETP")
    zero = int(items.get("zero", 0))
    if zero:
        out.append("HSDP" if "zero_group" in items else "FSDP" if zero == 3 else f"ZeRO-{zero}")
    if items.get("sp") in ("1", "true"):
        out.append("SP")
    if int(items.get("chunks", 1)) > 1:
        out.append("interleaved")
    elif int(items.get("pp", 1)) > 1:
        out.append(items.get("schedule", "1f1b"))
    recompute = items.get("recompute", "none")
    if recompute != "none":
        out.append(f"recompute:{recompute}")
    stack = row.get("stack", {})
    if stack.get("tp_overlap") not in (None, "none") and int(items.get("tp", 1)) > 1:
        out.append(f"tp-overlap:{stack['tp_overlap']}")
    if stack.get("compile"):
        out.append("compile")
    if stack.get("moe_dispatcher"):
        out.append(f"dispatcher:{stack['moe_dispatcher']}")
    if stack.get("moe_overlap") not in (None, "none"):
        out.append(f"moe-overlap:{stack['moe_overlap']}")
    if stack.get("cuda_graph"):
        out.append("cuda-graph:" + "+".join(stack["cuda_graph"]))
    if stack.get("flash") is False:
        out.append("no-flash")
    elif stack.get("attention"):
        out.append(f"attn:{stack['attention']}")
    out.append(f"fp8:{row['fp8']}" if row.get("fp8") else row.get("dtype", "bf16"))
    return out


# ----------------------------------------------------------------------------------- report
def _stats(errors: list[float]) -> str:
    if not errors:
        return "no predicted rows"
    absolute = [abs(e) for e in errors]
    return (f"median |error| {statistics.median(absolute):6.1%}, max {max(absolute):6.1%}, "
            f"median signed {statistics.median(errors):+6.1%}")


def report(results: list[Result], sources: dict[str, dict[str, Any]], rows: bool = True
           ) -> None:
    if rows:
        print(f"{'row':<62} {'quantity':<21} {'published':>11} {'predicted':>11} {'error':>8}")
        for r in results:
            q = r.row["published"]["quantity"]
            value = r.row["published"]["value"]
            if r.reason is not None:
                print(f"{r.row['id']:<62} {q:<21} {value:>11.4g}   not expressible: {r.reason}")
            else:
                print(f"{r.row['id']:<62} {q:<21} {value:>11.4g} {r.predicted:>11.4g} "
                      f"{r.error:>+8.1%}")
        print()
    groups: dict[str, list[Result]] = defaultdict(list)
    families: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        groups[r.row["source"]].append(r)
        families[sources[r.row["source"]]["family"]].append(r)
    print("Per source (rows predicted / rows; accelerators; stacks; features exercised):")
    for sid, group in groups.items():
        done = [r.error for r in group if r.error is not None]
        accelerators = sorted({r.row.get("accelerator", "?") for r in group})
        stacks = sorted({r.row["stack"].get("impl", "?") for r in group})
        tags = sorted({t for r in group for t in features(r.row)})
        print(f"  {sid:<24} {len(done):>3}/{len(group):<3} {_stats(done)}")
        print(f"  {'':<24} {', '.join(accelerators)}; {', '.join(stacks)}; {' '.join(tags)}")
    print("\nPer family:")
    for family, group in families.items():
        done = [r.error for r in group if r.error is not None]
        print(f"  {family:<24} {len(done):>3}/{len(group):<3} {_stats(done)}")
    done = [r.error for r in results if r.error is not None]
    print(f"\nOverall: {len(done)}/{len(results)} rows predicted; {_stats(done)}")
    reasons: dict[str, int] = defaultdict(int)
    for r in results:
        if r.reason is not None:
            reasons[r.reason.split(";")[0][:110]] += 1
    if reasons:
        print("Not expressible (rows: first reason):")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {n:>4}  {reason}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", help="only this source id")
    parser.add_argument("--family", help="only this source family")
    parser.add_argument("--summary", action="store_true", help="tables only, no row lines")
    args = parser.parse_args(argv)
    _, sources, rows = load()
    chosen = [r for r in rows
              if (args.source is None or r["source"] == args.source)
              and (args.family is None or sources[r["source"]]["family"] == args.family)]
    if not chosen:
        print(f"no rows match; sources: {', '.join(sources)}", file=sys.stderr)
        return 2
    report([evaluate(r) for r in chosen], sources, rows=not args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
