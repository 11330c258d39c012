"""Implementation profiles (`estimate.profiles`): registry, published figures, Megatron's own
formula, scalar = array, the per-stage peak. The measured agreement with Hugging Face and
torchtitan code is in test_profiles_measured.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardwise.arch import PRESETS, ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import (
    activation_bytes_per_layer,
    saved_tensors_per_layer,
    training_memory_per_gpu,
)
from shardwise.estimate.profiles import (
    DEFAULT_IMPL,
    PROFILES,
    component,
    get_profile,
    layer_bytes,
    saved_tensors,
)
from shardwise.layout import Layout, TrainSpec
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

IMPLS = list(PROFILES)


def test_registry_and_bad_names():
    assert set(IMPLS) == {"shardwise", "megatron-te", "torchtitan", "hf-sdpa", "hf-eager"}
    assert DEFAULT_IMPL in PROFILES
    with pytest.raises(ShardwiseError, match="valid: shardwise, megatron-te"):
        get_profile("deepspeed")
    with pytest.raises(ShardwiseError, match="stack 'x' unknown"):
        TrainSpec(impl="x").validate()
    assert TrainSpec().impl == DEFAULT_IMPL  # the default stack's profile has the same name
    assert TrainSpec().profile == DEFAULT_IMPL


def test_issue_figures_llama3_8b_layer():
    """Issue 10, measured on the real transformers LlamaDecoderLayer (s=4096, b=1, bf16, one
    layer, so with the RoPE cos/sin tables, 2·s·d·2 B): 49.16·sbh with SDPA, 244.13·sbh eager.
    shardwise's own count is the walk of `test_shardwise_count_walked_out_for_llama3_8b`."""
    model = PRESETS["llama3-8b"]
    s, h = 4096, model.d_model
    sbh = s * h
    tables = 2 * s * model.head_dim * 2

    def per_sbh(impl: str, flash: bool, extra: float = 0.0) -> float:
        return (activation_bytes_per_layer(model, s, 1, flash=flash, impl=impl) + extra) / sbh

    assert per_sbh("hf-sdpa", True, tables) == pytest.approx(49.16, abs=0.005)
    assert per_sbh("hf-eager", False, tables) == pytest.approx(244.13, abs=0.005)
    # hf-sdpa and hf-eager fix their kernel; shardwise follows --flash
    assert per_sbh("hf-sdpa", False) == per_sbh("hf-sdpa", True)


def test_shardwise_count_walked_out_for_llama3_8b():
    """SPEC §3's generalised count, one Llama-3-8B layer (h 4096, a 32, a_kv 8, d 128,
    f 14336, RMSNorm, SwiGLU, no dropout), bf16 (2 B), fp32 statistics (4 B), b = 1, walked
    tensor by tensor in units of s·b·h bytes:

        norm 1: input 2, rstd 4/h            attention: QKV input 2, Q 2, K and V 2·a_kv/a each
        attention output (out-proj input) 2  norm 2: input 2, rstd 4/h
        MLP: input 2, gate and up 2f/h each, down-projection input 2f/h
        flash: log-sum-exp (b, a, s) fp32, 4a/h; materialised: softmax output 2as/h

    = 34 + 8/h + 4a/h = 34.0332 (flash), 34 + 8/h + 2as/h = 98.0020 (materialised)."""
    model = PRESETS["llama3-8b"]
    s, h, a, kv, f = 4096, model.d_model, model.n_heads, model.n_kv_heads, model.d_ff
    walk = {"norm1_input": 2, "norm1_stats": 4 / h, "qkv_input": 2, "q": 2, "k": 2 * kv / a,
            "v": 2 * kv / a, "attention_output": 2, "norm2_input": 2, "norm2_stats": 4 / h,
            "mlp_input": 2, "mlp_gate": 2 * f / h, "mlp_up": 2 * f / h,
            "mlp_down_input": 2 * f / h}
    for flash, attention in ((True, {"flash_logsumexp": 4 * a / h}),
                             (False, {"softmax_output": 2 * a * s / h})):
        expected = walk | attention
        saved = saved_tensors("shardwise", model, s, 1, flash=flash)
        assert saved == pytest.approx({k: v * s * h for k, v in expected.items()}, rel=1e-12)
        total = activation_bytes_per_layer(model, s, 1, flash=flash) / (s * h)
        assert total == pytest.approx(34 + 8 / h + (4 * a / h if flash else 2 * a * s / h),
                                      rel=1e-12)


def test_megatron_te_follows_theoretical_memory_usage():
    """Megatron-LM megatron/training/theoretical_memory_usage.py, `compute_activation_memory`
    (SP + selective recompute): `s·b·h·(18 + 4f/h) / t` per layer for a GPT layer (MHA,
    LayerNorm, GELU MLP, dropout). The profile adds only the fp32 norm statistics, which the
    formula leaves out."""
    gpt = ModelSpec("gpt", 24, 2048, 16, 16, 5461, 50257, gated_mlp=False, norm="layernorm",
                    dropout=True)
    s, b, t = 2048, 2, 4
    saved = saved_tensors("megatron-te", gpt, s, b, tp=t, sp=True, flash=True, selective=True)
    stats = saved["norm1_stats"] + saved["norm2_stats"]
    megatron = s * b * gpt.d_model * (18 + 4 * gpt.d_ff / gpt.d_model) / t
    assert sum(saved.values()) - stats == pytest.approx(megatron, rel=1e-12)


def test_shardwise_profile_is_the_generalised_count():
    model = PRESETS["mixtral-8x7b"]
    for moe, flash in itertools.product((False, True), repeat=2):
        a = saved_tensors_per_layer(model, 4096, 1, tp=2, sp=True, flash=flash, moe=moe)
        assert a == saved_tensors("shardwise", model, 4096, 1, tp=2, sp=True, flash=flash,
                                  moe=moe)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_tensor_has_a_component(impl):
    gpt = ModelSpec("gpt", 2, 256, 4, 4, 1024, 1000, gated_mlp=False, norm="layernorm",
                    dropout=True)
    for model in (PRESETS["llama3-8b"], PRESETS["mixtral-8x7b"], PRESETS["deepseek-v3"], gpt):
        for flash in (False, True):
            names = saved_tensors(impl, model, 1024, 1, flash=flash, moe=model.is_moe)
            assert all(component(name) != "other" for name in names), names


@pytest.mark.parametrize("impl", IMPLS)
def test_arrays_equal_scalars(impl):
    """The planner evaluates the profile on arrays; each element equals the scalar call."""
    model = PRESETS["mixtral-8x7b"]
    grid = list(itertools.product((1, 2, 8), (False, True), (1, 2), (1, 2), (0, 1, 2)))
    t, sp, c, b, rc = (np.array(col) for col in zip(*grid, strict=True))
    for flash, moe in itertools.product((False, True), repeat=2):
        arrays = layer_bytes(impl, model, 4096, b, tp=t, sp=sp, cp=c, flash=flash,
                             selective=rc == 1, full=rc == 2, moe=moe)
        scalars = [activation_bytes_per_layer(
            model, 4096, bi, tp=ti, sp=spi, cp=ci, flash=flash, moe=moe, impl=impl,
            recompute=("none", "selective", "full")[rci]) for ti, spi, ci, bi, rci in grid]
        np.testing.assert_allclose(arrays, scalars, rtol=1e-12)
        codes = activation_bytes_per_layer(model, 4096, b, tp=t, sp=sp, cp=c, flash=flash,
                                           moe=moe, impl=impl, recompute=rc)
        np.testing.assert_allclose(codes, scalars, rtol=1e-12)


def test_profiles_order_for_llama():
    """hf-eager keeps the most, shardwise = megatron-te (dense) the least."""
    model = PRESETS["llama3-8b"]
    bytes_ = {impl: activation_bytes_per_layer(model, 8192, 1, flash=True, impl=impl)
              for impl in IMPLS}
    assert bytes_["shardwise"] == bytes_["megatron-te"]
    assert bytes_["shardwise"] < bytes_["hf-sdpa"] < bytes_["torchtitan"] < bytes_["hf-eager"]
    # full recompute keeps the layer input, whoever's code
    full = {activation_bytes_per_layer(model, 8192, 1, recompute="full", impl=impl)
            for impl in IMPLS}
    assert full == {8192 * model.d_model * 2}


def test_training_memory_uses_the_profile():
    model = PRESETS["llama3-8b"]
    layout = Layout(dp=8, zero=2)
    shard = training_memory_per_gpu(model, layout, TrainSpec(seq_len=8192, impl="shardwise"))[0]
    hf = training_memory_per_gpu(model, layout, TrainSpec(seq_len=8192, impl="hf-sdpa"))[0]
    per_layer = (activation_bytes_per_layer(model, 8192, 1, flash=True, impl="hf-sdpa")
                 - activation_bytes_per_layer(model, 8192, 1, flash=True, impl="shardwise"))
    assert hf.activations - shard.activations == pytest.approx(32 * per_layer)
    assert hf.state == shard.state


# --------------------------------------------------------------------------------- peak
def test_peak_terms_and_dominant():
    model = PRESETS["llama3-8b"]
    train = TrainSpec(seq_len=8192, impl="shardwise")
    stage = training_memory_per_gpu(model, Layout(dp=8, zero=2), train)[0]
    parts = dict(stage.transients)
    # the loss's fp32 buffer: one logits-sized fp32 tensor, s·b·V·4/t
    assert parts["loss buffer"] == 8192 * model.vocab * 4
    # FlashAttention-2's fp32 dq accumulator for one layer
    assert parts["attention workspace"] == 8192 * model.d_model * 4
    # ZeRO-2: one layer's unsharded bf16 gradients before the reduce-scatter
    assert parts["gradient bucket"] == model.dense_layer_params() * 2
    # foreach Adam: one fp32 buffer per parameter the rank steps on (ZeRO-2: 1/8 of them)
    assert parts["optimizer step"] == pytest.approx(model.count_params().total / 8 * 4)
    assert stage.peak == pytest.approx(stage.total + parts["loss buffer"])
    assert stage.peak_transient == "loss buffer"
    assert stage.peak_term == "activations"
    # a pipeline's middle stage has no loss; with little activation memory the optimizer
    # step is the peak, and its largest term the optimizer state
    small = training_memory_per_gpu(model, Layout(tp=8, pp=4, sp=True, recompute="full"),
                                    TrainSpec(seq_len=2048, impl="shardwise"))[1]
    assert small.peak == pytest.approx(small.state + dict(small.transients)["optimizer step"])
    assert small.peak_transient == "optimizer step" and small.peak_term == "optimizer"


def test_peak_zero3_keeps_the_gather():
    model = PRESETS["llama2-7b"]
    stage = training_memory_per_gpu(model, Layout(dp=8, zero=3), TrainSpec(seq_len=4096))[0]
    assert stage.workspace > 0 and stage.peak >= stage.total


# ---------------------------------------------------------------------------------- CLI
def test_cli_memory_states_the_profile_and_the_peak():
    text = shardwise("memory", "llama3-8b", "--gpus", "8", "--zero", "2").stdout
    assert f"(--impl {DEFAULT_IMPL})" in text and get_profile(DEFAULT_IMPL).title in text
    assert "Peak, stage 0" in text and "CPU allocator cannot" in text
    out = shardwise_json("memory", "llama3-8b", "--zero", "2", "--impl", "hf-eager")
    assert out["train"]["impl"] == "hf-eager"
    stage = out["stages"][0]
    assert stage["peak"] >= stage["total"] and stage["peak_term"] == "activations"
    assert set(stage["transients"]) == {"loss buffer", "attention workspace", "ZeRO-3 gather",
                                        "gradient bucket", "optimizer step"}
    saved = out["layer_saved"]
    assert saved["profile"] == "hf-eager" and "attention internals" in saved["by_component"]
    assert sum(saved["tensors"].values()) == pytest.approx(activation_bytes_per_layer(
        PRESETS["llama3-8b"], 8192, 1, flash=True, impl="hf-eager"))
    assert "One layer saves" in text and "MLP internals" in text
    help_text = " ".join(shardwise("memory", "--help").stdout.split())
    assert f"default: {DEFAULT_IMPL}" in help_text and "Training stack" in help_text


def test_cli_plan_takes_impl():
    args = ("plan", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "64",
            "--top", "1")
    shard = shardwise_json(*args, "--impl", "shardwise")
    eager = shardwise_json(*args, "--impl", "hf-eager")
    assert shard != eager
    text = shardwise(*args, "--impl", "torchtitan").stdout
    assert "(--impl torchtitan)" not in text and "torchtitan 0.3.0" in text


def test_cli_bad_impl_is_one_line():
    assert_one_line_error(shardwise("memory", "--impl", "deepspeed", check=False),
                          "stack 'deepspeed' unknown; valid: megatron-te")
    assert_one_line_error(shardwise("memory", "--impl", "torchtitan@0.2", check=False),
                          "modelled at torchtitan 0.3.0 and torchtitan 0.1.0 only")


@pytest.mark.slow
def test_cli_check_states_its_profile():
    args = ("check", "--seq", "32", "--global-batch", "2", "--steps", "1", "--dtype", "fp64")
    text = " ".join(shardwise(*args).stdout.split())
    assert "against the shardwise profile, which the runtime implements exactly" in text
    out = shardwise_json(*args, "--impl", "hf-sdpa")
    assert out["activation_profile"] == "hf-sdpa" and out["ok"]
    rows = [row for row in out["rows"] if row["item"] == "activations"]
    assert rows and all(row["target"] == "-" for row in rows)
    assert all("against the hf-sdpa profile" in row["note"] for row in rows)
    # the shardwise runtime keeps less than HF's code would for the same layer
    assert all(row["measured"] < row["predicted"] for row in rows)


def test_mla_layer_by_hand():
    """DeepSeek-V3's layer under Megatron-Core + TE (tp 8, SP, fused attention, bf16), read
    from megatron/core/transformer/multi_latent_attention.py 0.16.1: the input norm (input,
    rsigma, output), the q latent (1536) and the kv latent (W_DKV's 512 + 64 output, the norm's
    input a view of it; the normed 512) each with rsigma, all ÷8 by SP; q and k at 192 and v at
    128 per head for 16 heads per rank, the output at 128, the softmax statistics fp32."""
    v3 = PRESETS["deepseek-v3"]
    s, b, t = 4096, 1, 8
    rows = s * b
    saved = saved_tensors("megatron-te", v3, s, b, tp=t, sp=True, flash=True)
    mla = (rows * (2 * 7168 * 2 + 4)  # norm1 input and output, rstd
           + rows * (2 * 1536 * 2 + 4) + rows * ((576 + 512) * 2 + 4)) / t  # latents
    mla += rows * 16 * (192 * 2 * 2 + 128 * 2 * 2 + 4)  # q, k, v, output, log-sum-exp
    names = [n for n in saved if not n.startswith(("norm2", "mlp", "router", "expert", "shared"))]
    assert sum(saved[n] for n in names) == pytest.approx(mla, rel=1e-12)
    assert saved == saved_tensors("shardwise", v3, s, b, tp=t, sp=True, flash=True)


def test_expert_tensor_parallel_arrays_equal_scalars():
    """MoE activations with expert tensor parallelism: the routed copies of the etp group's
    share of the tokens, `etp/tp` of them, at f/etp (arrays as the planner passes them)."""
    v3 = PRESETS["deepseek-v3"]
    t, etp = np.array([1, 2, 8, 8]), np.array([0, 1, 1, 2])
    arrays = layer_bytes("megatron-te", v3, 4096, 1, tp=t, sp=True, flash=True, moe=True,
                         etp=etp)
    scalars = [layer_bytes("megatron-te", v3, 4096, 1, tp=int(ti), sp=True, flash=True,
                           moe=True, etp=int(ei)) for ti, ei in zip(t, etp, strict=True)]
    np.testing.assert_allclose(arrays, scalars, rtol=1e-12)
    one = saved_tensors("megatron-te", v3, 4096, 1, tp=8, sp=True, flash=True, moe=True, etp=1)
    same = saved_tensors("megatron-te", v3, 4096, 1, tp=8, sp=True, flash=True, moe=True)
    assert one["expert_inputs"] == same["expert_inputs"] / 8  # 1/8 of the rows …
    assert one["expert_gate"] == same["expert_gate"]  # … at 8× the width
