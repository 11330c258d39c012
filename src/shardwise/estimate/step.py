"""Step time, throughput, MFU and HFU of one training step (SPEC §7):

    step = compute + exposed TP + exposed CP + EP + PP p2p + bubble + exposed DP + optimizer

per rank, on the pipeline's critical path (the slowest stage), for `m` micro-batches.
`step_terms` assembles the terms for layouts given as numbers or arrays (the planner's
batches, `estimate_step`'s one layout): compute from `estimate.compute`, the per-axis
communication from `estimate.axes` (TP, CP, PP, DP/ZeRO) and `estimate.expert` (EP), the
collectives on the calibrated links from `estimate.links`. MFU counts model FLOPs = 3 ×
forward with full `s²` attention (`FLOP_CONVENTION`, the papers'); `mfu_causal` the causal
half; HFU adds recomputation. The derivation of every term, its sources and the rank
placement: docs/concepts/step-time.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.estimate.axes import (
    cp_time,
    dp_time,
    dp_traffic,
    interleaved_window,
    p2p_exposed,
    pipeline_bubble,
    tp_overlapped,
    tp_time,
)
from shardwise.estimate.compute import (
    RC_CODES,
    ComputeContext,
    embedding_cost,
    head_cost,
    host_overhead,
    layer_cost,
    memory_time,
    optimizer_host_ops,
    optimizer_time,
)
from shardwise.estimate.expert import ep_time
from shardwise.estimate.kernels import linear
from shardwise.estimate.links import (
    Links,
    _bucketed,
    busy_fraction,
    group_collective_time,
    measured_call,
    p2p_latency,
    small_calls,
)
from shardwise.estimate.memory import bytes_per_param_training
from shardwise.estimate.offload import offload_step
from shardwise.estimate.pipe_engine import pipe_engine_time
from shardwise.estimate.stages import StageShape, busiest_stage_params, stage_shape
from shardwise.estimate.uncertainty import Uncertainty, uncertainty
from shardwise.hardware import Cluster
from shardwise.layout import (
    CP_KINDS,
    Layout,
    Partition,
    TrainSpec,
    check_specs,
    ulysses_degree,
)
from shardwise.placement import members_per_node
from shardwise.schedules.registry import SCHEDULE_CODES

__all__ = [  # with the names of `estimate.links` and `estimate.axes` it re-exports
    "FLOP_CONVENTION",
    "RC_CODES",
    "SCHEDULE_CODES",
    "Links",
    "StepEstimate",
    "_bucketed",
    "busiest_stage_params",
    "busy_fraction",
    "compute_costs",
    "cp_time",
    "dp_time",
    "estimate_step",
    "group_collective_time",
    "interleaved_window",
    "measured_call",
    "p2p_exposed",
    "p2p_latency",
    "pipeline_bubble",
    "small_calls",
    "step_terms",
    "tp_overlapped",
    "tp_time",
]


FLOP_CONVENTION = (
    "mfu: model FLOPs = 3 x forward, full s^2 attention (6N + 12*L*h*s per token: Megatron-LM "
    "num_floating_point_operations, Korthikanti et al. 2022, PaLM; MLA: scores at "
    "d_nope + d_rope, P*V at d_v per head, the projections as they run, unabsorbed); "
    "mfu_causal: attention "
    "counted as the causal half; hfu: mfu's FLOPs plus recomputation (full: every layer's "
    "forward again; selective: attention scores and P*V again)")

BREAKDOWN = ("compute", "tp_comm", "cp_comm_exposed", "ep_comm", "pp_comm", "bubble",
             "dp_comm_exposed", "optimizer")


# ------------------------------------------------------------------------- the step model
def host_copy_time(links: Links, n_bytes: Any) -> Any:
    """One host↔device copy of `n_bytes` (numbers or arrays) on the host link."""
    return np.where(n_bytes > 0, links.host_lat + n_bytes / max(links.host_bw, 1e-30), 0.0)


def _dp_inputs(model: ModelSpec, links: Links, cal: Calibration, train: TrainSpec,
               shape: StageShape, *, zero: Any, group: Any, m: Any) -> dict[str, Any]:
    """The arguments `axes.dp_time` and `axes.dp_traffic` share, of layouts of `shape`, ZeRO
    stage `zero`, shard group `group` (`StageShape.shard_group`) and `m` micro-batches."""
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    return {"links": links, "train": train, "bucket": cal.dp_bucket_bytes,
            "groups": shape.param_groups(model), "replicas": shape.replicas,
            "in_node": shape.in_node, "group": group, "zero": zero, "m": m,
            "layers": shape.layers, "grad_bytes": state.grad, "weight_bytes": state.weight,
            "host_copy": partial(host_copy_time, links)}


def dp_total(ctx: ComputeContext, links: Links, train: TrainSpec, shape: StageShape, *,
             zero: Any, zero_group: Any, m: Any) -> Any:
    """`step_terms`' `dp_comm_total` (every DP/ZeRO collective's seconds, before any overlap)
    of layouts of `shape` at ZeRO stage `zero` and group `zero_group`, without the rest of
    the step: the planner's floor (`plan.evaluate.dp_floor`)."""
    return dp_traffic(**_dp_inputs(ctx.model, links, ctx.calibration, train, shape, zero=zero,
                                   group=shape.shard_group(zero_group), m=m))


def step_terms(ctx: ComputeContext, links: Links, train: TrainSpec, *, tp: Any, pp: Any,
               cp: Any, ep: Any, dp: Any, zero: Any, zero_group: Any, sp: Any, schedule: Any,
               chunks: Any, recompute: Any, micro_batch: Any, m: Any,
               costs: dict[str, Any] | None = None, partition: Partition = (), etp: Any = 0,
               cp_kind: Any = 0, ulysses: Any = 0, shape: StageShape | None = None,
               floor: bool = False) -> dict[str, Any]:
    """Every term of the step-time model for layouts given as numbers or arrays, keyed by the
    `Layout` field names (codes for `recompute` and `schedule`: `layout_codes`; `zero_group`
    = 0 for ZeRO over all dp·cp ranks) and `m` micro-batches. Returns seconds (and
    diagnostics) with the broadcast shape of the inputs. `estimate_step` and the planner both
    call this.

    `costs` may carry the compute costs already evaluated for these layouts (`compute_costs`;
    the planner evaluates them once per distinct `(tp, cp, micro_batch, sp, recompute, ep)`
    and gathers); `shape` their `stages.stage_shape` (the planner's floor shares it with its
    DP/ZeRO bound). `partition`: one layout's explicit stage partition, or a `Balanced` one
    for arrays of layouts (the planner's searched partitions); () the default
    (`Layout.stage_partition`). `floor`: only the terms before DP/ZeRO and the optimizer
    (compute, tp_comm, cp_comm_exposed, ep_comm, pp_comm, bubble; the planner's floor)."""
    # the papers' notation from here on
    t, p, c, e, zg, sched, v, rc, b = (tp, pp, cp, ep, zero_group, schedule, chunks, recompute,
                                       micro_batch)
    model, cal, s, ab = ctx.model, ctx.calibration, ctx.seq_len, ctx.act_bytes
    settings = train.settings()
    h, gpn = model.d_model, links.gpus_per_node
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    wb, gb_ = state.weight, state.grad
    full = (rc == RC_CODES["full"]) * ctx.recompute_share  # the share of layers replayed
    offload = settings.stack.offload_support(train.offload)

    host_copy = partial(host_copy_time, links)

    def on_node(axis: str) -> Any:
        """Members of one `axis` group on a node (`placement`, the runtime's rank order)."""
        return members_per_node(axis, gpn, pp=p, dp=dp, cp=c, tp=t, ep=e, etp=etp)

    # ---- compute per micro-batch: one dense layer, one MoE layer, head, embedding
    costs = costs if costs is not None else compute_costs(ctx, t, c, b, sp, rc, e, etp)
    dense = costs["dense"]
    # uneven stages: the busiest, first and last stage's layers relative to L/p; MoE layers
    # at their average share
    if shape is None:
        shape = stage_shape(model, gpn, tp=t, pp=p, cp=c, ep=e, dp=dp, chunks=v,
                            schedule=sched, partition=partition, etp=etp)
    most, first, last = shape.most, shape.first, shape.last
    n_dense, n_moe = most * model.n_dense_layers / p, most * model.n_moe_layers / p
    f_mid = n_dense * dense.fwd
    b_mid = n_dense * (dense.bwd + dense.recompute)
    w_mid = n_dense * dense.wgrad
    attn_f, attn_b = n_dense * dense.attn_fwd, n_dense * dense.attn_bwd
    if model.n_moe_layers:
        moe = costs["moe"]
        f_mid = f_mid + n_moe * moe.fwd
        b_mid = b_mid + n_moe * (moe.bwd + moe.recompute)
        w_mid = w_mid + n_moe * moe.wgrad
        attn_f, attn_b = attn_f + n_moe * moe.attn_fwd, attn_b + n_moe * moe.attn_bwd
    head_f, head_b = costs["head"][:2]
    emb_f, emb_b = costs["embedding"]
    single = p == 1
    f_last = f_mid * last / most + head_f + np.where(single, emb_f, 0.0)
    b_last = b_mid * last / most + head_b + np.where(single, emb_b, 0.0)
    f_first, b_first = f_mid * first / most + emb_f, b_mid * first / most + emb_b
    # multi-token prediction on the stage holding the head (megatron-core `GPTModel.forward`,
    # `MultiTokenPredictionLayer`; DeepSeek-V3 §2.2): per module `eh_proj` (T×2h)·(2h×h/t), one
    # more layer of the decoder's last kind (MoE in an MoE model) and the LM head with its loss
    mtp = model.mtp_layers if train.mtp_layers is None else train.mtp_layers
    mtp_moe = mtp if model.n_moe_layers else 0
    if mtp:
        kind = costs["moe"] if model.n_moe_layers else dense
        proj = linear(ctx, s / c * b, 2 * h, h / t)
        f_last = f_last + mtp * (kind.fwd + proj.fwd + head_f)
        b_last = b_last + mtp * (kind.bwd + kind.recompute + proj.dgrad + proj.wgrad + head_b)

    # ---- expert parallel: the dispatcher's collectives per MoE layer, exposed or overlapped
    if model.n_moe_layers:
        ep_f, ep_b = ep_time(ctx, links, train, t=t, c=c, b=b, sp=sp, e=e, etp=etp, full=full,
                             n_moe=n_moe, ep_in_node=on_node("ep"), m=m,
                             work_f=f_mid, work_b=b_mid)
    else:
        ep_f = ep_b = 0.0 * t
    # per MoE layer, so that each stage is charged its own MoE layers' (the MTP's included)
    ep_layer = (ep_f + ep_b) / np.maximum(n_moe, 1e-30)
    moe_first, moe_last = (first * model.n_moe_layers / p,
                           last * model.n_moe_layers / p + mtp_moe)

    # the slowest stage (compute and its EP collectives): the last unless an uneven partition
    # makes the first or the busiest one
    pick_first = ~single & (f_first + b_first + moe_first * ep_layer
                            > f_last + b_last + moe_last * ep_layer)
    f_crit, b_crit = np.where(pick_first, f_first, f_last), np.where(pick_first, b_first, b_last)
    moe_crit = np.where(pick_first, moe_first, moe_last)
    pick_mid = f_mid + b_mid + n_moe * ep_layer > f_crit + b_crit + moe_crit * ep_layer
    f_crit, b_crit = np.where(pick_mid, f_mid, f_crit), np.where(pick_mid, b_mid, b_crit)
    # the critical stage's EP time: the busiest stage's (`ep_time`) scaled to its MoE layers
    ep_scale = np.where(pick_mid, 1.0, moe_crit / np.maximum(n_moe, 1e-30))

    # ---- tensor parallel: all-reduces of the (s/c, b, h) activation, on the critical path
    layers = shape.layers
    kappa = cal.overlap_contention
    # Megatron-Core's MoE layers without shared experts make no MLP pair (`tp_time`;
    # Megatron-DeepSpeed runs DeepSpeed-MoE, whose layer is not this one)
    no_pair = (train.impl == "megatron-te" and model.n_moe_layers > 0
               and not model.n_shared_experts)
    mlp_share = 1 - n_moe / np.maximum(layers, 1e-30) if no_pair else 1.0
    tp_f, tp_b, tp_crit, _ = tp_time(ctx, links, train, t=t, sp=sp, rc=rc, b=b, c=c,
                                     layers=layers, gemm_f=dense.wgrad,
                                     tp_in_node=on_node("tp"), single=single,
                                     mlp_share=mlp_share)

    # ---- context parallel: ring hops behind the block compute, Ulysses' all-to-alls exposed
    cp_f, cp_b = cp_time(ctx, links, train, t=t, c=c, u=ulysses_degree(c, cp_kind, ulysses),
                         gather=cp_kind == CP_KINDS.index("allgather"),
                         b=b, rc=rc, layers=layers, attn_f=attn_f, attn_b=attn_b, dp=dp, p=p,
                         e=e)

    # ---- pipeline: p2p per micro-batch and virtual stage, and the bubble
    pp_intra = on_node("pp") == p
    p2p_bytes = s / c * b * h * ab / t
    p2p = (p2p_latency(links, np.where(pp_intra, links.intra_lat, links.inter_lat))
           + p2p_bytes / np.where(pp_intra, links.intra_bw, links.inter_bw))
    p2p_busy = (p2p_latency(links, links.intra_lat) + p2p_bytes / links.intra_bw) / p2p
    pp_comm = (np.where(p > 1, p2p_exposed(p2p, p, v, m, settings.p2p_overlapped(v),
                                           kappa * p2p_busy), 0.0)
               + small_calls(links, "all-gather", p, 1))  # the stages' agreement check
    big_f = f_mid + tp_f + cp_f + ep_f
    big_b = b_mid + tp_b + cp_b + ep_b
    # uneven stages: the closed form's (p-1) busiest-stage times become the other stages' sum,
    # L - n_most layers (exact for GPipe, an upper bound for the 1F1B family: tested against
    # the simulator, which `estimate_step(simulate=True)` runs with each stage's own times)
    others = (p - most) / np.maximum((p - 1) * most, 1e-30)
    bubble = np.where(p > 1, others * pipeline_bubble(sched, p, v, m, big_f, big_b, w_mid), 0.0)

    # ---- data parallel / ZeRO over the dp·cp replicas
    dense_params, expert_params = shape.dense, shape.expert
    replicas, in_node, shift = shape.replicas, shape.in_node, shape.shift
    # DeepSpeed's pipeline engine: serial sends, TP gathers, tied and bf16 reductions
    pp_more, dp_more = pipe_engine_time(
        settings.stack, ctx, links, train, t=t, p=p, c=c, b=b, m=m, zero=zero, schedule=sched,
        p2p=p2p, pp_intra=pp_intra, tp_in_node=on_node("tp"), params=dense_params,
        replicas=replicas, dp_in_node=in_node)
    pp_comm = pp_comm + pp_more

    # ---- FP8 weight casts once per step (Transformer Engine caches them over the
    # micro-batches; under ZeRO-3 it casts every micro-batch's gathered weights)
    fp8_casts = 0.0 * t
    if ctx.fp8 is not None:
        per_cast = ctx.fp8.cast_bytes(ctx.generation).weight_step
        fp8_weights = n_dense * dense.fp8_weights + (
            n_moe * costs["moe"].fp8_weights if model.n_moe_layers else 0.0)
        fp8_casts = memory_time(ctx, per_cast * fp8_weights * np.where(zero == 3, m, 1))

    compute = m * (f_crit + b_crit) + fp8_casts
    tp_comm = m * tp_crit
    cp_comm = m * (cp_f + cp_b)
    ep_comm = m * (ep_f + ep_b) * ep_scale
    terms = {"compute": compute, "tp_comm": tp_comm, "cp_comm_exposed": cp_comm,
             "ep_comm": ep_comm, "pp_comm": pp_comm, "bubble": bubble,
             "t_forward": big_f, "t_backward": big_b, "t_wgrad": w_mid}
    if floor:
        return terms

    group = shape.shard_group(zg)
    # The overlap window: the last micro-batch's backward (the next step's first forward for
    # the parameter all-gather). Interleaved (v chunks), each chunk's gradients are final
    # `p` chunk-backwards apart in the cool-down (chunk v-1 first), so the reduction of all
    # but the last chunk hides behind the cool-down: `(1 + (v-1)·p)/v` micro-batch backwards
    # (Megatron-Core buckets per chunk; `interleaved_window`). v = 1: one backward.
    widen = interleaved_window(p, v)
    window_b = widen * (b_crit + tp_b)
    window_f = widen * (f_crit + tp_f)
    dp_exposed, dp_traffic_s = dp_time(
        kappa=kappa, window_b=window_b, window_f=window_f, big_f=big_f, big_b=big_b,
        **_dp_inputs(model, links, cal, train, shape, zero=zero, group=group, m=m))
    dp_exposed = dp_exposed + dp_more

    # ---- optimizer step over the parameters this rank updates (offloaded: on the CPU)
    opt_dense = dense_params / np.where(zero >= 1, group, 1)
    opt_expert = expert_params / np.where(zero >= 1, np.maximum(group / shift, 1), 1)
    on_host = 0.0 if offload is None else (1.0 if offload.kind == "params"
                                           else train.offload_fraction)
    optimizer = (optimizer_time(ctx, (opt_dense + opt_expert) * (1 - on_host), gb_, wb,
                                state.master, state.moments)
                 + host_overhead(ctx, optimizer_host_ops(ctx, n_dense, n_moe, e, single))
                 + small_calls(links, "all-reduce", t * p * c * dp, 2))
    if offload is not None:
        optimizer = optimizer + offload_step(
            offload, (opt_dense + opt_expert) * on_host, gb_, wb, np.where(zero == 2, m, 1),
            window_b, settings.dp_overlapped(zero), host_copy, gpn, links.host)

    total = compute + tp_comm + cp_comm + ep_comm + pp_comm + bubble + dp_exposed + optimizer
    return terms | {"dp_comm_exposed": dp_exposed, "optimizer": optimizer, "total": total,
                    "dp_comm_total": dp_traffic_s}


def compute_costs(ctx: ComputeContext, t: Any, c: Any, b: Any, sp: Any, rc: Any, e: Any,
                  etp: Any = 0) -> dict[str, Any]:
    """The compute costs `step_terms` needs: a dense layer, an MoE layer (MoE models), the
    head and the embedding, per rank and micro-batch."""
    return {
        "dense": layer_cost(ctx, t, c, b, sp, rc),
        "moe": (layer_cost(ctx, t, c, b, sp, rc, moe=True, ep=e, etp=etp) if ctx.model.is_moe
                else None),
        "head": head_cost(ctx, t, c, b, sp),
        "embedding": embedding_cost(ctx, t, c, b),
    }


def flops_per_token(model: ModelSpec, seq_len: int, causal: bool = False
                    ) -> tuple[float, tuple[float, ...]]:
    """(model FLOPs per token, hardware FLOPs per token by recompute code): full attention
    (`FLOP_CONVENTION`), or its causal half; cached per (model, seq_len, causal)."""
    try:
        return _flops_per_token(model, seq_len, causal)
    except TypeError:  # a spec built with a list where a tuple belongs: not hashable
        return _flops_per_token.__wrapped__(model, seq_len, causal)


@lru_cache(maxsize=64)
def _flops_per_token(model: ModelSpec, seq_len: int, causal: bool
                     ) -> tuple[float, tuple[float, ...]]:
    model_flops = model.training_flops_per_token(seq_len, causal=causal)
    by_code = {code: model.training_flops_per_token(seq_len, causal=causal, recompute=name)
               for name, code in RC_CODES.items()}
    return model_flops, tuple(by_code[code] for code in range(len(by_code)))


# ------------------------------------------------------------------------ scalar interface
@dataclass(frozen=True)
class StepEstimate:
    """One layout's predicted training step: seconds per component and the derived rates.

    The components sum to `total`. `dp_comm_total` is the data-parallel traffic time before
    overlap; `t_forward`/`t_backward` are one micro-batch on a middle stage (comm included).
    """

    compute: float
    tp_comm: float
    cp_comm_exposed: float
    ep_comm: float
    pp_comm: float
    bubble: float
    dp_comm_exposed: float
    optimizer: float
    total: float
    tokens_per_step: float
    tokens_per_s: float
    model_flops_per_gpu: float
    mfu: float
    hfu: float
    mfu_causal: float
    microbatches: int
    n_gpus: int
    dp_comm_total: float = 0.0
    t_forward: float = 0.0
    t_backward: float = 0.0
    bubble_fraction: float = 0.0
    bubble_source: str = "closed form"
    flop_convention: str = FLOP_CONVENTION
    # how sure: the validation band and what no published run measured (`estimate.uncertainty`;
    # None on the "this machine" preset, which `shardwise check` validates instead)
    uncertainty: Uncertainty | None = None

    def breakdown(self) -> dict[str, float]:
        """Seconds per component (they sum to `total`)."""
        return {name: getattr(self, name) for name in BREAKDOWN}

    @property
    def band(self) -> tuple[float, float]:
        """(low, high) step time of the band (`uncertainty`; the step time itself without)."""
        width = (self.uncertainty.band or 0.0) if self.uncertainty else 0.0
        return self.total * (1 - width), self.total * (1 + width)

    def time_to_train(self, tokens: float) -> float:
        """Seconds to train on `tokens` tokens at this step's throughput."""
        return tokens / self.tokens_per_s

    def gpu_hours(self, tokens: float) -> float:
        return self.time_to_train(tokens) * self.n_gpus / 3600

    def cost(self, tokens: float, price_per_gpu_hour: float) -> float:
        return self.gpu_hours(tokens) * price_per_gpu_hour

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def finish(terms: dict[str, Any], model_flops_token: float, hw_flops_token: Any, tokens: Any,
           n_gpus: int, peak: float, causal_flops_token: float) -> dict[str, Any]:
    """Throughput, model FLOP/s per GPU, MFU and HFU (`FLOP_CONVENTION`: full attention) and
    MFU with causal attention from the step time."""
    total = terms["total"]
    per_gpu = model_flops_token * tokens / (total * n_gpus)
    mfu = per_gpu / peak
    return {"tokens_per_step": tokens, "tokens_per_s": tokens / total,
            "model_flops_per_gpu": per_gpu, "mfu": mfu,
            "hfu": mfu * (hw_flops_token / model_flops_token),
            "mfu_causal": mfu * (causal_flops_token / model_flops_token)}


def estimate_step(model: ModelSpec, cluster: Cluster, layout: Layout,
                  train: TrainSpec | None = None, calib: Calibration | None = None, *,
                  simulate: bool = False) -> StepEstimate:
    """Predicted step time of `layout` training `model` on `cluster` (see the module docstring).

    `simulate=True` takes the pipeline bubble from the schedule simulator
    (`shardwise.schedules`) run with this layout's per-micro-batch stage times instead of the
    closed form; with equal stages the two agree.
    """
    check_specs(model=model, layout=layout, cluster=cluster, train=train,
                optional=("train",))
    train = (train or TrainSpec()).validate()
    layout.validate(model, cluster, train)
    cal = calib or default_calibration(cluster.accelerator.calibration_name)
    ctx = ComputeContext.of(model, cluster.accelerator, train, cal)
    links = Links.of(cluster, cal)
    m = layout.microbatches(train)
    terms = {k: float(v) for k, v in step_terms(ctx, links, train, m=m,
                                                partition=layout.partition,
                                                **layout.codes()).items()}
    source = "closed form"
    if simulate and layout.pp > 1:
        simulated = simulated_bubble(layout, m, terms["t_forward"], terms["t_backward"],
                                     terms["t_wgrad"], model.n_layers)
        terms["total"] += simulated - terms["bubble"]
        terms["bubble"] = simulated
        source = "simulator"
    model_flops, hardware = flops_per_token(model, train.seq_len)
    tokens = m * layout.micro_batch * layout.dp * train.seq_len
    rates = finish(terms, model_flops, hardware[RC_CODES[layout.recompute]], tokens,
                   cluster.n_gpus, ctx.peak, flops_per_token(model, train.seq_len, True)[0])
    busy = terms["total"] - terms["bubble"]
    values: dict[str, Any] = {name: terms[name] for name in (*BREAKDOWN, "total",
                                                             "dp_comm_total", "t_forward",
                                                             "t_backward")}
    values.update({k: float(v) for k, v in rates.items()})
    sure = (None if cal.op_count == "runtime" else
            uncertainty(cluster.accelerator.name, train.impl, layout, train, cal))
    return StepEstimate(
        **values, microbatches=m, n_gpus=cluster.n_gpus,
        bubble_fraction=terms["bubble"] / (terms["bubble"] + busy) if busy > 0 else 0.0,
        bubble_source=source, uncertainty=sure,
    )


def simulated_bubble_floor(layout: Layout, m: Any, t_f: Any, t_b: Any, t_w: Any,
                           n_layers: int) -> Any:
    """A lower bound on `simulated_bubble` for arrays of `m`, `t_f`, `t_b`, `t_w` on
    `layout`'s stages, from the simulator's dependencies alone (0 for bidirectional
    schedules). With `a_s` stage s's layers and `h_s` those of the virtual stages before its
    first, each over the busiest stage's: s starts after micro-batch 0's forwards through
    them and works `m(t_f + t_b)a_s`; its last input-gradient backward ends all but its
    weight gradients and is followed by that micro-batch's through them, so
    `makespan ≥ m(t_f + t_b)a_s + max(t_f·h_s, (t_f + t_b - t_w)h_s - m·t_w·a_s)` (`t_w` = 0
    where the schedule does not split the backward). docs/concepts/planner.md#pruning."""
    from shardwise.schedules.actions import stage_of
    from shardwise.schedules.registry import get_schedule

    info = get_schedule(layout.schedule)
    work = m * (t_f + t_b)
    if info.bidirectional:
        return 0.0 * work
    t_w = t_w if info.splits_backward else 0.0 * t_w
    sizes = layout.stage_sizes(n_layers)
    busiest = max(layout.stage_layers(n_layers))
    p = layout.pp
    held: list[int] = [0] * p  # each stage's layers
    before: dict[int, int] = {}  # the layers before its first virtual stage
    for vs, n in enumerate(sizes):
        stage = stage_of(vs, p, layout.placement)
        held[stage] += n
        before.setdefault(stage, sum(sizes[:vs]))
    makespan = 0.0 * work
    for stage in range(p):
        a, h = held[stage] / busiest, before[stage] / busiest
        makespan = np.maximum(makespan, work * a + np.maximum(
            t_f * h, (t_f + t_b - t_w) * h - m * t_w * a))
    return np.maximum(makespan - work, 0.0)


def simulated_bubble(layout: Layout, m: int, t_f: float, t_b: float, t_w: float,
                     n_layers: int) -> float:
    """The bubble from the event simulator: makespan minus the busiest stage's busy time.

    `t_f`, `t_b`, `t_w` are the busiest stage's per-micro-batch times (all its chunks; `t_w`
    the weight-gradient part of `t_b`, split off where the schedule splits the backward); each
    virtual stage takes its share by layers (`Layout.stage_sizes`): `n/N` of them for a
    virtual stage of `n` layers and a busiest stage of `N` (equal stages: `1/v`), through
    `schedules.stage_timeline`. Imported lazily: the simulator is only needed here.
    """
    from shardwise.schedules import stage_timeline

    p, v = layout.pp, layout.chunks
    sizes = layout.stage_sizes(n_layers)
    busiest = max(layout.stage_layers(n_layers))  # over all its chunks
    timeline = stage_timeline(layout.schedule, p, m, v, t_f=max(t_f, 1e-12),
                              t_b=max(t_b, 1e-12), t_w=max(t_w, 1e-13),
                              shares=[max(n / busiest, 1e-9) for n in sizes])  # E/L-only: ~0
    return timeline.makespan - m * (t_f + t_b)
