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

import pytest

from shardwise.arch import get_model
from shardwise.choices import RECOMPUTE
from shardwise.estimate.axes import cp_time, dp_time, tp_time
from shardwise.estimate.links import Links
from shardwise.layout import TrainSpec

B_IN, A_IN, B_OUT, A_OUT = 300e9, 3e-6, 40e9, 11e-6


def ring(rounds, size, n, bw, lat):
    """SPEC §5: `rounds·(n-1)·(α + S/(n·β))`."""
    return rounds * (n - 1) * (lat + size / (n * bw))


def coll(op, size, n, g):
    """Hierarchical collective over n ranks, g per node: inside, then S/g across n/g nodes."""
    k = n / g
    if op == "all-reduce":
        return 2 * ring(1, size, g, B_IN, A_IN) + ring(2, size / g, k, B_OUT, A_OUT)
    return ring(1, size, g, B_IN, A_IN) + ring(1, size / g, k, B_OUT, A_OUT)


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
M, LAYERS, BIG_F, BIG_B = 3, 5, 0.04, 0.09


def _dp_hand(zero, replicas, in_node, group, window_b, window_f, kappa, overlapped):
    """docs/concepts/step-time.md's DP / ZeRO term, per group of (params, shift). Hybrid
    shard: the shard's all-reduce across groups follows each reduce-scatter bucket
    (Megatron-Core's inter-instance all-reduce per bucket), so what stays exposed at least is
    one reduce-scatter bucket's share of it."""
    total_sum = exposed_sum = busy_sum = 0.0
    for params, shift in ((P_DENSE, 1), (P_EXPERT, 2)):
        n = replicas / shift
        g_all = max(in_node // shift, 1)
        grp, grp_in = max(group / shift, 1), max(min(group, in_node) // shift, 1)
        across, across_in = replicas / group, max(in_node // group, 1)
        grads, weights = params * GB, params * WB

        def bucketed(op, size, nn, gg):
            k = max(math.ceil(size / BUCKET), 1)
            return k * coll(op, size / k, nn, gg), k

        if zero == 0:
            ar, k = bucketed("all-reduce", grads, n, g_all)
            total, exposed = ar, max(ar / k, ar - window_b)
        elif zero in (1, 2):
            rs, k = bucketed("reduce-scatter", grads, grp, grp_in)
            ag, kw = bucketed("all-gather", weights, grp, grp_in)
            xr, _ = bucketed("all-reduce", grads / grp, across, across_in)
            red = M if zero == 2 else 1
            exposed = (red * max(rs / k, rs - window_b) + max(ag / kw, ag - window_f)
                       + (max(xr / k, xr - max(window_b - rs, 0.0)) if across > 1 else 0.0))
            total = red * rs + ag + (xr if across > 1 else 0.0)
        else:
            ag = coll("all-gather", weights / LAYERS, grp, grp_in)
            rs = coll("reduce-scatter", grads / LAYERS, grp, grp_in)
            f, b = BIG_F / LAYERS, BIG_B / LAYERS
            per_mb = (LAYERS * max(0.0, ag - f) + ag + LAYERS * max(0.0, ag + rs - b) + rs)
            xr, _ = bucketed("all-reduce", grads / grp, across, across_in)
            rs_all, k = bucketed("reduce-scatter", grads, grp, grp_in)
            xr_exposed = max(xr / k, xr - max(window_b - rs_all, 0.0))
            exposed = M * per_mb + (xr_exposed if across > 1 else 0.0)
            total = M * LAYERS * (2 * ag + rs) + (xr if across > 1 else 0.0)
        nn, gg = (n, g_all) if zero == 0 else (grp, grp_in)
        real = coll("reduce-scatter", grads, nn, gg)
        local = ring(1, grads, gg, B_IN, A_IN) + ring(1, grads / gg, nn / gg, B_IN, A_IN)
        busy = local / real if real > 0 else 1.0
        if n > 1:
            total_sum += total
            exposed_sum += exposed
            busy_sum += busy * max(total - exposed, 0.0)
    return (exposed_sum + kappa * busy_sum if overlapped else total_sum), total_sum


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("group", [16, 8])
@pytest.mark.parametrize("overlap", [False, True])
def test_dp_and_zero_terms_by_hand(zero, group, overlap):
    """16 replicas, 4 per node (4 nodes), dense parameters and experts over the
    expert-data-parallel group of 8 (shift 2); shard groups of 16 or 8 (hybrid: the shard
    all-reduced across the 2 groups); windows that hide part of the traffic."""
    if zero == 0 and group != 16:
        pytest.skip("ZeRO-0 has no shard group")
    kappa, window_b, window_f = 0.35, 0.012, 0.004
    train = TrainSpec(seq_len=S, dp_overlap=overlap)
    exposed, total = dp_time(
        links(4), train, kappa, BUCKET, groups=[(P_DENSE, 1), (P_EXPERT, 2)], replicas=16,
        in_node=4, group=group, zero=zero, m=M, layers=LAYERS, window_b=window_b,
        window_f=window_f, big_f=BIG_F, big_b=BIG_B, grad_bytes=GB, weight_bytes=WB,
        host_copy=lambda n: 1e9 * n)  # no offload: never called
    hand_exposed, hand_total = _dp_hand(zero, 16, 4, group, window_b, window_f, kappa, overlap)
    assert float(total) == pytest.approx(hand_total, rel=1e-12)
    assert float(exposed) == pytest.approx(hand_exposed, rel=1e-12)
    if overlap:
        assert float(exposed) < float(total)


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
