"""The step's assembly (estimate/step.py `step_terms`) written out by hand from
docs/concepts/step-time.md ("The terms of the step") for one small layout where every term
shows: an MoE model with a shared expert and dense first layers (GQA), tp 2 with SP, cp 2
(ring), ep 4, dp 4, pp 2 interleaved over 2 chunks, ZeRO-3 with overlap, selective
recompute, 8 micro-batches, on 4 nodes of 8 GPUs whose links differ inside and across nodes.
The per-layer compute costs are given (chosen numbers, `costs`), so compute, TP, CP, PP,
bubble and optimizer are closed forms of them and of the links; the DP/ZeRO term is
`axes.dp_time` on the windows and groups the page states (its own closed forms:
tests/estimate/test_axes_closed_forms.py); the EP term is only held to its contract (it
is what `t_forward`/`t_backward` add beyond the other terms), not to a number."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.calibration import default_calibration
from shardwise.estimate.axes import dp_time
from shardwise.estimate.compute import ComputeContext
from shardwise.estimate.links import Links
from shardwise.estimate.step import busiest_stage_params, step_terms
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from tests.estimate.closed_forms import A_IN, A_OUT, B_IN, B_OUT, coll

MODEL = ModelSpec("step-moe", n_layers=8, d_model=1024, n_heads=16, n_kv_heads=4, d_ff=4096,
                  vocab=32000, n_experts=8, top_k=2, d_ff_expert=512, n_shared_experts=1,
                  first_dense_layers=2).validate()
S, M = 4096, 8
LINKS = Links(B_IN, A_IN, B_OUT, A_OUT, 8, host_bw=50e9, host_lat=5e-6, host="pcie5")
LAYOUT = Layout.parse("tp=2,cp=2,pp=2,dp=4,ep=4,sp=1,zero=3,schedule=interleaved,chunks=2,"
                      "recompute=selective")




def _cost(fwd, bwd, recompute, wgrad, attn_fwd, attn_bwd):
    return SimpleNamespace(fwd=fwd, bwd=bwd, recompute=recompute, wgrad=wgrad,
                           attn_fwd=attn_fwd, attn_bwd=attn_bwd, fp8_weights=0.0)


DENSE = _cost(1.0e-3, 2.1e-3, 0.3e-3, 0.9e-3, 0.25e-3, 0.6e-3)
MOE = _cost(1.7e-3, 3.3e-3, 0.5e-3, 1.4e-3, 0.26e-3, 0.62e-3)


def _terms(head=(0.8e-3, 1.5e-3), emb=(0.05e-3, 0.07e-3), layout=LAYOUT, dense=DENSE, moe=MOE,
           cal=None, **train):
    train = TrainSpec(seq_len=S, global_batch=M * layout.dp, dp_overlap=True, **train)
    cal = cal or default_calibration("h100-sxm")
    ctx = ComputeContext.of(MODEL, Cluster.of(32, "h100").accelerator, train, cal)
    costs = {"dense": dense, "moe": moe, "head": head, "embedding": emb}
    terms = step_terms(ctx, LINKS, train, m=M, costs=costs, partition=layout.partition,
                       **layout.codes())
    return {k: float(v) for k, v in terms.items()}, ctx, train


def test_every_term_of_the_step_by_hand():
    t, c, p, v, b, h = 2, 2, 2, 2, 1, MODEL.d_model
    terms, ctx, train = _terms()
    kappa = ctx.calibration.overlap_contention
    # 8 layers over 2 stages of 2 chunks: 4 layers a stage, the dense and MoE layers at their
    # average share (2/2 dense, 6/2 MoE)
    layers, n_dense, n_moe = 4, 1, 3
    f_mid = n_dense * DENSE.fwd + n_moe * MOE.fwd
    b_mid = (n_dense * (DENSE.bwd + DENSE.recompute) + n_moe * (MOE.bwd + MOE.recompute))
    w_mid = n_dense * DENSE.wgrad + n_moe * MOE.wgrad
    # the last stage (head) is the slowest
    f_crit, b_crit = f_mid + 0.8e-3, b_mid + 1.5e-3
    assert terms["compute"] == pytest.approx(M * (f_crit + b_crit), rel=1e-12)
    assert terms["t_wgrad"] == pytest.approx(w_mid, rel=1e-12)

    # TP (SP): per layer 2 reduce-scatter + all-gather pairs each way, tp inside a node; the
    # head's pair and the cross-entropy's 3 fp32 all-reduces per token
    act = S / c * b * h * 2
    ar = coll("reduce-scatter", act, t, 2) + coll("all-gather", act, t, 2)
    ce = 3 * coll("all-reduce", S / c * b * 4, t, 2)
    tp_f = tp_b = layers * 2 * ar
    assert terms["tp_comm"] == pytest.approx(M * (tp_f + tp_b + ar + ce), rel=1e-12)

    # CP ring over 2 ranks (stride tp = 2: both in one node): a K/V block of 4/2 heads of
    # 64 + 64 per hop, hidden behind half a layer's attention (+ κ of the hidden part);
    # backward twice the bytes plus selective recompute's replayed forward hop
    block = S / c * b * (4 // t) * (64 + 64) * 2
    hop = A_IN + block / B_IN

    def hidden(x, compute):
        return max(0.0, x - compute) + kappa * min(x, compute)

    attn_f = n_dense * DENSE.attn_fwd + n_moe * MOE.attn_fwd
    attn_b = n_dense * DENSE.attn_bwd + n_moe * MOE.attn_bwd
    hop_f = hidden(hop, attn_f / layers / c)
    cp_f = layers * (c - 1) * hop_f
    cp_b = layers * (c - 1) * (hidden(2 * hop, attn_b / layers / c) + hop_f)
    assert terms["cp_comm_exposed"] == pytest.approx(M * (cp_f + cp_b), rel=1e-12)

    # EP: what the forward and backward carry beyond compute, TP and CP
    ep_f = terms["t_forward"] - (f_mid + tp_f + cp_f)
    ep_b = terms["t_backward"] - (b_mid + tp_b + cp_b)
    assert ep_f > 0 and ep_b > 0
    assert terms["ep_comm"] == pytest.approx(M * (ep_f + ep_b), rel=1e-9)

    # PP: the stages are tp·cp·dp = 16 ranks apart (across nodes); s/c·b·h/t bytes per
    # transfer; interleaved Megatron overlaps the steady state: 2(p-1) exposed, κ·busy of 2vm
    size = S / c * b * h * 2 / t
    p2p = A_OUT + size / B_OUT
    busy = (A_IN + size / B_IN) / p2p
    pp = 2 * (p - 1) * p2p + kappa * busy * 2 * v * M * p2p
    assert terms["pp_comm"] == pytest.approx(pp, rel=1e-12)

    # bubble: interleaved (p-1)(T_F + T_B)/v of the middle stage's times, comm included
    big_f, big_b = terms["t_forward"], terms["t_backward"]
    assert terms["bubble"] == pytest.approx((p - 1) * (big_f + big_b) / v, rel=1e-12)

    # DP / ZeRO-3 over dp·cp = 8 replicas, 4 a node (stride tp): the dense parameters and the
    # experts over their expert-data-parallel group 8/(ep·etp/tp) = 2; windows: the
    # interleaved cool-down (1 + (v-1)p)/v = 1.5 micro-batch passes of the critical stage
    dense_p, expert_p = busiest_stage_params(MODEL, t, p, 4, v)
    window = (1 + (v - 1) * p) / v
    cal = ctx.calibration
    exposed, total = dp_time(
        LINKS, train, kappa, cal.dp_bucket_bytes, groups=[(dense_p, 1), (expert_p, 4)],
        replicas=8, in_node=4, group=8, zero=3, m=M, layers=layers,
        window_b=window * (b_crit + tp_b), window_f=window * (f_crit + tp_f), big_f=big_f,
        big_b=big_b, grad_bytes=2, weight_bytes=2, host_copy=lambda n: n)
    assert terms["dp_comm_exposed"] == pytest.approx(float(exposed), rel=1e-12)
    assert terms["dp_comm_total"] == pytest.approx(float(total), rel=1e-12)
    assert terms["dp_comm_exposed"] < terms["dp_comm_total"]

    # optimizer: Adam on the shard this rank updates (dense / 8, experts / 2), 30 bytes a
    # parameter (bf16 weights and gradients, fp32 master and moments) at the HBM's rate,
    # three fused kernels
    params = dense_p / 8 + expert_p / 2
    assert terms["optimizer"] == pytest.approx(
        params * 30 / ctx.hbm + 3 * cal.kernel_overhead, rel=1e-12)

    parts = ("compute", "tp_comm", "cp_comm_exposed", "ep_comm", "pp_comm", "bubble",
             "dp_comm_exposed", "optimizer")
    assert terms["total"] == pytest.approx(sum(terms[k] for k in parts), rel=1e-12)


def test_the_dp_window_holds_the_critical_stages_tp_backward():
    """Layers 100 times cheaper than DENSE and MOE, 8 MB buckets: ZeRO-1's gradient
    reduce-scatter outlasts its window, so the exposed part is what 1.5 critical-stage
    backward passes leave, each with its TP reduce-scatter/all-gather pairs (2 per layer of
    the stage's 4)."""
    t, c, p, v, h = 2, 2, 2, 2, MODEL.d_model
    cheap = {name: SimpleNamespace(**{k: x / 100 for k, x in vars(cost).items()})
             for name, cost in (("dense", DENSE), ("moe", MOE))}
    head = (0.8e-5, 1.5e-5)
    cal = replace(default_calibration("h100-sxm"), dp_bucket_bytes=8e6)
    terms, _, train = _terms(head=head, emb=(0.05e-5, 0.07e-5), layout=replace(LAYOUT, zero=1),
                             cal=cal, **cheap)
    d, e = cheap["dense"], cheap["moe"]
    f_crit = d.fwd + 3 * e.fwd + head[0]  # the last stage: 1 dense, 3 MoE layers, the head
    b_crit = d.bwd + d.recompute + 3 * (e.bwd + e.recompute) + head[1]
    act = S / c * h * 2
    tp_b = 4 * 2 * (coll("reduce-scatter", act, t, 2) + coll("all-gather", act, t, 2))
    tp_f = tp_b  # the same pairs each way
    dense_p, expert_p = busiest_stage_params(MODEL, t, p, 4, v)
    window = (1 + (v - 1) * p) / v
    exposed, _ = dp_time(
        LINKS, train, cal.overlap_contention, 8e6,
        groups=[(dense_p, 1), (expert_p, 4)], replicas=8, in_node=4, group=8, zero=1, m=M,
        layers=4, window_b=window * (b_crit + tp_b), window_f=window * (f_crit + tp_f),
        big_f=terms["t_forward"], big_b=terms["t_backward"], grad_bytes=2, weight_bytes=2,
        host_copy=lambda n: n)
    assert terms["dp_comm_exposed"] == pytest.approx(float(exposed), rel=1e-12)


def test_the_slowest_stage_is_the_first_when_the_embedding_costs_more():
    """An embedding costlier than the head makes the first stage critical (its layers plus
    the embedding); the compute and the ZeRO windows follow it."""
    emb = (1.1e-3, 1.9e-3)
    terms, _, _ = _terms(emb=emb)
    f_mid = DENSE.fwd + 3 * MOE.fwd
    b_mid = DENSE.bwd + DENSE.recompute + 3 * (MOE.bwd + MOE.recompute)
    assert terms["compute"] == pytest.approx(M * (f_mid + b_mid + sum(emb)), rel=1e-12)


def test_one_stage_carries_embedding_and_head_and_no_pipeline_terms():
    """pp = 1: the one stage runs every layer, the head and the embedding; TP pays the head's
    and the embedding's pair; no p2p, no bubble."""
    layout = Layout.parse("tp=2,cp=2,dp=8,ep=4,sp=1,zero=1,recompute=selective")
    head, emb = (0.8e-3, 1.5e-3), (0.05e-3, 0.07e-3)
    terms, _, _ = _terms(head=head, emb=emb, layout=layout)
    f = 2 * DENSE.fwd + 6 * MOE.fwd + head[0] + emb[0]
    bwd = (2 * (DENSE.bwd + DENSE.recompute) + 6 * (MOE.bwd + MOE.recompute) + head[1]
           + emb[1])
    assert terms["compute"] == pytest.approx(M * (f + bwd), rel=1e-12)
    act = S / 2 * 2 * 1024
    ar = coll("reduce-scatter", act, 2, 2) + coll("all-gather", act, 2, 2)
    ce = 3 * coll("all-reduce", S / 2 * 4, 2, 2)
    assert terms["tp_comm"] == pytest.approx(M * (8 * 4 * ar + 2 * ar + ce), rel=1e-12)
    assert terms["pp_comm"] == terms["bubble"] == 0.0


def test_uneven_stages_scale_the_bubble_by_the_other_stages_layers():
    """An explicit partition 3:5 over pp 2 (1F1B): the busiest stage holds 5 layers; its
    per-layer terms scale by 5/4 and the bubble's (p-1) busiest-stage times become the other
    stage's 3 layers: (p - most)/((p-1)·most) with most = 5·2/8."""
    layout = Layout.parse("tp=2,cp=2,pp=2,dp=4,ep=4,sp=1,zero=1,partition=3:5")
    terms, _, _ = _terms(layout=layout)
    most = 5 * 2 / 8
    others = (2 - most) / ((2 - 1) * most)
    assert others == pytest.approx(3 / 5)
    big_f, big_b = terms["t_forward"], terms["t_backward"]
    assert terms["bubble"] == pytest.approx(others * (big_f + big_b), rel=1e-12)
    # the busiest stage (5 layers: 1.25 of the average) plus the head is the slowest
    f_mid = most * (DENSE.fwd + 3 * MOE.fwd)
    b_mid = most * (DENSE.bwd + DENSE.recompute + 3 * (MOE.bwd + MOE.recompute))
    assert terms["compute"] == pytest.approx(M * (f_mid + b_mid + 0.8e-3 + 1.5e-3),
                                             rel=1e-12)


def test_zero_one_optimizer_and_the_no_overlap_default():
    """ZeRO-1 shards the optimizer over the 8 replicas (experts over their 2); without
    --overlap-grad-reduce (Megatron's default) every DP byte is exposed."""
    layout = replace(LAYOUT, zero=1)
    on, ctx, _ = _terms(layout=layout)
    dense_p, expert_p = busiest_stage_params(MODEL, 2, 2, 4, 2)
    cal = ctx.calibration
    assert on["optimizer"] == pytest.approx(
        (dense_p / 8 + expert_p / 2) * 30 / ctx.hbm + 3 * cal.kernel_overhead, rel=1e-12)
    train = TrainSpec(seq_len=S, global_batch=M * 4)
    ctx = ComputeContext.of(MODEL, Cluster.of(32, "h100").accelerator, train, cal)
    off = step_terms(ctx, LINKS, train, m=M, costs={"dense": DENSE, "moe": MOE,
                                                    "head": (0.8e-3, 1.5e-3),
                                                    "embedding": (0.05e-3, 0.07e-3)},
                     **layout.codes())
    assert float(off["dp_comm_exposed"]) == pytest.approx(float(off["dp_comm_total"]))
    assert float(off["dp_comm_total"]) == pytest.approx(on["dp_comm_total"], rel=1e-12)


def test_estimate_step_rates_by_their_definitions():
    """`estimate_step` on llama3-8b, dp 2 · tp 2 · pp 2 (1F1B), micro-batch 2, full recompute:
    tokens per step m·b·dp·s; model FLOP/s per GPU = 3 × forward with full s² attention
    (6N' + 12·L·h·s per token, N' the matmul parameters) × tokens / (step · GPUs); MFU over
    the H100's 989 TFLOP/s dense BF16 (datasheet); HFU adds full recompute's forward (4/3 of
    the model FLOPs' matmul part and attention); mfu_causal the causal half of the square;
    the bubble fraction bubble / step; the band ± the uncertainty's half-width."""
    from shardwise.arch import get_model
    from shardwise.estimate.step import estimate_step

    model, s, gb = get_model("llama3-8b"), 4096, 64
    layout = Layout.parse("dp=2,tp=2,pp=2,sp=1,mb=2,recompute=full")
    est = estimate_step(model, Cluster.of(8, "h100"), layout, TrainSpec(s, gb))
    m = gb // (2 * 2)
    assert est.microbatches == m == 16 and est.n_gpus == 8
    assert est.tokens_per_step == m * 2 * 2 * s
    assert est.tokens_per_s == pytest.approx(m * 2 * 2 * s / est.total, rel=1e-12)
    params = model.count_params()
    matmul = params.total - model.vocab * model.d_model - params.norms  # embedding: a lookup
    attention = 12 * model.n_layers * model.d_model * s
    per_token = 6 * matmul + attention
    assert est.model_flops_per_gpu == pytest.approx(per_token * m * 2 * 2 * s / (est.total * 8),
                                                    rel=1e-9)
    assert est.mfu == pytest.approx(est.model_flops_per_gpu / 989e12, rel=1e-9)
    head = 2 * model.vocab * model.d_model  # the LM head's forward: not recomputed
    hw = per_token + (2 * matmul - head + attention / 3)
    assert est.hfu == pytest.approx(est.mfu * hw / per_token, rel=1e-6)
    causal = per_token - attention / 2
    assert est.mfu_causal == pytest.approx(est.mfu * causal / per_token, rel=1e-9)
    assert est.bubble_fraction == pytest.approx(est.bubble / est.total, rel=1e-12)
    assert est.bubble > 0
    width = est.uncertainty.band
    assert est.band == pytest.approx((est.total * (1 - width), est.total * (1 + width)))
    assert est.breakdown()["bubble"] == est.bubble and sum(est.breakdown().values()) == (
        pytest.approx(est.total, rel=1e-12))
    assert est.to_dict()["microbatches"] == m
    # the "this machine" preset (the runtime's op count) carries no band: `check` validates it
    runtime = replace(default_calibration("h100-sxm"), op_count="runtime")
    assert estimate_step(model, Cluster.of(8, "h100"), layout, TrainSpec(s, gb),
                         runtime).uncertainty is None
    # no band: none known (no uncertainty) or "not validated" (band None)
    assert replace(est, uncertainty=None).band == (est.total, est.total)
    unbacked = replace(est, uncertainty=replace(est.uncertainty, band=None))
    assert unbacked.band == (est.total, est.total)


def test_simulated_bubble_runs_each_stage_at_its_share_of_the_busiest():
    """`simulate=True` with an explicit partition 20:12 of llama3-8b's 32 layers (1F1B, pp 2):
    the schedule simulator runs stage 0 at 20/20 of the busiest stage's per-micro-batch times
    and stage 1 at 12/20 (the closed form is only an upper bound here); the bubble is its makespan minus the busiest stage's busy time
    m·(t_f + t_b), and the total moves by the difference from the closed form."""
    from shardwise.arch import get_model
    from shardwise.estimate.step import estimate_step
    from shardwise.schedules import stage_timeline

    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    layout = Layout.parse("tp=2,pp=2,dp=2,sp=1,partition=20:12")
    train = TrainSpec(4096, 16)
    closed = estimate_step(model, cluster, layout, train)
    sim = estimate_step(model, cluster, layout, train, simulate=True)
    m = 8
    timeline = stage_timeline("1f1b", 2, m, 1, t_f=closed.t_forward, t_b=closed.t_backward,
                              shares=[1.0, 12 / 20])
    want = timeline.makespan - m * (closed.t_forward + closed.t_backward)
    assert sim.bubble == pytest.approx(want, rel=1e-9)
    assert sim.bubble < 0.9 * closed.bubble
    assert sim.bubble_source == "simulator" and closed.bubble_source == "closed form"
    assert sim.total == pytest.approx(closed.total - closed.bubble + want, rel=1e-12)
    assert sim.bubble_fraction == pytest.approx(want / sim.total, rel=1e-9)
    # one stage: nothing to simulate
    one = estimate_step(model, cluster, Layout.parse("tp=2,dp=4,sp=1"), train, simulate=True)
    assert one.bubble == 0.0 and one.bubble_source == "closed form"


@pytest.mark.parametrize("impl, pairs", [("megatron-te", (1 + (1 - 3 / 4)) / 2),
                                         ("torchtitan", 1.0)])
def test_moe_layers_without_shared_experts_make_no_mlp_pair_on_megatron(impl, pairs):
    """Megatron-Core's MoE layer without shared experts makes no TP pair for its MLP (the
    routed tokens stay sequence-sharded; the dispatcher gathers over expert-TP): of a
    stage's 4 layers, 3 MoE, the MLP pairs are 1 - 3/4 of them, the attention's all 4.
    torchtitan's MoE block all-reduces (or RS+AG) its output as a dense MLP would."""
    model = replace(MODEL, n_shared_experts=0, name="step-moe-routed").validate()
    train = TrainSpec(seq_len=S, global_batch=M * 4, impl=impl)
    cal = default_calibration("h100-sxm")
    ctx = ComputeContext.of(model, Cluster.of(32, "h100").accelerator, train, cal)
    layout = Layout.parse("tp=2,pp=2,dp=8,ep=4,sp=1,zero=1")
    costs = {"dense": DENSE, "moe": MOE, "head": (0.8e-3, 1.5e-3),
             "embedding": (0.05e-3, 0.07e-3)}
    terms = step_terms(ctx, LINKS, train, m=M, costs=costs, **layout.codes())
    act = S * 1 * 1024 * 2
    ar = coll("reduce-scatter", act, 2, 2) + coll("all-gather", act, 2, 2)
    ce = 3 * coll("all-reduce", S * 4, 2, 2)
    layers = 4
    want = M * (layers * pairs * 2 * ar * 2 + ar + ce)
    assert float(terms["tp_comm"]) == pytest.approx(want, rel=1e-12)


def test_experts_replicated_once_keep_their_whole_optimizer_state():
    """dp·cp = 4 replicas and ep 4 (etp = tp): the experts' data-parallel group is
    4/(4·2/2) = 1, so ZeRO-1 leaves each rank all its experts' state (dense over 4)."""
    layout = Layout.parse("tp=2,cp=2,pp=2,dp=2,ep=4,sp=1,zero=1,schedule=interleaved,"
                          "chunks=2")
    terms, ctx, _ = _terms(layout=layout)
    dense_p, expert_p = busiest_stage_params(MODEL, 2, 2, 4, 2)
    assert terms["optimizer"] == pytest.approx(
        (dense_p / 4 + expert_p / 1) * 30 / ctx.hbm + 3 * ctx.calibration.kernel_overhead,
        rel=1e-12)


def test_ring_hops_longer_than_the_attention_are_exposed_by_the_difference():
    """The ring's hops (2 CP ranks, one node) behind attention shorter than a hop: each hop
    is exposed past its layer's share of the attention, dense and MoE layers' attention at
    their average share (1 dense, 3 MoE on the stage), the backward's two hops behind the
    backward attention, plus selective recompute's replayed forward hop."""
    short_dense = _cost(1.0e-3, 2.1e-3, 0.3e-3, 0.9e-3, 2.0e-6, 5.0e-6)
    short_moe = _cost(1.7e-3, 3.3e-3, 0.5e-3, 1.4e-3, 2.2e-6, 5.6e-6)
    terms, ctx, _ = _terms(dense=short_dense, moe=short_moe)
    kappa, t, c, layers = ctx.calibration.overlap_contention, 2, 2, 4
    hop = A_IN + S / c * (4 // t) * (64 + 64) * 2 / B_IN

    def hidden(x, compute):
        return max(0.0, x - compute) + kappa * min(x, compute)

    attn_f = 1 * 2.0e-6 + 3 * 2.2e-6
    attn_b = 1 * 5.0e-6 + 3 * 5.6e-6
    assert attn_f / layers / c < hop and attn_b / layers / c < 2 * hop  # exposed
    hop_f = hidden(hop, attn_f / layers / c)
    cp_f = layers * (c - 1) * hop_f
    cp_b = layers * (c - 1) * (hidden(2 * hop, attn_b / layers / c) + hop_f)
    assert terms["cp_comm_exposed"] == pytest.approx(M * (cp_f + cp_b), rel=1e-12)


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize(("gpu", "per_cast"), [("h100", 2 + 1 + 1), ("b200", 2 + 1)])
def test_fp8_weight_casts_once_per_step_or_per_micro_batch_under_zero3(zero, gpu, per_cast):
    """FP8 (Transformer Engine's delayed scaling, weights cached): the busiest stage's FP8
    weights (1 dense layer's and 3 MoE layers' worth at their average share) are cast once
    per step at the recipe's bytes per element — read bf16, write FP8 and on Hopper its
    transpose, which Blackwell does not keep — every micro-batch under ZeRO-3, whose
    gathered weights TE casts again; memory-bound at the HBM's rate, inside `compute`."""
    dense = SimpleNamespace(**{**vars(DENSE), "fp8_weights": 3.0e6})
    moe = SimpleNamespace(**{**vars(MOE), "fp8_weights": 5.0e6})
    layout = replace(LAYOUT, zero=zero)
    train = TrainSpec(seq_len=S, global_batch=M * 4, fp8="delayed")
    accelerator = Cluster.of(32, gpu).accelerator
    cal = default_calibration(accelerator.calibration_name)
    ctx = ComputeContext.of(MODEL, accelerator, train, cal)
    costs = {"dense": dense, "moe": moe, "head": (0.8e-3, 1.5e-3),
             "embedding": (0.05e-3, 0.07e-3)}
    terms = step_terms(ctx, LINKS, train, m=M, costs=costs, **layout.codes())
    weights = 1 * 3.0e6 + 3 * 5.0e6
    casts = per_cast * weights * (M if zero == 3 else 1) / ctx.hbm
    f_crit = DENSE.fwd + 3 * MOE.fwd + 0.8e-3
    b_crit = DENSE.bwd + DENSE.recompute + 3 * (MOE.bwd + MOE.recompute) + 1.5e-3
    assert float(terms["compute"]) == pytest.approx(M * (f_crit + b_crit) + casts, rel=1e-12)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_dense_models_fp8_weight_casts_are_its_dense_layers_only(zero):
    """FP8 on a dense model (MODEL without experts): the busiest stage casts its 4 dense
    layers' FP8 weights (8 layers over 2 stages), no MoE layer's, once per step or every
    micro-batch under ZeRO-3, memory-bound at the HBM's rate."""
    dense_model = replace(MODEL, name="step-dense", n_experts=0, top_k=0, d_ff_expert=0,
                          n_shared_experts=0, first_dense_layers=0).validate()
    dense = SimpleNamespace(**{**vars(DENSE), "fp8_weights": 3.0e6})
    layout = replace(LAYOUT, ep=1, zero=zero)
    train = TrainSpec(seq_len=S, global_batch=M * 4, fp8="delayed")
    ctx = ComputeContext.of(dense_model, Cluster.of(32, "h100").accelerator, train,
                            default_calibration("h100-sxm"))
    costs = {"dense": dense, "head": (0.8e-3, 1.5e-3), "embedding": (0.05e-3, 0.07e-3)}
    terms = step_terms(ctx, LINKS, train, m=M, costs=costs, **layout.codes())
    per_cast = ctx.fp8.cast_bytes(ctx.generation).weight_step
    casts = per_cast * 4 * 3.0e6 * (M if zero == 3 else 1) / ctx.hbm
    f_crit = 4 * DENSE.fwd + 0.8e-3  # the last stage's 4 layers and the head
    b_crit = 4 * (DENSE.bwd + DENSE.recompute) + 1.5e-3
    assert float(terms["compute"]) - M * (f_crit + b_crit) == pytest.approx(casts, rel=1e-9)


@pytest.mark.parametrize("optimizer, moments", [("sgd", 0.0), ("sgd-momentum", 4.0),
                                                ("adafactor", None)])
def test_the_optimizer_step_moves_its_own_state(optimizer, moments):
    """Per parameter the step reads the gradient twice (clipping, the update), writes the
    weight, reads and writes the fp32 master and the moments: 2·2 + 2 + 2·(4 + moments)
    bytes (bf16 weights and gradients); SGD keeps no moment, momentum SGD one fp32 buffer."""
    from shardwise.estimate.state import MOMENT_BYTES

    moments = MOMENT_BYTES[optimizer] if moments is None else moments
    terms, ctx, _ = _terms(optimizer=optimizer)
    dense_p, expert_p = busiest_stage_params(MODEL, 2, 2, 4, 2)
    per_param = 2 * 2 + 2 + 2 * (4 + moments)
    assert terms["optimizer"] == pytest.approx(
        (dense_p / 8 + expert_p / 2) * per_param / ctx.hbm
        + 3 * ctx.calibration.kernel_overhead, rel=1e-12)


def test_an_optimizer_offload_of_nothing_costs_nothing():
    """Megatron's --optimizer-offload-fraction 0: no parameter's state on the host, so no
    copy (not even a copy's latency) and no CPU step: every term as without offload."""
    layout = Layout.parse("tp=2,cp=2,pp=2,dp=4,ep=4,sp=1,zero=1,schedule=interleaved,"
                          "chunks=2")
    none, _, _ = _terms(layout=layout)
    kept, _, _ = _terms(layout=layout, offload="optimizer", offload_fraction=0.0)
    assert kept == pytest.approx(none, rel=1e-12)


def test_a_host_copy_pays_the_links_latency_for_any_bytes_and_nothing_for_none():
    from shardwise.estimate.step import host_copy_time

    got = host_copy_time(LINKS, np.array([0.0, 1.0, 1e9]))
    assert got.tolist() == pytest.approx([0.0, 5e-6 + 1 / 50e9, 5e-6 + 1e9 / 50e9], rel=1e-12)


def test_the_first_stages_expert_traffic_is_its_own_moe_layers_not_the_mtp_stages():
    """With the embedding costly the first stage is critical; a multi-token-prediction module
    adds one MoE layer to the last stage only, so the first stage's compute and its EP term
    are the same with it and without it (the EP term: the busiest stage's scaled to the
    critical stage's own MoE layers)."""
    emb = (10e-3, 20e-3)
    without, _, _ = _terms(emb=emb, mtp_layers=0)
    with_mtp, _, _ = _terms(emb=emb, mtp_layers=1)
    f_mid = DENSE.fwd + 3 * MOE.fwd
    b_mid = DENSE.bwd + DENSE.recompute + 3 * (MOE.bwd + MOE.recompute)
    for terms in (without, with_mtp):  # the first stage is critical in both
        assert terms["compute"] == pytest.approx(M * (f_mid + b_mid + sum(emb)), rel=1e-12)
    assert with_mtp["ep_comm"] == pytest.approx(without["ep_comm"], rel=1e-12)
    assert without["ep_comm"] > 0


def test_a_dense_models_mtp_module_runs_a_dense_layer():
    """A dense model's multi-token-prediction module on the last stage: its eh_proj
    (T × 2h)·(2h × h/t), one more dense layer and the head again (not an MoE layer, whose
    costs a dense model's table may still hold)."""
    from shardwise.estimate.compute import linear

    model = replace(MODEL, name="step-dense", n_experts=0, top_k=0, d_ff_expert=0,
                    n_shared_experts=0, first_dense_layers=0).validate()
    layout = Layout.parse("tp=2,pp=2,dp=8,sp=1")
    train = TrainSpec(seq_len=S, global_batch=M * layout.dp, mtp_layers=1)
    ctx = ComputeContext.of(model, Cluster.of(32, "h100").accelerator, train)
    head = (0.8e-3, 1.5e-3)
    costs = {"dense": DENSE, "moe": MOE, "head": head, "embedding": (0.05e-3, 0.07e-3)}
    terms = step_terms(ctx, LINKS, train, m=M, costs=costs, **layout.codes())
    proj = linear(ctx, S * 1, 2 * model.d_model, model.d_model / 2)
    f = 4 * DENSE.fwd + head[0] + DENSE.fwd + proj.fwd + head[0]
    b = (4 * (DENSE.bwd + DENSE.recompute) + head[1]
         + DENSE.bwd + DENSE.recompute + proj.dgrad + proj.wgrad + head[1])
    assert float(terms["compute"]) == pytest.approx(M * (f + b), rel=1e-12)


def test_the_critical_stage_weighs_its_own_expert_traffic_under_one_moe_layer_a_stage():
    """pp 8 over 8 layers: each stage holds 6/8 of an MoE layer on average, the last one more
    with the MTP module. The first stage (the embedding) becomes critical exactly where its
    compute and its own share of the EP traffic (6/8 ÷ (6/8 + 1) of the last stage's)
    overtake the last stage's — found here from the last stage's reported terms; 0.2 % either
    side of that embedding cost decides it."""
    layout = Layout.parse("tp=2,cp=2,pp=8,dp=2,ep=4,sp=1,zero=1,recompute=selective")
    last, _, _ = _terms(emb=(0.05e-3, 0.07e-3), layout=layout, mtp_layers=1)
    n_dense, n_moe = 2 / 8, 6 / 8
    f_mid = n_dense * DENSE.fwd + n_moe * MOE.fwd
    b_mid = n_dense * (DENSE.bwd + DENSE.recompute) + n_moe * (MOE.bwd + MOE.recompute)
    ep_first = last["ep_comm"] * n_moe / (n_moe + 1)
    edge = (last["compute"] + last["ep_comm"] - ep_first) / M - (f_mid + b_mid)
    below, _, _ = _terms(emb=(0.499 * edge, 0.499 * edge), layout=layout, mtp_layers=1)
    above, _, _ = _terms(emb=(0.501 * edge, 0.501 * edge), layout=layout, mtp_layers=1)
    assert below["compute"] == last["compute"]  # still the last stage
    assert above["compute"] == pytest.approx(M * (f_mid + b_mid + 1.002 * edge), rel=1e-12)
    assert above["ep_comm"] == pytest.approx(ep_first, rel=1e-12)


def test_stages_one_node_apart_send_over_the_inter_node_link():
    """tp 2 · cp 2 · dp 2: consecutive stages are 8 ranks apart on nodes of 8, so each stage
    fills a node and the pipeline's p2p crosses nodes (the closed form of the full layout
    above, on the inter-node link)."""
    layout = Layout.parse("tp=2,cp=2,pp=2,dp=2,ep=4,sp=1,zero=3,schedule=interleaved,"
                          "chunks=2,recompute=selective")
    terms, ctx, _ = _terms(layout=layout)
    t, c, b, h, p, v = 2, 2, 1, MODEL.d_model, 2, 2
    kappa = ctx.calibration.overlap_contention
    size = S / c * b * h * 2 / t
    p2p = A_OUT + size / B_OUT
    busy = (A_IN + size / B_IN) / p2p
    pp = 2 * (p - 1) * p2p + kappa * busy * 2 * v * M * p2p
    assert terms["pp_comm"] == pytest.approx(pp, rel=1e-12)


def test_estimate_step_without_a_training_spec_runs_the_default_one():
    """`train` left out is `TrainSpec()`, the documented default."""
    from shardwise.estimate.step import estimate_step

    model, cluster = get_model("tiny-deepseek"), Cluster.of(8, "h100")
    layout = Layout(dp=2, tp=2, pp=2, ep=2)
    assert estimate_step(model, cluster, layout).total == \
        estimate_step(model, cluster, layout, TrainSpec()).total
