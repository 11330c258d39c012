"""Selective recompute replays the forward of the modules Megatron's `--recompute-modules`
names (megatron-core 0.16.1: transformer_layer.py layernorm, experts.py moe_act,
multi_latent_attention.py mla_up_proj, the default core_attn): the time `layer_cost` adds
before the backward is the closed-form cost of exactly those modules' forward kernels."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.arch import get_model
from shardwise.estimate.compute import (
    RC_CODES,
    ComputeContext,
    _attention_core,
    layer_cost,
    matmul_time,
    memory_time,
)
from shardwise.hardware import get_accelerator
from shardwise.layout import TrainSpec

SEL = RC_CODES["selective"]
T_, B, EP, SEQ = 2, 2, 8, 4096  # tp 2 with sequence parallelism, 2 sequences, ep 8


def _ctx(modules: tuple[str, ...] | None, model: str = "deepseek-v3") -> ComputeContext:
    train = TrainSpec(seq_len=SEQ, global_batch=64, impl="megatron-te",
                      recompute_modules=modules)
    return ComputeContext.of(get_model(model), get_accelerator("h100-sxm"), train)


def _recompute(ctx: ComputeContext, moe: bool = True) -> float:
    return float(layer_cost(ctx, T_, 1, B, True, SEL, moe=moe, ep=EP).recompute)


def test_the_default_replays_the_attention_core_alone():
    ctx = _ctx(None)
    assert ctx.recompute_modules == ("core_attn",)
    assert _recompute(ctx) == pytest.approx(float(_attention_core(ctx, T_, 1, B)[0]), rel=1e-12)


def test_layernorm_and_moe_act_replay_the_norms_and_the_experts_activation():
    # DeepSeek-V3: 1 shared expert, routed experts top-8 of 2048 each; tp 2 with sp: the norms
    # see T·h/t rows, each tp rank runs T·k/t routed rows of the full expert width (etp 1)
    model = get_model("deepseek-v3")
    assert model.n_shared_experts and model.gated_mlp
    ctx = _ctx(("layernorm", "moe_act"))
    tokens = SEQ * B
    ab = ctx.act_bytes
    norms = 2 * 2 * ab * tokens * model.d_model / T_  # two norms, read + write, ÷t (sp)
    act = 3 * ab * tokens * model.top_k / T_ * model.expert_d_ff  # read gate, up; write
    assert _recompute(ctx) == pytest.approx(float(memory_time(ctx, norms + act)), rel=1e-9)
    # the attention core is no longer replayed, and neither module costs nothing
    assert 0 < float(memory_time(ctx, act)) < _recompute(ctx)
    assert _recompute(_ctx(("layernorm",))) == pytest.approx(float(memory_time(ctx, norms)))


def test_mla_up_proj_replays_the_up_projections_and_rope():
    model = get_model("deepseek-v3")
    assert model.is_mla and model.q_lora_rank
    ctx = _ctx(("core_attn", "mla_up_proj"))
    tokens, heads = SEQ * B, model.n_heads / T_
    d, d_v = model.head_dim, model.value_head_dim
    up = (matmul_time(ctx, tokens, model.q_lora_rank, heads * d)
          + matmul_time(ctx, tokens, model.kv_lora_rank, heads * (model.qk_nope_head_dim + d_v)))
    rope = memory_time(ctx, 2 * ctx.act_bytes * tokens * heads * (2 * d + d_v))
    want = float(_attention_core(ctx, T_, 1, B)[0] + up + rope)
    assert _recompute(ctx) == pytest.approx(want, rel=1e-9)


def test_a_module_the_layer_lacks_replays_nothing():
    # mlp in an MoE layer, moe_act and shared_experts in a dense one: no such module there
    assert _recompute(_ctx(("mlp",)), moe=True) == 0.0
    assert _recompute(_ctx(("moe_act", "shared_experts")), moe=False) == 0.0
    assert _recompute(_ctx(("mlp",)), moe=False) > 0 < _recompute(_ctx(("moe_act",)), moe=True)


@pytest.mark.parametrize("model", [
    replace(get_model("deepseek-v3"), n_shared_experts=2),  # two shared experts
    get_model("mixtral-8x7b")])  # none
def test_moe_replays_the_router_the_experts_the_shared_experts_and_their_memory(model):
    """`--recompute-modules moe` (moe_layer.py `tensor_parallel.checkpoint` of the block):
    the router (T × h)·(h × E) in bf16, E/ep local experts' two GEMMs on T·k·ep/E rows at
    f/t (etp = tp = 2), each shared expert's two GEMMs on all T rows at f/t, and the bytes
    of the permutation (4·ab·T·k·h) and of the SwiGLU (read gate and up, write: 3·ab per
    element of every routed and shared row) — by hand, on T = s·b rows (sp gathers them)."""
    train = TrainSpec(seq_len=SEQ, global_batch=64, impl="megatron-te",
                      recompute_modules=("moe",))
    ctx = ComputeContext.of(model, get_accelerator("h100-sxm"), train)
    tokens, h, e, k = SEQ * B, model.d_model, model.n_experts, model.top_k
    f, n_shared, ab = model.expert_d_ff / T_, model.n_shared_experts, ctx.act_bytes
    rows = tokens * k * EP / e
    experts = e / EP * (matmul_time(ctx, rows, h, 2 * f) + matmul_time(ctx, rows, f, h))
    shared = n_shared * (matmul_time(ctx, tokens, h, 2 * f) + matmul_time(ctx, tokens, f, h))
    bytes_ = 4 * ab * tokens * k * h + 3 * ab * (tokens * k * f + n_shared * tokens * f)
    want = matmul_time(ctx, tokens, h, e) + experts + shared + memory_time(ctx, bytes_)
    assert _recompute(ctx) == pytest.approx(float(want), rel=1e-9)
    assert (n_shared > 0) == (model.name == "deepseek-v3")


def test_mlp_replays_the_dense_mlp_and_its_activation():
    """`--recompute-modules mlp` on a dense SwiGLU layer: the gate-and-up GEMM (T × h)·(h × 2f)
    and the down GEMM (T × f)·(f × h) at f = d_ff/t, and the activation's bytes (read gate and
    up, write: 3·ab per element of T·f) — by hand, on T = s·b rows (sp gathers them)."""
    model = get_model("llama3-8b")
    ctx = _ctx(("mlp",), "llama3-8b")
    tokens, h, f, ab = SEQ * B, model.d_model, model.d_ff / T_, ctx.act_bytes
    want = (matmul_time(ctx, tokens, h, 2 * f) + matmul_time(ctx, tokens, f, h)
            + memory_time(ctx, 3 * ab * tokens * f))
    assert _recompute(ctx, moe=False) == pytest.approx(float(want), rel=1e-9)
    assert model.gated_mlp and f != h


@pytest.mark.parametrize("dropout", [False, True])
def test_the_materialised_attention_core_moves_the_scores_bytes(dropout):
    """Without FlashAttention (c = 1) the core is two batched GEMMs over b·a/t heads, QKᵀ
    (s×d)·(d×s) and P·V (s×s)·(s×d_v), and the softmax's read and write of the b·(a/t)·s²
    scores; dropout adds a read, a write and a 1-byte mask; backward 2 × the GEMMs, the
    softmax's 3 accesses and dropout's again — by hand (d = 128, 32 heads over t = 2)."""
    model = replace(get_model("llama3-8b"), dropout=dropout)
    train = TrainSpec(seq_len=SEQ, global_batch=64, impl="megatron-te", flash_attention=False)
    ctx = ComputeContext.of(model, get_accelerator("h100-sxm"), train)
    s, ab, batch = SEQ, ctx.act_bytes, B * model.n_heads / T_
    d, d_v = model.head_dim, model.value_head_dim
    gemms = matmul_time(ctx, s, d, s, batch) + matmul_time(ctx, s, s, d_v, batch)
    scores = batch * s * s
    drop = (2 * ab + 1) * scores if dropout else 0.0
    fwd, bwd = _attention_core(ctx, T_, 1, B)
    # (no absolute slack: a byte more is 3.5e-13 s)
    assert float(fwd) == pytest.approx(float(gemms + memory_time(ctx, 2 * ab * scores + drop)),
                                       rel=1e-12, abs=0)
    assert float(bwd) == pytest.approx(
        float(2 * gemms + memory_time(ctx, 3 * ab * scores + drop)), rel=1e-12, abs=0)
