"""Closed forms on the cases where every term shows (issue 45 item 1): context-parallel
all-gather costs on an MLA model whose key and value widths differ (DeepSeek-V2-Lite:
d_k = qk_nope + qk_rope = 128 + 64 = 192, d_v = 128), and per-op SAC's recomputed matmuls on
an MoE model with shared experts and MLA (o-proj a·d_v wide, not a·d_k). Each expected value is
worked by hand here from the model's published config, not from the code under test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise.arch import get_model
from shardwise.choices import CP_KINDS, RECOMPUTE
from shardwise.estimate.activations import gathered_kv_bytes
from shardwise.estimate.axes import cp_time
from shardwise.estimate.links import Links
from shardwise.layout import TrainSpec

S, C, LAYERS = 4096, 4, 27
BW, ALPHA = 100e9, 5e-6  # an intra-node link: bytes/s, seconds per ring round


def _deepseek_v2_lite():
    model = get_model("deepseek-v2-lite")
    # config.json: 16 heads, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128
    assert (model.n_heads, model.n_kv_heads, model.head_dim, model.value_head_dim) == (
        16, 16, 192, 128)
    return model


def _cp(model, train: TrainSpec, rc: str):
    ctx = SimpleNamespace(model=model, seq_len=S, act_bytes=2.0, recompute_share=1.0,
                          calibration=SimpleNamespace(overlap_contention=0.0))
    links = Links(intra_bw=BW, intra_lat=ALPHA, inter_bw=BW / 4, inter_lat=4 * ALPHA,
                  gpus_per_node=8)
    return cp_time(ctx, links, train, t=1, c=C, u=1, b=1, rc=RECOMPUTE.index(rc),
                   layers=LAYERS, attn_f=1.0, attn_b=2.0, dp=1, p=1, e=1, gather=True)


@pytest.mark.parametrize("rc", ["none", "full"])
def test_cp_allgather_time_on_mla_by_hand(rc):
    """torchtitan's FlexAttention CP on 4 ranks of one node: per layer, all-gathers of K
    (s·b·16 heads·192·2 bytes) and V (…·128·…), each a ring of c - 1 rounds of α + S/(c·β);
    backward reduce-scatters both gradients (the same cost) and, under full recompute, gathers
    again; the gathered K/V are kept otherwise (`cp_gather_kept`)."""
    model = _deepseek_v2_lite()
    train = TrainSpec(impl="torchtitan", seq_len=S)
    k_bytes, v_bytes = S * 16 * 192 * 2, S * 16 * 128 * 2
    one = 2 * (C - 1) * ALPHA + (C - 1) / C * (k_bytes + v_bytes) / BW  # K and V, one way
    fwd, bwd = _cp(model, train, rc)
    assert float(fwd) == pytest.approx(LAYERS * one, rel=1e-9)
    assert float(bwd) == pytest.approx(LAYERS * one * (2 if rc == "full" else 1), rel=1e-9)


@pytest.mark.parametrize("rc, extra", [("none", True), ("op-sac", False), ("full", False)])
def test_gathered_kv_memory_on_mla_by_hand(rc, extra):
    """What the kept gathered K/V add to a layer's saved bytes: the other c - 1 ranks' share,
    (c-1)·(s/c)·b·16·(192 + 128)·2 bytes; nothing when recompute gathers again."""
    model = _deepseek_v2_lite()
    train = TrainSpec(impl="torchtitan", seq_len=S)
    got = gathered_kv_bytes(model, train, tp=1, cp=C, cp_kind=CP_KINDS.index("allgather"),
                            recompute=RECOMPUTE.index(rc), micro_batch=2)
    hand = (C - 1) * (S // C) * 2 * 16 * (192 + 128) * 2
    assert float(got) == (hand if extra else 0.0)
    # with tp = 4 a rank holds 16/4 heads of both
    got = gathered_kv_bytes(model, train, tp=4, cp=C, cp_kind=CP_KINDS.index("allgather"),
                            recompute=0, micro_batch=2)
    assert float(got) == hand / 4


def test_op_sac_recomputed_flops_with_shared_experts_by_hand():
    """torchtitan's per-op SAC saves every second matmul of a block, so wo and each MLP's
    third matmul (w3) run again, and in MoE layers every routed-expert matmul (grouped_mm is
    not on its save list) and the router gate (`ModelSpec.op_sac_recomputed_flops`;
    tests/estimate/test_compute_op_sac_moe.py runs the policy). DeepSeek-V2-Lite: 1 dense layer
    (d_ff 10944) and 26 MoE layers with 6 routed (3 matmuls each) + 2 shared experts of 1408
    per token and 64 experts; wo maps a·d_v = 16·128 = 2048 to h = 2048 (MLA: not 3072)."""
    model = _deepseek_v2_lite()
    assert (model.n_dense_layers, model.n_moe_layers, model.top_k, model.n_shared_experts,
            model.d_model, model.d_ff, model.expert_d_ff) == (1, 26, 6, 2, 2048, 10944, 1408)
    wo = 16 * 128 * 2048
    dense = wo + 2048 * 10944
    moe = wo + (6 * 3 + 2) * 2048 * 1408 + 2048 * 64
    assert model.op_sac_recomputed_flops() == 2.0 * (1 * dense + 26 * moe)
