"""The step's per-axis communication terms, per rank and micro-batch (or step): tensor
parallel (`tp_time`), context parallel (`cp_time`), pipeline p2p and bubble (`p2p_exposed`,
`pipeline_bubble`), data parallel / ZeRO (`dp_time`), each exposed or overlapped with its
contention share. Expert parallelism has its own module (`estimate.expert`).

Array-polymorphic like `step.step_terms`, which assembles them. The derivation of every term
and its sources: docs/concepts/step-time.md ("The terms of the step").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardwise.estimate.compute import RC_CODES, ComputeContext
from shardwise.estimate.links import (
    Links,
    _bucketed,
    busy_fraction,
    group_collective_time,
    p2p_latency,
)
from shardwise.layout import TrainSpec
from shardwise.placement import members_per_node
from shardwise.schedules.registry import select

__all__ = ["cp_time", "dp_time", "dp_traffic", "interleaved_window", "p2p_exposed",
           "pipeline_bubble", "tp_overlapped", "tp_time"]


def tp_time(ctx: ComputeContext, links: Links, train: TrainSpec, *, t: Any, sp: Any,
            rc: Any, b: Any, c: Any, layers: Any, gemm_f: Any, tp_in_node: Any,
            single: Any, mlp_share: Any = 1.0) -> tuple[Any, Any, Any, Any]:
    """Tensor-parallel time of one micro-batch on the critical stage: (forward, backward,
    critical-path total, one all-reduce of the `(s/c, b, h)` activation) over `layers`
    layers whose forward GEMMs take `gemm_f` (Shoeybi et al. 2019; SP: Korthikanti et al.
    2022; overlap: `tp_overlapped`). The total adds the head's and (one stage) the
    embedding's all-reduce and the vocabulary-parallel cross-entropy's 3 fp32 all-reduces
    per token (Megatron's `_VocabParallelCrossEntropy`). `mlp_share`: the share of the layers
    whose MLP makes its TP pair (MoE layers without shared experts on Megatron make none: the
    routed tokens stay sequence-sharded and the dispatcher gathers over expert-TP,
    `estimate.expert`); the attention's pair is in every layer."""
    model, cal, ab = ctx.model, ctx.calibration, ctx.act_bytes
    settings = train.settings()
    full = (rc == RC_CODES["full"]) * ctx.recompute_share  # the share of layers replayed
    activation = ctx.seq_len / c * b * model.d_model * ab
    # SP: a reduce-scatter + all-gather pair per all-reduce — the same ring rounds and bytes
    # (SPEC §5), but two calls where a fixed cost per call was measured
    tp_ar = np.where(sp == 1,
                     group_collective_time("reduce-scatter", activation, t, tp_in_node, links)
                     + group_collective_time("all-gather", activation, t, tp_in_node, links),
                     group_collective_time("all-reduce", activation, t, tp_in_node, links))
    kappa = cal.overlap_contention
    # --tp-comm-overlap (needs SP): each layer's AG/RS pipelined with its adjacent GEMMs
    tp_overlap = (settings.tp_overlap != "none") & (sp == 1) & (t > 1)
    tp_f1 = tp_overlapped(2 * tp_ar, gemm_f, t, tp_overlap, cal.tp_overlap_efficiency, kappa)
    tp_b1 = tp_overlapped((2 + 2 * full) * tp_ar, (2 + full) * gemm_f, t, tp_overlap,
                          cal.tp_overlap_efficiency, kappa)
    # SP keeps only the sequence shard of the QKV and gate/up inputs: backward all-gathers
    # them again for the weight gradients (2 per layer), beside the input-gradient GEMMs in
    # Megatron (not charged), between them in shardwise's runtime (`impl` "shardwise")
    regather = (np.where((sp == 1) & (t > 1), 2 * group_collective_time(
        "all-gather", activation, t, tp_in_node, links), 0.0)
        if train.impl == "shardwise" else 0.0)
    # FP8 current scaling under SP: each column-parallel input (QKV, fc1) and row-parallel
    # output gradient (out-proj, fc2) all-reduces its amax over the tp group before the cast
    # (TE module/linear.py `set_quantizer_amax_reduction_group`): 2 scalars each way
    amax = 0.0 * t
    if ctx.fp8 is not None and ctx.fp8.amax_reduction_tp:
        amax = np.where((sp == 1) & (t > 1), 2 * group_collective_time(
            "all-reduce", 4.0, t, tp_in_node, links), 0.0)
    pairs = (1 + mlp_share) / 2  # of the two per layer (attention, MLP)
    tp_f = layers * (pairs * tp_f1 + amax)
    tp_b = layers * (pairs * (tp_b1 + regather) + amax)
    ce = 3 * group_collective_time("all-reduce", ctx.seq_len / c * b * 4, t, tp_in_node, links)
    tp_crit = tp_f + tp_b + tp_ar * np.where(single, 2, 1) + np.where(t > 1, ce, 0.0)
    return tp_f, tp_b, tp_crit, tp_ar


def dp_time(links: Links, train: TrainSpec, kappa: float, bucket: float, *, groups: Any,
            replicas: Any, in_node: Any, group: Any, zero: Any, m: Any, layers: Any,
            window_b: Any, window_f: Any, big_f: Any, big_b: Any, grad_bytes: float,
            weight_bytes: float, host_copy: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(exposed, total) data-parallel / ZeRO time per step over the `replicas` = dp·cp ranks
    (`in_node` of them per node; ZeRO shard groups of `group`), for `groups` of (parameters,
    shift): the dense parameters (shift 1) and the experts' over the expert-data-parallel
    group dp·cp/shift. Stage 0 all-reduces, stages 1-2 reduce-scatter (stage 2 every
    micro-batch) and all-gather, stage 3 gathers and reduce-scatters per layer, prefetched;
    hybrid shard all-reduces the shard across groups (`dp_traffic`). Overlapped
    (`dp_overlapped`) behind `window_b` / `window_f` with the contention share of the hidden
    part (`busy_fraction`); else all of it is exposed (docs/concepts/step-time.md)."""
    settings = train.settings()
    zs, across_live = _dp_collectives(
        links, train, bucket, groups=groups, replicas=replicas, in_node=in_node, group=group,
        zero=zero, m=m, layers=layers, grad_bytes=grad_bytes, weight_bytes=weight_bytes,
        host_copy=host_copy, parts=True)
    units = np.maximum(layers, 1.0)
    z0 = np.maximum(zs["ar_last"], zs["ar"] - window_b)
    rs_exposed = np.maximum(zs["rs_last"], zs["rs"] - window_b)
    xr_exposed = np.maximum(zs["xr_last"], zs["xr"] - np.maximum(window_b - zs["rs"], 0.0))
    ag_exposed = np.maximum(zs["ag_last"], zs["ag"] - window_f)
    reductions = np.where(zero == 2, m, 1)
    z12 = reductions * rs_exposed + xr_exposed * across_live + ag_exposed
    fwd_u, bwd_u = big_f / units, big_b / units
    z3_mb = (units * np.maximum(0.0, zs["ag_u"] - fwd_u) + zs["ag_u"]
             + units * np.maximum(0.0, zs["ag_u"] + zs["rs_u"] - bwd_u) + zs["rs_u"])
    z3 = m * z3_mb + xr_exposed * across_live
    exposed = np.where(zero == 0, z0, np.where(zero == 3, z3, z12))
    dp_total = zs["total"]
    # never more exposed than moved (ZeRO-3's first gather and last reduce-scatter are
    # already in its per-layer terms when no window hides anything)
    dp_exposed = np.where(dp_total > 0, np.minimum(exposed, dp_total), 0.0)
    hidden = np.maximum(dp_total - dp_exposed, 0.0) / np.maximum(dp_total, 1e-30)
    dp_busy = zs["busy"] * hidden
    # Overlapped traffic still slows the GEMMs it runs beside (SM and HBM contention); without
    # --overlap-grad-reduce / --overlap-param-gather every byte is on the critical path.
    dp_exposed = np.where(settings.dp_overlapped(zero), dp_exposed + kappa * dp_busy, dp_total)
    return dp_exposed, dp_total


def dp_traffic(links: Links, train: TrainSpec, bucket: float, *, groups: Any, replicas: Any,
               in_node: Any, group: Any, zero: Any, m: Any, layers: Any, grad_bytes: float,
               weight_bytes: float, host_copy: Callable[[Any], Any]) -> Any:
    """`dp_time`'s total (its second value) without the overlap arithmetic: the seconds of
    every DP/ZeRO collective of a step, which no window needs (the planner's floor, where
    the stack does not overlap them, `plan.evaluate.dp_floor`)."""
    return _dp_collectives(links, train, bucket, groups=groups, replicas=replicas,
                           in_node=in_node, group=group, zero=zero, m=m, layers=layers,
                           grad_bytes=grad_bytes, weight_bytes=weight_bytes,
                           host_copy=host_copy, parts=False)[0]["total"]


def _dp_collectives(links: Links, train: TrainSpec, bucket: float, *, groups: Any,
                    replicas: Any, in_node: Any, group: Any, zero: Any, m: Any, layers: Any,
                    grad_bytes: float, weight_bytes: float, host_copy: Callable[[Any], Any],
                    parts: bool) -> tuple[dict[str, Any], Any]:
    """The DP/ZeRO collectives of `dp_time`, summed over `groups`: `total` (each stage's
    traffic per step) and, with `parts`, each collective's seconds and its last bucket's
    (`ar`, `rs`, `xr`, `ag`, `ag_u`, `rs_u` and `*_last`), the contention-weighted total
    (`busy`); and where any group's shard has replicas across hybrid groups (1.0, else 0.0)."""
    offload = train.settings().stack.offload_support(train.offload)
    gpn = links.gpus_per_node
    group_in = np.minimum(group, in_node)
    across = replicas / group  # hybrid shard: replicas of each shard
    across_in = np.maximum(in_node // group, 1)
    # what the same traffic would cost at the node's link speed: the contention it causes
    # (`busy_fraction`) follows the bytes it moves through the GPU, not the wall time
    nvlink = Links(links.intra_bw, links.intra_lat, links.intra_bw, links.intra_lat, gpn)
    # Each group's collectives (dense over dp·cp, experts over their expert-data-parallel group)
    # as its buckets fill; the groups run beside each other through the same links and share
    # one overlap window, so the exposure is taken over their sums (Megatron-Core DDP: a bucket
    # group per parameter kind, all reduced during the same last backward)
    sums: dict[str, Any] = {}

    def add(name: str, value: Any, live: Any) -> None:
        sums[name] = sums.get(name, 0.0 * m) + np.where(live, value, 0.0)

    across_live = 0.0 * m
    # the stages to evaluate: all for the exposure; for the total alone, those in `zero`
    # (a stage's collectives enter only its own total; the others stay 0 and unread)
    need = [parts or bool(np.any(zero == k)) for k in range(4)]
    for params, n_shift in groups:
        n = replicas / n_shift
        live = n > 1
        g_all = np.maximum(in_node // n_shift, 1)
        grp = np.maximum(group / n_shift, 1)
        grp_in = np.maximum(group_in // n_shift, 1)
        grads, weights = params * grad_bytes, params * weight_bytes
        # stage 0: bucketed all-reduce
        none = (0.0, 1.0)
        ar, ar_buckets = (_bucketed("all-reduce", grads, n, g_all, links, bucket) if need[0]
                          else none)
        # stages 1-2: reduce-scatter inside the shard group (+ all-reduce of the shard across
        # groups when hybrid), all-gather of the updated weights
        rs, buckets, ag, ag_buckets = none + none
        if need[1] or need[2]:
            rs, buckets = _bucketed("reduce-scatter", grads, grp, grp_in, links, bucket)
            ag, ag_buckets = _bucketed("all-gather", weights, grp, grp_in, links, bucket)
        xr, _ = (_bucketed("all-reduce", grads / grp, across, across_in, links, bucket)
                 if any(need[1:]) else none)
        # stage 3: per-layer gathers (forward, backward) and reduce-scatters, prefetched;
        # parameter offload copies each layer's shard to the GPU before its gather and its
        # gradient shard back after the reduce-scatter, on the same streams
        units = np.maximum(layers, 1.0)
        ag_u = rs_u = 0.0
        if need[3]:
            ag_u = group_collective_time("all-gather", weights / units, grp, grp_in, links)
            rs_u = group_collective_time("reduce-scatter", grads / units, grp, grp_in, links)
        if need[3] and offload is not None and offload.kind == "params":
            ag_u = ag_u + host_copy(weights / units / grp)
            rs_u = rs_u + host_copy(grads / units / grp)
        total_g = np.where(zero == 0, ar,
                           np.where(zero == 3, m * units * (2 * ag_u + rs_u),
                                    np.where(zero == 2, m, 1) * rs + ag)
                           + np.where(across > 1, xr, 0.0))
        add("total", total_g, live)
        across_live = np.maximum(across_live, np.where(live & (across > 1), 1.0, 0.0))
        if not parts:
            continue
        add("ar", ar, live)
        add("ar_last", ar / ar_buckets, live)
        add("rs", rs, live)
        add("rs_last", rs / buckets, live)
        add("xr", xr, live & (across > 1))
        add("xr_last", xr / buckets, live & (across > 1))  # per reduce-scatter bucket
        add("ag", ag, live)
        add("ag_last", ag / ag_buckets, live)
        add("ag_u", ag_u, live)
        add("rs_u", rs_u, live)
        # the busy share of the overlapped part: the shard group's (or, stage 0, the
        # replicas') reduce-scatter at node speed over its time on the real links
        sizes = np.where(zero == 0, n, grp), np.where(zero == 0, g_all, grp_in)
        add("busy", busy_fraction(grads, *sizes, links, nvlink) * total_g, live)
    keys = ("ar", "ar_last", "rs", "rs_last", "xr", "xr_last", "ag", "ag_last", "ag_u", "rs_u",
            "total", "busy") if parts else ("total",)
    return {k: sums.get(k, 0.0 * m) for k in keys}, across_live


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


def cp_time(ctx: ComputeContext, links: Links, train: TrainSpec, *, t: Any, c: Any, u: Any,
            b: Any, rc: Any, layers: Any, attn_f: Any, attn_b: Any, dp: Any, p: Any, e: Any,
            gather: Any = False) -> tuple[Any, Any]:
    """Exposed context-parallel time of one micro-batch's forward and backward over `layers`
    layers whose attention takes `attn_f` / `attn_b`, for ring attention, Ulysses or their
    hybrid: `u` = `Layout.ulysses_degree` (1 ring, c Ulysses), the ring over `r = c/u` ranks.

    Ring (Liu et al. 2023): each rank's K/V block `(s/c)·b·a_kv/t·(d + d_v)·bytes` (after
    the hybrid's all-to-all a rank holds u× the tokens of 1/u of the heads: the same bytes)
    hops `r-1` times per layer forward, twice as much backward (K/V again, dK/dV back), once
    more when recompute replays the forward. Each hop hides behind one block of attention,
    `1/r` of the layer's (Transformer Engine posts the next hop before it computes the held
    block): `max(0, hop - block)` exposed, plus the contention share of the hidden part.

    All-to-all over the `u` ranks of a `cp_a2a` group (Jacobs et al. 2023;
    `comm.ulysses_comm_bytes_per_layer`): Q, K, V and the output per layer forward, each at
    its own width (Q, K at d; V, the output at d_v), their conjugates backward, the
    forward's again with recompute — each on the critical path
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

    # selective and full recompute replay the attention (op-sac keeps its output); full
    # recompute of a share of the layers (`TrainSpec.recompute_share`) replays that share
    replays = np.where(rc == RC_CODES["selective"], 1.0,
                       np.where(rc == RC_CODES["full"], ctx.recompute_share, 0.0))
    hop_f = hidden(hop, per_layer_f / r)  # one forward hop; a replay repeats it
    ring_f = layers * (r - 1) * hop_f
    ring_b = layers * (r - 1) * (hidden(2 * hop, per_layer_b / r)
                                 + replays * hop_f)
    # the all-to-alls of this rank's (s/c)·b tokens, each at its width per tp rank: Q a·d,
    # K a_kv·d, V a_kv·d_v, the output a·d_v (MLA: d_v < d)
    a2a_in = members_per_node("cp_a2a", **where)
    token_bytes = s / c * b * ab
    widths = (model.q_dim / t, kv_heads * model.head_dim, kv_heads * model.value_head_dim,
              model.o_dim / t)
    a2a = np.where(u > 1, sum(group_collective_time("all-to-all", token_bytes * w, u, a2a_in,
                                                    links) for w in widths), 0.0)
    fwd, bwd = ring_f + layers * a2a, ring_b + layers * a2a * (1 + replays)
    if not np.any(gather):
        return fwd, bwd
    # K and V of the whole sequence, s·b·kv_heads·(d_k + d_v)·bytes, gathered over cp
    cp_in = members_per_node("cp", **where)
    whole = s * b * kv_heads * ab
    ag = sum(group_collective_time("all-gather", whole * d, c, cp_in, links)
             for d in (model.head_dim, model.value_head_dim))
    rs = sum(group_collective_time("reduce-scatter", whole * d, c, cp_in, links)
             for d in (model.head_dim, model.value_head_dim))
    replayed = np.where(rc == RC_CODES["full"], ctx.recompute_share, (rc != RC_CODES["none"]) * 1.0)
    gathers = replayed + int(not train.settings().stack.cp_gather_kept)
    return (np.where(gather, layers * ag, fwd),
            np.where(gather, layers * (rs + gathers * ag), bwd))

