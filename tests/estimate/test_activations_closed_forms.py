"""Saved activations (estimate/activations.py) against Korthikanti et al. 2022 (arXiv:2205.05198
§4, Table 2): the closed form per parallelism and recompute, worked out here on GPT-3 175B's
shapes (s 2048, h 12288, a 96), and the generalised count equal to it on that MHA/GELU/
LayerNorm/dropout model once its fp32 statistics are left out; the all-gathered K/V kept by
torchtitan's FlexAttention on a model whose K and V widths differ (MLA: 24 and 16 per head);
Megatron's selective-recompute modules (megatron-core 0.16.1) per layer kind."""

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.activations import (
    activation_bytes_per_layer,
    gathered_kv_bytes,
    korthikanti_activation_bytes,
    recompute_adjust,
    recompute_dropped,
    saved_tensors_per_layer,
)
from shardwise.layout import TrainSpec

GPT3 = get_model("gpt3-175b")
S, B, H, A = 2048, 1, 12288, 96
SBH = S * B * H
SCORES = 5 * A * S / H  # 80


@pytest.mark.parametrize(("kw", "per_sbh"), [
    ({}, 34 + SCORES),
    ({"tp": 8}, 10 + 24 / 8 + SCORES / 8),
    ({"tp": 8, "sp": True}, 34 / 8 + SCORES / 8),
    ({"tp": 8, "recompute": "selective"}, 10 + 24 / 8),
    ({"tp": 8, "sp": True, "recompute": "selective"}, 34 / 8),
    ({"flash": True}, 34),
    ({"tp": 4, "flash": True}, 10 + 24 / 4),
    ({"recompute": "full"}, 2),
    ({"tp": 8, "recompute": "full"}, 2),  # the layer input, replicated over tp
    ({"tp": 8, "sp": True, "recompute": "full"}, 2 / 8),
])
def test_korthikanti_table_2(kw, per_sbh):
    assert korthikanti_activation_bytes(S, B, H, A, **kw) == pytest.approx(SBH * per_sbh,
                                                                          rel=1e-12)


def test_korthikanti_formula_through_the_layer_entry_divides_by_cp():
    one = activation_bytes_per_layer(GPT3, S, B, tp=8, sp=True, formula="korthikanti")
    assert one == pytest.approx(SBH * (34 / 8 + SCORES / 8))
    flash = activation_bytes_per_layer(GPT3, S, B, formula="korthikanti", flash=True)
    assert flash == pytest.approx(SBH * 34)  # FlashAttention keeps no scores
    two = activation_bytes_per_layer(GPT3, S, 2, tp=8, cp=2, recompute=1, formula="korthikanti")
    assert two == pytest.approx(S * 2 * H * (10 + 24 / 8) / 2)


@pytest.mark.parametrize("kw", [
    {}, {"tp": 8}, {"tp": 8, "sp": True}, {"flash": True}, {"tp": 8, "sp": True, "flash": True},
    {"selective": True}, {"tp": 8, "sp": True, "selective": True}, {"tp": 2, "cp": 2}])
def test_generalised_count_is_korthikantis_on_a_gpt3_layer(kw):
    """MHA, GELU with f = 4h, LayerNorm and dropout at 2 bytes: every item but the fp32
    statistics (LayerNorm's mean and rstd, FlashAttention's log-sum-exp) sums to Table 2."""
    saved = saved_tensors_per_layer(GPT3, S, B, **kw)
    stats = {"norm1_stats", "norm2_stats", "flash_logsumexp"}
    t, c = kw.get("tp", 1), kw.get("cp", 1)
    rc = "selective" if kw.get("selective") else "none"
    paper = korthikanti_activation_bytes(S, B, H, A, t, kw.get("sp", False), rc,
                                         kw.get("flash", False))
    if c == 1:  # ring attention's scores are per block: the paper's closed form holds at c = 1
        assert sum(v for k, v in saved.items() if k not in stats) == pytest.approx(paper)
    # the statistics: LayerNorm two fp32 per row (÷t with SP), log-sum-exp fp32 per head and row
    rows = S * B / c / (t if kw.get("sp") else 1)
    assert saved["norm1_stats"] == saved["norm2_stats"] == pytest.approx(2 * 4 * rows)
    if kw.get("flash") and not kw.get("selective"):
        assert saved["flash_logsumexp"] == pytest.approx(4 * A / t * S * B / c)
    else:
        assert "flash_logsumexp" not in saved


def test_full_recompute_keeps_the_layer_input():
    llama = get_model("llama3-8b")
    h = llama.d_model
    assert activation_bytes_per_layer(llama, 8192, 2, recompute="full") == 8192 * 2 * h * 2
    assert activation_bytes_per_layer(llama, 8192, 2, tp=4, sp=True, recompute="full",
                                      dtype="fp32") == 8192 * 2 * h * 4 / 4
    array = activation_bytes_per_layer(llama, 8192, 1, tp=np.array([1, 4]),
                                       sp=np.array([False, True]), recompute=np.array([2, 2]))
    assert list(array) == [8192 * h * 2, 8192 * h * 2 / 4]


def test_bad_recompute_and_formula_are_one_line():
    with pytest.raises(ShardwiseError) as err:
        activation_bytes_per_layer(GPT3, S, recompute="some")
    assert str(err.value) == ("recompute must be one of none, selective, full, op-sac; got "
                              "'some'")
    with pytest.raises(ShardwiseError) as err:
        activation_bytes_per_layer(GPT3, S, formula="paper")
    assert str(err.value) == "formula must be 'generalised' or 'korthikanti', got 'paper'"


def test_gathered_kv_of_flex_attention_with_unequal_key_and_value_widths():
    """torchtitan keeps the all-gathered K and V: (c−1)·(s/c)·b·a_kv/t·(d_k + d_v) elements
    more, without recompute only."""
    ds = get_model("tiny-deepseek")  # 4 heads; d_k = 16 + 8, d_v = 16
    titan = TrainSpec(seq_len=64, global_batch=8, impl="torchtitan", dtype="bf16")
    codes = dict(tp=2, cp=4, cp_kind=3, recompute=0, micro_batch=2)
    assert gathered_kv_bytes(ds, titan, **codes) == 3 * 64 / 4 * 2 * (4 / 2) * (24 + 16) * 2
    assert gathered_kv_bytes(ds, titan, **codes | {"cp_kind": 0}) == 0  # ring
    assert gathered_kv_bytes(ds, titan, **codes | {"recompute": 2}) == 0
    tiny = get_model("tiny")  # 2 kv heads of 16 at tp = 4: one head per rank
    assert gathered_kv_bytes(tiny, titan, **codes | {"tp": 4}) == 3 * 16 * 2 * 1 * 32 * 2
    te = TrainSpec(seq_len=64, global_batch=8, impl="megatron-te")  # gathers again
    assert gathered_kv_bytes(ds, te, **codes) == 0


def test_megatron_selective_recompute_modules_per_layer_kind():
    ds, llama, mixtral = get_model("tiny-deepseek"), get_model("tiny"), get_model("tiny-moe")
    # layernorm: the MLA spec's separate input norm, the pre-MLP norm of MoE models
    assert recompute_dropped(ds, ("layernorm",), True) == {
        "norm1_stats", "qkv_input", "norm2_stats", "mlp_input"}
    assert recompute_dropped(mixtral, ("layernorm",), True) == {"norm2_stats", "mlp_input"}
    assert recompute_dropped(llama, ("layernorm",), False) == set()
    assert recompute_dropped(ds, ("mla_up_proj",), False) == {"q", "k", "v"}
    assert recompute_dropped(llama, ("mla_up_proj",), False) == set()
    assert recompute_dropped(ds, ("moe_act",), True) == {"expert_down_input"}
    assert recompute_dropped(ds, ("shared_experts",), True) == {
        "shared_gate", "shared_up", "shared_down_input"}
    assert recompute_dropped(ds, ("moe",), True) == {
        "shared_gate", "shared_up", "shared_down_input", "router_probs",
        "router_indices_and_weights", "expert_inputs", "expert_gate", "expert_up",
        "expert_down_input", "expert_outputs", "expert_probs"}
    # mlp: a dense layer's MLP, with a dense model's fused pre-MLP norm
    assert recompute_dropped(llama, ("mlp",), False) == {
        "mlp_gate", "mlp_up", "mlp_down_input", "norm2_stats", "mlp_input"}
    assert recompute_dropped(ds, ("mlp",), False) == {"mlp_gate", "mlp_up", "mlp_down_input"}
    assert recompute_dropped(ds, ("mlp", "moe_act"), True) == {"expert_down_input"}


def test_recompute_adjust_frees_stores_in_fp8_and_offloads():
    ds = get_model("tiny-deepseek")
    saved = {"expert_gate": 8.0, "expert_up": 8.0, "expert_down_input": 8.0, "q": 8.0,
             "norm1_input": 8.0, "q_latent_normed": 8.0, "mlp_input": 8.0}
    out = recompute_adjust(ds, ("moe_act", "mla_up_proj"), True, True, 2.0, True,
                           ("attn_norm",))(saved)
    assert out == {"expert_gate": 4.0, "expert_up": 4.0, "expert_down_input": 0.0, "q": 0.0,
                   "norm1_input": 0.0, "q_latent_normed_checkpoint": 8.0, "mlp_input": 8.0}
    # selective off: nothing freed, the latents keep their name
    out = recompute_adjust(ds, ("moe_act", "mla_up_proj"), True, False, 2.0, False)(saved)
    assert out == saved
    # arrays of layouts: freed where selective holds
    out = recompute_adjust(ds, ("moe_act",), True, np.array([True, False]), 2.0, False)(saved)
    assert list(out["expert_down_input"]) == [0.0, 8.0] and out["expert_gate"] == 8.0


LLAMA = get_model("tiny")
DS = get_model("tiny-deepseek")


def _sum(saved):
    return sum(saved.values())


def test_a_layer_keeps_the_sum_of_its_saved_tensors_with_the_documented_defaults():
    # defaults: one sequence, no parallelism, no recompute, FlashAttention off, bf16
    assert activation_bytes_per_layer(LLAMA, 64) == _sum(saved_tensors_per_layer(
        LLAMA, 64, 1, tp=1, sp=False, cp=1, flash=False, selective=False, dtype_bytes_=2,
        moe=False))
    # the MoE layer by default for an MoE model; experts split over etp = tp unless given
    kw = dict(tp=2, sp=True, cp=2, flash=True, dtype="fp32")
    ref = dict(tp=2, sp=True, cp=2, flash=True, dtype_bytes_=4, a2a=1)
    assert activation_bytes_per_layer(DS, 64, 2, **kw) == pytest.approx(_sum(
        saved_tensors_per_layer(DS, 64, 2, moe=True, etp=2, **ref)))
    assert activation_bytes_per_layer(DS, 64, 2, moe=False, etp=1, a2a=2, **kw) == (
        pytest.approx(_sum(saved_tensors_per_layer(DS, 64, 2, moe=False, etp=1,
                                                   **ref | {"a2a": 2}))))
    # saved_tensors_per_layer's own default etp is tp's; etp = 1 changes the experts' share
    assert _sum(saved_tensors_per_layer(DS, 64, 2, tp=2, moe=True)) == pytest.approx(
        activation_bytes_per_layer(DS, 64, 2, tp=2, etp=2))
    assert activation_bytes_per_layer(DS, 64, 2, tp=2, etp=1) == pytest.approx(_sum(
        saved_tensors_per_layer(DS, 64, 2, tp=2, etp=1, moe=True)))
    assert activation_bytes_per_layer(DS, 64, 2, tp=2, etp=1) != activation_bytes_per_layer(
        DS, 64, 2, tp=2)
    # selective recompute drops the attention core's tensors; FP8 inputs are 1 byte
    sel = activation_bytes_per_layer(DS, 64, 1, recompute="selective", flash=True)
    assert sel == pytest.approx(_sum(saved_tensors_per_layer(DS, 64, 1, flash=True,
                                                             selective=True, moe=True)))
    fp8 = activation_bytes_per_layer(LLAMA, 64, 1, flash=True, fp8_inputs=1.0)
    plain = activation_bytes_per_layer(LLAMA, 64, 1, flash=True)
    # QKV's and fc1's norm outputs and fc2's input at 1 byte, not 2, and the out-projection's
    # FP8 copy beside the attention output: −s·h − s·h − s·f + s·h
    assert plain - fp8 == pytest.approx(64 * (64 + 128))
    # op-sac (code 3) keeps less than nothing recomputed
    assert activation_bytes_per_layer(DS, 64, 1, recompute=np.array([3]))[0] < (
        activation_bytes_per_layer(DS, 64, 1))


def test_megatron_recompute_modules_and_stores_through_the_layer_entry():
    saved = saved_tensors_per_layer(DS, 64, 1, moe=True, flash=True)
    # modules without core_attn: the attention core kept, only the experts' fc2 input freed
    only = activation_bytes_per_layer(DS, 64, 1, recompute="selective", flash=True,
                                      modules=("moe_act",))
    assert only == pytest.approx(_sum(saved) - saved["expert_down_input"])
    core = saved_tensors_per_layer(DS, 64, 1, moe=True, flash=True, selective=True)
    both = activation_bytes_per_layer(DS, 64, 1, recompute="selective", flash=True,
                                      modules=("core_attn", "moe_act"))
    assert both == pytest.approx(_sum(core) - core["expert_down_input"])
    # layernorm (MLA's separate input norm, an MoE model's pre-MLP norm) through the entry
    norms = activation_bytes_per_layer(DS, 64, 1, recompute="selective", flash=True,
                                       modules=("layernorm",))
    assert norms == pytest.approx(_sum(saved) - sum(saved[n] for n in (
        "norm1_stats", "qkv_input", "norm2_stats", "mlp_input")))
    # nothing recomputed: the modules free nothing
    assert activation_bytes_per_layer(DS, 64, 1, flash=True, modules=("moe_act",)) == (
        pytest.approx(_sum(saved)))
    # SwiGLU inputs stored in FP8: the gate and up tensors at 1 byte of 2
    stored = activation_bytes_per_layer(DS, 64, 1, flash=True, act_fp8_store=True)
    gate_up = sum(saved[n] for n in ("expert_gate", "expert_up", "shared_gate", "shared_up"))
    assert stored == pytest.approx(_sum(saved) - gate_up / 2)
    # offloaded module inputs leave the GPU
    off = activation_bytes_per_layer(DS, 64, 1, flash=True, offload_modules=("attn_norm",
                                                                             "expert_fc1"))
    assert off == pytest.approx(_sum(saved) - saved["norm1_input"] - saved["expert_inputs"])


def test_recompute_modules_combine():
    assert recompute_dropped(DS, ("layernorm", "mla_up_proj"), False) == {
        "norm1_stats", "qkv_input", "norm2_stats", "mlp_input", "q", "k", "v"}
    assert recompute_dropped(DS, ("moe_act", "shared_experts"), True) == {
        "expert_down_input", "shared_gate", "shared_up", "shared_down_input"}
    assert recompute_dropped(DS, ("layernorm", "moe_act"), True) == {
        "norm1_stats", "qkv_input", "norm2_stats", "mlp_input", "expert_down_input"}
    assert recompute_dropped(DS, ("layernorm", "moe"), True) >= {"norm1_stats", "router_probs"}
    assert recompute_dropped(DS, ("layernorm", "mlp"), False) == {
        "norm1_stats", "qkv_input", "norm2_stats", "mlp_input", "mlp_gate", "mlp_up",
        "mlp_down_input"}


def test_recompute_adjust_keeps_latent_names_unless_mla_up_proj_on_one_layout():
    saved = {"q_latent_normed": 8.0, "expert_down_input": 8.0, "norm1_input": 0.0}
    # MLA without mla_up_proj: the latents keep their (FP8-saved) name
    out = recompute_adjust(DS, ("moe_act",), True, True, 2.0, False, ("attn_norm",))(saved)
    assert out == {"q_latent_normed": 8.0, "expert_down_input": 0.0, "norm1_input": 0.0}
    # arrays of layouts: each by its own rule — the latents are a bf16 checkpoint input where
    # selective holds, FP8-saved where it does not; and freed per layout
    out = recompute_adjust(DS, ("mla_up_proj", "moe_act"), True, np.array([True, False]), 2.0,
                           False)(saved)
    assert set(out) == set(saved) | {"q_latent_normed_checkpoint"}
    assert list(out["q_latent_normed_checkpoint"]) == [8.0, 0.0]
    assert list(out["q_latent_normed"]) == [0.0, 8.0]
    assert list(out["expert_down_input"]) == [0.0, 8.0]
    # so an FP8 recipe's array of layouts counts what each layout counts alone
    fp8 = {"moe": True, "fp8_inputs": 1.0, "modules": ("mla_up_proj",), "sp": True, "tp": 2}
    both = activation_bytes_per_layer(DS, 64, 1, recompute=np.array([1, 0]), **fp8)
    assert list(both) == [activation_bytes_per_layer(DS, 64, 1, recompute=rc, **fp8)
                          for rc in ("selective", "none")]


def test_routed_load_and_a_share_of_full_recompute_by_hand():
    """tiny-deepseek's MoE layer (top-2, h 64, expert f 32, bf16, s 32): each routed copy
    keeps its input and output (h) and its gate, up and down input (f), so a routed load of
    1.5 adds 0.5·32·2·(2·64 + 3·32)·2 B; with full recompute of half the layers (recompute
    codes as arrays) a full layer keeps ½·full + ½·none and a none layer what none keeps."""
    ds = get_model("tiny-deepseek")
    more = (activation_bytes_per_layer(ds, 32, 1, moe=True, routed_load=1.5)
            - activation_bytes_per_layer(ds, 32, 1, moe=True))
    assert more == 0.5 * 32 * 2 * (2 * 64 + 3 * 32) * 2
    none, full = (activation_bytes_per_layer(ds, 32, 1, recompute=rc) for rc in ("none", "full"))
    mixed = activation_bytes_per_layer(ds, 32, 1, recompute=np.array([0, 2]), full_share=0.5)
    assert list(mixed) == [none, 0.5 * full + 0.5 * none]
