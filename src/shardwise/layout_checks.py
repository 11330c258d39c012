"""What a `Layout` may not be: every violated constraint as one clear sentence
(`Layout.problems`), given the model, optionally the cluster and the training target.

Divisibility of heads, `d_ff` and experts by the parallel degrees; the partition
(`partition.partition_problems`); the schedule's chunk and micro-batch rules
(`schedules.registry`); the context-parallel kind's head split; the stack's own rules
(`Stack.layout_problems`) and offload support.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.choices import (
    AXES,
    CP_KINDS,
    MOMENT_DTYPES,
    OFFLOAD_MODULES,
    RECOMPUTE,
    RECOMPUTE_MODULES,
)
from shardwise.cuda_graph import cuda_graph_layout_problems
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.partition import partition_problems
from shardwise.schedules.registry import SCHEDULE_REGISTRY, SCHEDULES
from shardwise.stacks import STACKS

if TYPE_CHECKING:
    from shardwise.layout import Layout, TrainSpec


def layout_problems(layout: Layout, model: ModelSpec, cluster: Cluster | None = None,
                train: TrainSpec | None = None) -> list[str]:
    """Every constraint `layout` violates, one clear sentence each (`Layout.problems`, which
    checks the arguments' types first)."""
    out: list[str] = []
    for axis in (*AXES, "chunks", "micro_batch"):
        try:
            validate.degree(getattr(layout, axis), axis)
        except ShardwiseError as exc:
            out.append(str(exc))
    for name in ("zero_group", "etp", "ulysses"):  # 0: the default each documents
        try:
            validate.integer(getattr(layout, name), name, low=0, high=validate.MAX_DEGREE)
        except ShardwiseError as exc:
            out.append(str(exc))
    for name, allowed in (("schedule", SCHEDULES), ("recompute", RECOMPUTE)):
        if not isinstance(getattr(layout, name), str):
            out.append(f"{name} must be one of {', '.join(allowed)}, got "
                       f"{getattr(layout, name)!r}")
    if not isinstance(layout.sp, bool | int):
        out.append(f"sp must be true or false, got {layout.sp!r}")
    if out:
        return out
    t = layout.tp
    if model.n_heads % t:
        out.append(f"tp={t} does not divide n_heads={model.n_heads}")
    if model.n_kv_heads % t and t % model.n_kv_heads:
        out.append(
            f"tp={t} neither divides n_kv_heads={model.n_kv_heads} nor is a multiple of it "
            "(for replicated kv heads)"
        )
    if model.d_ff % t:
        out.append(f"tp={t} does not divide d_ff={model.d_ff}")
    if layout.etp < 0:
        out.append(f"etp must be ≥ 0 (0: the same as tp), got {layout.etp}")
        return out
    et = layout.expert_tp
    if model.is_moe and model.expert_d_ff % et:
        name = "etp" if layout.etp else "tp"
        out.append(f"{name}={et} does not divide the expert d_ff={model.expert_d_ff}")
    if model.n_shared_experts and et != t and model.expert_d_ff % t:
        out.append(f"tp={t} does not divide the shared experts' d_ff={model.expert_d_ff}")
    if layout.etp and not model.is_moe:
        out.append(f"etp={layout.etp} needs a mixture-of-experts model; {model.name} is dense")
    out.extend(partition_problems(model.n_layers, layout.pp, layout.chunks, layout.partition))
    info = SCHEDULE_REGISTRY.get(layout.schedule)
    if info is None:
        out.append(f"schedule {layout.schedule!r} unknown; valid: {', '.join(SCHEDULES)}")
    elif info.chunked:
        if (problem := info.chunk_problem(layout.chunks)) is not None:
            out.append(problem)
        if layout.pp < 2:
            out.append(f"the {info.name} schedule needs pp ≥ 2")
    elif layout.chunks != 1:
        chunked = "|".join(s.name for s in SCHEDULE_REGISTRY.values() if s.chunked)
        out.append(f"chunks={layout.chunks} needs schedule={chunked}")
    out.extend(_cp_problems(layout, model))
    if layout.recompute not in RECOMPUTE:
        out.append(f"recompute {layout.recompute!r} unknown; valid: {', '.join(RECOMPUTE)}")
    if layout.zero not in (0, 1, 2, 3):
        out.append(f"zero stage must be 0, 1, 2 or 3, got {layout.zero}")
    if layout.zero_group and (layout.dp * layout.cp) % layout.zero_group:
        out.append(f"zero_group={layout.zero_group} does not divide dp·cp={layout.dp * layout.cp}")
    if layout.ep > 1 and not model.is_moe:
        out.append(f"ep={layout.ep} needs a mixture-of-experts model; {model.name} is dense")
    if model.is_moe and model.n_experts % layout.ep:
        out.append(f"ep={layout.ep} does not divide n_experts={model.n_experts}")
    if et == t and (layout.dp * layout.cp) % layout.ep:
        folded = ("; with etp=1 (Megatron's --expert-tensor-parallel-size 1) the experts fold "
                  "over tp·dp·cp" if (t * layout.dp * layout.cp) % layout.ep == 0 else "")
        out.append(f"ep={layout.ep} must divide dp·cp={layout.dp * layout.cp} (experts reuse "
                   f"data/context-parallel ranks){folded}")
    elif (t * layout.dp * layout.cp) % (et * layout.ep):
        out.append(f"etp·ep={et}·{layout.ep} must divide tp·dp·cp={t * layout.dp * layout.cp} "
                   "(the expert layers' ranks of a pipeline stage)")
    if cluster is not None and layout.world_size != cluster.n_gpus:
        out.append(
            f"dp·tp·pp·cp = {layout.dp}·{layout.tp}·{layout.pp}·{layout.cp} = {layout.world_size} "
            f"ranks, but the cluster has {cluster.n_gpus} GPUs"
        )
    if train is not None:
        out.extend(_train_problems(layout, train, model))
    return out

def _cp_problems(layout: Layout, model: ModelSpec) -> list[str]:
    """The context-parallel kind's constraints. An all-to-all over heads gives each of its
    `u` ranks `1/u` of a tensor-parallel rank's query heads and of its key/value heads, so
    `u` divides both (Transformer Engine's `AttnFuncWithCPAndQKVOA2A`, cp_comm_type "a2a",
    asserts `num_heads % cp_size == 0` for Q and for K/V; TE 2.20.0.dev0,
    attention/dot_product_attention/context_parallel.py). DeepSpeed 0.19.8 also runs
    fewer key/value heads than ranks apart unevenly when a_kv ≥ u (`uneven_heads_all2all`,
    deepspeed/sequence/layer.py); shardwise models the even split only."""
    if layout.cp_kind not in CP_KINDS:
        return [f"cp_kind {layout.cp_kind!r} unknown; valid: {', '.join(CP_KINDS)}"]
    c, u = layout.cp, layout.ulysses
    if layout.cp_kind != "hybrid" and u:
        return [f"ulysses={u} applies to cp_kind=hybrid only (the all-to-all degree inside "
                "each cp group)"]
    if layout.cp_kind == "hybrid" and (not 1 < u < c or c % u):
        return [f"cp_kind=hybrid needs ulysses=u with 1 < u < cp={c} and u dividing cp "
                f"(all-to-all inside groups of u ranks, ring across cp/u), got ulysses={u}"]
    return _head_problems(layout, model)

def _head_problems(layout: Layout, model: ModelSpec) -> list[str]:
    """`Layout.ulysses_degree` divides the query and the key/value heads of a tp rank."""
    u, t = layout.ulysses_degree, layout.tp
    if u == 1:
        return []
    out = []
    q_heads, kv_heads = model.n_heads // t, max(model.n_kv_heads // t, 1)
    for what, heads in (("query heads", q_heads), ("key/value heads", kv_heads)):
        if heads % u:
            out.append(f"the Ulysses all-to-all over {u} ranks splits each tensor-parallel "
                       f"rank's {heads} {what} (n_heads={model.n_heads}, n_kv_heads="
                       f"{model.n_kv_heads}, tp={t}): {u} must divide {heads}")
    return out

def _train_problems(layout: Layout, train: TrainSpec, model: ModelSpec) -> list[str]:
    split_ok = not partition_problems(model.n_layers, layout.pp, layout.chunks, layout.partition)
    out = (train.stack.layout_problems(layout, model.n_layers if split_ok else None, train)
           if train.impl in STACKS else [])
    if train.impl in STACKS and train.offload in train.stack.offload_kinds():
        support = train.stack.offload_support(train.offload)
        if support is not None and layout.zero not in support.zero:
            out.append(f"{train.stack.name} offloads the {train.offload} with ZeRO "
                       f"{', '.join(map(str, support.zero))} only ({support.flag}), "
                       f"not zero={layout.zero}")
    out += cuda_graph_layout_problems(layout, model, train)
    if train.recompute_share != 1 and layout.recompute != "full":
        out.append(f"recompute_share={train.recompute_share:g} checkpoints a share of the "
                   f"layers fully; it needs recompute=full, not {layout.recompute}")
    if "mla_up_proj" in (train.recompute_modules or ()) and not model.is_mla:
        out.append(f"recompute module mla_up_proj needs multi-latent attention; {model.name} "
                   "has none (megatron-core's TransformerConfig refuses it too)")
    # Zigzag causal balancing splits the sequence into 2·cp chunks.
    if layout.cp > 1 and train.seq_len % (2 * layout.cp):
        out.append(f"2·cp={2 * layout.cp} does not divide seq_len={train.seq_len}")
    if layout.sp and train.seq_len % (layout.tp * layout.cp):
        out.append(f"tp·cp={layout.tp * layout.cp} does not divide seq_len={train.seq_len} "
                   "(sequence parallel)")
    if train.global_batch is not None:
        per_step = layout.dp * layout.micro_batch
        if train.global_batch % per_step:
            out.append(
                f"global batch {train.global_batch} is not a multiple of dp·micro_batch="
                f"{layout.dp}·{layout.micro_batch}"
            )
        elif layout.schedule in SCHEDULE_REGISTRY and layout.pp > 1 and (
                problem := SCHEDULE_REGISTRY[layout.schedule].microbatch_problem(
                    layout.pp, layout.microbatches(train))) is not None:
            out.append(problem)
    return out



def memory_setting_problems(train: TrainSpec) -> list[str]:
    """The memory-as-trained settings of `train` (`TrainSpec.recompute_modules`, the moment
    and master dtypes, `act_fp8_store`, `mtp_layers`): known names, and a stack that has them
    (Megatron-Core's `--recompute-modules`, `--use-precision-aware-optimizer`,
    `--activation-func-fp8-input-store`, `--mtp-num-layers`)."""
    out = []
    modules = train.recompute_modules
    if modules is not None:
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown or not modules:
            out.append(f"recompute modules {','.join(map(str, unknown)) or '(none)'} unknown; "
                       f"valid: {', '.join(RECOMPUTE_MODULES)}")
    share = train.recompute_share
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        out.append(f"recompute_share must be a share of the layers in (0, 1], got {share!r}")
    if unknown := [m for m in train.offload_modules if m not in OFFLOAD_MODULES]:
        out.append(f"offload modules {','.join(map(str, unknown))} unknown; valid: "
                   f"{', '.join(OFFLOAD_MODULES)}")
    if "attn_proj" in train.offload_modules and "core_attn" not in train.offload_modules:
        out.append("offload module attn_proj needs core_attn too (its input is core_attn's "
                   "output; megatron-core's TransformerConfig refuses it alone)")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"):
        value = getattr(train, name)
        valid = ("fp32", "fp16") if name == "main_params_dtype" else MOMENT_DTYPES
        if value is not None and value not in valid:
            out.append(f"{name} {value!r} unknown; valid: {', '.join(valid)}")
    if train.mtp_layers is not None and (not isinstance(train.mtp_layers, int)
                                         or not 0 <= train.mtp_layers <= 16):
        out.append(f"mtp_layers must be a whole number 0..16, got {train.mtp_layers!r}")
    megatron = train.stack.profile == "megatron-te"
    used = [flag for flag, on in (
        ("--recompute-modules", modules is not None),
        ("--use-precision-aware-optimizer", any(getattr(train, n) not in (None, "fp32") for n in
                                                ("exp_avg_dtype", "exp_avg_sq_dtype",
                                                 "main_params_dtype"))),
        ("--activation-func-fp8-input-store", train.act_fp8_store),
        ("--offload-modules", bool(train.offload_modules))) if on]
    if used and not megatron:
        out.append(f"{', '.join(used)}: Megatron-Core's settings; {train.stack.name} has none "
                   "(use --impl megatron-te)")
    return out
