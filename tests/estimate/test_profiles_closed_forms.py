"""`estimate.profiles` walked out by hand, tensor by tensor, for layers where every term is
told apart: d_head set (a·d ≠ h), GQA (a_kv ≠ a), LayerNorm (mean and rstd), dropout, tp 2 with
sequence parallelism, cp 2, micro-batch 3; MLA with d_k (48) ≠ d_v (24) and q/kv latents of
their own widths; MoE with two shared experts, top-2 of 8, expert width ≠ the dense width,
expert tensor parallelism 1 under tp 2 and an imbalanced routed load.

The expected sizes are written from the sources each profile names (docs/concepts/
profiles.md): a fused norm keeps its input in the activation dtype, an unfused one (HF,
torch) its fp32 upcast, HF its normalised rows in bf16 and torch in fp32; a flash kernel keeps
the fp32 log-sum-exp per query row and head, FlexAttention also the fp32 row maxima; eager
attention keeps the fp32 softmax, repeats K/V to all heads, and keeps the bf16 cast or, with
dropout, the 1-byte mask and the dropped-out probabilities; Megatron's fused SwiGLU keeps gate
and up, HF's and torchtitan's unfused one also act(gate); Megatron-Core's TEGroupedMLP keeps
the fp32 routing weight per copy instead of the expert output; HF's Mixtral router keeps
4 int64 indices and 2 fp32 weights per copy and one fp32 sum per token.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.profiles import (
    FP8_SAVED_INPUTS,
    PROFILES,
    Profile,
    by_component,
    component,
    fp8_saved_delta,
    fused_attention,
    layer_bytes,
    op_sac_saved,
    saved_tensors,
)

# h 320, a 8, a_kv 4, d 48 (a·d = 384 ≠ h), f 880, LayerNorm, dropout
DENSE = ModelSpec("gqa", 4, 320, 8, 4, 880, 64, d_head=48, norm="layernorm", dropout=True)
# MLA: q latent 96, kv latent 64, d_nope 32 + d_R 16 = d_k 48, d_v 24; MoE 8 experts, top 2,
# expert width 120, two shared experts; RMSNorm, no dropout
MLA_MOE = ModelSpec("mla-moe", 4, 320, 8, 8, 880, 64, n_experts=8, top_k=2, d_ff_expert=120,
                    n_shared_experts=2, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                    qk_rope_head_dim=16, v_head_dim=24)
S, CP, B, TP = 1024, 2, 3, 2
SB = S // CP * B  # 1536 rows per rank
H = 320

# per profile, read from its source: how the norm keeps its input, whether the unfused norm
# keeps normalised rows (bytes per element), the MLP keeps act(gate), residual dropout masks
TRAITS = {  # norm input bytes, normalised-rows bytes (0: none), keeps act(gate), residual masks
    "shardwise": (2, 0, False, True), "megatron-te": (2, 0, False, True),
    "torchtitan": (4, 4, True, False), "hf-sdpa": (4, 2, True, False),
    "hf-eager": (4, 2, True, False),
}


def _norm(prefix: str, output: str, impl: str, width: float, stats: float, rep: float,
          kept: float | None = None) -> dict[str, float]:
    upcast, rows, _, _ = TRAITS[impl]
    held = kept if kept is not None and upcast == 2 else width
    out = {f"{prefix}_input": SB * held * upcast / rep, f"{prefix}_stats": SB * stats / rep}
    if rows:
        out[f"{prefix}_normalized"] = SB * width * rows / rep
    out[output] = SB * width * 2 / rep
    return out


def _dense_expected(impl: str, flash: bool) -> dict[str, float]:
    """DENSE at tp 2 + SP, cp 2, b 3, bf16, by hand."""
    rep, stats = TP, 2 * 4  # SP splits the replicated rows; LayerNorm: mean and rstd, fp32
    heads, kv_heads, d = 8 / TP, 4 // TP, 48
    f = 880 / TP
    scores = heads * SB * S  # s/c query rows against all s keys
    exp = _norm("norm1", "qkv_input", impl, H, stats, rep)
    exp["q"] = SB * 8 * d * 2 / TP
    if impl == "hf-eager":  # repeat_kv to every head on the rank
        exp["k"] = exp["v"] = SB * heads * d * 2
    else:
        exp["k"] = exp["v"] = SB * kv_heads * d * 2
    if impl in ("hf-sdpa", "torchtitan") or (impl in ("shardwise", "megatron-te") and flash):
        exp["flash_logsumexp"] = heads * SB * 4
        if impl == "torchtitan":
            exp["flex_max_scores"] = heads * SB * 4
    elif impl == "hf-eager":
        exp["softmax_output"] = scores * 4
        exp["attention_dropout_mask"] = scores * 1
        exp["attention_dropout_output"] = scores * 2
    else:
        exp["softmax_output"] = scores * 2
        exp["attention_dropout_mask"] = scores * 1
        exp["attention_dropout_output"] = scores * 2
    exp["attention_output"] = SB * 8 * d * 2 / TP
    residual = TRAITS[impl][3]
    if residual:
        exp["attention_residual_dropout_mask"] = SB * H * 1 / rep
    exp |= _norm("norm2", "mlp_input", impl, H, stats, rep)
    exp |= {"mlp_gate": SB * f * 2, "mlp_up": SB * f * 2, "mlp_down_input": SB * f * 2}
    if TRAITS[impl][2]:
        exp["mlp_activation_output"] = SB * f * 2
    if residual:
        exp["mlp_residual_dropout_mask"] = SB * H * 1 / rep
    return exp


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("impl", list(PROFILES))
def test_dense_layer_every_tensor_by_hand(impl, flash):
    saved = saved_tensors(impl, DENSE, S, B, tp=TP, sp=True, cp=CP, flash=flash)
    expected = _dense_expected(impl, flash)
    assert sorted(saved) == sorted(expected)
    assert saved == pytest.approx(expected, rel=1e-12)
    total = layer_bytes(impl, DENSE, S, B, tp=TP, sp=True, cp=CP, flash=flash)
    assert total == pytest.approx(sum(expected.values()), rel=1e-12)


def test_eager_without_dropout_keeps_the_cast_and_fp32_keeps_none():
    """transformers' eager_attention_forward: softmax(dtype=float32).to(query.dtype) — a
    bf16 copy unless the activations are fp32 already; one K/V head left after tp is expanded
    as a view (no repeat); rmsnorm keeps one fp32 statistic per row."""
    model = ModelSpec("mqa", 4, 320, 8, 2, 880, 64, d_head=48)  # a_kv 2, tp 2: one per rank
    heads = 8 / TP
    bf16 = saved_tensors("hf-eager", model, S, B, tp=TP, cp=CP)
    assert bf16["softmax_output_cast"] == heads * SB * S * 2
    assert bf16["softmax_output"] == heads * SB * S * 4
    assert bf16["k"] == SB * 1 * 48 * 2 and bf16["v"] == SB * 1 * 48 * 2
    assert bf16["norm1_stats"] == SB * 4 and bf16["norm1_input"] == SB * H * 4
    fp32 = saved_tensors("hf-eager", model, S, B, tp=TP, cp=CP, dtype_bytes_=4)
    assert "softmax_output_cast" not in fp32
    assert fp32["softmax_output"] == heads * SB * S * 4
    assert fp32["q"] == SB * 8 * 48 * 4 / TP
    # 8-byte activations: the statistics follow them up (at least fp32)
    fp64 = saved_tensors("hf-eager", model, S, B, tp=TP, cp=CP, dtype_bytes_=8)
    assert fp64["norm1_stats"] == SB * 8 and fp64["softmax_output"] == heads * SB * S * 8


def test_eager_selective_keeps_the_core_inputs_before_the_repeat():
    """Under selective recompute the checkpointed core re-runs: its inputs K and V as the
    projections left them (a_kv/t heads), none of the softmax."""
    saved = saved_tensors("hf-eager", DENSE, S, B, tp=TP, sp=True, cp=CP, selective=True)
    assert saved["k"] == SB * 2 * 48 * 2 and saved["v"] == SB * 2 * 48 * 2
    assert not {"softmax_output", "attention_dropout_mask", "attention_dropout_output"} & set(
        saved)
    selective = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP, flash=True,
                              selective=True)
    assert "flash_logsumexp" not in selective


def test_ulysses_keeps_the_fused_output_twice():
    """TE's AttnFuncWithCPAndQKVOA2A saves its head-sharded output before the all-to-all and
    the out-projection the sequence-sharded one: the same bytes twice when a2a > 1 and the
    kernel is fused; a materialised softmax or selective recompute keeps no second copy."""
    out = SB * 8 * 48 * 2 / TP
    two = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP, flash=True, a2a=2)
    assert two["attention_output_heads"] == out == two["attention_output"]
    one = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP, flash=True, a2a=1)
    assert "attention_output_heads" not in one
    unfused = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP, a2a=2)
    assert "attention_output_heads" not in unfused
    sel = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP, flash=True, a2a=2,
                        selective=True)
    assert "attention_output_heads" not in sel
    arrays = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP, flash=True,
                           a2a=np.array([1, 2, 4]), selective=np.array([False, False, True]))
    np.testing.assert_array_equal(arrays["attention_output_heads"], [0.0, out, 0.0])


def test_arrays_keep_zero_where_a_tensor_does_not_apply():
    """Boolean arrays for `sp` and `selective`: each entry is what the scalar call gives, 0
    where the tensor does not exist."""
    sp, sel = np.array([False, True, True]), np.array([False, False, True])
    arrays = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=sp, cp=CP, selective=sel)
    for i, (s_i, c_i) in enumerate(zip(sp, sel, strict=True)):
        one = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=bool(s_i), cp=CP,
                            selective=bool(c_i))
        for name, value in arrays.items():
            value = np.broadcast_to(value, sp.shape)[i]  # terms sp leaves alone: scalars
            assert value == pytest.approx(one.get(name, 0.0), rel=1e-12), name
    assert arrays["softmax_output"][2] == 0.0
    assert arrays["norm1_input"][0] == SB * H * 2 and arrays["norm1_input"][1] == SB * H


def _mla_moe_expected(impl: str, etp: int, load: float) -> dict[str, float]:
    """MLA_MOE at tp 2 + SP, cp 2, b 3, flash, bf16 (Megatron-Core MLASelfAttention's walk,
    docs/concepts/profiles.md), with the MoE block of `_moe_saved`'s docstring."""
    rep, stats, heads = TP, 4, 8 / TP  # RMSNorm: one fp32 rstd per row
    exp = _norm("norm1", "qkv_input", impl, H, stats, rep)
    exp |= _norm("q_latent", "q_latent_normed", impl, 96, stats, rep)
    # W_DKV's output holds the kv latent (64) and the RoPE key (16): the fused norm keeps it
    exp |= _norm("kv_latent", "kv_latent_normed", impl, 64, stats, rep, kept=64 + 16)
    exp["q"] = SB * 8 * 48 * 2 / TP  # d_k = 48 per head
    exp["k"] = SB * 8 // TP * 48 * 2
    exp["v"] = SB * 8 // TP * 24 * 2  # d_v = 24 per head
    exp["flash_logsumexp"] = heads * SB * 4
    exp["attention_output"] = SB * 8 * 24 * 2 / TP  # d_v wide
    exp |= _norm("norm2", "mlp_input", impl, H, stats, rep)
    exp["router_probs"] = SB * 8 * 4
    copies = 2 * SB * (etp or TP) / TP * load  # top 2 of the tp group's tokens ÷ etp's share
    fe = 120 / (etp or TP)
    exp["expert_inputs"] = copies * H * 2
    exp |= {"expert_gate": copies * fe * 2, "expert_up": copies * fe * 2,
            "expert_down_input": copies * fe * 2}
    if impl == "megatron-te":
        exp["expert_probs"] = copies * 4
    else:
        exp["expert_outputs"] = copies * H * 2
    fs = 120 / TP  # shared experts: every token, width ÷ tp, two of them
    exp |= {"shared_gate": 2 * SB * fs * 2, "shared_up": 2 * SB * fs * 2,
            "shared_down_input": 2 * SB * fs * 2}
    return exp


@pytest.mark.parametrize(("impl", "etp", "load"), [("megatron-te", 0, 1.0),
                                                   ("megatron-te", 1, 1.25),
                                                   ("shardwise", 1, 1.5)])
def test_mla_moe_layer_every_tensor_by_hand(impl, etp, load):
    saved = saved_tensors(impl, MLA_MOE, S, B, tp=TP, sp=True, cp=CP, flash=True, moe=True,
                          etp=etp, routed_load=load)
    expected = _mla_moe_expected(impl, etp, load)
    assert sorted(saved) == sorted(expected)
    assert saved == pytest.approx(expected, rel=1e-12)


def test_hf_moe_router_and_unfused_experts():
    """HF Mixtral: the router keeps per routed copy 4 int64 indices and 2 fp32 weights (40 B)
    and per token the fp32 sum (4 B); each expert's unfused SwiGLU keeps act(gate) too, and the
    expert output is kept for the weighting (no probs in the activation)."""
    model = ModelSpec("moe", 4, 320, 8, 4, 880, 64, d_head=48, n_experts=8, top_k=2,
                      d_ff_expert=120, n_shared_experts=2)
    saved = saved_tensors("hf-sdpa", model, S, B, tp=TP, cp=CP, moe=True)
    copies = 2 * SB
    assert saved["router_indices_and_weights"] == SB * (2 * 40 + 4)
    assert saved["router_probs"] == SB * 8 * 4
    assert saved["expert_activation_output"] == copies * 60 * 2
    assert saved["expert_outputs"] == copies * H * 2
    assert saved["shared_activation_output"] == 2 * SB * 60 * 2
    assert "expert_probs" not in saved
    mega = saved_tensors("megatron-te", model, S, B, tp=TP, cp=CP, moe=True)
    assert "router_indices_and_weights" not in mega and "expert_activation_output" not in mega
    # a non-gated MLP: the activation's input and the down projection's input
    gelu = ModelSpec("gelu", 4, 320, 8, 4, 880, 64, gated_mlp=False, n_experts=8, top_k=2,
                     d_ff_expert=120, n_shared_experts=1)
    plain = saved_tensors("megatron-te", gelu, S, B, tp=TP, cp=CP, moe=True)
    assert plain["expert_activation_input"] == plain["expert_down_input"] == copies * 60 * 2
    assert plain["shared_activation_input"] == SB * 60 * 2
    dense = saved_tensors("megatron-te", gelu, S, B, tp=TP, cp=CP)
    assert dense["mlp_activation_input"] == dense["mlp_down_input"] == SB * 440 * 2


def test_full_recompute_and_op_sac_totals():
    """Full recompute keeps the layer input, s/c·b·h·bytes ÷ t with SP; torchtitan's per-op
    SAC keeps the block input, the qkv, w1 and w2 outputs, the attention output and its fp32
    log-sum-exp, and under SP w2's reduce-scatter output."""
    for sp, rep in ((True, TP), (False, 1)):
        full = layer_bytes("megatron-te", DENSE, S, B, tp=TP, sp=sp, cp=CP, full=True)
        assert full == SB * H * 2 / rep
    f, kv = 880 / TP, 4 // TP * 48
    sac = {"block_input": SB * H * 2 / TP, "qkv_output": SB * (384 / TP + 2 * kv) * 2,
           "attention_output": SB * 384 / TP * 2, "flash_logsumexp": 8 / TP * SB * 4,
           "mlp_w1_output": SB * f * 2, "mlp_w2_output": SB * H * 2,
           "mlp_reduce_scatter_output": SB * H * 2 / TP}
    assert op_sac_saved(DENSE, S, B, tp=TP, sp=True, cp=CP) == pytest.approx(sac, rel=1e-12)
    assert layer_bytes("torchtitan", DENSE, S, B, tp=TP, sp=True, cp=CP, op_sac=True
                       ) == pytest.approx(sum(sac.values()), rel=1e-12)
    # tp = 4: at tp = 2 the block input ÷t and the reduce-scatter output ÷t add up to one
    # unsharded copy, so a lost ÷t on both would not show in the total
    sac4 = {"block_input": SB * H * 2 / 4, "qkv_output": SB * (384 / 4 + 2 * 48) * 2,
            "attention_output": SB * 384 / 4 * 2, "flash_logsumexp": 8 / 4 * SB * 4,
            "mlp_w1_output": SB * 880 / 4 * 2, "mlp_w2_output": SB * H * 2,
            "mlp_reduce_scatter_output": SB * H * 2 / 4}
    assert layer_bytes("torchtitan", DENSE, S, B, tp=4, sp=True, cp=CP, op_sac=True
                       ) == pytest.approx(sum(sac4.values()), rel=1e-12)
    no_sp = op_sac_saved(DENSE, S, B, tp=TP, sp=False, cp=CP)
    assert no_sp["mlp_reduce_scatter_output"] == 0.0 and no_sp["block_input"] == SB * H * 2
    moe = op_sac_saved(MLA_MOE, S, B, tp=TP, sp=True, cp=CP, moe=True)
    assert moe["mlp_w1_output"] == (2 + 2) * SB * 120 / TP * 2  # top-k + shared copies
    assert moe["mlp_w2_output"] == (2 + 2) * SB * H * 2
    assert moe["router_probs"] == SB * 8 * 4
    # arrays: each entry picks its own branch
    arr = layer_bytes("torchtitan", DENSE, S, B, tp=TP, sp=True, cp=CP,
                      full=np.array([True, False, False]), op_sac=np.array([False, True, False]))
    whole = layer_bytes("torchtitan", DENSE, S, B, tp=TP, sp=True, cp=CP)
    np.testing.assert_allclose(arr, [SB * H * 2 / TP, sum(sac.values()), whole], rtol=1e-12)


def test_fp8_inputs_by_hand():
    """An FP8 recipe (1 byte per element) keeps the linear inputs at 1 B instead of 2: the
    QKV input (twice for MLA: its two down-projections each keep a copy), fc1's and fc2's,
    the latents' up-projection inputs, the experts' (not an MoE layer's mlp_input, which the
    router keeps in bf16); a fused attention kernel's output stays bf16 beside the
    out-projection's FP8 copy."""
    saved = saved_tensors("megatron-te", MLA_MOE, S, B, tp=TP, sp=True, cp=CP, flash=True,
                          moe=True)
    half = {n: saved[n] for n in FP8_SAVED_INPUTS if n in saved}
    # qkv_input: two copies at half the bytes, 2·0.5 − 1 = 0; the rest −0.5 each
    expected = (sum(v * -0.5 for n, v in half.items() if n not in ("qkv_input", "mlp_input"))
                + saved["qkv_input"] * 0.0 + saved["attention_output"] * 0.5)
    delta = fp8_saved_delta(saved, MLA_MOE, True, 1.0, 2.0, True)
    assert delta == pytest.approx(expected, rel=1e-12)
    total = layer_bytes("megatron-te", MLA_MOE, S, B, tp=TP, sp=True, cp=CP, flash=True,
                        moe=True, fp8_inputs=1.0)
    assert total == pytest.approx(sum(saved.values()) + expected, rel=1e-12)
    dense = saved_tensors("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP)  # unfused
    delta = fp8_saved_delta(dense, DENSE, False, 1.0, 2.0, False)
    assert delta == pytest.approx(-0.5 * (dense["qkv_input"] + dense["mlp_input"]
                                          + dense["mlp_down_input"]
                                          + dense["attention_output"]), rel=1e-12)


def test_adjust_rewrites_before_the_sum():
    kept = layer_bytes("megatron-te", DENSE, S, B, tp=TP, sp=True, cp=CP,
                       adjust=lambda saved: {"q": saved["q"]})
    assert kept == SB * 384 * 2 / TP


def test_fused_attention_per_profile():
    assert fused_attention("hf-sdpa", False) and fused_attention("torchtitan", False)
    assert not fused_attention("hf-eager", True) and not fused_attention("hf-eager", False)
    assert fused_attention("megatron-te", True) and not fused_attention("megatron-te", False)
    assert fused_attention(PROFILES["shardwise"], True)


def test_profile_validate_names_the_bad_field():
    base = PROFILES["megatron-te"]
    import dataclasses

    with pytest.raises(ShardwiseError, match=r"^profile megatron-te: norm 'rms' unknown$"):
        dataclasses.replace(base, norm="rms").validate()
    with pytest.raises(ShardwiseError,
                       match=r"^profile megatron-te: attention 'flash' unknown$"):
        dataclasses.replace(base, attention="flash").validate()
    for norm in ("fused", "hf", "torch"):
        for attention in ("flag", "sdpa", "flex", "eager"):
            p = dataclasses.replace(base, norm=norm, attention=attention)
            assert p.validate() is p
    assert isinstance(base, Profile)


@pytest.mark.parametrize(("name", "comp"), [
    ("norm1_input", "norm"), ("norm2_stats", "norm"), ("qkv_input", "QKV input"),
    ("q_latent_normed", "MLA latents"), ("kv_latent_input", "MLA latents"), ("q", "q/k/v"),
    ("k", "q/k/v"), ("v", "q/k/v"), ("softmax_output_cast", "attention internals"),
    ("attention_dropout_mask", "attention internals"),
    ("flash_logsumexp", "attention internals"), ("flex_max_scores", "attention internals"),
    ("attention_output", "output projection input"),
    ("attention_output_heads", "output projection input"), ("mlp_input", "MLP input"),
    ("mlp_gate", "MLP internals"), ("router_probs", "MoE routing"),
    ("expert_inputs", "MoE experts"), ("shared_up", "MoE experts"),
    ("mlp_residual_dropout_mask", "dropout"), ("attention_residual_dropout_mask", "dropout"),
    ("qk", "other"), ("norm", "other"), ("query", "other"),
])
def test_component_of_each_name(name, comp):
    assert component(name) == comp


def test_by_component_sums_in_walk_order():
    saved = saved_tensors("hf-eager", DENSE, S, B, tp=TP, sp=True, cp=CP)
    grouped = by_component(saved)
    assert list(grouped)[:3] == ["norm", "QKV input", "q/k/v"]
    assert grouped["norm"] == pytest.approx(sum(v for n, v in saved.items()
                                                if n.startswith(("norm1", "norm2"))))
    assert sum(grouped.values()) == pytest.approx(sum(saved.values()), rel=1e-12)


def test_single_device_defaults_by_hand():
    """No keyword: one GPU (tp 1, cp 1, no SP), materialised attention, bf16, a dense layer,
    no recompute — Megatron-Core's walk of DENSE for s = 256, b = 1, in bytes."""
    s = rows = 256
    norm = rows * (2 * H * 2 + 8)  # input and output bf16, LayerNorm's mean and rstd fp32
    attention = rows * 384 * 2 + 2 * rows * 4 * 48 * 2  # q (a·d = 384), k, v (4 kv heads)
    attention += 8 * rows * s * (2 + 1 + 2)  # softmax, its dropout mask and output
    attention += rows * 384 * 2  # the out-projection's input
    mlp = 3 * rows * 880 * 2  # gate, up, the down-projection's input
    masks = 2 * rows * H  # residual dropout after attention and after the MLP
    expected = 2 * norm + attention + mlp + masks
    assert layer_bytes("megatron-te", DENSE, s, 1) == pytest.approx(expected, rel=1e-12)
    assert sum(saved_tensors("megatron-te", DENSE, s, 1).values()) == pytest.approx(
        expected, rel=1e-12)


def test_profile_names_in_registry_order():
    from shardwise.estimate.profiles import DEFAULT_IMPL, get_profile, profile_names

    assert profile_names() == ("shardwise", "megatron-te", "torchtitan", "hf-sdpa", "hf-eager")
    assert DEFAULT_IMPL == "megatron-te" and get_profile(DEFAULT_IMPL) is PROFILES[DEFAULT_IMPL]
    with pytest.raises(ShardwiseError, match=r"^implementation profile 'x' unknown; valid: "
                                             r"shardwise, megatron-te, torchtitan, hf-sdpa, "
                                             r"hf-eager$"):
        get_profile("x")


@pytest.mark.parametrize("qk", ["head", "full"])
@pytest.mark.parametrize("impl", ["megatron-te", "torchtitan", "hf-sdpa"])
def test_qk_norm_and_sandwich_norms_by_hand(impl, qk):
    """QK-norm keeps its inputs Q (a/t·d wide) and K (a_kv/t·d), one fp32 rstd per head row
    ("head") or per row ("full"); Gemma's sandwich norms keep input and statistics per row of
    h (÷t with SP); unfused norms also the normalised rows — fp32 for HF's Gemma/OLMo 2
    RMSNorms, which then keep fp32 rows for norm1 and norm2 as well (their extra 2 B each)."""
    import dataclasses

    model = dataclasses.replace(DENSE, qk_norm=qk, block_norms="sandwich")
    base = saved_tensors(impl, DENSE, S, B, tp=TP, sp=True, cp=CP, flash=True)
    saved = saved_tensors(impl, model, S, B, tp=TP, sp=True, cp=CP, flash=True)
    extra = {k: v for k, v in saved.items() if k not in base}
    upcast = TRAITS[impl][0]
    rows = {"megatron-te": 0, "torchtitan": 4, "hf-sdpa": 4}[impl]
    heads, kv_heads = 8 / TP, 4 // TP
    exp = {"q_norm_input": SB * 192 * upcast, "k_norm_input": SB * 96 * upcast,
           "q_norm_stats": SB * 4 * (heads if qk == "head" else 1),
           "k_norm_stats": SB * 4 * (kv_heads if qk == "head" else 1)}
    for name in ("post_attention_norm", "post_mlp_norm"):
        exp[f"{name}_input"] = SB * H * upcast / TP
        exp[f"{name}_stats"] = SB * 8 / TP  # LayerNorm: mean and rstd
    if rows:
        exp |= {"q_norm_normalized": SB * 192 * rows, "k_norm_normalized": SB * 96 * rows,
                "post_attention_norm_normalized": SB * H / TP * rows,
                "post_mlp_norm_normalized": SB * H / TP * rows}
    if impl == "hf-sdpa":
        exp["norm_fp32_rows"] = 2 * SB * H * (4 - 2) / TP
    assert extra == pytest.approx(exp, rel=1e-12)
    assert {k: saved[k] for k in base} == base  # nothing else changes


def test_selective_recompute_lists_no_attention_intermediates():
    """With scalar arguments only the tensors that exist are listed: under selective recompute
    the core's log-sum-exp (flash) and softmax and its cast (eager) are not saved, so they
    are absent — not listed at 0 bytes."""
    tiny = get_model("tiny")
    for profile, flash, names in (("shardwise", True, {"flash_logsumexp"}),
                                  ("hf-eager", False, {"softmax_output",
                                                       "softmax_output_cast"})):
        kept = saved_tensors(profile, tiny, 32, 1, flash=flash, selective=False)
        replayed = saved_tensors(profile, tiny, 32, 1, flash=flash, selective=True)
        assert names <= set(kept) and not names & set(replayed), profile
