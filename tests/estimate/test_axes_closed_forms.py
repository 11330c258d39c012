"""The step's per-axis terms (estimate/axes.py) written out by hand from
docs/concepts/step-time.md ("The terms of the step") and SPEC §5's α-β ring: tensor parallel
(all-reduce pairs per layer, SP's reduce-scatter + all-gather, full recompute's replay, the
head's and embedding's all-reduce, the vocabulary-parallel cross-entropy, --tp-comm-overlap,
the SP regather of shardwise's runtime, FP8 amax reductions), data parallel / ZeRO 0-3 with
buckets, hybrid shard groups, an expert group and overlap windows, and ring context
parallelism on an MLA model (d_k ≠ d_v) inside and across nodes. Links differ inside and
across nodes in bandwidth and latency; groups cross nodes where it matters."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.choices import RECOMPUTE
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
from shardwise.estimate.links import Links
from shardwise.layout import TrainSpec
from shardwise.schedules import stage_timeline
from shardwise.schedules.registry import SCHEDULE_CODES
from tests.estimate.closed_forms import A_IN, A_OUT, B_IN, B_OUT, coll, ring


def links(gpn):
    return Links(B_IN, A_IN, B_OUT, A_OUT, gpn)


# ------------------------------------------------------------------------------ tensor parallel
S, H, AB = 4096, 2048, 2.0


def _tp_ctx(share=0.5, kappa=0.3, eta=0.8, fp8=None):
    return SimpleNamespace(model=SimpleNamespace(d_model=H), seq_len=S, act_bytes=AB,
                           recompute_share=share, fp8=fp8,
                           calibration=SimpleNamespace(overlap_contention=kappa,
                                                       tp_overlap_efficiency=eta))


@pytest.mark.parametrize("single", [False, True])
def test_tp_all_reduces_with_full_recompute_by_hand(single):
    """No SP, tp 4 in one node, c = 2, b = 2, 6 layers, half of them replayed (full
    recompute, share 0.5), 3/4 of the MLPs making their pair: per layer forward 2 AR, backward
    2 + 2·0.5 AR, times (1 + 3/4)/2 of the pairs; the head's AR (and the embedding's with one
    stage) and 3 AR of an fp32 per token for the cross-entropy."""
    t, c, b, layers = 4, 2, 2, 6
    act = S / c * b * H * AB
    ar = coll("all-reduce", act, t, t)
    pairs = (1 + 0.75) / 2
    tp_f, tp_b = layers * pairs * 2 * ar, layers * pairs * 3 * ar
    ce = 3 * coll("all-reduce", S / c * b * 4, t, t)
    crit = tp_f + tp_b + (2 if single else 1) * ar + ce
    got = tp_time(_tp_ctx(), links(8), TrainSpec(seq_len=S), t=t, sp=0,
                  rc=RECOMPUTE.index("full"), b=b, c=c, layers=layers, gemm_f=1e-3,
                  tp_in_node=4, single=single, mlp_share=0.75)
    assert [float(x) for x in got] == pytest.approx([tp_f, tp_b, crit, ar], rel=1e-12)


def test_tp_comm_overlap_across_nodes_by_hand():
    """SP over tp 16 with 8 per node: each AR is a reduce-scatter + all-gather (hierarchical).
    --tp-comm-overlap hides at most `W = η·gemm·(t-1)/t` of each pass's collectives and
    charges κ of what it hides: `max(0, comm - W) + κ·min(comm, W)`; backward with full
    recompute: comm (2 + 2·r)·AR beside (2 + r)·gemm (r = 0.5)."""
    t, c, b, layers, gemm, eta, kappa = 16, 1, 1, 4, 2e-4, 0.8, 0.3
    act = S / c * b * H * AB
    ar = coll("reduce-scatter", act, t, 8) + coll("all-gather", act, t, 8)

    def hidden(comm, g):
        w = eta * g * (t - 1) / t
        return max(0.0, comm - w) + kappa * min(comm, w)

    f1, b1 = hidden(2 * ar, gemm), hidden(3 * ar, 2.5 * gemm)
    assert 2 * ar > eta * gemm * (t - 1) / t  # partly hidden: both branches of max/min show
    ce = 3 * coll("all-reduce", S / c * b * 4, t, 8)
    train = TrainSpec(seq_len=S, tp_overlap="bulk")
    got = tp_time(_tp_ctx(eta=eta, kappa=kappa), links(8), train, t=t, sp=1,
                  rc=RECOMPUTE.index("full"), b=b, c=c, layers=layers, gemm_f=gemm,
                  tp_in_node=8, single=False)
    want = [layers * f1, layers * b1, layers * (f1 + b1) + ar + ce, ar]
    assert [float(x) for x in got] == pytest.approx(want, rel=1e-12)
    # the same without overlap: every byte exposed
    off = tp_time(_tp_ctx(eta=eta, kappa=kappa), links(8), TrainSpec(seq_len=S), t=t, sp=1,
                  rc=RECOMPUTE.index("full"), b=b, c=c, layers=layers, gemm_f=gemm,
                  tp_in_node=8, single=False)
    assert float(off[0]) == pytest.approx(layers * 2 * ar, rel=1e-12)
    assert float(off[1]) == pytest.approx(layers * 3 * ar, rel=1e-12)


def test_sp_regather_of_shardwise_and_fp8_amax_reductions_by_hand():
    """shardwise's runtime all-gathers the SP-sharded QKV and gate/up inputs again in backward
    (2 AG per pair); FP8 current scaling all-reduces 2 amax scalars (4 bytes) per layer each
    way under SP (TE's amax reduction group)."""
    t, c, b, layers = 4, 2, 1, 3
    act = S / c * b * H * AB
    ag, rs = coll("all-gather", act, t, t), coll("reduce-scatter", act, t, t)
    ar = ag + rs
    ce = 3 * coll("all-reduce", S / c * b * 4, t, t)
    none = RECOMPUTE.index("none")
    got = tp_time(_tp_ctx(), links(8), TrainSpec(seq_len=S, impl="shardwise"), t=t, sp=1,
                  rc=none, b=b, c=c, layers=layers, gemm_f=1e-3, tp_in_node=4, single=False)
    f, bwd = layers * 2 * ar, layers * (2 * ar + 2 * ag)
    assert [float(x) for x in got] == pytest.approx([f, bwd, f + bwd + ar + ce, ar], rel=1e-12)
    amax = 2 * coll("all-reduce", 4.0, t, t)
    fp8 = SimpleNamespace(amax_reduction_tp=True)
    got = tp_time(_tp_ctx(fp8=fp8), links(8), TrainSpec(seq_len=S), t=t, sp=1, rc=none, b=b,
                  c=c, layers=layers, gemm_f=1e-3, tp_in_node=4, single=True)
    f, bwd = layers * (2 * ar + amax), layers * (2 * ar + amax)
    assert [float(x) for x in got] == pytest.approx([f, bwd, f + bwd + 2 * ar + ce, ar],
                                                    rel=1e-12)
    # without SP no amax reduction (and no regather)
    got = tp_time(_tp_ctx(fp8=fp8), links(8), TrainSpec(seq_len=S), t=t, sp=0, rc=none, b=b,
                  c=c, layers=layers, gemm_f=1e-3, tp_in_node=4, single=False)
    ar0 = coll("all-reduce", act, t, t)
    assert float(got[0]) == pytest.approx(layers * 2 * ar0, rel=1e-12)
    # one rank: no collective, no cross-entropy reduction
    got = tp_time(_tp_ctx(fp8=fp8), links(8), TrainSpec(seq_len=S), t=1, sp=1, rc=none, b=b,
                  c=c, layers=layers, gemm_f=1e-3, tp_in_node=1, single=True)
    assert [float(x) for x in got] == [0.0, 0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------ data parallel
P_DENSE, P_EXPERT, GB, WB, BUCKET = 3.0e8, 5.0e8, 4.0, 2.0, 1.0e8
M, LAYERS, BIG_F, BIG_B = 3, 5, 0.002, 0.006


def _dp_hand(zero, replicas, in_node, group, window_b, window_f, kappa, overlapped,
             groups=((P_DENSE, 1), (P_EXPERT, 2)), layers=LAYERS, copy=None):
    """docs/concepts/step-time.md's DP / ZeRO term. Each group's collectives (dense over the
    replicas, experts over their expert-data-parallel group) run during the same last
    backward through the same links, so they share one overlap window: the exposure is taken
    over the groups' sums (last buckets, RS − window_b, AG − window_f; per layer for ZeRO-3).
    Hybrid shard: the shard's all-reduce across groups follows each reduce-scatter bucket
    (Megatron-Core's inter-instance all-reduce per bucket), so what stays exposed at least is
    one reduce-scatter bucket's share of it."""
    sums = dict.fromkeys(("ar", "ar_last", "rs", "rs_last", "xr", "xr_last", "ag", "ag_last",
                          "ag_u", "rs_u", "total", "busy"), 0.0)
    across, across_in = replicas / group, max(in_node // group, 1)
    units = max(layers, 1.0)
    any_across = False
    for params, shift in groups:
        n = replicas / shift
        if n <= 1:  # a group of one moves nothing (nor copies)
            continue
        g_all = max(in_node // shift, 1)
        grp, grp_in = max(group / shift, 1), max(min(group, in_node) // shift, 1)
        grads, weights = params * GB, params * WB

        def bucketed(op, size, nn, gg):
            k = max(math.ceil(size / BUCKET), 1)
            return k * coll(op, size / k, nn, gg), k

        ar, k0 = bucketed("all-reduce", grads, n, g_all)
        rs, k = bucketed("reduce-scatter", grads, grp, grp_in)
        ag, kw = bucketed("all-gather", weights, grp, grp_in)
        xr, _ = bucketed("all-reduce", grads / grp, across, across_in)
        ag_u = coll("all-gather", weights / units, grp, grp_in)
        rs_u = coll("reduce-scatter", grads / units, grp, grp_in)
        if copy is not None:  # parameter offload: each shard to the GPU and back
            ag_u, rs_u = ag_u + copy(weights / units / grp), rs_u + copy(grads / units / grp)
        sums["ar"] += ar
        sums["ar_last"] += ar / k0
        sums["rs"] += rs
        sums["rs_last"] += rs / k
        sums["ag"] += ag
        sums["ag_last"] += ag / kw
        sums["ag_u"] += ag_u
        sums["rs_u"] += rs_u
        if across > 1:
            any_across = True
            sums["xr"] += xr
            sums["xr_last"] += xr / k
        red = M if zero == 2 else 1
        total = (ar if zero == 0 else
                 M * units * (2 * ag_u + rs_u) if zero == 3 else red * rs + ag)
        total += xr if (zero != 0 and across > 1) else 0.0
        nn, gg = (n, g_all) if zero == 0 else (grp, grp_in)
        real = coll("reduce-scatter", grads, nn, gg)
        local = ring(1, grads, gg, B_IN, A_IN) + ring(1, grads / gg, nn / gg, B_IN, A_IN)
        sums["total"] += total
        sums["busy"] += (local / real if real > 0 else 1.0) * total
    xr_exposed = (max(sums["xr_last"], sums["xr"] - max(window_b - sums["rs"], 0.0))
                  if any_across else 0.0)
    if zero == 0:
        exposed = max(sums["ar_last"], sums["ar"] - window_b)
    elif zero in (1, 2):
        red = M if zero == 2 else 1
        exposed = (red * max(sums["rs_last"], sums["rs"] - window_b)
                   + max(sums["ag_last"], sums["ag"] - window_f) + xr_exposed)
    else:
        f, b = BIG_F / units, BIG_B / units
        ag_u, rs_u = sums["ag_u"], sums["rs_u"]
        per_mb = units * max(0.0, ag_u - f) + ag_u + units * max(0.0, ag_u + rs_u - b) + rs_u
        exposed = M * per_mb + xr_exposed
    total = sums["total"]
    exposed = min(exposed, total)  # never more exposed than moved
    busy = sums["busy"] * max(total - exposed, 0.0) / total if total > 0 else 0.0
    return (exposed + kappa * busy if overlapped else total), total


@pytest.mark.parametrize("zero, group", [(0, 16), (1, 16), (2, 16), (3, 16), (1, 8), (2, 8),
                                         (3, 8)])  # ZeRO-0 has no shard group
@pytest.mark.parametrize("overlap", [False, True])
def test_dp_and_zero_terms_by_hand(zero, group, overlap):
    """16 replicas, 4 per node (4 nodes), dense parameters and experts over the
    expert-data-parallel group of 8 (shift 2); shard groups of 16 or 8 (hybrid: the shard
    all-reduced across the 2 groups); windows that hide part of the traffic."""
    kappa, window_b, window_f = 0.35, 0.012, 0.004
    train = TrainSpec(seq_len=S, dp_overlap=overlap)
    exposed, total = dp_time(
        links(4), train, kappa, BUCKET, groups=[(P_DENSE, 1), (P_EXPERT, 2)], replicas=16,
        in_node=4, group=group, zero=zero, m=M, layers=LAYERS, window_b=window_b,
        window_f=window_f, big_f=BIG_F, big_b=BIG_B, grad_bytes=GB, weight_bytes=WB,
        host_copy=lambda n: 1e9 * n)  # no offload: never called
    hand_exposed, hand_total = _dp_hand(zero, 16, 4, group, window_b, window_f, kappa, overlap)
    assert float(total) == pytest.approx(hand_total, rel=1e-12)
    # the planner's floor reads the same total with no window (`dp_traffic`)
    moved = dp_traffic(
        links(4), train, BUCKET, groups=[(P_DENSE, 1), (P_EXPERT, 2)], replicas=16,
        in_node=4, group=group, zero=zero, m=M, layers=LAYERS, grad_bytes=GB,
        weight_bytes=WB, host_copy=lambda n: 1e9 * n)
    assert float(moved) == pytest.approx(hand_total, rel=1e-12)
    assert float(exposed) == pytest.approx(hand_exposed, rel=1e-12)
    if overlap and zero < 3:
        assert float(exposed) < float(total)
    if overlap:  # never more exposed than moved (ZeRO-3 here: the two groups fill the window)
        assert float(exposed) <= float(total)
    if zero == 3:  # the prefetch hides part of each layer's gathers, not all
        ag = coll("all-gather", P_DENSE * WB / LAYERS, group, min(group, 4))
        assert ag > BIG_F / LAYERS


@pytest.mark.parametrize("replicas, in_node, group, expert_shift, zero", [
    (2, 2, 2, 2, 1), (2, 1, 2, 2, 3), (4, 4, 4, 4, 0), (4, 1, 4, 4, 2), (8, 8, 4, 2, 3),
    (12, 6, 4, 4, 1), (24, 6, 24, 4, 3)])
def test_dp_groups_at_their_thresholds(replicas, in_node, group, expert_shift, zero):
    """Groups of two (the smallest that moves bytes), an expert group of one replica (nothing
    to reduce), one replica per node, groups that split a node unevenly (6 a node: members per
    node `max(1, in_node // stride)`, the placement's rule); overlapped."""
    groups = ((P_DENSE, 1), (P_EXPERT, expert_shift))
    train = TrainSpec(seq_len=S, dp_overlap=True)
    exposed, total = dp_time(
        links(8), train, 0.35, BUCKET, groups=list(groups), replicas=replicas,
        in_node=in_node, group=group, zero=zero, m=M, layers=LAYERS, window_b=0.012,
        window_f=0.004, big_f=BIG_F, big_b=BIG_B, grad_bytes=GB, weight_bytes=WB,
        host_copy=lambda n: 1e9 * n)
    hand = _dp_hand(zero, replicas, in_node, group, 0.012, 0.004, 0.35, True, groups=groups)
    assert (float(exposed), float(total)) == pytest.approx(hand, rel=1e-12)


@pytest.mark.parametrize("layers", [1.0, 0.5, 6.0])
def test_zero3_parameter_offload_copies_each_shard_by_hand(layers):
    """Parameter offload (torchtitan's CPU offload under FSDP): each layer's weight shard
    comes over the host link before its gather and its gradient shard goes back after the
    reduce-scatter, on the same streams; fewer than one layer a stage is one unit."""
    def copy(n):
        return 2e-6 + n / 25e9

    train = TrainSpec(seq_len=S, impl="torchtitan", offload="params")
    exposed, total = dp_time(
        links(4), train, 0.35, BUCKET, groups=[(P_DENSE, 1), (P_EXPERT, 2)], replicas=16,
        in_node=4, group=8, zero=3, m=M, layers=layers, window_b=0.012, window_f=0.004,
        big_f=BIG_F, big_b=BIG_B, grad_bytes=GB, weight_bytes=WB, host_copy=copy)
    overlapped = train.settings().dp_overlapped(3)
    hand = _dp_hand(3, 16, 4, 8, 0.012, 0.004, 0.35, overlapped, layers=layers, copy=copy)
    assert (float(exposed), float(total)) == pytest.approx(hand, rel=1e-12)


def test_dp_with_one_replica_is_free():
    exposed, total = dp_time(
        links(8), TrainSpec(seq_len=S), 0.3, BUCKET, groups=[(P_DENSE, 1)], replicas=1,
        in_node=1, group=1, zero=1, m=M, layers=LAYERS, window_b=0.0, window_f=0.0,
        big_f=BIG_F, big_b=BIG_B, grad_bytes=GB, weight_bytes=WB, host_copy=lambda n: n)
    assert (float(exposed), float(total)) == (0.0, 0.0)


# --------------------------------------------------------------------------- context parallel
def _mla_ctx(kappa):
    model = get_model("deepseek-v2-lite")
    assert (model.n_kv_heads, model.head_dim, model.value_head_dim) == (16, 192, 128)
    return SimpleNamespace(model=model, seq_len=S, act_bytes=AB, recompute_share=0.25,
                           calibration=SimpleNamespace(overlap_contention=kappa))


@pytest.mark.parametrize("gpn, rc", [(8, "selective"), (4, "full"), (4, "none")])
def test_ring_attention_hops_hide_behind_blocks_by_hand(gpn, rc):
    """Ring over c = 4 with tp 2 (Megatron-Core/TE, overlapped): each hop moves this rank's
    K (d_k 192) and V (d_v 128) block of 16/2 heads, `s/c·b·8·(192+128)·2` bytes, on NVLink
    when the 4 ring ranks share a node (8 GPUs a node) else on InfiniBand (4 a node: 2), and
    hides behind 1/c of a layer's attention: `max(0, hop - block) + κ·busy·min(hop, block)`
    with busy = the hop at node speed over its time. Forward c-1 hops per layer, backward
    c-1 of twice the bytes plus the replayed forward's (selective 1, full its share 0.25)."""
    kappa, c, b, layers, attn_f, attn_b = 0.4, 4, 2, 3, 0.9e-3, 2.1e-3
    block = S / c * b * 8 * (192 + 128) * AB
    bw, lat = (B_IN, A_IN) if gpn == 8 else (B_OUT, A_OUT)
    hop = lat + block / bw
    busy = (A_IN + block / B_IN) / hop

    def hidden(x, compute):
        return max(0.0, x - compute) + kappa * busy * min(x, compute)

    replays = {"selective": 1.0, "full": 0.25, "none": 0.0}[rc]
    f1 = hidden(hop, attn_f / layers / c)
    fwd = layers * (c - 1) * f1
    bwd = layers * (c - 1) * (hidden(2 * hop, attn_b / layers / c) + replays * f1)
    got = cp_time(_mla_ctx(kappa), links(gpn), TrainSpec(seq_len=S), t=2, c=c, u=1, b=b,
                  rc=RECOMPUTE.index(rc), layers=layers, attn_f=attn_f, attn_b=attn_b, dp=1,
                  p=1, e=1)
    assert [float(x) for x in got] == pytest.approx([fwd, bwd], rel=1e-12)


def test_blocking_ring_hops_are_send_then_receive():
    """A stack without CP overlap (shardwise's runtime): each hop a blocking send then
    receive, all exposed: forward (c-1)·2·hop, backward (c-1)·(2·2·hop + replay)."""
    c, b, layers = 4, 1, 2
    block = S / c * b * 8 * (192 + 128) * AB
    hop = A_IN + block / B_IN
    got = cp_time(_mla_ctx(0.4), links(8), TrainSpec(seq_len=S, impl="shardwise"), t=2, c=c,
                  u=1, b=b, rc=RECOMPUTE.index("selective"), layers=layers, attn_f=1.0,
                  attn_b=2.0, dp=1, p=1, e=1)
    fwd = layers * (c - 1) * 2 * hop
    assert [float(x) for x in got] == pytest.approx(
        [fwd, layers * (c - 1) * (4 * hop + 2 * hop)], rel=1e-12)
    none = cp_time(_mla_ctx(0.4), links(8), TrainSpec(seq_len=S), t=2, c=1, u=1, b=b,
                   rc=0, layers=layers, attn_f=1.0, attn_b=2.0, dp=1, p=1, e=1)
    assert [float(x) for x in none] == [0.0, 0.0]


@pytest.mark.parametrize("gpn, hybrid", [(8, False), (4, False), (4, True)])
def test_ulysses_and_hybrid_all_to_alls_on_gqa_by_hand(gpn, hybrid):
    """Ulysses over u ranks (Jacobs et al. 2023) on llama3-8b (32 query heads, 8 KV heads of
    128): per layer 2 all-to-alls q_dim/t = 32·128/2 wide (Q, the output) and 2 kv wide
    (K, V: 8/2 heads × 128) of this rank's s/c·b tokens, each `(u-1)·α + S·(g-1)/u/β_i +
    S·(u-g)/u/β_o`; backward the conjugates, plus the forward's again under selective
    recompute. The hybrid (u = 2 inside c = 4) adds the ring over r = 2 on top."""
    model = get_model("llama3-8b")
    assert (model.n_heads, model.n_kv_heads, model.head_dim) == (32, 8, 128)
    model_ctx = SimpleNamespace(model=model, seq_len=S, act_bytes=AB, recompute_share=0.25,
                                calibration=SimpleNamespace(overlap_contention=0.0))
    c, u, t, b, layers = 4, (2 if hybrid else 4), 2, 2, 3
    tokens = S / c * b * AB
    q, kv = 32 * 128 / t, 4 * 128
    a2a_in = min(u, gpn // t)  # the a2a group's stride is tp

    def a2a(size):
        alpha = A_OUT if u > a2a_in else A_IN
        return ((u - 1) * alpha + size * (a2a_in - 1) / u / B_IN
                + size * (u - a2a_in) / u / B_OUT)

    per = 2 * (a2a(tokens * q) + a2a(tokens * kv))
    got = cp_time(model_ctx, links(gpn), TrainSpec(seq_len=S), t=t, c=c, u=u, b=b,
                  rc=RECOMPUTE.index("selective"), layers=layers, attn_f=0.3, attn_b=0.6,
                  dp=1, p=1, e=1)
    fwd, bwd = layers * per, layers * per * 2
    if hybrid:  # the ring over 2 ranks of stride t·u = 4: a node of 4 holds one
        block = S / c * b * 4 * (128 + 128) * AB
        hop = (A_OUT if gpn == 4 else A_IN) + block / (B_OUT if gpn == 4 else B_IN)
        f1 = max(0.0, hop - 0.3 / layers / 2)  # κ = 0
        fwd += layers * f1
        bwd += layers * (max(0.0, 2 * hop - 0.6 / layers / 2) + f1)
    assert [float(x) for x in got] == pytest.approx([fwd, bwd], rel=1e-12)


@pytest.mark.parametrize("gqa", [False, True])
def test_ulysses_all_to_alls_at_mla_widths_by_hand(gqa):
    """Ulysses over c = u = 4 at tp 2, one node of 8 (the group's stride is tp: 4 a node), on
    deepseek-v2-lite (16 heads, 16 kv heads, d 192, d_v 128) and on the same widths with GQA
    (32 heads, 8 kv heads): per layer four all-to-alls of this rank's s/c·b tokens, each at
    its own width per tp rank — Q a/t·d, K a_kv/t·d, V a_kv/t·d_v, the output a/t·d_v —
    each `(u-1)·α + (u-1)/u·S/β`; backward the conjugates, the forward's again under
    selective recompute."""
    model = get_model("deepseek-v2-lite")
    if gqa:  # the analytic side reads only these
        model = SimpleNamespace(n_heads=32, n_kv_heads=8, head_dim=192, value_head_dim=128,
                                q_dim=32 * 192, o_dim=32 * 128)
    ctx = SimpleNamespace(model=model, seq_len=S, act_bytes=AB, recompute_share=0.25,
                          calibration=SimpleNamespace(overlap_contention=0.0))
    c = u = 4
    t, b, layers = 2, 2, 3
    heads, kv_heads = (16, 4) if gqa else (8, 8)  # per tp rank
    tokens = S / c * b * AB

    def a2a(width):
        return (u - 1) * A_IN + tokens * width * (u - 1) / u / B_IN

    per = a2a(heads * 192) + a2a(kv_heads * 192) + a2a(kv_heads * 128) + a2a(heads * 128)
    for rc, replays in (("none", 0), ("selective", 1)):
        got = cp_time(ctx, links(8), TrainSpec(seq_len=S), t=t, c=c, u=u, b=b,
                      rc=RECOMPUTE.index(rc), layers=layers, attn_f=0.3, attn_b=0.6, dp=1,
                      p=1, e=1)
        assert [float(x) for x in got] == pytest.approx(
            [layers * per, layers * per * (1 + replays)], rel=1e-12)


@pytest.mark.parametrize("impl, rc, gathers", [("torchtitan", "none", 0), ("torchtitan", "full", 0.25),
                                                ("megatron-te", "none", 1),
                                                ("megatron-te", "selective", 2)])
def test_all_gather_context_parallel_on_mla_across_nodes_by_hand(impl, rc, gathers):
    """K (d_k 192) and V (d_v 128) of the whole sequence gathered over c = 4 ranks, 2 a node
    (tp 2, 4 a node), before each layer's attention; backward reduce-scatters both
    gradients and gathers them again unless the stack keeps them (torchtitan) and once more
    when recompute replays the attention (full: its share 0.25)."""
    c, t, b, layers = 4, 2, 1, 3
    whole = S * b * 8 * AB
    ag = sum(coll("all-gather", whole * d, c, 2) for d in (192, 128))
    rs = sum(coll("reduce-scatter", whole * d, c, 2) for d in (192, 128))
    got = cp_time(_mla_ctx(0.4), links(4), TrainSpec(seq_len=S, impl=impl), t=t, c=c, u=1,
                  b=b, rc=RECOMPUTE.index(rc), layers=layers, attn_f=0.3, attn_b=0.6, dp=1,
                  p=1, e=1, gather=True)
    assert [float(x) for x in got] == pytest.approx(
        [layers * ag, layers * (rs + gathers * ag)], rel=1e-12)


def test_context_parallel_edges():
    """No layout splitting the sequence costs nothing (even with no attention time); fewer
    than one layer on a stage keeps its attention time per layer as given."""
    none = cp_time(_mla_ctx(0.4), links(8), TrainSpec(seq_len=S), t=2, c=1, u=1, b=1, rc=0,
                   layers=2, attn_f=0.0, attn_b=0.0, dp=1, p=1, e=1)
    assert [float(x) for x in none] == [0.0, 0.0]
    kappa, c, b, layers, attn_f, attn_b = 0.4, 4, 2, 0.5, 2e-6, 5e-6  # blocks < hops
    block = S / c * b * 8 * (192 + 128) * AB
    hop = A_IN + block / B_IN

    def hidden(x, compute):
        return max(0.0, x - compute) + kappa * min(x, compute)

    got = cp_time(_mla_ctx(kappa), links(8), TrainSpec(seq_len=S), t=2, c=c, u=1, b=b, rc=0,
                  layers=layers, attn_f=attn_f, attn_b=attn_b, dp=1, p=1, e=1)
    want = [layers * 3 * hidden(hop, attn_f / layers / c),
            layers * 3 * hidden(2 * hop, attn_b / layers / c)]
    assert attn_b / layers / c < hop
    assert [float(x) for x in got] == pytest.approx(want, rel=1e-12)
    # arrays of layouts, all-gather CP beside the ring (the planner's batches)
    both = cp_time(_mla_ctx(kappa), links(8), TrainSpec(seq_len=S, impl="torchtitan"), t=2,
                   c=c, u=1, b=b, rc=0, layers=layers, attn_f=attn_f, attn_b=attn_b, dp=1,
                   p=1, e=1, gather=np.array([True, False]))
    whole = S * b * 8 * AB
    ag = sum(coll("all-gather", whole * d, c, 4) for d in (192, 128))
    rs = sum(coll("reduce-scatter", whole * d, c, 4) for d in (192, 128))
    assert both[0] == pytest.approx([layers * ag, want[0]], rel=1e-12)
    assert both[1] == pytest.approx([layers * rs, want[1]], rel=1e-12)


def test_sp_pairs_are_two_calls_where_a_call_cost_was_measured():
    """With SP each all-reduce is a reduce-scatter + all-gather: the same ring rounds and
    bytes, but two calls where the calibration measured a fixed cost per call (the "this
    machine" preset): α_RS + α_AG + bytes/β instead of α_AR + bytes/β. tp 2 inside a node."""
    call = (("all-gather/2", 4e-4), ("all-reduce/2", 5e-4), ("reduce-scatter/2", 3e-4))
    timed = Links(B_IN, A_IN, B_OUT, A_OUT, 8, call=call)
    t, c, b, layers = 2, 1, 1, 2
    act = S * H * AB
    half = act / (2 * B_IN)  # one ring round of S/2
    rs, ag, ar = 3e-4 + half, 4e-4 + half, 5e-4 + 2 * half
    ce = 3 * (5e-4 + 2 * (S * 4) / (2 * B_IN))
    none = RECOMPUTE.index("none")
    sp = tp_time(_tp_ctx(), timed, TrainSpec(seq_len=S), t=t, sp=1, rc=none, b=b, c=c,
                 layers=layers, gemm_f=1e-3, tp_in_node=2, single=False)
    pair = rs + ag
    assert [float(x) for x in sp] == pytest.approx(
        [layers * 2 * pair, layers * 2 * pair, layers * 4 * pair + pair + ce, pair], rel=1e-12)
    plain = tp_time(_tp_ctx(), timed, TrainSpec(seq_len=S, impl="shardwise"), t=t, sp=0,
                    rc=none, b=b, c=c, layers=layers, gemm_f=1e-3, tp_in_node=2, single=False)
    assert [float(x) for x in plain] == pytest.approx(
        [layers * 2 * ar, layers * 2 * ar, layers * 4 * ar + ar + ce, ar], rel=1e-12)
    # tp 2 with SP under --tp-comm-overlap: W = η·gemm/2
    gemm, eta, kappa = 1e-3, 0.8, 0.3
    over = tp_time(_tp_ctx(eta=eta, kappa=kappa), timed, TrainSpec(seq_len=S, tp_overlap="bulk"),
                   t=t, sp=1, rc=none, b=b, c=c, layers=layers, gemm_f=gemm, tp_in_node=2,
                   single=False)
    w = eta * gemm / 2
    f1 = max(0.0, 2 * pair - w) + kappa * min(2 * pair, w)
    b1 = max(0.0, 2 * pair - 2 * w) + kappa * min(2 * pair, 2 * w)
    assert float(over[0]) == pytest.approx(layers * f1, rel=1e-12)
    assert float(over[1]) == pytest.approx(layers * b1, rel=1e-12)
    # FP8 amax reductions at tp 2: 2 all-reduces of 4 bytes per layer each way
    amax = 2 * (5e-4 + 2 * 4.0 / (2 * B_IN))
    fp8 = tp_time(_tp_ctx(fp8=SimpleNamespace(amax_reduction_tp=True)), timed,
                  TrainSpec(seq_len=S), t=t, sp=1, rc=none, b=b, c=c, layers=layers,
                  gemm_f=1e-3, tp_in_node=2, single=False)
    assert float(fp8[0]) == pytest.approx(layers * (2 * pair + amax), rel=1e-12)


# ------------------------------------------------------------------------------ pipeline
def test_exposed_p2p_by_hand_for_arrays_of_layouts():
    """Without overlap 2·(v·m + p - 1) transfers; overlapped 2·(p - 1) plus κ of 2·v·m."""
    x, kappa = 3e-4, 0.2
    p, v, m = np.array([4, 4, 2]), np.array([2, 1, 3]), np.array([8, 5, 6])
    on = np.array([True, False, True])
    want = [2 * 3 * x + kappa * 2 * 16 * x, 2 * (5 + 3) * x, 2 * 1 * x + kappa * 2 * 18 * x]
    assert p2p_exposed(x, p, v, m, on, kappa) == pytest.approx(want, rel=1e-12)
    assert p2p_exposed(x, 3, 2, 7, False, kappa) == pytest.approx(2 * (14 + 2) * x, rel=1e-12)


@pytest.mark.parametrize("name, p, v, m", [("gpipe", 4, 1, 6), ("1f1b", 3, 1, 5),
                                           ("interleaved", 4, 2, 8), ("interleaved", 2, 3, 4),
                                           ("zb-h1", 4, 1, 6), ("zb-h1", 3, 1, 2),
                                           ("zbv", 4, 2, 8), ("dualpipev", 4, 2, 10)])
def test_bubbles_equal_the_simulators_makespans(name, p, v, m):
    """Each schedule's closed form (SPEC §6: GPipe and 1F1B (p-1)(F+B), interleaved /v,
    ZB-H1's max form) equals the event simulator's makespan minus the busy time, with
    forward, backward and weight-gradient times all different."""
    t_f, t_b, t_w = 1.3, 2.9, 1.1
    timeline = stage_timeline(name, p, m, v, t_f=t_f, t_b=t_b, t_w=t_w)
    simulated = timeline.makespan - m * (t_f + t_b)
    got = pipeline_bubble(SCHEDULE_CODES[name], p, v, m, t_f, t_b, t_w)
    assert float(got) == pytest.approx(simulated, rel=1e-9)
    if name in ("gpipe", "1f1b"):
        assert float(got) == pytest.approx((p - 1) * (t_f + t_b), rel=1e-12)
    if name == "interleaved":
        assert float(got) == pytest.approx((p - 1) * (t_f + t_b) / v, rel=1e-12)


def test_bubble_of_arrays_of_schedules():
    codes = np.array([SCHEDULE_CODES[n] for n in ("1f1b", "interleaved", "zb-h1")])
    p, v, m = np.array([4, 4, 4]), np.array([1, 2, 1]), np.array([8, 8, 8])
    t_f, t_b, t_w = 1.3, 2.9, 1.1
    got = pipeline_bubble(codes, p, v, m, t_f, t_b, t_w)
    b = t_b - t_w
    assert got == pytest.approx([3 * (t_f + t_b), 3 * (t_f + t_b) / 2,
                                 3 * max(t_f + b - t_w, b, t_f)], rel=1e-12)


def test_interleaved_window_and_tp_overlap_closed_forms():
    """(1 + (v-1)·p)/v micro-batch passes; TP overlap `max(0, comm - W) + κ·min(comm, W)`,
    W = η·gemm·(t-1)/t, for arrays with overlap on and off side by side."""
    assert interleaved_window(4, 3) == pytest.approx((1 + 2 * 4) / 3)
    assert interleaved_window(np.array([2, 5]), np.array([2, 1])) == pytest.approx([1.5, 1.0])
    comm, gemm = np.array([1.0, 2.0, 2.0]), np.array([2.0, 2.0, 2.0])
    t, on = np.array([4, 4, 2]), np.array([True, True, False])
    # W = 0.8·2·3/4 = 1.2
    assert tp_overlapped(comm, gemm, t, on, 0.8, 0.1) == pytest.approx(
        [0.1 * 1.0, 0.8 + 0.1 * 1.2, 2.0])
    assert tp_overlapped(2.0, 2.0, 2, True, 0.8, 0.1) == pytest.approx(1.2 + 0.1 * 0.8)
