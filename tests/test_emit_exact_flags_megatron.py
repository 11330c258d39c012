"""Megatron-LM exports of non-degenerate runs, read back by Megatron-LM's parser and checked
against megatron-core's constants: the flags it reads, its run settings' refusals, positions
and YaRN (not marked integration: mutation testing of emit/* runs them)."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.emit import emit
from shardwise.emit.megatron_oss import QUICK_GELU_ALPHA, megatron_builds, megatron_lacks
from shardwise.emit.models import model_refusal, nope_every
from shardwise.layout import Layout
from tests.emit_exact import V2, V2_LAYOUT, _argv, _flag, _megatron_lm, _refusal, _train

# --- Megatron-LM: the flags megatron-core reads -------------------------------------------------


def test_mla_with_plain_rope_is_megatrons_rope_type_rope():
    """Megatron-LM's MLA defaults --rope-type to yarn (arguments.py); DeepSeek-V2-Lite without
    its YaRN scaling must say rope."""
    v2 = get_model("deepseek-v2-lite")
    layout = Layout(dp=4, tp=2, ep=4, zero=1, sp=True)
    out = emit("megatron", v2.with_(rope_scaling=()), layout, _train("megatron"))
    assert _flag(out, "--rope-type") == "rope"
    assert _megatron_lm(out, 8).rope_type == "rope"
    yarn = emit("megatron", v2, layout, _train("megatron"))
    assert _flag(yarn, "--rope-type") == "yarn" and _flag(yarn, "--rotary-scaling-factor") == "40"
    linear = v2.with_(rope_scaling=(("factor", 2.0), ("rope_type", "linear")))
    assert _refusal("megatron", linear, layout) == (
        "Megatron-LM's MLA has no linear RoPE scaling (rope or yarn)")


@pytest.mark.parametrize("top_k", [1, 2])
def test_unnormalised_sigmoid_gates_export_at_top_1_only(top_k):
    """megatron-core 0.16.1 moe_utils.py:724 (`topk_routing_with_score_function`): sigmoid
    scores are divided by their sum only `if topk > 1`; a model that leaves them unnormalised
    exports at top-1 (the same gates) and is refused above."""
    model = get_model("tiny-deepseek").with_(norm_topk=False, top_k=top_k)
    layout = Layout(dp=2, ep=2)
    if top_k == 1:
        out = emit("megatron", model, layout, _train("megatron"))
        assert _flag(out, "--moe-router-score-function") == "sigmoid"
        assert "--moe-router-enable-expert-bias" in _argv(out)
    else:
        assert _refusal("megatron", model, layout) == (
            "Megatron-LM normalises sigmoid top-k gates (moe_utils."
            "topk_routing_with_score_function); this model leaves them unnormalised "
            "(norm_topk_prob false)")


def test_gpt_oss_flags_as_megatron_reads_them():
    """gpt-oss-20b: attention sinks (`--softmax-type learnable`), biased experts at etp 1,
    the clamped SwiGLU as megatron-core's quick GEGLU, whose α is megatron-core's own
    `activations.quick_gelu` constant (x·σ(1.702 x)), gpt-oss's swiglu_alpha."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megatron.core.activations import quick_gelu

    x = torch.tensor([0.5, 2.0], dtype=torch.float64)
    alpha = torch.logit(quick_gelu(x) / x) / x  # σ⁻¹(q(x)/x) / x
    assert torch.allclose(alpha, torch.full_like(x, QUICK_GELU_ALPHA), rtol=1e-12, atol=0)
    model = get_model("gpt-oss-20b")
    assert dict(model.multipliers)["swiglu_alpha"] == QUICK_GELU_ALPHA
    assert megatron_builds(model) == {"attention sinks", "swiglu_clamp MLP",
                                      "scalar multipliers", "MLP biases", "a router bias"}
    assert set(model.runtime_variants()) <= megatron_builds(model)
    other = model.with_(multipliers=(("swiglu_alpha", 2.0), ("swiglu_limit", 7.0)))
    assert "swiglu_clamp MLP" not in megatron_builds(other)
    layout = Layout(dp=16, ep=8)
    out = emit("megatron", model, layout, _train("megatron", attention="cudnn", seq_len=4096))
    args = _megatron_lm(out, 16)
    assert args.softmax_type == "learnable" and args.add_bias_linear
    assert not args.bias_dropout_fusion and args.quick_geglu
    assert (args.glu_linear_offset, args.activation_func_clamp_value) == (1.0, 7.0)
    assert _refusal("megatron", model, layout, attention="fa2") == _refusal(
        "megatron", model, layout, attention="fa3") == (
        "Transformer Engine runs attention sinks (--softmax-type learnable) in its cuDNN and "
        "unfused attention only: plan with --attention cudnn")
    assert _refusal("megatron", model, Layout(dp=8, tp=2, ep=8, sp=True),
                    attention="cudnn") == (
        "megatron-core 0.16.1 builds biased experts with expert tensor parallelism 1 only "
        "(\"Bias in Moe is only supported when ETP==1\"), not etp=2: plan with --etp 1")


def test_yarn_outside_mla_is_refused_naming_llama_3_1s_scaling():
    model = get_model("llama3-8b").with_(rope_scaling=(("factor", 4.0), ("rope_type", "yarn")))
    assert megatron_lacks(model) == (
        "llama3-8b scales RoPE with yarn; megatron-core 0.16.1 scales standard attention's "
        "RoPE as Llama 3.1 only (--use-rope-scaling) and builds YaRN for multi-latent "
        "attention only (MLATransformerConfig; TransformerConfig has no yarn_* fields, "
        "Megatron-LM asserts rope_type rope): it would train another model")
    assert megatron_lacks(get_model("llama3-8b")) is None


def test_every_nth_layer_without_rope_is_no_rope_freq_n_and_other_patterns_are_refused():
    """megatron-core's `no_rope_freq` N builds [0]·(N-1) + [1] repeated (transformer_config.py):
    SmolLM3's layers 4, 8, …, 36 (1-based) are N = 4; a pattern that is not every N-th
    layer has no such N."""
    smol = get_model("smollm3-3b")
    assert smol.nope_layers == tuple(range(3, 36, 4)) and nope_every(smol) == 4
    assert model_refusal("megatron", smol, _train("megatron")) is None
    for layers in ((3, 7, 11), (3, 7, 11, 15, 19, 23, 27, 31, 34)):  # stops early; one off
        irregular = smol.with_(nope_layers=layers)
        assert nope_every(irregular) == 0
        assert "layers without RoPE" in model_refusal("megatron", irregular, _train("megatron"))
    assert nope_every(smol.with_(n_layers=34, nope_layers=tuple(range(3, 34, 4)))) == 0


# --- Megatron-LM: the run settings' refusals ------------------------------------------------------



@pytest.mark.parametrize(("layout", "train", "message"), [
    (dict(dp=8, tp=2, zero=1, sp=True), dict(moe_overlap="1f1b"),
     "moe_overlap 1f1b as planned: megatron-core 0.16.1's --overlap-moe-expert-parallel-comm "
     "needs expert parallelism (ep > 1) (transformer_config.py __post_init__)"),
    (V2_LAYOUT, dict(moe_dispatch_fp8=True, moe_dispatcher="flex"),
     "moe_dispatch_fp8 as planned: megatron-core 0.16.1's flex dispatcher sends bf16 "
     "(moe/fused_a2a.py: DeepEP's dispatch takes no FP8 payload, HybridEP's fp8_dispatch is "
     "fixed False) and Megatron-LM has no FP8-dispatch flag"),
    (V2_LAYOUT, dict(comm_sms=20),
     "comm_sms as planned: Megatron-LM sets the SMs of DeepEP's kernels only "
     "(--moe-deepep-num-sms, flex dispatcher); its alltoall dispatcher's NCCL collectives "
     "take no SM count"),
])
def test_megatron_refuses_a_moe_setting_naming_the_rule(layout, train, message):
    assert _refusal("megatron", get_model(V2), Layout(**layout), **train) == (
        "--emit megatron cannot run " + message)


def test_a_recompute_share_on_uneven_stages_is_refused_naming_their_sizes():
    """7, 9, 9, 7 layers: half of 7 and half of 9 are no one whole N of Megatron's block
    method (transformer_block.py: the first N layers of each chunk)."""
    layout = Layout(dp=2, tp=2, pp=4, zero=1, partition=(7, 9, 9, 7), recompute="full")
    assert _refusal("megatron", get_model("llama3-8b"), layout, recompute_share=0.5) == (
        "--emit megatron cannot run recompute_share 0.5 as planned: Megatron's "
        "--recompute-method block recomputes the same N first layers of every (virtual) stage "
        "chunk; this layout's chunks hold 7/9 layers, which no whole N matches")
    even = emit("megatron", get_model("llama3-8b"), layout.with_(partition=()),
                _train("megatron", recompute_share=0.5))
    assert (_flag(even, "--recompute-method"), _flag(even, "--recompute-num-layers")) == (
        "block", "4")  # half of 32 / 4 stages


def test_recompute_modules_outside_selective_recompute_are_a_note():
    out = emit("megatron", get_model("llama3-8b"), Layout(dp=8, recompute="full"),
               _train("megatron", recompute_modules=("core_attn", "mlp")))
    assert "recompute_modules core_attn,mlp apply with selective recompute only; this layout " \
           "recomputes full, as planned" in out.notes
    assert (_flag(out, "--recompute-method"), _flag(out, "--recompute-num-layers")) == (
        "uniform", "1")


def test_delayed_fp8_cannot_recompute_layernorm():
    message = _refusal("megatron", get_model("llama3-8b"), Layout(dp=8, recompute="selective"),
                       fp8="delayed", recompute_modules=("layernorm",))
    assert message == ("--emit megatron cannot run recompute_modules layernorm as planned: "
                       "megatron-core 0.16.1: delayed FP8 scaling cannot recompute moe_act or "
                       "layernorm (transformer_config.py)")



# --- Megatron-LM: positions and YaRN ---------------------------------------------------------

def test_learned_positions_are_megatrons_learned_absolute():
    out = emit("megatron", get_model("gpt3-1.3b"), Layout(dp=8), _train("megatron"))
    assert _megatron_lm(out, 8).position_embedding_type == "learned_absolute"


def test_v2_lite_yarn_as_its_config_json_sets_it():
    """DeepSeek-V2-Lite's config.json rope_scaling: factor 40, mscale 0.707, mscale_all_dim
    0.707 (huggingface.co/deepseek-ai/DeepSeek-V2-Lite); a YaRN config without a factor is
    Megatron-LM's default factor (its parser's 1.0: no scaling)."""
    v2, layout = get_model(V2), Layout(**V2_LAYOUT)
    args = _megatron_lm(emit("megatron", v2, layout, _train("megatron")), 8)
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == (
        "yarn", 40.0, 0.707, 0.707)
    bare = v2.with_(rope_scaling=tuple((k, v) for k, v in v2.rope_scaling if k != "factor"))
    args = _megatron_lm(emit("megatron", bare, layout, _train("megatron")), 8)
    from tests.integration.test_megatron_lm import _parse

    assert args.rotary_scaling_factor == _parse([]).rotary_scaling_factor == 1.0


@pytest.mark.parametrize("full", [(2, 4, 6, 8, 10, 12), (3, 6, 9, 12), (2, 5, 8, 11), (12,)])
def test_sliding_windows_as_megatron_core_places_them(full):
    """The layers (1-based) with full attention, the others windowed: megatron-core's own
    `is_layer_window_attention` (transformer/utils.py) on the export's flags gives back each
    layer's kind, whether they are every N-th (an int) or not (a list)."""
    pytest.importorskip("megatron.core")
    import ast

    from megatron.core.transformer.utils import is_layer_window_attention

    from shardwise.emit.megatron_oss import window_args

    model = get_model("gpt-oss-20b").with_(n_layers=12, layer_types=tuple(
        "full" if n in full else "sliding" for n in range(1, 13)))
    flags = dict(arg.split(" ", 1) for arg in window_args(model))
    left, right = map(int, flags["--window-size"].split(","))
    assert (left + 1, right) == (model.sliding_window, 0)
    freq = ast.literal_eval(flags["--window-attn-skip-freq"].strip("'"))
    assert isinstance(freq, int) == (full in ((2, 4, 6, 8, 10, 12), (3, 6, 9, 12), (12,)))
    assert [is_layer_window_attention((left, right), freq, n) for n in range(1, 13)] == [
        n not in full for n in range(1, 13)]


def test_torchtitan_sets_sequence_parallelism_only_with_a_tp_group():
    """SP is an option of the TP group (torchtitan applies its sharding only with
    `parallel_dims.tp_enabled`, models/llama3/parallelize.py:52): written at tp 2 as planned
    (on or off), left to torchtitan's default at tp 1."""
    llama, train = get_model("llama3-8b"), _train("torchtitan")
    words = _argv(emit("torchtitan", llama, Layout(dp=8, zero=2), train))
    assert not [w for w in words if "enable_sequence_parallel" in w]
    for sp in (True, False):
        words = _argv(emit("torchtitan", llama, Layout(dp=4, tp=2, zero=2, sp=sp), train))
        assert [w for w in words if "enable_sequence_parallel" in w] == [
            "--parallelism." + ("" if sp else "no_") + "enable_sequence_parallel"]
