"""estimate/compute.py against hand closed forms, one resource at a time: every GEMM at
peak with free memory (time × rate = FLOPs), free compute on a slow HBM (time × bandwidth =
bytes), and free device work (time = launches × the cost of one). The models make every term
distinguishable: MLA with a q latent and d_qk ≠ d_v, MoE with top-k > 1 and two shared experts
of a width f_e ≠ f, GQA with d_head·a ≠ h; layouts with tp·etp·ep > 1, sequence parallelism,
uneven routing (λ ≠ 1, a ≠ 1). The formulas are written out here from the docstrings'
contracts (Megatron's layer shapes; FlashAttention's FLOP count), not read from the code."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardwise.arch import ModelSpec
from shardwise.calibration import default_calibration
from shardwise.estimate.compute import (
    RC_CODES,
    ComputeContext,
    embedding_cost,
    head_cost,
    layer_cost,
)
from shardwise.hardware import get_accelerator, get_link
from shardwise.layout import TrainSpec

SEQ = 1024
H100 = get_accelerator("h100")
# MLA (q latent 96, kv latent 64, d_nope 32 + d_R 16 = d_qk 48 ≠ d_v 24), 16 experts of
# f_e = 96, top-4, 2 shared experts; dense layers at f = 640
MLA_MOE = ModelSpec(name="mla-moe", n_layers=2, d_model=256, n_heads=8, n_kv_heads=8,
                    d_ff=640, vocab=512, max_seq=SEQ, n_experts=16, top_k=4, d_ff_expert=96,
                    n_shared_experts=2, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                    qk_rope_head_dim=16, v_head_dim=24).validate()
# GQA with heads wider than h/a: a·d = 384 ≠ h = 256 (Qwen3-MoE, Gemma, gpt-oss do so)
GQA = ModelSpec(name="gqa-wide", n_layers=2, d_model=256, n_heads=8, n_kv_heads=2, d_head=48,
                d_ff=640, vocab=512, max_seq=SEQ).validate()
# GELU MLP (one input matrix), dropout, LayerNorm, GQA heads of h/a
GELU = ModelSpec(name="gelu", n_layers=2, d_model=256, n_heads=8, n_kv_heads=4, d_ff=640,
                 vocab=512, max_seq=SEQ, gated_mlp=False, dropout=True,
                 norm="layernorm").validate()
LOAD, ACTIVE = 1.5, 0.75  # the busiest rank's rows ÷ the balanced share; experts with rows


def _ctx(model: ModelSpec, *, peak: float = 1e30, hbm: float = 1e30, overhead: float = 0.0,
         flash: bool = True, **train) -> ComputeContext:
    """A context with one resource priced: `peak` FLOP/s at efficiency 1 (no saturation, no
    job share), `hbm` bytes/s at efficiency 1, `overhead` seconds per host launch."""
    cal = replace(default_calibration("h100-sxm"), matmul_half_dim=0.0, matmul_efficiency=1.0,
                  attention_efficiency=1.0, sustained_compute=1.0, attention_kernel="",
                  attention_kernels={}, hbm_efficiency=1.0, kernel_overhead=overhead)
    spec = TrainSpec(seq_len=SEQ, flash_attention=flash, **train)
    ctx = ComputeContext.of(model, H100, spec, cal)
    return replace(ctx, peak=peak, accelerator=replace(ctx.accelerator, hbm_bandwidth=hbm))


def _sync(ctx: ComputeContext) -> float:
    """The dispatcher's blocking copy: the host link's latency and one launch."""
    return get_link(H100.host, H100.links).latency + ctx.calibration.kernel_overhead


# --------------------------------------------------------------------------- FLOPs
def _mla_moe_flops(t: int, sp: bool, load: float = LOAD) -> tuple[float, float, float]:
    """(projection + router + experts GEMM FLOPs, attention core FLOPs, op-sac recompute
    GEMM FLOPs) of one MLA MoE layer forward on one rank: Megatron-Core's MLASelfAttention
    (down-projections duplicated on every tp rank, on the sequence shard under SP; the rest
    split by heads), the router whole, the routed experts' T·k·λ rows shared by the tp group
    (each etp group runs its share at f_e/etp: T·k·λ·3·h·f_e/t whatever etp and ep), the
    shared experts at f_e/t on every row."""
    m = MLA_MOE
    h, a, f = m.d_model, m.n_heads / t, m.expert_d_ff
    tokens = SEQ
    down_rows = tokens / (t if sp else 1)
    down = 2 * down_rows * h * (96 + 64 + 16)
    up = 2 * tokens * (96 * a * 48 + 64 * a * (32 + 24))
    out = 2 * tokens * a * 24 * h
    router = 2 * tokens * h * 16
    routed = 2 * tokens * 4 * load * 3 * h * f / t
    shared = 2 * 2 * tokens * 3 * h * f / t
    core = 2 * tokens * (SEQ / 2) * a * (48 + 24)  # causal: s/2 keys; QKᵀ at 48, P·V at 24
    # op-sac runs again wo, the router, every routed GEMM and the shared experts' w3
    sac = out + router + routed + 2 * 2 * tokens * h * f / t
    return down + up + out + router + routed + shared, core, sac


@pytest.mark.parametrize("t, sp, ep, etp", [(1, False, 1, 0), (2, True, 4, 0),
                                             (4, False, 2, 1), (4, True, 8, 2)])
def test_mla_moe_layer_flops_per_rank(t, sp, ep, etp):
    """Forward = GEMMs + attention core; backward = 2 × GEMMs (input and weight gradients)
    + 2.5 × the core (FlashAttention's backward); wgrad = the GEMMs once; the dispatcher's
    sync once per forward; selective recompute the core, full the forward, op-sac the GEMMs
    it does not save."""
    peak = 1e9  # slow enough that every GEMM outlasts the experts' host launches
    ctx = _ctx(MLA_MOE, peak=peak, expert_load=LOAD, experts_active=ACTIVE)
    gemms, core, sac = _mla_moe_flops(t, sp)
    costs = {rc: layer_cost(ctx, t, 1, 1, sp, RC_CODES[rc], moe=True, ep=ep, etp=etp)
             for rc in ("none", "selective", "full")}
    cost = costs["none"]
    sync = _sync(ctx)
    assert cost.wgrad * peak == pytest.approx(gemms, rel=1e-12)
    assert cost.attn_fwd * peak == pytest.approx(core, rel=1e-12)
    assert cost.attn_bwd * peak == pytest.approx(2.5 * core, rel=1e-12)
    assert (cost.fwd - sync) * peak == pytest.approx(gemms + core, rel=1e-12)
    assert cost.bwd * peak == pytest.approx(2 * gemms + 2.5 * core, rel=1e-12)
    assert cost.recompute == 0
    assert costs["selective"].recompute * peak == pytest.approx(core, rel=1e-12)
    assert costs["full"].recompute == pytest.approx(cost.fwd, rel=1e-12)
    op_sac = layer_cost(ctx, t, 1, 1, sp, 3, moe=True, ep=ep, etp=etp)
    assert op_sac.recompute * peak == pytest.approx(sac, rel=1e-12)


def test_full_recompute_replays_its_share_of_the_layers():
    ctx = replace(_ctx(GQA, peak=1e9), recompute_share=0.25)
    cost = layer_cost(ctx, 2, 1, 1, True, RC_CODES["full"])
    assert cost.recompute == pytest.approx(0.25 * cost.fwd, rel=1e-12)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_gqa_layer_flops_use_the_heads_width(t):
    """Q and O are `h × a·d` (a·d = 384 ≠ h = 256 here), K and V `h × a_kv·d` with whole
    K/V heads per rank (one replicated when t > a_kv), the gated MLP 3·h·f; the core's
    scores and P·V at d; ÷ t per rank; micro-batch b scales the rows."""
    peak = 1e9
    ctx = _ctx(GQA, peak=peak)
    b, h, d = 2, 256, 48
    tokens = SEQ * b
    kv = max(2 // t, 1) * d
    q = 8 * d / t
    gemms = 2 * tokens * (h * (q + 2 * kv) + q * h + 3 * h * 640 / t)
    core = 2 * tokens * (SEQ / 2) * (8 / t) * 2 * d
    cost = layer_cost(ctx, t, 1, b, False, 0)
    assert cost.wgrad * peak == pytest.approx(gemms, rel=1e-12)
    assert cost.fwd * peak == pytest.approx(gemms + core, rel=1e-12)
    op_sac = layer_cost(ctx, t, 1, b, False, 3)
    # wo and w3 (torchtitan's SelectiveAC saves every second matmul)
    assert op_sac.recompute * peak == pytest.approx(2 * tokens * (q * h + h * 640 / t),
                                                     rel=1e-12)


def test_context_parallel_ranks_run_their_share_of_the_queries():
    """cp = c: each rank holds s/c queries (all s keys over the ring): GEMMs and the core
    ÷ c."""
    peak = 1e9
    ctx = _ctx(GELU, peak=peak)
    one, four = layer_cost(ctx, 2, 1, 1, True, 0), layer_cost(ctx, 2, 4, 1, True, 0)
    assert four.wgrad == pytest.approx(one.wgrad / 4, rel=1e-12)
    assert four.attn_fwd == pytest.approx(one.attn_fwd / 4, rel=1e-12)


def test_head_flops_and_embedding_bytes():
    """LM head `(T × h)·(h × V/t)`: forward once, backward twice; the embedding's gather
    reads and writes T·h activations, its backward twice that."""
    peak = 1e9
    ctx = _ctx(GQA, peak=peak)
    fwd, bwd, wgrad = head_cost(ctx, 4, 1, 2, True)
    flops = 2 * 2 * SEQ * 256 * 512 / 4
    assert wgrad * peak == pytest.approx(flops, rel=1e-12)
    assert fwd * peak == pytest.approx(flops, rel=1e-12)  # kernel_overhead 0
    assert bwd * peak == pytest.approx(2 * flops, rel=1e-12)
    hbm = 1e9
    mem = _ctx(GQA, hbm=hbm, overhead=1e-3)
    f, bw = embedding_cost(mem, 4, 2, 3)
    rows = 2 * 2 * (SEQ / 2 * 3) * 256  # bf16, T = s/c·b
    assert f == pytest.approx(rows / hbm + 1e-3, rel=1e-12)
    assert bw == pytest.approx(2 * rows / hbm + 1e-3, rel=1e-12)


# --------------------------------------------------------------------------- bytes
def _gemm_bytes(m: float, k: float, n: float, ab: float = 2) -> float:
    """A GEMM's HBM traffic: both operands read, the output written."""
    return ab * (m * k + k * n + m * n)


@pytest.mark.parametrize("t, sp", [(1, False), (2, True), (4, False)])
def test_dense_layer_bytes(t, sp):
    """Forward bytes per rank, R = T·h (÷ t under SP, else every tp rank repeats it): two
    norms 4R·ab, two residual adds 6R·ab, dropout masks 2R; QKV post-processing
    2·ab·T·(q + 2kv) and the attention output 2·ab·T·q (q = a·d/t); the GELU 2·ab·T·f/t;
    plus each GEMM's operands and output; backward twice the elementwise bytes and two
    GEMMs per forward one."""
    hbm = 1e6
    ctx = _ctx(GELU, hbm=hbm)
    h, d, f, ab = 256, 32, 640 / t, 2
    tokens = SEQ
    rows = tokens * h / (t if sp else 1)
    kv = max(4 // t, 1) * d
    q = 8 * d / t
    elementwise = ((4 + 6) * ab + 2) * rows + 2 * ab * tokens * (q + 2 * kv) \
        + 2 * ab * tokens * q + 2 * ab * tokens * f
    gemms = (_gemm_bytes(tokens, h, q + 2 * kv) + _gemm_bytes(tokens, q, h)
             + _gemm_bytes(tokens, h, f) + _gemm_bytes(tokens, f, h))
    cost = layer_cost(ctx, t, 1, 1, sp, 0)
    assert cost.fwd * hbm == pytest.approx(elementwise + gemms, rel=1e-9)
    assert cost.bwd * hbm == pytest.approx(2 * elementwise + 2 * gemms, rel=1e-9)
    assert cost.wgrad * hbm == pytest.approx(gemms, rel=1e-9)
    # op-sac: wo, w1 (the only MLP input matrix) and every memory-bound op again
    sac = layer_cost(ctx, t, 1, 1, sp, 3).recompute
    assert sac * hbm == pytest.approx(_gemm_bytes(tokens, q, h) + _gemm_bytes(tokens, h, f)
                                      + elementwise, rel=1e-9)


def test_materialised_attention_bytes_and_batched_gemms():
    """Without flash (c = 1): QKᵀ `(s×d)·(d×s)` and P·V `(s×s)·(s×d)` over b·a/t heads, the
    softmax reading and writing b·(a/t)·s² scores, dropout another read, write and a 1-byte
    mask; backward twice the GEMMs, softmax 3 accesses, dropout 2 + mask."""
    hbm = 1e6
    ctx = _ctx(GELU, hbm=hbm, flash=False)
    t, b, d, ab = 2, 2, 32, 2
    batch = b * 8 / t
    scores = batch * SEQ * SEQ
    gemms = batch * (_gemm_bytes(SEQ, d, SEQ) + _gemm_bytes(SEQ, SEQ, d))
    cost = layer_cost(ctx, t, 1, b, True, 0)
    assert cost.attn_fwd * hbm == pytest.approx(gemms + 2 * ab * scores
                                                + (2 * ab + 1) * scores, rel=1e-9)
    assert cost.attn_bwd * hbm == pytest.approx(2 * gemms + 3 * ab * scores
                                                + (2 * ab + 1) * scores, rel=1e-9)


def test_mla_moe_layer_bytes():
    """MLA: the latent norms (read + write r_q + r_kv per down row), RoPE and the q, k, v
    concatenations (a/t·(2·d_qk + d_v)), the attention output (a/t·d_v); MoE: the routed
    copies' permutation into and out of expert order (4·ab·T·k·h·etp/t), the SwiGLU over
    the routed rows at f_e/etp (× λ) and the shared experts' rows at f_e/t; GEMM traffic
    per GEMM, the experts' weights read by each expert that runs."""
    hbm = 1e6
    t, sp, ep, etp = 4, True, 2, 2
    ctx = _ctx(MLA_MOE, hbm=hbm, expert_load=LOAD, experts_active=ACTIVE)
    h, a, ab, tokens = 256, 8 / t, 2, SEQ
    down = tokens / t
    rows = tokens * h / t
    f, f_shared = 96 / etp, 96 / t
    routed = tokens * 4 * etp / t
    elementwise = (10 * ab * rows + 2 * ab * (down * (96 + 64) + tokens * a * (2 * 48 + 24)
                                              + tokens * a * 24)
                   + 3 * ab * (routed * LOAD * f + 2 * tokens * f_shared)
                   + 4 * ab * routed * h)
    per_expert = tokens * 4 * ep / 16 * (etp / t) * LOAD / ACTIVE
    local = 16 / ep * ACTIVE
    gemms = (_gemm_bytes(down, h, 64 + 16) + _gemm_bytes(tokens, 64, a * (32 + 24))
             + _gemm_bytes(down, h, 96) + _gemm_bytes(tokens, 96, a * 48)
             + _gemm_bytes(tokens, a * 24, h) + _gemm_bytes(tokens, h, 16)
             + local * (_gemm_bytes(per_expert, h, 2 * f) + _gemm_bytes(per_expert, f, h))
             + 2 * (_gemm_bytes(tokens, h, 2 * f_shared) + _gemm_bytes(tokens, f_shared, h)))
    cost = layer_cost(ctx, t, 1, 1, sp, 0, moe=True, ep=ep, etp=etp)
    assert cost.wgrad * hbm == pytest.approx(gemms, rel=1e-9)
    assert (cost.fwd - _sync(ctx)) * hbm == pytest.approx(elementwise + gemms, rel=1e-9)
    assert cost.bwd * hbm == pytest.approx(2 * elementwise + 2 * gemms, rel=1e-9)


def test_head_bytes_per_logit_by_kernels():
    """The final norm (read + write T·h, ÷ t under SP) and the cross-entropy's bytes per
    logit: fused (Megatron's vocab-parallel kernel) ab + 12 forward, ab + 4 backward; eager
    ab + 16 and ab + 24; compiled 2·ab each way; GEMM traffic on top; 4 launches each way
    on the fused count (the backward 2 ×)."""
    hbm, ab, t = 1e6, 2, 2
    tokens, vocab = SEQ, 512 / t
    norm = 4 * ab * tokens * 256 / t
    gemm = _gemm_bytes(tokens, 256, vocab)
    for kernels, (pf, pb) in {"fused": (ab + 12, ab + 4), "eager": (ab + 16, ab + 24),
                              "compiled": (2 * ab, 2 * ab)}.items():
        ctx = replace(_ctx(GQA, hbm=hbm), kernels=kernels)
        fwd, bwd, _ = head_cost(ctx, t, 1, 1, True)
        assert fwd * hbm == pytest.approx(gemm + norm + pf * tokens * vocab, rel=1e-9)
        assert bwd * hbm == pytest.approx(2 * gemm + 2 * norm + pb * tokens * vocab, rel=1e-9)
    slow = _ctx(GQA, overhead=1e-3)
    fwd, bwd, _ = head_cost(slow, t, 1, 1, True)
    assert (fwd, bwd) == pytest.approx((4e-3, 8e-3), rel=1e-9)


def test_compiled_traffic_table_coefficients():
    """Eager/compiled stacks: the table's bytes per token (bf16) as coefficients of (R,
    T·(q + kv), the MLP's rows), q + kv the heads' widths per rank."""
    hbm = 1e6
    ctx = _ctx(GELU, hbm=hbm, impl="torchtitan", compile=True)
    assert ctx.traffic is not None
    (fh, fqk, ff), (bh, bqk, bf) = ctx.traffic
    t, h, d = 2, 256, 32
    q, kv, f = 8 * d / t, max(4 // t, 1) * d, 640 / t
    rows, tokens = SEQ * h / t, SEQ
    gemms = (_gemm_bytes(tokens, h, q + 2 * kv) + _gemm_bytes(tokens, q, h)
             + _gemm_bytes(tokens, h, f) + _gemm_bytes(tokens, f, h))
    cost = layer_cost(ctx, t, 1, 1, True, 0)
    assert cost.fwd * hbm == pytest.approx(fh * rows + fqk * tokens * (q + kv)
                                           + ff * tokens * f + gemms, rel=1e-9)
    assert cost.bwd * hbm == pytest.approx(bh * rows + bqk * tokens * (q + kv)
                                           + bf * tokens * f + 2 * gemms, rel=1e-9)


# --------------------------------------------------------------------------- paths
def test_array_layouts_agree_with_scalar_ones_plumbing():
    """plumbing: the vectorised planner's arrays give each scalar layout's cost."""
    ctx = _ctx(MLA_MOE, peak=1e12, hbm=1e11, overhead=1e-6)
    t, sp, rc = np.array([1, 2, 4]), np.array([False, True, True]), np.array([0, 1, 3])
    many = layer_cost(ctx, t, 1, 1, sp, rc, moe=True, ep=2)
    for i in range(3):
        one = layer_cost(ctx, int(t[i]), 1, 1, bool(sp[i]), int(rc[i]), moe=True, ep=2)
        for field in one._fields:
            assert np.asarray(getattr(many, field))[i] == pytest.approx(getattr(one, field))


def test_ring_attention_runs_the_online_softmax_kernel_even_without_flash():
    """c > 1 always merges blocks with the online softmax (flash-style FLOPs, causal half,
    backward 2.5 ×), whatever the attention setting; c = 1 without flash materialises the
    scores (no causal saving)."""
    peak = 1e9
    ctx = _ctx(GQA, peak=peak, flash=False)
    ring = layer_cost(ctx, 2, 2, 1, True, 0)
    core = 2 * (SEQ / 2) * (SEQ / 2) * (8 / 2) * 2 * 48
    assert ring.attn_fwd * peak == pytest.approx(core, rel=1e-12)
    assert ring.attn_bwd * peak == pytest.approx(2.5 * core, rel=1e-12)
    whole = layer_cost(ctx, 2, 1, 1, True, 0)
    # QKᵀ and P·V over all s² scores: twice the causal half, on twice the queries
    assert whole.attn_fwd * peak == pytest.approx(4 * core, rel=1e-12)


def test_mla_without_a_q_latent_projects_q_from_h():
    """DeepSeek-V2-Lite's MLA: no q latent, Q is `h × a·d_qk` split by heads; only the kv
    down-projection is duplicated over tp."""
    peak, t = 1e9, 2
    model = MLA_MOE.with_(q_lora_rank=0, name="mla-noq")
    ctx = _ctx(model, peak=peak)
    h, a = 256, 8 / t
    gemms = (2 * SEQ / t * h * (64 + 16) + 2 * SEQ * (h * a * 48 + 64 * a * (32 + 24))
             + 2 * SEQ * a * 24 * h + 2 * SEQ * 3 * h * 640 / t)
    assert layer_cost(ctx, t, 1, 1, True, 0).wgrad * peak == pytest.approx(gemms, rel=1e-12)


def test_fp8_gemms_run_at_the_fp8_rate_but_the_router_and_bf16_experts():
    """An FP8 recipe quantises the projections and the shared experts; the router stays
    bf16; the routed experts follow `Fp8Recipe.experts_fp8`; op-sac reruns them alike."""
    peak, fp8_peak = 1e9, 4e9
    base = replace(_ctx(MLA_MOE, peak=peak, fp8="tensorwise", expert_load=LOAD,
                        experts_active=ACTIVE), fp8_peak=fp8_peak)
    fast = base.fp8_rate
    assert fast > peak
    t, sp, ep = 2, True, 4
    gemms, core, sac = _mla_moe_flops(t, sp)
    router = 2 * SEQ * 256 * 16
    routed = 2 * SEQ * 4 * LOAD * 3 * 256 * 96 / t
    for experts_fp8 in (True, False):
        ctx = replace(base, fp8=replace(base.fp8, experts_fp8=experts_fp8))
        slow = router + (0 if experts_fp8 else routed)
        cost = layer_cost(ctx, t, 1, 1, sp, 0, moe=True, ep=ep)
        assert cost.fwd - _sync(ctx) == pytest.approx(
            (slow + core) / peak + (gemms - slow) / fast, rel=1e-12)
        op_sac = layer_cost(ctx, t, 1, 1, sp, 3, moe=True, ep=ep).recompute
        assert op_sac == pytest.approx(slow / peak + (sac - slow) / fast, rel=1e-12)
