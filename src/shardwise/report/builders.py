"""One builder per command: the payload `shardwise <command> --json` prints and `/api/<command>`
answers. The CLI and the web API both call these functions, so every number on a page is the
number the terminal shows for the same input (tests/web/test_api_matches_cli.py).

Each builder takes the command's options by their CLI names (raw strings such as "1GB" or
"4M-tokens" where the CLI takes strings), validates them with the same functions, and returns
plain JSON types. Bad input raises `ShardwiseError` (CLI: one line, exit 2; API: HTTP 400).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import shardwise.validate as validate
from shardwise.arch import PRESETS, ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.profiles import DEFAULT_IMPL
from shardwise.hardware import Cluster, get_link
from shardwise.layout import Layout, TrainSpec, resolve_partition
from shardwise.units import dtype_bytes, parse_batch, parse_count, parse_size

__all__ = ["FRAMEWORKS", "build_layout", "comm_payload", "emit_payload", "memory_payload",
           "model_row", "models_payload", "plan_payload", "run_plan", "schedule_payload",
           "schedule_svg", "simulate_schedule", "training_budget"]

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
MAX_TOKENS = 1e18  # a training budget: a million times the largest published run (15T)


# ------------------------------------------------------------------------------------ models
def model_row(spec: ModelSpec) -> dict[str, Any]:
    """A model's shape and parameter counts (total, and active per token for MoE)."""
    counts = validate.instance(spec, ModelSpec, "model").count_params()
    return {"name": spec.name, "layers": spec.n_layers, "hidden": spec.d_model,
            "heads": spec.n_heads, "kv_heads": spec.n_kv_heads, "ffn": spec.d_ff,
            "vocab": spec.vocab, "experts": spec.n_experts, "top_k": spec.top_k,
            "total_params": counts.total, "active_params": counts.active}


def models_payload() -> list[dict[str, Any]]:
    """`shardwise models --json`: every preset."""
    return [model_row(spec) for spec in PRESETS.values()]


# ------------------------------------------------------------------------------------ memory
def _check_seq(spec: ModelSpec, seq: int) -> None:
    """The model can run sequences of `seq` tokens (its sliding window: `seq_problems`)."""
    validate.instance(spec, ModelSpec, "model", " (shardwise.get_model)")
    for problem in spec.seq_problems(seq):
        raise ShardwiseError(problem)


def build_layout(gpus: int, n_layers: int = 0, **kw: Any) -> Layout:
    """A `Layout` from the layout options; `dp=None` takes the GPUs tp·pp·cp leave; the stage
    partition from `partition` (text or counts) or `first_stage_layers`/`last_stage_layers`
    (of `n_layers`)."""
    for axis in ("tp", "pp", "cp"):
        validate.degree(kw[axis], axis)
    kw["partition"] = resolve_partition(n_layers, kw["pp"], kw.get("partition"),
                                        kw.pop("first_stage_layers", None),
                                        kw.pop("last_stage_layers", None))
    model_parallel = kw["tp"] * kw["pp"] * kw["cp"]
    dp = kw.pop("dp")
    if dp is None:
        if gpus % model_parallel:
            raise ShardwiseError(
                f"tp·pp·cp = {model_parallel} does not divide --gpus {gpus}"
            )
        dp = gpus // model_parallel
    return Layout(dp=dp, **kw)


def cluster_for(gpus: int, gpu: str, gpus_per_node: int, intra: str | None = None,
                inter: str | None = None, calibration_path: str | None = None
                ) -> tuple[Cluster, Any]:
    """(cluster, its calibration or None): `--gpu this-machine` is one node of `gpus` ranks
    of the machine a `shardwise calibrate` file describes (`calibration.machine`)."""
    from shardwise.calibration.machine import THIS_MACHINE, machine_cluster

    if gpu.lower() == THIS_MACHINE:
        return machine_cluster(gpus, calibration_path)
    return Cluster.of(gpus, gpu, gpus_per_node, intra, inter), None


def memory_payload(spec: ModelSpec, *, gpus: int = 8, gpu: str = "h100", gpus_per_node: int = 8,
                   seq: int = 8192, global_batch: str | None = None, flash: bool = True,
                   dtype: str = "bf16", grad_dtype: str | None = None, optimizer: str = "adam",
                   formula: str = "generalised", impl: str = DEFAULT_IMPL,
                   headroom: float = 0.85, calibration_path: str | None = None,
                   **layout_kw: Any) -> dict[str, Any]:
    """`shardwise memory --json`: per-GPU bytes of every pipeline stage (SPEC §2–§4) against
    the budget `memory × headroom` (bytes; GB = 10^9, GiB = 2^30 when shown), with each
    stage's modelled peak and what one layer saves under implementation profile `impl`."""
    from shardwise.estimate.memory import saved_tensors_per_layer, training_memory_per_gpu
    from shardwise.estimate.profiles import by_component, fused_attention, get_profile

    cluster, _ = cluster_for(gpus, gpu, gpus_per_node, calibration_path=calibration_path)
    layout = build_layout(gpus, spec.n_layers, **layout_kw)
    batch = None if global_batch is None else parse_batch(global_batch, seq)
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype, grad_dtype=grad_dtype,
                      optimizer=optimizer, flash_attention=flash, impl=impl).validate()
    _check_seq(spec, seq)
    layout.validate(spec, cluster, train)
    stages = training_memory_per_gpu(spec, layout, train, formula=formula)
    layer = saved_tensors_per_layer(  # one (MoE, if any) layer, one micro-batch, this rank
        spec, seq, layout.micro_batch, tp=layout.tp, sp=layout.sp, cp=layout.cp,
        flash=flash, selective=layout.recompute == "selective",
        dtype_bytes_=dtype_bytes(dtype), moe=spec.is_moe, impl=impl)
    budget = cluster.accelerator.memory_bytes * headroom
    worst = max(stages, key=lambda s: s.total)
    return validate.finite_result({
        "model": spec.name, "layout": layout.to_dict(), "train": asdict(train),
        "accelerator": cluster.accelerator.name, "budget_bytes": budget,
        "fits": worst.total <= budget,
        "stages": [s.as_dict() | s.peak_dict() | {"stage": s.stage, "layers": s.layers,
                                                  "in_flight": s.in_flight} for s in stages],
        "layout_short": layout.short(), "gpus": gpus, "formula": formula,
        "headroom": headroom, "memory_bytes": cluster.accelerator.memory_bytes,
        "largest_stage": worst.stage,
        "largest_peak_stage": max(stages, key=lambda s: s.peak).stage,
        "impl": impl, "impl_title": get_profile(impl).title,
        "fused_attention": fused_attention(impl, flash),
        "layer_saved": {"impl": impl, "recompute": layout.recompute, "moe": spec.is_moe,
                        "tensors": layer, "by_component": by_component(layer)},
    }, "memory")


# -------------------------------------------------------------------------------------- comm
def comm_payload(*, op: str = "all-reduce", size: str = "1GB", ranks: int = 8,
                 link: str = "nvlink4", algorithm: str = "ring", nodes: int = 1,
                 inter: str = "ndr", calibration_path: str | None = None) -> dict[str, Any]:
    """`shardwise comm --json`: ring rounds, bytes each rank sends and the α-β time of one
    collective (SPEC §5), with its bus bandwidth (bytes/s, NCCL's convention). `--link
    this-machine` is the link a `shardwise calibrate` file measured."""
    from shardwise.estimate.comm import (
        bus_bandwidth,
        collective_time,
        ring_bytes_on_wire,
        ring_steps,
    )

    size_bytes = validate.size(parse_size(size), f"--size {size}")
    if algorithm == "hierarchical" and (nodes < 1 or ranks % nodes):
        raise ShardwiseError(f"--nodes {nodes} must divide --ranks {ranks}")
    if link.lower() == "this-machine":
        from shardwise.calibration.machine import machine_cluster

        chosen = machine_cluster(ranks, calibration_path)[0].intra
    else:
        chosen = get_link(link)
    seconds = collective_time(op, size_bytes, ranks, chosen, algorithm, nodes=nodes,
                              inter=get_link(inter))
    return validate.finite_result({
        "op": op, "size_bytes": size_bytes, "ranks": ranks, "link": chosen.name,
        "algorithm": algorithm, "rounds": ring_steps(op, ranks),
        "bytes_sent_per_rank": ring_bytes_on_wire(op, size_bytes, ranks), "seconds": seconds,
        "bus_bandwidth": bus_bandwidth(op, size_bytes, ranks, seconds) if seconds else None},
        "comm")


# ---------------------------------------------------------------------------------- schedule
def simulate_schedule(*, stages: int = 4, microbatches: int = 8, schedule: str = "1f1b",
                      chunks: int | None = None, t_f: float = 1.0, t_b: float = 1.0,
                      t_w: float = 1.0, p2p_latency: float = 0.0) -> Any:
    """Generate, validate and simulate a schedule (SPEC §6); returns the `Timeline`. Times
    are in [MIN_TIME, MAX_TIME] (`validate.duration`), so no start or end overflows; a
    chunked schedule needs v ≥ 2 chunks and the others v = 1, as a `Layout` does."""
    from shardwise.schedules import make_schedule, simulate, validate_schedule
    from shardwise.schedules.registry import SCHEDULE_REGISTRY

    for value, name in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")):
        validate.duration(value, name)
    validate.finite(p2p_latency, "p2p_latency", low=0, high=validate.MAX_TIME)
    v = chunks or (2 if schedule == "interleaved" else 1)
    info = SCHEDULE_REGISTRY.get(schedule)
    if info is not None and info.chunked and v < 2:
        raise ShardwiseError(f"the {info.name} schedule needs chunks ≥ 2, got {v}")
    if info is not None and not info.chunked and v != 1:
        raise ShardwiseError(f"chunks={v} needs a chunked schedule (interleaved), not "
                             f"{schedule}")
    actions = make_schedule(schedule, stages, microbatches, v)
    validate_schedule(actions, stages, microbatches, v)
    split = schedule == "zb-h1"
    return simulate(actions, t_f, t_b, t_w if split else None, p2p_latency)


def schedule_payload(timeline: Any, *, stages: int = 4, microbatches: int = 8,
                     schedule: str = "1f1b", chunks: int | None = None) -> dict[str, Any]:
    """`shardwise schedule --json`: counts, makespan, simulated and closed-form bubble
    `(p-1)/(v·m+p-1)`, peak micro-batches in flight per stage, the action lists as text and
    the simulated timeline (one event per action: stage, kind F/B/W, micro-batch, chunk,
    start, end in the units of t_f)."""
    from shardwise.schedules import bubble_fraction, schedule_text

    p, m = stages, microbatches
    v = chunks or (2 if schedule == "interleaved" else 1)
    by_stage: dict[int, list[Any]] = {}
    for event in timeline.events:
        by_stage.setdefault(event.stage, []).append(event.action)
    out = {"schedule": schedule, "stages": p, "microbatches": m, "chunks": v,
           "actions": len(timeline.events), "makespan": timeline.makespan,
           "bubble_fraction": timeline.bubble_fraction,
           "bubble_closed_form": None if schedule == "zb-h1" else bubble_fraction(p, m, v),
           "peak_in_flight": list(timeline.peak_in_flight), "text": schedule_text(by_stage),
           "timeline": [{"stage": e.stage, "kind": e.action.kind,
                         "microbatch": e.action.micro_batch, "chunk": e.action.chunk,
                         "start": e.start, "end": e.end} for e in timeline.events]}
    return validate.finite_result(out, "schedule")


def schedule_svg(timeline: Any, out: dict[str, Any]) -> str:
    """`shardwise schedule --svg`: the timeline as an SVG Gantt chart, titled by the payload."""
    from shardwise.schedules import render_svg

    return render_svg(timeline, title=f"{out['schedule']} p={out['stages']} "
                                      f"m={out['microbatches']} v={out['chunks']}")


# ---------------------------------------------------------------------------------------- plan
def run_plan(spec: ModelSpec, *, gpus: int = 64, gpu: str = "h100", gpus_per_node: int = 8,
             intra: str | None = None, inter: str | None = None, seq: int = 8192,
             global_batch: str = "4M-tokens", tokens: str | None = None,
             price: float | None = None, top: int = 10, layout_text: str | None = None,
             flash: bool = True, dtype: str = "bf16", grad_dtype: str | None = None,
             optimizer: str = "adam", headroom: float = 0.85,
             calibration_path: str | None = None, impl: str = DEFAULT_IMPL,
             progress: Callable[[str], None] | None = None,
             partition: str | tuple[int, ...] | None = None,
             first_stage_layers: int | None = None, last_stage_layers: int | None = None
             ) -> Any:
    """Validate the plan options and search every layout (SPEC §7); returns the `PlanResult`.
    `partition` or `first_stage_layers`/`last_stage_layers` set the given layout's stages.
    `layout_text` (`tp=8,pp=2,zero=1`; dp: the GPUs the other axes leave) is evaluated too."""
    from shardwise.calibration import load_calibration
    from shardwise.plan import plan

    cluster, machine_calib = cluster_for(gpus, gpu, gpus_per_node, intra, inter,
                                         calibration_path)
    batch = parse_batch(global_batch, seq)
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype, grad_dtype=grad_dtype,
                      optimizer=optimizer, flash_attention=flash, impl=impl).validate()
    _check_seq(spec, seq)
    calib = machine_calib or load_calibration(cluster.accelerator.name, calibration_path)
    given = None
    if not layout_text and (partition or first_stage_layers is not None
                            or last_stage_layers is not None):
        raise ShardwiseError("--partition and --first/--last-stage-layers describe the --layout "
                             "you give; add --layout tp=…,pp=…")
    if layout_text:
        given = Layout.parse(layout_text)
        if "dp=" not in layout_text.replace(" ", ""):  # the GPUs the other axes leave
            given = build_layout(gpus, spec.n_layers, **(given.to_dict() | {"dp": None}))
        if partition or first_stage_layers is not None or last_stage_layers is not None:
            given = given.with_(partition=resolve_partition(
                spec.n_layers, given.pp, partition, first_stage_layers, last_stage_layers))
        given.validate(spec, cluster, train)
    training_budget(tokens, price)
    return plan(spec, cluster, train, top, headroom=headroom, calib=calib, layout=given,
                progress=progress)


def training_budget(tokens: str | None, price: float | None) -> float | None:
    """The token budget `--tokens` names (None without it); `--price` needs it."""
    budget = None
    if tokens is not None:
        budget = validate.positive(parse_count(tokens, what="token budget"),
                                   f"--tokens {tokens}", high=MAX_TOKENS)
    if price is not None and budget is None:
        raise ShardwiseError("--price needs --tokens (the training budget)")
    return budget


def emit_payload(framework: str, result: Any) -> dict[str, Any]:
    """`shardwise plan --emit F --json`: the launch configuration of the chosen layout (yours
    with --layout, else the winner) for Megatron-LM, torchtitan or DeepSpeed."""
    from shardwise.emit import emit

    chosen = result.given.layout if result.given is not None else result.best.layout
    emitted = emit(framework, result.model, chosen, result.train,
                   result.cluster.gpus_per_node)
    return {"framework": framework, "layout": chosen.to_dict(), "config": emitted.text,
            "notes": list(emitted.notes)}


def plan_payload(result: Any, *, tokens: str | None = None,
                 price: float | None = None) -> dict[str, Any]:
    """`shardwise plan --json`: the search result (ranked layouts with step-time and memory
    breakdowns, baseline, your layout, rejected regions, statistics), the explanation, time
    and cost of the token budget, and the chosen layout's three launch configurations (or why
    one cannot be written)."""
    from shardwise.report.plan_report import explain, training_summary

    out = result.to_dict()
    out["explanation"] = explain(result)
    out["training"] = training_summary(result.best, training_budget(tokens, price), price)
    emits: dict[str, Any] = {}
    for framework in FRAMEWORKS:
        try:
            emits[framework] = emit_payload(framework, result)
        except ShardwiseError as exc:
            emits[framework] = {"framework": framework, "error": str(exc)}
    out["emits"] = emits
    return validate.finite_result(out, "plan")
