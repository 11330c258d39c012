"""Step time, throughput, MFU and HFU of one training step (SPEC §7).

    step = compute + exposed TP + exposed CP + EP + PP p2p + bubble + exposed DP + optimizer

All per rank, on the pipeline's critical path, for `m` micro-batches:

* **compute** — `m · (t_f + t_b)` of the slowest stage (the last, which carries the LM head and
  the loss; with `pp = 1` the one stage also carries the embedding). With uneven stages
  (`Layout.stage_partition`) the slowest of the first (layers + embedding), the busiest and the
  last (layers + head); the busiest stage's layers set the per-layer communication and the
  bubble (the pace of the pipeline). `t_f`, `t_b` come from
  `estimate.compute` (GEMMs at a shape-dependent efficiency, attention, memory-bound kernels),
  `t_b` includes recomputation.
* **TP** (Shoeybi et al. 2019) — 2 all-reduces of the `(s/c, b, h)` activation per layer forward,
  2 backward, 2 more when full recompute replays the forward; sequence parallelism swaps each for
  a reduce-scatter + all-gather of the same bytes (Korthikanti et al. 2022), inside the node
  when `tp ≤ gpus_per_node`. On the critical path unless `TrainSpec.tp_comm_overlap` (Megatron
  `--tp-comm-overlap`, with SP): then each is pipelined with its adjacent GEMMs and only the
  part the calibrated window cannot hide, plus the contention share, is charged
  (`tp_overlapped`). SP as implemented also
  all-gathers the sequence-sharded QKV and gate/up input again in backward for the weight
  gradients (2 all-gathers of `(t-1)/t · s·b·h` per layer, `comm.tp_comm_ops_per_layer`);
  Megatron overlaps them with the input-gradient GEMMs, so they are not charged here.
* **CP** (`cp_time`) — ring attention (Liu et al. 2023): `c-1` K/V block transfers per layer
  forward, twice the bytes backward; each hides behind one block of attention compute, only
  `max(0, transfer - block)` is exposed. Ulysses (Jacobs et al. 2023): four all-to-alls per
  layer forward (Q, K, V, output), four backward, exposed; the hybrid both (all-to-all
  inside groups of `Layout.ulysses`, ring across).
* **EP** — dispatch + combine all-to-alls per MoE layer forward, two backward (exposed).
* **PP** — one activation (forward) and one gradient (backward) p2p per micro-batch and virtual
  stage, `s/c·b·h/t` bytes (Megatron's scatter/gather): `2·(v·m + p - 1)` transfers exposed;
  with `TrainSpec.overlap_p2p` and the interleaved schedule only the warm-up/cool-down
  `2·(p-1)` (`p2p_exposed`); on the "this machine" preset also the runtime's per-step
  agreement all-gather (`small_calls`).
* **bubble** — `(p-1)·(T_F + T_B)` for GPipe and 1F1B, `/v` interleaved (Narayanan et al.
  2021), for ZB-H1 (Qi et al. 2023) `max((p-1)(T_F + B - T_W), (p-1)(T_F + B) - (m-1)·T_W)`
  with `B = T_B - T_W` the input-gradient part of the backward — with the middle stage's
  per-micro-batch times `T_*` (comm included). With equal stages these equal the schedule
  simulator's makespans exactly (tested); `estimate_step(..., simulate=True)` runs it. With
  uneven stages the `(p-1)` busiest-stage times become the other stages' (`L - n_most`
  layers' worth): exact for GPipe, an upper bound for the 1F1B family (tested against the
  simulator); `estimate_step(..., simulate=True)` runs each virtual stage at its own times
  (`simulated_bubble`), as the planner does for its top layouts when the schedule is small.
* **overlap contention** — overlapped TP, CP, PP and DP/ZeRO traffic is not free: a
  calibrated fraction `overlap_contention` of its time is charged (NCCL kernels take SMs and
  HBM bandwidth from the GEMMs they overlap), per second of node-local traffic; traffic that
  crosses nodes moves the same bytes over a longer time and is charged its `busy_fraction`
  (its time at the node's link speed over its real time).
* **DP / ZeRO** (Rajbhandari et al. 2020) over the `dp·cp` replicas, in gradient buckets
  (`dp_bucket_bytes`, one latency term per bucket), gradients in `TrainSpec.grad_dtype` (fp32
  or bf16 reduction: the bytes on the wire), overlapped as below when
  `TrainSpec.overlap_grad_reduce` (Megatron `--overlap-grad-reduce/--overlap-param-gather`),
  else all exposed:
  stage 0 all-reduce, overlapped with the last micro-batch's backward, only `max(C/buckets,
  C - t_b)` exposed ("only the last bucket"; with interleaved PP the window is the cool-down,
  `t_b·(1 + (v-1)·p)/v`: `interleaved_window`); stages 1-2 reduce-scatter (stage 2 after *every*
  micro-batch: its gradients are sharded, no full accumulation buffer) and one all-gather of
  the updated weights overlapped with the next step's first forward; stage 3 gathers each
  layer's weights in forward and again in backward, prefetched one layer ahead, and
  reduce-scatters each layer's gradients: per micro-batch `L_s·max(0, gather - t_layer)` plus
  the first gather / last reduce-scatter are exposed. Hybrid shard (`zero_group`) runs these
  inside the group and all-reduces the shard across groups once per step. Collectives spanning
  nodes are hierarchical (inside the node on NVLink, across on the inter-node link).
* **optimizer** — memory-bound step over the parameters this rank updates; on the "this
  machine" preset also the host cost of the runtime's ops per parameter tensor
  (`compute.optimizer_host_ops`). With host offload (`TrainSpec.offload`) the offloaded
  share steps on the CPU instead, with its gradient and weight copies over the host link
  (`offload.offload_step`); parameter offload's per-layer copies join the ZeRO-3 gathers and
  reduce-scatters.
* **FP8** (`TrainSpec.fp8`) — the layers' GEMMs and casts are in `compute`; `compute` also
  holds the recipe's weight casts once per step (per micro-batch under ZeRO-3), and the TP
  term current scaling's amax all-reduces under sequence parallelism.

Ranks are placed tp fastest, then cp, dp (ep inside dp·cp), pp (Megatron-LM's order; one rule
for estimate and runtime in `shardwise.placement`), so the tp group is inside a node, the dp×cp
group and an ep group have `min(n, gpus_per_node/t)` members per node.
Link bandwidths are the datasheet figures times the calibrated achievable fraction.

MFU = model FLOPs / (step · peak · GPUs), model FLOPs = 3 × forward with attention counted as
the full `s²` square — the papers' convention (`FLOP_CONVENTION`): Megatron-LM's
`num_floating_point_operations`, Korthikanti et al. 2022, PaLM's `6N + 12·L·h·s` per token.
`mfu_causal` counts the causal half of the square instead (the work a causal kernel needs; lower
by 4 % at 8k tokens on a 405B model, more on small models and long sequences). HFU adds what
recomputation runs again: full recompute every layer's forward once more, selective the
attention scores and P·V (SPEC §1). The compute *time* is not affected by this choice:
`estimate.compute` times the kernels that run (FlashAttention skips the masked half).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.errors import ShardwiseError
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
from shardwise.estimate.memory import bytes_per_param_training, placement_of, stage_param_counts
from shardwise.estimate.offload import host_link, offload_step
from shardwise.estimate.uncertainty import Uncertainty, uncertainty
from shardwise.hardware import Cluster
from shardwise.layout import (
    CP_KINDS,
    Layout,
    Partition,
    TrainSpec,
    check_specs,
    stage_extremes,
    ulysses_degree,
)
from shardwise.placement import expert_tp_degree, members_per_node
from shardwise.schedules.actions import Placement
from shardwise.schedules.registry import SCHEDULE_CODES, select

__all__ = [
    "FLOP_CONVENTION",
    "SCHEDULE_CODES",
    "StepEstimate",
    "busy_fraction",
    "compute_costs",
    "cp_time",
    "estimate_step",
    "group_collective_time",
    "interleaved_window",
    "p2p_exposed",
    "pipeline_bubble",
    "step_terms",
    "tp_overlapped",
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


# ------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Links:
    """Achievable link figures of a cluster (calibrated) and the node size."""

    intra_bw: float
    intra_lat: float
    inter_bw: float
    inter_lat: float
    gpus_per_node: int
    # measured fixed cost of one call per "op/ranks" (`Calibration.collective_call`)
    call: tuple[tuple[str, float], ...] = ()
    # the accelerator's host link (`Accelerator.host`, calibrated): offload's copies
    host_bw: float = 0.0
    host_lat: float = 0.0
    host: str = ""

    @classmethod
    def of(cls, cluster: Cluster, cal: Calibration) -> Links:
        intra, inter = cal.link(cluster.intra), cal.link(cluster.inter)
        host = cal.link(host_link(cluster.accelerator))
        return cls(intra.bandwidth, intra.latency, inter.bandwidth, inter.latency,
                   cluster.gpus_per_node, tuple(sorted(cal.collective_call.items())),
                   host.bandwidth, host.latency, host.name)


def _ring(rounds_per_rank: Any, size: Any, n: Any, bw: float, lat: float) -> Any:
    """Ring collective: `rounds·(α + S/(N·β))` — `rounds·α + bytes_on_wire/β` (SPEC §5)."""
    rounds = rounds_per_rank * (n - 1)
    return rounds * (lat + size / (n * bw))


def measured_call(links: Links, key: str) -> float | None:
    """The calibration's fixed cost of one call, keyed "op/ranks" ("p2p/2": one message one
    way), or None where it measured none (every built-in GPU preset)."""
    return dict(links.call).get(key)


def group_collective_time(op: str, size: Any, n: Any, in_node: Any, links: Links) -> Any:
    """Alpha-beta time of a collective over `n` ranks, `in_node` of them per node (SPEC §5).

    All-reduce: reduce-scatter inside the node, ring all-reduce of `S/g` across the `n/g`
    nodes, all-gather inside (hierarchical); with one node it is the plain ring on the intra
    link, with one rank per node the plain ring on the inter link. Reduce-scatter / all-gather:
    inside then across on `S/g`. All-to-all: the `(g-1)/n` share of `S` goes over the intra
    link, the `(n-g)/n` share over the inter link, `n-1` latencies.

    Where the calibration measured a fixed cost per call for `op` on `n` ranks
    (`links.call`, the "this machine" preset), that cost replaces the rounds' latencies:
    `t = α_call + bytes/β` (on gloo a call costs about the same with one ring round or two).
    """
    if links.call:
        table = dict(links.call)
        alpha = np.vectorize(lambda k: table.get(f"{op}/{int(k)}", np.nan), otypes=[float])(n)
        if not np.all(np.isnan(alpha)):
            plain = replace(links, call=())
            free = replace(plain, intra_lat=0.0, inter_lat=0.0)
            timed = np.where(np.isnan(alpha), group_collective_time(op, size, n, in_node, plain),
                             alpha + group_collective_time(op, size, n, in_node, free))
            return timed if np.ndim(timed) else float(timed)
    g = in_node
    k = n / g
    if op == "all-reduce":
        return (2 * _ring(1, size, g, links.intra_bw, links.intra_lat)
                + _ring(2, size / g, k, links.inter_bw, links.inter_lat))
    if op in ("reduce-scatter", "all-gather"):
        return (_ring(1, size, g, links.intra_bw, links.intra_lat)
                + _ring(1, size / g, k, links.inter_bw, links.inter_lat))
    if op == "all-to-all":
        lat = np.where(k > 1, links.inter_lat, links.intra_lat)
        return ((n - 1) * lat + size * (g - 1) / n / links.intra_bw
                + size * (n - g) / n / links.inter_bw)
    raise ShardwiseError(f"unknown collective {op!r}")


def _bucketed(op: str, size: Any, n: Any, g: Any, links: Links, bucket: float) -> Any:
    """`ceil(S/bucket)` collectives of one bucket each: bandwidth of `S`, one latency each."""
    buckets = np.maximum(np.ceil(size / bucket), 1)
    return buckets * group_collective_time(op, size / buckets, n, g, links), buckets


def pipeline_bubble(sched: Any, p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """Idle time of the critical stage per step: each schedule's closed form (its registry
    entry's `bubble`, SPEC §6) for the schedule codes `sched`.

    GPipe, 1F1B: `(p-1)·(t_f+t_b)`; interleaved: `(p-1)·(t_f+t_b)/v` (Narayanan et al. 2021);
    ZB-H1 (Qi et al. 2023), with `t_b` the whole backward and `t_w` its weight-gradient part
    (so the input-gradient pass is `B = t_b - t_w`): `(p-1)·max(t_f + B - t_w, B, t_f)` once
    `m ≥ p` (the paper's `(p-1)(T_F+T_B-T_W)` when W is the shortest), more with fewer
    micro-batches; ZBV and DualPipeV: their critical paths (registry). All equal the event
    simulator's makespan minus the busy time when stages are equal, for any times (tested).
    """
    return select(sched, lambda info: info.bubble(p, v, m, t_f, t_b, t_w))


# ------------------------------------------------------------------------- the step model
def busiest_stage_params(model: ModelSpec, t: Any, p: Any, e: Any, v: Any,
                         partition: Partition = (), etp: Any = 0, placement: Placement = "loop"
                         ) -> tuple[Any, Any]:
    """(dense, expert) parameters per rank of the pipeline stage holding the most, counted
    per stage by the memory model (`memory.stage_param_counts`): every stage of an explicit
    partition; of a `Balanced` one (the default) the first (embedding), the second (the
    busiest when the balanced split gives it an extra layer) and the last (head) — the others
    hold no more layers than the second and neither end."""
    explicit = isinstance(partition, tuple) and partition
    stages = np.arange(p) if explicit else np.stack([0 * p, np.minimum(1, p - 1), p - 1])
    dense, expert = stage_param_counts(model, tp=t, pp=p, ep=e, chunks=v, stage=stages,
                                       partition=partition, etp=etp, placement=placement)
    dense, expert = np.broadcast_arrays(dense, expert)
    pick = np.expand_dims(np.argmax(dense + expert, axis=0), 0)
    return (np.take_along_axis(dense, pick, 0)[0], np.take_along_axis(expert, pick, 0)[0])


def step_terms(ctx: ComputeContext, links: Links, train: TrainSpec, *, tp: Any, pp: Any,
               cp: Any, ep: Any, dp: Any, zero: Any, zero_group: Any, sp: Any, schedule: Any,
               chunks: Any, recompute: Any, micro_batch: Any, m: Any,
               costs: dict[str, Any] | None = None, partition: Partition = (), etp: Any = 0,
               cp_kind: Any = 0, ulysses: Any = 0) -> dict[str, Any]:
    """Every term of the step-time model for layouts given as numbers or arrays, keyed by the
    `Layout` field names (codes for `recompute` and `schedule`: `layout_codes`; `zero_group`
    = 0 for ZeRO over all dp·cp ranks) and `m` micro-batches. Returns seconds (and
    diagnostics) with the broadcast shape of the inputs. `estimate_step` and the planner both
    call this.

    `costs` may carry the compute costs already evaluated for these layouts (`compute_costs`;
    the planner evaluates them once per distinct `(tp, cp, micro_batch, sp, recompute, ep)`
    and gathers). `partition`: one layout's explicit stage partition, or a `Balanced` one for
    arrays of layouts (the planner's searched partitions); () the default
    (`Layout.stage_partition`)."""
    # the papers' notation from here on
    t, p, c, e, zg, sched, v, rc, b = (tp, pp, cp, ep, zero_group, schedule, chunks, recompute,
                                       micro_batch)
    model, cal, s, ab = ctx.model, ctx.calibration, ctx.seq_len, ctx.act_bytes
    settings = train.settings()
    h, gpn = model.d_model, links.gpus_per_node
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    wb, gb_ = state.weight, state.grad
    full = rc == RC_CODES["full"]
    offload = settings.stack.offload_support(train.offload)

    def host_copy(n_bytes: Any) -> Any:
        """One host↔device copy of `n_bytes` (numbers or arrays) on the host link."""
        return np.where(n_bytes > 0, links.host_lat + n_bytes / max(links.host_bw, 1e-30), 0.0)

    def on_node(axis: str) -> Any:
        """Members of one `axis` group on a node (`placement`, the runtime's rank order)."""
        return members_per_node(axis, gpn, pp=p, dp=dp, cp=c, tp=t, ep=e, etp=etp)

    # ---- compute per micro-batch: one dense layer, one MoE layer, head, embedding
    costs = costs if costs is not None else compute_costs(ctx, t, c, b, sp, rc, e, etp)
    dense = costs["dense"]
    placement = placement_of(sched, partition)
    # uneven stages: the layers of the busiest, the first and the last stage relative to L/p
    # (exactly 1 for even stages); MoE layers at their average share
    most, first, last = (n * p / model.n_layers
                         for n in stage_extremes(model.n_layers, p, v, partition, placement))
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
    # the slowest stage: the last unless an uneven partition makes the first or the busiest one
    pick_first = ~single & (f_first + b_first > f_last + b_last)
    f_crit, b_crit = np.where(pick_first, f_first, f_last), np.where(pick_first, b_first, b_last)
    pick_mid = f_mid + b_mid > f_crit + b_crit
    f_crit, b_crit = np.where(pick_mid, f_mid, f_crit), np.where(pick_mid, b_mid, b_crit)

    # ---- tensor parallel: all-reduces of the (s/c, b, h) activation, on the critical path
    activation = s / c * b * h * ab
    # SP: a reduce-scatter + all-gather pair per all-reduce — the same ring rounds and bytes
    # (SPEC §5), but two calls where a fixed cost per call was measured
    tp_ar = np.where(sp == 1,
                     group_collective_time("reduce-scatter", activation, t, on_node("tp"), links)
                     + group_collective_time("all-gather", activation, t, on_node("tp"), links),
                     group_collective_time("all-reduce", activation, t, on_node("tp"), links))
    layers = most * model.n_layers / p
    kappa = cal.overlap_contention
    # --tp-comm-overlap (needs SP): each layer's AG/RS pipelined with its adjacent GEMMs
    tp_overlap = (settings.tp_overlap != "none") & (sp == 1) & (t > 1)
    gemm_f = dense.wgrad  # one dense layer's forward GEMMs (the backward runs 2x)
    tp_f1 = tp_overlapped(2 * tp_ar, gemm_f, t, tp_overlap, cal.tp_overlap_efficiency, kappa)
    tp_b1 = tp_overlapped((2 + 2 * full) * tp_ar, (2 + full) * gemm_f, t, tp_overlap,
                          cal.tp_overlap_efficiency, kappa)
    # SP keeps only the sequence shard of the QKV and gate/up inputs: backward all-gathers
    # them again for the weight gradients (2 per layer), beside the input-gradient GEMMs in
    # Megatron (not charged), between them in shardwise's runtime (`impl` "shardwise")
    regather = (np.where((sp == 1) & (t > 1), 2 * group_collective_time(
        "all-gather", activation, t, on_node("tp"), links), 0.0)
        if train.impl == "shardwise" else 0.0)
    # FP8 current scaling under SP: each column-parallel input (QKV, fc1) and row-parallel
    # output gradient (out-proj, fc2) all-reduces its amax over the tp group before the cast
    # (TE module/linear.py `set_quantizer_amax_reduction_group`): 2 scalars each way
    amax = 0.0 * t
    if ctx.fp8 is not None and ctx.fp8.amax_reduction_tp:
        amax = np.where((sp == 1) & (t > 1), 2 * group_collective_time(
            "all-reduce", 4.0, t, on_node("tp"), links), 0.0)
    tp_f = layers * (tp_f1 + amax)
    tp_b = layers * (tp_b1 + regather + amax)
    # head: the input-gradient all-reduce backward; embedding (pp = 1): its output all-reduce;
    # the vocabulary-parallel cross-entropy: 3 all-reduces of one fp32 per token (the logits'
    # max, the target logit, the sum of exponentials; Megatron's `_VocabParallelCrossEntropy`)
    ce = 3 * group_collective_time("all-reduce", s / c * b * 4, t, on_node("tp"), links)
    tp_crit = tp_f + tp_b + tp_ar * np.where(single, 2, 1) + np.where(t > 1, ce, 0.0)

    # ---- context parallel: ring hops behind the block compute, Ulysses' all-to-alls exposed
    cp_f, cp_b = cp_time(ctx, links, train, t=t, c=c, u=ulysses_degree(c, cp_kind, ulysses),
                         gather=cp_kind == CP_KINDS.index("allgather"),
                         b=b, rc=rc, layers=layers, attn_f=attn_f, attn_b=attn_b, dp=dp, p=p,
                         e=e)

    # ---- expert parallel: dispatch + combine all-to-alls per MoE layer
    if model.n_moe_layers:
        routed = s / c * b * model.top_k * h * ab
        ep_in_node = on_node("ep")
        a2a = group_collective_time("all-to-all", routed, e, ep_in_node, links)
        # before the dispatch the ranks swap their token counts per expert (an all-to-all
        # of one int64 per expert: Megatron-Core's alltoall dispatcher, the runtime's too)
        counts = group_collective_time("all-to-all", 8 * model.n_experts, e, ep_in_node, links)
        ep_f = n_moe * (2 * a2a + np.where(e > 1, counts, 0.0))
        ep_b = n_moe * (2 + 2 * full) * a2a
    else:
        ep_f = ep_b = 0.0 * t

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
    dense_params, expert_params = busiest_stage_params(model, t, p, e, v, partition, etp,
                                                       placement)
    replicas = dp * c
    in_node = on_node("dp_cp")
    group = np.where(zg > 0, zg, replicas)
    group_in = np.minimum(group, in_node)
    across = replicas / group  # hybrid shard: replicas of each shard
    across_in = np.maximum(in_node // group, 1)
    # The overlap window: the last micro-batch's backward (the next step's first forward for
    # the parameter all-gather). Interleaved (v chunks), each chunk's gradients are final
    # `p` chunk-backwards apart in the cool-down (chunk v-1 first), so the reduction of all
    # but the last chunk hides behind the cool-down: `(1 + (v-1)·p)/v` micro-batch backwards
    # (Megatron-Core buckets per chunk; `interleaved_window`). v = 1: one backward.
    widen = interleaved_window(p, v)
    window_b = widen * (b_crit + tp_b)
    window_f = widen * (f_crit + tp_f)
    bucket = cal.dp_bucket_bytes
    # what the same traffic would cost at the node's link speed: the contention it causes
    # (`busy_fraction`) follows the bytes it moves through the GPU, not the wall time
    nvlink = Links(links.intra_bw, links.intra_lat, links.intra_bw, links.intra_lat, gpn)
    dp_total, dp_exposed, dp_busy = 0.0 * t, 0.0 * t, 0.0 * t
    # the experts' replicas: the expert-data-parallel group tp·dp·cp/(etp·ep) = dp·cp/shift
    shift = e * expert_tp_degree(etp, t) / t
    groups = [(dense_params, 1)] + ([(expert_params, shift)] if model.n_moe_layers else [])
    for params, n_shift in groups:
        n = replicas / n_shift
        g_all = np.maximum(in_node // n_shift, 1)
        grp = np.maximum(group / n_shift, 1)
        grp_in = np.maximum(group_in // n_shift, 1)
        grads, weights = params * gb_, params * wb
        # stage 0: bucketed all-reduce
        ar, buckets = _bucketed("all-reduce", grads, n, g_all, links, bucket)
        z0 = np.maximum(ar / buckets, ar - window_b)
        # stages 1-2: reduce-scatter inside the shard group (+ all-reduce of the shard across
        # groups when hybrid), all-gather of the updated weights
        rs, buckets = _bucketed("reduce-scatter", grads, grp, grp_in, links, bucket)
        xr, _ = _bucketed("all-reduce", grads / grp, across, across_in, links, bucket)
        ag, ag_buckets = _bucketed("all-gather", weights, grp, grp_in, links, bucket)
        rs_exposed = np.maximum(rs / buckets, rs - window_b)
        xr_exposed = np.maximum(xr / buckets, xr - np.maximum(window_b - rs, 0.0))
        ag_exposed = np.maximum(ag / ag_buckets, ag - window_f)
        reductions = np.where(zero == 2, m, 1)
        z12 = reductions * rs_exposed + np.where(across > 1, xr_exposed, 0.0) + ag_exposed
        # stage 3: per-layer gathers (forward, backward) and reduce-scatters, prefetched;
        # parameter offload copies each layer's shard to the GPU before its gather and its
        # gradient shard back after the reduce-scatter, on the same streams
        units = np.maximum(layers, 1.0)
        ag_u = group_collective_time("all-gather", weights / units, grp, grp_in, links)
        rs_u = group_collective_time("reduce-scatter", grads / units, grp, grp_in, links)
        if offload is not None and offload.kind == "params":
            ag_u = ag_u + host_copy(weights / units / grp)
            rs_u = rs_u + host_copy(grads / units / grp)
        fwd_u, bwd_u = big_f / units, big_b / units
        z3_mb = (units * np.maximum(0.0, ag_u - fwd_u) + ag_u
                 + units * np.maximum(0.0, ag_u + rs_u - bwd_u) + rs_u)
        z3 = m * z3_mb + np.where(across > 1, xr_exposed, 0.0)
        exposed = np.where(zero == 0, z0, np.where(zero == 3, z3, z12))
        total = np.where(zero == 0, ar,
                         np.where(zero == 3, m * units * (2 * ag_u + rs_u),
                                  reductions * rs + ag) + np.where(across > 1, xr, 0.0))
        # the busy share of the overlapped part: the shard group's (or, stage 0, the
        # replicas') reduce-scatter at node speed over its time on the real links
        sizes = np.where(zero == 0, n, grp), np.where(zero == 0, g_all, grp_in)
        busy = busy_fraction(grads, *sizes, links, nvlink)
        dp_exposed = dp_exposed + np.where(n > 1, exposed, 0.0)
        dp_total = dp_total + np.where(n > 1, total, 0.0)
        dp_busy = dp_busy + np.where(n > 1, busy * np.maximum(total - exposed, 0.0), 0.0)
    # Overlapped traffic still slows the GEMMs it runs beside (SM and HBM contention); without
    # --overlap-grad-reduce / --overlap-param-gather every byte is on the critical path.
    dp_exposed = np.where(settings.dp_overlapped(zero), dp_exposed + kappa * dp_busy, dp_total)

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
    ep_comm = m * (ep_f + ep_b)
    total = compute + tp_comm + cp_comm + ep_comm + pp_comm + bubble + dp_exposed + optimizer
    return {
        "compute": compute, "tp_comm": tp_comm, "cp_comm_exposed": cp_comm,
        "ep_comm": ep_comm, "pp_comm": pp_comm, "bubble": bubble,
        "dp_comm_exposed": dp_exposed, "optimizer": optimizer, "total": total,
        "dp_comm_total": dp_total, "t_forward": big_f, "t_backward": big_b, "t_wgrad": w_mid,
    }


def cp_time(ctx: ComputeContext, links: Links, train: TrainSpec, *, t: Any, c: Any, u: Any,
            b: Any, rc: Any, layers: Any, attn_f: Any, attn_b: Any, dp: Any, p: Any, e: Any,
            gather: Any = False) -> tuple[Any, Any]:
    """Exposed context-parallel time of one micro-batch's forward and backward over `layers`
    layers whose attention takes `attn_f` / `attn_b`, for ring attention, Ulysses or their
    hybrid: `u` = `Layout.ulysses_degree` (1 ring, c Ulysses), the ring over `r = c/u` ranks.

    Ring (Liu et al. 2023): each rank's K/V block `2·(s/c)·b·kv·bytes` (kv = a_kv·d/t; after
    the hybrid's all-to-all a rank holds u× the tokens of 1/u of the heads: the same bytes)
    hops `r-1` times per layer forward, twice as much backward (K/V again, dK/dV back), once
    more when recompute replays the forward. Each hop hides behind one block of attention,
    `1/r` of the layer's (Transformer Engine posts the next hop before it computes the held
    block): `max(0, hop - block)` exposed, plus the contention share of the hidden part.

    All-to-all over the `u` ranks of a `cp_a2a` group (Jacobs et al. 2023;
    `comm.ulysses_comm_bytes_per_layer`): Q, K, V and the output per layer forward, their
    conjugates backward, the forward's again with recompute — each on the critical path
    (DeepSpeed's `DistributedAttention` without an `sp_stream`, and Transformer Engine's
    `AttnFuncWithCPAndQKVOA2A`, wait for them before and after the attention kernel).

    All-gather (`gather`; torchtitan's FlexAttention CP, torch's `cplib::flex_cp_allgather`;
    Megatron's `--cp-comm-type all_gather`, TE's `AttnFuncWithCPAndKVAllGather`): each layer
    all-gathers K and V over the `c` ranks before the attention and waits for them (exposed);
    backward reduce-scatters their gradients (exposed) and gathers them again unless the
    stack keeps the gathered ones (`Stack.cp_gather_kept`), and once more when recompute
    replays the attention (the SAC policy saves no all-gather; TE's core attention holds it).
    """
    if not (np.any(c > 1) or np.any(u > 1)):  # no layout splits the sequence
        return 0.0 * attn_f, 0.0 * attn_b
    model, s, ab, kappa = ctx.model, ctx.seq_len, ctx.act_bytes, ctx.calibration.overlap_contention
    r = c // u
    where = {"gpus_per_node": links.gpus_per_node, "pp": p, "dp": dp, "cp": c, "tp": t, "ep": e,
             "ulysses": u}
    kv_heads = np.maximum(model.n_kv_heads // t, 1)
    kv = kv_heads * model.head_dim
    kv_block = s / c * b * kv_heads * (model.head_dim + model.value_head_dim) * ab  # K at d,
    # V at d_v (MLA: d_v < d)
    ring_intra = members_per_node("cp_ring", **where) == r
    hop = (p2p_latency(links, np.where(ring_intra, links.intra_lat, links.inter_lat))
           + kv_block / np.where(ring_intra, links.intra_bw, links.inter_bw))
    # contention per second of a transfer relative to node-local traffic (`busy_fraction`)
    busy = (p2p_latency(links, links.intra_lat) + kv_block / links.intra_bw) / hop
    overlap = train.settings().stack.cp_overlap
    if not overlap:  # each hop a blocking send, then a blocking receive
        hop, busy = 2 * hop, 1.0
    per_layer_f = attn_f / np.maximum(layers, 1e-30)  # attention time of one layer
    per_layer_b = attn_b / np.maximum(layers, 1e-30)

    def hidden(transfer: Any, block: Any) -> Any:
        """Exposed part of a transfer overlapped with `block` compute (+ contention)."""
        if not overlap:
            return transfer
        exposed = np.maximum(0.0, transfer - block)
        return exposed + kappa * busy * (transfer - exposed)

    # selective and full recompute replay the attention (op-sac keeps its output)
    replays = (rc == 1) | (rc == 2)
    hop_f = hidden(hop, per_layer_f / r)  # one forward hop; a replay repeats it
    ring_f = layers * (r - 1) * hop_f
    ring_b = layers * (r - 1) * (hidden(2 * hop, per_layer_b / r)
                                 + np.where(replays, hop_f, 0.0))
    # the all-to-alls of this rank's (s/c)·b tokens: Q and the output q wide, K and V kv wide
    a2a_in = members_per_node("cp_a2a", **where)
    token_bytes = s / c * b * ab
    a2a = np.where(u > 1, 2 * (group_collective_time("all-to-all", token_bytes * model.q_dim / t,
                                                     u, a2a_in, links)
                               + group_collective_time("all-to-all", token_bytes * kv, u,
                                                       a2a_in, links)), 0.0)
    fwd, bwd = ring_f + layers * a2a, ring_b + layers * a2a * np.where(replays, 2, 1)
    if not np.any(gather):
        return fwd, bwd
    # K and V of the whole sequence, s·b·kv_heads·(d_k + d_v)·bytes, gathered over cp
    cp_in = members_per_node("cp", **where)
    whole = s * b * kv_heads * ab
    ag = sum(group_collective_time("all-gather", whole * d, c, cp_in, links)
             for d in (model.head_dim, model.value_head_dim))
    rs = sum(group_collective_time("reduce-scatter", whole * d, c, cp_in, links)
             for d in (model.head_dim, model.value_head_dim))
    gathers = np.where(rc != RC_CODES["none"], 1, 0) + int(not train.settings().stack.cp_gather_kept)
    return (np.where(gather, layers * ag, fwd),
            np.where(gather, layers * (rs + gathers * ag), bwd))


def busy_fraction(size: Any, n: Any, in_node: Any, links: Links, nvlink: Links) -> Any:
    """How much of an overlapped collective's wall time slows the compute beside it, relative
    to the same collective inside one node: its reduce-scatter time with every hop at the
    node's link speed over its time on the real links (1 inside a node; about
    `B_inter/B_intra` for traffic that crosses nodes).

    An overlapped collective costs the GEMMs beside it the SMs and HBM bandwidth its kernels
    use to move and reduce its bytes; over InfiniBand the same bytes trickle in over a longer
    time (NCCL's network path also runs fewer channels, so fewer SMs), so its contention per
    second is lower. `overlap_contention` is calibrated per second of node-local traffic."""
    real = group_collective_time("reduce-scatter", size, n, in_node, links)
    local = group_collective_time("reduce-scatter", size, n, in_node, nvlink)
    return np.where(real > 0, local / np.maximum(real, 1e-30), 1.0)


def interleaved_window(p: Any, v: Any) -> Any:
    """Micro-batch passes (backward, or forward for the parameter all-gather) that overlapped
    DP/ZeRO traffic can hide behind at the end (start) of a step.

    Megatron-Core's interleaved 1F1B (Narayanan et al. 2021 §2.2; `schedules.py`, one grad
    buffer and bucket set per model chunk) runs the last `p` micro-batches' backward chunk by
    chunk, `v-1` down to 0, `t_b/v` each: chunk `k`'s gradients are final `k·p` chunk-backwards
    before the end, and their reduce-scatter (`--overlap-grad-reduce`) runs beside the rest.
    With `C` the whole reduction and `W = t_b·(1 + (v-1)·p)/v` the exposed part is
    `max(C - W, one bucket)`; the parameter all-gather (`--overlap-param-gather`) mirrors it
    in the next step's warm-up forwards. v = 1 gives the last micro-batch's backward."""
    return (1 + (v - 1) * p) / v


def tp_overlapped(comm: Any, gemm: Any, t: Any, on: Any, eta: float, kappa: float) -> Any:
    """Exposed time of one layer pass's TP collectives `comm` next to GEMMs taking `gemm`.

    Without overlap all of `comm` is exposed (Shoeybi et al. 2019). With Megatron's
    `--tp-comm-overlap` (Transformer Engine userbuffers; Wang et al. 2022, "Overlap
    communication with dependent computation via decomposition", ASPLOS'23) each all-gather /
    reduce-scatter is split into `t` chunks pipelined with the GEMM that consumes / produces
    them (ring exchange; bulk overlap for the weight-gradient GEMMs): the first chunk's
    transfer cannot hide, so at most `(t-1)/t` of the GEMM time is a window, and the
    communication kernels slow the GEMM they share the SMs with. With
    `W = η·gemm·(t-1)/t` (η = `tp_overlap_efficiency`, calibrated):

        exposed = max(0, comm - W) + κ·min(comm, W)     (κ = `overlap_contention`)
    """
    if not np.any(on):
        return comm
    window = eta * gemm * (t - 1) / np.maximum(t, 1)
    hidden = np.minimum(comm, window)
    return np.where(on, comm - hidden + kappa * hidden, comm)


def p2p_latency(links: Links, latency: Any) -> Any:
    """The fixed cost of one point-to-point message: the calibration's measured one-way cost
    ("p2p/2", half a ping-pong) where it has one, else the link's α."""
    call = measured_call(links, "p2p/2")
    return latency if call is None else call + 0.0 * latency


def small_calls(links: Links, op: str, ranks: Any, count: int) -> Any:
    """`count` calls of `op` on a few bytes over `ranks` ranks, charged where the calibration
    measured a call's cost on that many ranks (the "this machine" preset; on a GPU cluster
    such a call is tens of µs, left out). The runtime makes them every step: two all-reduces
    of a scalar over all ranks (the loss for the log, the global gradient norm for clipping)
    and, with a pipeline, one all-gather of a checksum over its stages (they agree on the
    schedule before the first message, `runtime.pipeline._check_agreement`)."""
    calls = {int(k.split("/")[1]): v for k, v in links.call if k.startswith(f"{op}/")}
    if not calls:
        return 0.0 * ranks
    return np.vectorize(lambda n: count * calls.get(int(n), 0.0) if n > 1 else 0.0,
                        otypes=[float])(ranks)


def p2p_exposed(p2p: Any, p: Any, v: Any, m: Any, on: Any, kappa: float) -> Any:
    """Exposed pipeline send/receive time per step on the critical stage.

    Each micro-batch and virtual stage sends one activation forward and one gradient back:
    `2·(v·m + p - 1)` transfers of `p2p` seconds on the critical path without overlap.
    Megatron's `--overlap-p2p-communication` posts them asynchronously beside the next
    micro-batch's compute (Narayanan et al. 2021 §4.2 scatter/gather, Megatron-Core's
    interleaved schedule), so only the warm-up and cool-down transfers, `2·(p - 1)`, stay
    exposed and the steady state's `2·v·m` cost the contention fraction κ (here already
    scaled by the transfer's `busy_fraction`: lower across nodes). Megatron overlaps them
    only in the interleaved schedule (`on` is `overlap_p2p` and `chunks > 1`).
    """
    return np.where(on, 2 * (p - 1) * p2p + kappa * 2 * v * m * p2p,
                    2 * (v * m + p - 1) * p2p)


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
                    ) -> tuple[float, dict[int, float]]:
    """(model FLOPs per token, hardware FLOPs per token by recompute code): full attention
    (`FLOP_CONVENTION`), or its causal half."""
    model_flops = model.training_flops_per_token(seq_len, causal=causal)
    hardware = {code: model.training_flops_per_token(seq_len, causal=causal, recompute=name)
                for name, code in RC_CODES.items()}
    return model_flops, hardware


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
                              shares=[n / busiest for n in sizes])
    return timeline.makespan - m * (t_f + t_b)
