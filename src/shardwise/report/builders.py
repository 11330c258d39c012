"""One builder per command: the payload `shardwise <command> --json` prints and `/api/<command>`
answers. The CLI and the web API both call these functions, so every number on a page is the
number the terminal shows for the same input (tests/web/test_api_matches_cli.py).

Each builder takes the command's options by their CLI names (raw strings such as "1GB" or
"4M-tokens" where the CLI takes strings), validates them with the same functions, and returns
plain JSON types. Bad input raises `ShardwiseError` (CLI: one line, exit 2; API: HTTP 400).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import shardwise.validate as validate
from shardwise.arch import PRESETS, ModelSpec
from shardwise.emit import model_refusal, unrunnable
from shardwise.errors import ShardwiseError
from shardwise.hardware import Accelerator, Cluster, get_link
from shardwise.layout import Layout, TrainSpec, partition_problems, resolve_partition
from shardwise.stacks import DEFAULT_STACK, split_refuses, stack_split
from shardwise.units import dtype_bytes, parse_batch, parse_count, parse_size

__all__ = ["FRAMEWORKS", "build_layout", "comm_payload", "emit_payload", "memory_payload",
           "model_row", "models_payload", "plan_payload", "reliability", "run_plan",
           "schedule_payload", "schedule_svg", "simulate_schedule", "training_budget"]

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
    """`spec` is a model (windowed attention is modelled at any `seq`: `attention_keys`; the
    runtime's limits are `seq_problems`)."""
    validate.instance(spec, ModelSpec, "model", " (shardwise.get_model)")


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


def stack_stages(layout: Layout, n_layers: int, train: TrainSpec) -> Layout:
    """`layout`, given without stages, on the stack's own split where the stack cannot run
    the default one (torchtitan's virtual stages, DeepSpeed's blocks: `stacks.stack_split`)."""
    split = train.stack.split
    own = stack_split(split, n_layers, layout.pp, layout.chunks) if layout.pp > 1 else None
    if layout.partition or not own:
        return layout
    if partition_problems(n_layers, layout.pp, layout.chunks, ()) or split_refuses(
            split, n_layers, layout.stage_sizes(n_layers), layout.pp):
        return layout.with_(partition=own)
    return layout


def cluster_for(gpus: int, gpu: str | Accelerator, gpus_per_node: int,
                intra: str | None = None, inter: str | None = None,
                calibration_path: str | None = None) -> tuple[Cluster, Any]:
    """(cluster, its calibration or None): `gpu` a preset name or an `Accelerator` (the CLI's
    `--gpu FILE` / `--clock-mhz`, `hardware.resolve_gpu`); `--gpu this-machine` is one node of
    `gpus` ranks of the machine a `shardwise calibrate` file describes
    (`calibration.machine`)."""
    from shardwise.calibration.machine import THIS_MACHINE, machine_cluster

    if isinstance(gpu, str) and gpu.lower() == THIS_MACHINE:
        return machine_cluster(gpus, calibration_path)
    return Cluster.of(gpus, gpu, gpus_per_node, intra, inter), None


def memory_payload(spec: ModelSpec, *, gpus: int = 8, gpu: str | Accelerator = "h100",
                   gpus_per_node: int = 8,
                   seq: int = 8192, global_batch: str | None = None, flash: bool = True,
                   dtype: str = "bf16", grad_dtype: str | None = None, optimizer: str = "adam",
                   formula: str = "generalised", impl: str = DEFAULT_STACK,
                   headroom: float = 0.85, calibration_path: str | None = None,
                   stack_kw: dict[str, Any] | None = None, fp8: str | None = None,
                   offload: str = "none", offload_fraction: float = 1.0,
                   **layout_kw: Any) -> dict[str, Any]:
    """`shardwise memory --json`: per-GPU bytes of every pipeline stage (SPEC §2–§4) against
    the budget `memory × headroom` (bytes; GB = 10^9, GiB = 2^30 when shown), with each
    stage's modelled peak and margin, what one layer saves on stack `impl` (its activation
    profile; `stack_kw`: the stack's other choices, `TrainSpec`'s compile/tp_overlap/
    dp_overlap/attention), and, when it does not fit, the smallest change of each knob that
    would (`plan.fit.fit_hints`). `fp8`: an FP8 recipe of the stack; `offload`,
    `offload_fraction`: host offload (`TrainSpec`), with the host bytes per rank and per node
    (the largest stage's × GPUs per node: an upper bound)."""
    from shardwise.estimate.memory import saved_tensors_per_layer, training_memory_per_gpu
    from shardwise.estimate.profiles import by_component, fused_attention, get_profile
    from shardwise.estimate.uncertainty import generation
    from shardwise.plan.fit import fit_hints

    cluster, _ = cluster_for(gpus, gpu, gpus_per_node, calibration_path=calibration_path)
    layout = build_layout(gpus, spec.n_layers, **layout_kw)
    batch = None if global_batch is None else parse_batch(global_batch, seq)
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype, grad_dtype=grad_dtype,
                      optimizer=optimizer, flash_attention=flash, impl=impl, fp8=fp8,
                      offload=offload, offload_fraction=offload_fraction,
                      **(stack_kw or {})).validate()
    _check_seq(spec, seq)
    layout = stack_stages(layout, spec.n_layers, train)
    layout.validate(spec, cluster, train)
    profile = train.profile
    gen = generation(cluster.accelerator.calibration_name)
    from shardwise.capabilities import check

    check(train, cluster.accelerator, gen)  # its attention kernel and FP8 recipe run here
    stages = training_memory_per_gpu(spec, layout, train, formula=formula, generation=gen)
    layer = saved_tensors_per_layer(  # one (MoE, if any) layer, one micro-batch, this rank
        spec, seq, layout.micro_batch, tp=layout.tp, sp=layout.sp, cp=layout.cp,
        flash=flash, selective=layout.recompute == "selective",
        dtype_bytes_=dtype_bytes(dtype), moe=spec.is_moe, impl=profile, etp=layout.etp,
        a2a=layout.ulysses_degree, routed_load=train.routed_load)
    budget = cluster.accelerator.memory_bytes * headroom
    worst = max(stages, key=lambda s: s.total)
    hints = fit_hints(spec, cluster, train, layout, budget, formula)
    return validate.finite_result({
        "model": spec.name, "layout": layout.to_dict(), "train": asdict(train),
        "accelerator": cluster.accelerator.name, "budget_bytes": budget,
        "fits": worst.total <= budget, "margin_bytes": budget - worst.total,
        "stages": [s.as_dict() | s.peak_dict() | {"stage": s.stage, "layers": s.layers,
                                                  "in_flight": s.in_flight,
                                                  "margin": budget - s.total,
                                                  "peak_margin": budget - s.peak}
                   for s in stages],
        "fit_hints": [hint.to_dict() for hint in hints],
        "layout_short": layout.short(), "gpus": gpus, "formula": formula,
        "headroom": headroom, "memory_bytes": cluster.accelerator.memory_bytes,
        "largest_stage": worst.stage,
        "host_bytes_per_rank": max(s.host for s in stages),
        "host_bytes_per_node": max(s.host for s in stages) * cluster.gpus_per_node,
        "gpus_per_node": cluster.gpus_per_node,
        "largest_peak_stage": max(stages, key=lambda s: s.peak).stage,
        "impl": train.impl, "impl_title": train.stack.title,
        "stack": train.settings().to_dict(), "profile": profile,
        "profile_title": get_profile(profile).title,
        "fused_attention": fused_attention(profile, flash),
        "layer_saved": {"impl": train.impl, "profile": profile, "recompute": layout.recompute, "moe": spec.is_moe,
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
                      t_w: float | None = None, p2p_latency: float = 0.0) -> Any:
    """Generate and simulate a schedule with per-stage times (SPEC §6,
    `schedules.stage_timeline`); returns the `Timeline`. Times are in [MIN_TIME, MAX_TIME]
    (`validate.duration`), so no start or end overflows."""
    from shardwise.schedules import stage_timeline

    for value, name in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")):
        if value is not None:
            validate.duration(value, name)
    validate.finite(p2p_latency, "p2p_latency", low=0, high=validate.MAX_TIME)
    return stage_timeline(schedule, stages, microbatches, chunks, t_f=t_f, t_b=t_b, t_w=t_w,
                          p2p_latency=p2p_latency)


def schedule_payload(timeline: Any, *, stages: int = 4, microbatches: int = 8,
                     schedule: str = "1f1b", chunks: int | None = None, t_f: float = 1.0,
                     t_b: float = 1.0, t_w: float | None = None,
                     p2p_latency: float = 0.0) -> dict[str, Any]:
    """`shardwise schedule --json`: counts, the times used (per stage: `t_f`, `t_b` a stage's
    forward and whole backward of one micro-batch over all its chunks, `t_w` the weight-
    gradient part of `t_b` when the schedule splits it, else None), makespan, simulated and
    closed-form bubble fraction (the registry's bubble over bubble plus work, without p2p
    latency; None where the schedule has no closed form for these `m`), peak micro-batches in
    flight per stage (a chunk counts `1/v`), the chunks' placement ("loop" or "v"), the action
    lists as text and the simulated timeline (one event per action: stage, kind F/B/W,
    micro-batch, chunk, start, end in the units of the times, and `pair`: it is one of an
    overlapped F&B pair, DualPipeV's)."""
    from shardwise.schedules import get_schedule, schedule_text

    info = get_schedule(schedule)
    p, m, v = stages, microbatches, chunks or info.default_chunks
    t_w = (t_b / 2 if t_w is None else t_w) if info.splits_backward else None
    closed = None
    if info.microbatch_problem(p, m) is None:
        bubble = float(info.bubble(p, v, m, t_f, t_b, t_w or 0.0))
        closed = bubble / (bubble + m * (t_f + t_b))
    by_stage: dict[int, list[Any]] = {}
    paired = set()  # events of an overlapped pair: the one marked `with_next` and its next
    for index, event in enumerate(timeline.events):
        by_stage.setdefault(event.stage, []).append(event.action)
        if event.action.with_next:
            paired |= {index, index + 1}
    out = {"schedule": schedule, "stages": p, "microbatches": m, "chunks": v,
           "placement": info.placement, "t_f": t_f, "t_b": t_b, "t_w": t_w,
           "p2p_latency": p2p_latency, "actions": len(timeline.events),
           "makespan": timeline.makespan, "bubble_fraction": timeline.bubble_fraction,
           "bubble_closed_form": closed, "peak_in_flight": list(timeline.peak_in_flight),
           "text": schedule_text(by_stage),
           "timeline": [{"stage": e.stage, "kind": e.action.kind,
                         "microbatch": e.action.micro_batch, "chunk": e.action.chunk,
                         "start": e.start, "end": e.end, "pair": index in paired}
                        for index, e in enumerate(timeline.events)]}
    return validate.finite_result(out, "schedule")


def schedule_svg(timeline: Any, out: dict[str, Any]) -> str:
    """`shardwise schedule --svg`: the timeline as an SVG Gantt chart, titled by the payload."""
    from shardwise.schedules import render_svg

    return render_svg(timeline, title=f"{out['schedule']} p={out['stages']} "
                                      f"m={out['microbatches']} v={out['chunks']}")


# ---------------------------------------------------------------------------------------- plan
def run_plan(spec: ModelSpec, *, gpus: int = 64, gpu: str | Accelerator = "h100",
             gpus_per_node: int = 8,
             intra: str | None = None, inter: str | None = None, seq: int = 8192,
             global_batch: str = "4M-tokens", tokens: str | None = None,
             price: float | None = None, top: int = 10, layout_text: str | None = None,
             flash: bool = True, dtype: str = "bf16", grad_dtype: str | None = None,
             optimizer: str = "adam", headroom: float = 0.85,
             calibration_path: str | None = None, impl: str = DEFAULT_STACK,
             stack_kw: dict[str, Any] | None = None,
             progress: Callable[[str], None] | None = None,
             partition: str | tuple[int, ...] | None = None,
             first_stage_layers: int | None = None, last_stage_layers: int | None = None,
             fix_text: str | None = None, max_text: str | None = None,
             all_variants: bool = False, fp8: str | None = None, offload: str = "none",
             offload_fraction: float = 1.0, rank_by: str = "step",
             mtbf_gpu_hours: float | None = None, checkpoint_bandwidth: str | None = None,
             restart_minutes: float | None = None, async_checkpoint: bool = False,
             export: str | None = None, choose: str = "simplest",
             prune_above: int | None = None, memory_budget: float | None = None) -> Any:
    """Validate the plan options and search every layout (SPEC §7); returns the `PlanResult`.
    `memory_budget`: bytes the search may hold (`budget.check_search`; None: no limit).
    `partition` or `first_stage_layers`/`last_stage_layers` set the given layout's stages.
    `layout_text` (`tp=8,pp=2,zero=1`; dp: the GPUs the other axes leave) is evaluated too.
    `impl` names the training stack, `stack_kw` its other choices (`TrainSpec`).
    `fix_text` (`tp=8,pp=4`) and `max_text` (`tp=8`) confine the search (`--fix`, `--max`);
    `all_variants` lists every layout instead of folding second-order variants. `fp8`,
    `offload`, `offload_fraction`: `TrainSpec`'s; `offload="auto"` lets the search compare
    the stack's offloads with none (`SearchSpace.offload`). `rank_by` ("step" or "goodput")
    and the failure and checkpoint inputs (`reliability`) set how rows rank and what their
    goodput is. `export` (`--emit`): the framework the chosen layout goes to, whose refusals
    come first. `choose` ("simplest" or "fastest", `plan.rank.CHOOSE`): which row of the first
    tier is recommended — the headline, the explanation and the exports use it. `prune_above`:
    the valid layouts above which the search prunes (`plan`)."""
    from shardwise.calibration import load_calibration
    from shardwise.plan import Constraint, SearchSpace, plan
    from shardwise.plan.tiers import CHOOSE

    if choose not in CHOOSE:
        raise ShardwiseError(f"--choose {choose!r}: use one of {', '.join(CHOOSE)}")

    cluster, machine_calib = cluster_for(gpus, gpu, gpus_per_node, intra, inter,
                                         calibration_path)
    batch = parse_batch(global_batch, seq)
    auto = offload == "auto"
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype, grad_dtype=grad_dtype,
                      optimizer=optimizer, flash_attention=flash, impl=impl, fp8=fp8,
                      offload="none" if auto else offload, offload_fraction=offload_fraction,
                      **(stack_kw or {})).validate()
    _check_seq(spec, seq)
    refused = model_refusal(export, spec, train) if export else None
    if refused:
        raise ShardwiseError(f"{export} cannot run this plan: {refused}")
    calib = machine_calib or load_calibration(
        cluster.accelerator.calibration_name, calibration_path,
        tuple(link.name for link in cluster.accelerator.links))
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
        else:
            given = stack_stages(given, spec.n_layers, train)
        given.validate(spec, cluster)
        refusal = unrunnable(spec, given, train, cluster, export)  # before any estimate
        if refusal is not None:
            raise refusal
        given.validate(spec, cluster, train)
    training_budget(tokens, price)
    inputs = reliability(mtbf_gpu_hours, checkpoint_bandwidth, restart_minutes,
                         async_checkpoint)
    inputs.check_stack(train)
    space = SearchSpace(constraint=Constraint.parse(fix_text, max_text),
                        offload=train.stack.offload_kinds() if auto else None,
                        recompute=("full",) if train.recompute_share != 1 else None)  # a share of it
    from shardwise.budget import check_search
    from shardwise.plan.prune import PRUNE_ABOVE

    check_search(spec, cluster, train, space, memory_budget, fix_text, max_text)

    result = plan(spec, cluster, train, top, headroom=headroom, calib=calib, layout=given,
                  progress=progress, space=space, all_variants=all_variants, rank_by=rank_by,
                  reliability=inputs,
                  prune_above=PRUNE_ABOVE if prune_above is None else prune_above)
    return replace(result, choose=choose)


def reliability(mtbf_gpu_hours: float | None = None, checkpoint_bandwidth: str | None = None,
                restart_minutes: float | None = None, async_checkpoint: bool = False) -> Any:
    """The goodput inputs (`estimate.goodput.Reliability`) from the plan options, each
    checked under its option's name; None takes the published default.
    `checkpoint_bandwidth` per node: `2GB/s`, `500MB/s` or bytes/s."""
    from shardwise.estimate.goodput import Reliability

    given: dict[str, Any] = {"async_checkpoint": bool(async_checkpoint)}
    if mtbf_gpu_hours is not None:
        given["mtbf_gpu_hours"] = validate.finite(mtbf_gpu_hours, "--mtbf-gpu-hours", low=0,
                                                  low_open=True, high=1e12)
    if checkpoint_bandwidth is not None:
        text = str(checkpoint_bandwidth).strip()
        try:
            rate = parse_size(text[:-2] if text.lower().endswith("/s") else text)
        except ShardwiseError:
            raise ShardwiseError(f"--checkpoint-bandwidth {checkpoint_bandwidth!r}: write bytes "
                                 "per second per node, e.g. 2GB/s or 500MB/s") from None
        given["checkpoint_bandwidth"] = validate.finite(
            rate, f"--checkpoint-bandwidth {checkpoint_bandwidth} (bytes/s per node)", low=1e6,
            high=1e15)  # 1 MB/s (a slow disk) to 1 PB/s
    if restart_minutes is not None:
        given["restart_s"] = 60 * validate.finite(restart_minutes, "--restart-minutes",
                                                  low=0, high=1e6)
    return Reliability(**given).validate()


def training_budget(tokens: str | None, price: float | None) -> float | None:
    """The token budget `--tokens` names (None without it); `--price` needs it."""
    budget = None
    if tokens is not None:
        budget = validate.positive(parse_count(tokens, what="token budget"),
                                   f"--tokens {tokens}", high=MAX_TOKENS)
    if price is not None and budget is None:
        raise ShardwiseError("--price needs --tokens (the training budget)")
    return budget


def emit_payload(framework: str, result: Any, launcher: str | None = None,
                 image: str | None = None, job_name: str | None = None) -> dict[str, Any]:
    """`shardwise plan --emit F --json`: the launch configuration of the chosen layout (yours
    with --layout, else the recommended one, `PlanResult.recommended`) for Megatron-LM,
    torchtitan or DeepSpeed; with `launcher` (`emit.launchers.LAUNCHERS`) the job that runs it
    on the planned nodes (`script`), and every launcher's job or why it cannot write one
    (`launchers`; k8s needs `image`)."""
    from shardwise.emit import emit
    from shardwise.emit.launchers import LAUNCHERS, launcher_script

    chosen = result.given.layout if result.given is not None else result.recommended.layout
    emitted = emit(framework, result.model, chosen, result.train,
                   result.cluster.gpus_per_node, result.cluster)
    train = result.train
    jobs: dict[str, Any] = {}
    assert emitted.launch is not None  # every framework's export has one
    for name in LAUNCHERS:  # each launcher's job, or why it cannot write one
        try:
            jobs[name] = launcher_script(
                name, emitted.launch, chosen.world_size, image=image,
                name=job_name or f"{result.model.name}-{chosen.short()}",
                accelerator=result.cluster.accelerator.calibration_name)
        except ShardwiseError as exc:
            if name == launcher:
                raise
            jobs[name] = {"error": str(exc)}
    return {"framework": framework, "layout": chosen.to_dict(), "config": emitted.text,
            "launcher": launcher, "script": jobs[launcher] if launcher else None,
            "launchers": jobs,
            "notes": list(emitted.notes),
            "plan": {"model": result.model.name, "seq_len": train.seq_len,
                     "global_batch": train.global_batch, "dtype": train.dtype,
                     "grad_dtype": train.grad_dtype or train.dtype,
                     "stack": train.settings().to_dict()}}


def plan_payload(result: Any, *, tokens: str | None = None, price: float | None = None,
                 failure_model: str | None = None, simulate: int | None = None,
                 stragglers: str | None = None, image: str | None = None) -> dict[str, Any]:
    """`shardwise plan --json`: the search result (ranked layouts with step-time and memory
    breakdowns and goodput, baseline, your layout, rejected regions, statistics), the
    explanation, time and cost of the token budget, the recommended layout's goodput (with the
    budget: its expected interruptions, days, GPU-hours and cost), and the chosen layout's
    three launch configurations (or why one cannot be written) with every launcher's job (k8s:
    with `image`). Every row's tier, the tiers'
    resolution and rule, and the `recommended` row (`PlanResult.tiering`); every estimate's
    `uncertainty` carries its band's bounds in seconds (`low`, `high`; `_95` at 95 %). With
    `failure_model`, the recommended layout's run simulated under it (`report.simulation`)."""
    from shardwise.estimate.uncertainty import bounds
    from shardwise.plan.rank import SECOND_ORDER, SIMPLER
    from shardwise.report.plan_report import explain, goodput_summary, training_summary
    from shardwise.report.simulation import simulation_payload

    out = result.to_dict()
    out.pop("simplest", None)  # the recommendation replaces it
    for key in ("baseline", "given"):  # off the ranking: no tier of their own
        if out[key] is not None:
            out[key]["tier"] = None
    for entry in (*out["ranked"], out["recommended"], out["baseline"], out["given"]):
        sure = entry["estimate"]["uncertainty"] if entry else None
        if sure is not None:
            sure.update(bounds(entry["estimate"]["total"], sure))
    out["stack"] = result.train.settings().to_dict()
    out["explanation"] = explain(result)
    out["tie_break"], out["second_order"] = list(SIMPLER), list(SECOND_ORDER)
    budget = training_budget(tokens, price)
    out["training"] = training_summary(result.recommended, budget, price)
    out["goodput"] = goodput_summary(result.recommended, budget, price)
    out["goodput_simulated"] = (simulation_payload(result, failure_model, runs=simulate,
                                                   tokens=budget, stragglers=stragglers)
                                if failure_model else None)
    emits: dict[str, Any] = {}
    own = result.train.stack.export  # the stack's own framework first, the others say why not
    for framework in sorted(FRAMEWORKS, key=lambda name: name != own):
        try:
            emits[framework] = emit_payload(framework, result, image=image)
        except ShardwiseError as exc:
            emits[framework] = {"framework": framework, "error": str(exc)}
    out["emits"] = emits
    return validate.finite_result(out, "plan")
