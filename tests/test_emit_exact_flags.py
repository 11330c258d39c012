"""Exports of non-degenerate runs checked against references written here or read from the
frameworks' own code (not marked integration: mutation testing of emit/* runs them): the exact
flag values Megatron-LM, Megatron-DeepSpeed and DeepSpeed read (their parsers' defaults and
megatron-core's constants), and each refusal's one line naming the field, the framework's rule
and its source file, case and all (a user greps for them)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from shardwise.arch import get_model
from shardwise.emit import emit, nearest
from shardwise.emit.common import _edits
from shardwise.emit.megatron_oss import QUICK_GELU_ALPHA, megatron_builds
from shardwise.emit.models import model_refusal
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from tests.emit_exact import (
    V2,
    V2_LAYOUT,
    _argv,
    _flag,
    _megatron_deepspeed,
    _megatron_lm,
    _refusal,
    _train,
)

# --- every export: its framework's name, each flag once --------------------------------------

RUNS = [  # (framework, model, layout, train): MoE with shared experts over tp·cp·ep = 16, …
    ("megatron", "deepseek-v2-lite", dict(dp=4, tp=2, cp=2, ep=4, zero=1, sp=True), {}),
    # the optimizer offload writes --use-precision-aware-optimizer; the moments' dtype needs it
    ("megatron", "llama3-8b", dict(dp=4, tp=2, zero=1, sp=True),
     dict(offload="optimizer", exp_avg_dtype="bf16")),
    ("torchtitan", "llama3-8b", dict(dp=2, tp=2, pp=4, schedule="interleaved", chunks=2,
                                     zero=2, recompute="op-sac"), {}),
    ("deepspeed", "mixtral-8x7b", dict(dp=16, tp=2, ep=8, zero=2), {}),
]


@pytest.mark.parametrize(("framework", "model", "layout", "train"), RUNS)
def test_an_export_names_its_framework_and_sets_each_flag_once(framework, model, layout, train):
    out = emit(framework, get_model(model), Layout(**layout), _train(framework, **train))
    assert out.framework == framework  # the payload's key (report.builders.emit_payload)
    flags = Counter(word for word in _argv(out) if word.startswith("--"))
    assert [f for f, n in flags.items() if n > 1] == []
    if train.get("offload"):
        assert flags["--use-precision-aware-optimizer"] == 1
        assert _flag(emit(framework, get_model(model), Layout(**layout),
                          _train(framework, **train)), "--exp-avg-dtype") == "bf16"


# --- the vocabulary divisor -----------------------------------------------------------------

@pytest.mark.parametrize(("framework", "model", "tp"), [
    ("megatron", "qwen3-8b", 2),      # V/tp = 75968 = 64·1187: 64
    ("megatron", "llama3-8b", 2),     # V/tp = 64128 = 128·501: 128
    ("deepspeed", "gpt3-1.3b", 1),    # V = 50257 = 29·1733, odd: 1
])
def test_the_vocabulary_divisor_is_the_largest_up_to_128_that_leaves_v_unpadded(
        framework, model, tp):
    """Megatron pads V up to a multiple of `make_vocab_size_divisible_by · tp` (Megatron-LM
    megatron/training/tokenizer/tokenizer.py `_vocab_size_with_padding`, default divisor 128):
    the export's divisor is the largest power of two d ≤ 128 (the default's divisors) with
    d·tp | V, found here by trying each."""
    spec = get_model(model)
    layout = Layout(dp=8 // tp, tp=tp, sp=tp > 1)
    out = emit(framework, spec, layout, _train(framework))
    expected = max(2**k for k in range(8) if spec.vocab % (2**k * tp) == 0)
    assert int(_flag(out, "--make-vocab-size-divisible-by")) == expected
    assert expected == {"qwen3-8b": 64, "llama3-8b": 128, "gpt3-1.3b": 1}[model]


# --- the nearest runnable layout ----------------------------------------------------------------

def test_folding_tp_into_data_parallelism_drops_sequence_parallelism():
    """Sequence parallelism splits the tp group's tokens: with tp folded to 1 it is off."""
    model, train = get_model("llama3-8b"), _train("megatron")
    layout = Layout(dp=4, tp=2, zero=1, sp=True)
    edits = list(_edits(train.stack, model, layout))
    assert layout.with_(tp=1, sp=False) in edits
    assert not [e for e in edits if e.tp == 1 and e.sp]


def test_the_nearest_search_stops_at_its_depth():
    """DeepSpeed-MoE refuses both Megatron SP and ZeRO-3 (deepspeed/moe/sharded_moe.py,
    runtime/engine.py @0.19.8): no single edit fixes both, two do (sp off, zero ≤ 2)."""
    model, train = get_model("mixtral-8x7b"), _train("deepspeed")
    layout = Layout(dp=16, tp=2, ep=8, zero=3, sp=True)
    cluster = Cluster.of(32, "h100")
    assert nearest("deepspeed", model, layout, train, cluster, depth=1) is None
    found = nearest("deepspeed", model, layout, train, cluster, depth=2)
    assert found is not None
    near = found[0]
    assert not near.sp and near.zero <= 2 and near.tp * near.dp * near.pp * near.cp == 32


def test_a_refusal_prices_the_nearest_layout_on_the_given_cluster():
    """torchtitan has no selective recompute: the refusal's step time is the named layout's
    estimate on the cluster passed (A100s here), not on the default H100s."""
    from shardwise.estimate.step import estimate_step

    model, train = get_model("llama3-8b"), _train("torchtitan")
    a100 = Cluster.of(8, "a100")
    with pytest.raises(ShardwiseError) as info:
        emit("torchtitan", model, Layout(dp=8, zero=3, recompute="selective"), train,
             cluster=a100)
    found = re.search(r"\(--layout ([^)]*)\), ([\d.]+) s per step", str(info.value))
    assert found is not None, str(info.value)
    named = Layout.parse(found.group(1), dp=8)
    on_a100 = estimate_step(model, a100, named, train).total
    on_h100 = estimate_step(model, Cluster.of(8, "h100"), named, train).total
    assert on_a100 > 1.3 * on_h100  # the two clusters are told apart
    assert float(found.group(2)) == pytest.approx(on_a100, rel=0.01)


# --- DeepSpeed and Megatron-DeepSpeed ------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_deepspeed_builds_the_linear_biases_the_model_has(bias):
    """Megatron-DeepSpeed's `add_bias_linear` (default True, `--disable-bias-linear` clears
    it) is the model's bias."""
    model = get_model("gpt3-1.3b").with_(bias=bias)
    out = emit("deepspeed", model, Layout(dp=8), _train("deepspeed"))
    assert _megatron_deepspeed(out, 8).add_bias_linear is bias


def test_deepspeed_recomputes_a_share_of_layers_as_block_and_keeps_the_optimizer():
    """Half of 32 layers fully recomputed without pipeline stages: `--recompute-method block
    --recompute-num-layers 16` (ParallelTransformer checkpoints its first N layers), with
    plain SGD as `--optimizer sgd --sgd-momentum 0`."""
    out = emit("deepspeed", get_model("llama3-8b"), Layout(dp=8, recompute="full"),
               _train("deepspeed", optimizer="sgd", recompute_share=0.5))
    args = _megatron_deepspeed(out, 8)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == (
        "full", "block", 16)
    assert (args.optimizer, args.sgd_momentum) == ("sgd", 0.0)


def test_deepspeed_refuses_an_optimizer_megatron_lacks_naming_deepspeed():
    assert _refusal("deepspeed", get_model("llama3-8b"), Layout(dp=8),
                    optimizer="adafactor") == (
        "--emit deepspeed cannot run optimizer adafactor as planned: Megatron's --optimizer "
        "runs adam or sgd (with or without momentum) only")


def test_deepspeed_clips_gradients_as_megatron_deepspeed_does(monkeypatch, tmp_path):
    """DeepSpeed's engine clips at `gradient_clipping` (0.19.8's default 1.0,
    runtime/constants.py:203); Megatron-DeepSpeed's own `--clip-grad` default is 1.0 too."""
    pytest.importorskip("deepspeed")
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    from tests.integration import megatron_deepspeed
    from tests.integration.test_deepspeed import _Mpu

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *_, **__: 0)
    out = emit("deepspeed", get_model("llama3-8b"), Layout(dp=8, zero=3),
               _train("deepspeed"))
    path = tmp_path / "ds_config.json"
    path.write_text(out.text)
    config = DeepSpeedConfig(str(path), mpu=_Mpu(8))
    default = next(o["default"] for o in megatron_deepspeed.options() if o["dest"] == "clip_grad")
    assert config.gradient_clipping == default == 1.0
    assert config.zero_optimization_stage == 3


# --- torchtitan -------------------------------------------------------------------------------

def test_torchtitan_runs_fp8_through_llama3_405bs_config_only():
    """torchtitan 0.3 turns on Float8 in a config function; llama3_405b's has the rowwise
    converter with `filter_fqns=["lm_head"]`: the export names it and notes the head in bf16;
    another config with FP8 is refused."""
    layout = Layout(dp=16, tp=8, zero=3)
    out = emit("torchtitan", get_model("llama3-405b"), layout, _train("torchtitan",
                                                                      fp8="rowwise"))
    assert _flag(out, "--config") == "llama3_405b"
    assert out.notes == ("llama3_405b's Float8 converter leaves lm_head in bf16 (filter_fqns); "
                         "the plan charged the head's GEMMs in FP8",)
    assert _refusal("torchtitan", get_model("llama3-70b"), layout, fp8="rowwise") == (
        "torchtitan 0.3 turns on FP8 (rowwise) in a config function (model_registry(..., "
        "converters=[Float8LinearConverter.Config(recipe_name=…)])), not on the command line; "
        "only its llama3_405b config has one (rowwise): write your own, or emit for "
        "Megatron-LM")


# --- the nearest search's edits -------------------------------------------------------------

def test_the_edits_toward_a_stack_keep_what_it_runs():
    """Megatron-LM (megatron-te): interleaving 36 layers over pp 4 takes the fewest virtual
    stages that split them evenly (36 % 8 ≠ 0, 36 % 12 = 0: 3); its ZeRO 1, 2 and 3 shard in
    groups (zero_group kept), ZeRO-0 has none. torchtitan splits 27 layers over 2 stages
    counting the embedding and the head as a layer each (29 → 15 + 14, less one each end:
    14, 13), not the default 13, 14; a layout already on that split gets no edit to it."""
    megatron = _train("megatron").stack
    qwen = get_model("qwen3-8b")
    edits = list(_edits(megatron, qwen, Layout(dp=2, pp=4)))
    assert Layout(dp=2, pp=4, schedule="interleaved", chunks=3) in edits
    grouped = Layout(dp=8, zero=1, zero_group=4)
    zeros = {(e.zero, e.zero_group) for e in _edits(megatron, qwen, grouped) if e.zero != 1}
    assert zeros == {(0, 0), (2, 4), (3, 4)}
    titan, v2 = _train("torchtitan").stack, get_model("deepseek-v2-lite")
    layout = Layout(dp=4, pp=2, zero=2)
    assert layout.stage_partition(27) == (13, 14)
    assert layout.with_(partition=(14, 13)) in list(_edits(titan, v2, layout))
    own = layout.with_(partition=(14, 13))
    assert own not in list(_edits(titan, v2, own))


def test_a_layout_four_changes_from_what_torchtitan_runs_is_refused_without_a_nearest():
    """torchtitan lacks zb-h1, ZeRO-1, ring attention (cp folds into dp) and selective
    recompute: four fields to change, one more than the search's three."""
    model = get_model("llama3-8b")
    layout = Layout(dp=4, cp=2, cp_kind="ring", zero=1, recompute="selective", pp=2,
                    schedule="zb-h1")
    message = _refusal("torchtitan", model, layout)
    assert message.startswith("torchtitan (torchtitan 0.3.0) cannot run this layout: ")
    assert message.endswith("; no layout within three changes runs")


# --- one-line refusals, exact ---------------------------------------------------------------

def test_an_export_needs_a_global_batch():
    with pytest.raises(ShardwiseError) as info:
        emit("megatron", get_model("llama3-8b"), Layout(dp=8),
             TrainSpec(impl="megatron-te", seq_len=4096))
    assert str(info.value) == "emitting a launch configuration needs a global batch"


def test_deepspeed_refuses_megatron_core_settings():
    assert _refusal("deepspeed", get_model("llama3-8b"), Layout(dp=8, recompute="selective"),
                    recompute_modules=("core_attn",)) == (
        "--emit deepspeed cannot run recompute_modules as planned: Megatron-Core settings "
        "(--recompute-modules, the precision-aware optimizer, --activation-func-fp8-input-"
        "store, fine-grained activation offloading) that Megatron-DeepSpeed 4efb479 does "
        "not have")


def test_megatron_refuses_capacity_padding_with_deepep_and_1f1b_overlap_with_full_recompute():
    v2, layout = get_model(V2), Layout(**V2_LAYOUT)
    assert _refusal("megatron", v2, layout, moe_capacity=1.25, moe_dispatcher="flex") == (
        "--emit megatron cannot run moe_capacity as planned: megatron-core 0.16.1 refuses "
        "--moe-pad-expert-input-to-capacity with the flex (DeepEP) dispatcher "
        "(transformer_config.py)")
    assert _refusal("megatron", v2, layout.with_(recompute="full"), moe_overlap="1f1b") == (
        "--emit megatron cannot run moe_overlap 1f1b as planned: megatron-core 0.16.1's "
        "--overlap-moe-expert-parallel-comm needs no full recompute "
        "(transformer_config.py __post_init__)")
    out = emit("megatron", v2, layout, _train("megatron", moe_capacity=1.25))
    assert _flag(out, "--moe-expert-capacity-factor") == "1.25"
    assert "--moe-pad-expert-input-to-capacity" in _argv(out)


def test_model_refusals_name_what_megatron_and_torchtitan_do_not_build():
    llama = get_model("llama3-8b")
    train = _train("megatron")
    assert "has QK-norm over 'l2';" in model_refusal("megatron", llama.with_(qk_norm="l2"),
                                                       train)
    assert model_refusal("megatron", llama.with_(parallel_residual=True), train) == (
        "llama3-8b runs attention and MLP side by side on one normalised input (GPT-NeoX's "
        "use_parallel_residual), which Megatron-LM main d98e8a6's block does not: an export "
        "would train another model")
    assert model_refusal("torchtitan", get_model("llama3-405b"), _train("torchtitan")) == (
        "torchtitan 0.3.0's llama3_405b config trains its linear layers in Float8 (rowwise) "
        "under torch.compile (models/llama3/config_registry.py): plan it with --fp8 rowwise "
        "--compile, or with --impl megatron-te for Megatron-LM")


# --- more closed forms: pipeline ends, router scaling, DeepEP, windows, notes -------------------

def test_a_two_stage_pipeline_is_offered_each_schedule():
    """32 layers over pp 2: interleaving takes 2 virtual stages (32 % 4 = 0)."""
    edits = list(_edits(_train("megatron").stack, get_model("llama3-8b"), Layout(dp=4, pp=2)))
    assert Layout(dp=4, pp=2, schedule="interleaved", chunks=2) in edits


def test_one_layer_end_stages_are_megatrons_first_and_last_stage_flags():
    """1, 15, 15, 1: equal middles, ends of one layer (> 0, which megatron-core requires of
    these flags): --decoder-first/last-pipeline-num-layers 1."""
    layout = Layout(dp=2, tp=2, pp=4, zero=1, partition=(1, 15, 15, 1))
    args = _megatron_lm(emit("megatron", get_model("llama3-8b"), layout, _train("megatron")), 16)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
            args.pipeline_model_parallel_layout) == (1, 1, None)


@pytest.mark.parametrize("scaling", [1.0, 2.0, 2.5])
def test_the_routed_scaling_factor_reaches_megatron(scaling):
    """Megatron-LM's --moe-router-topk-scaling-factor (default None: gates unscaled)."""
    model = get_model("tiny-deepseek").with_(routed_scaling=scaling)
    args = _megatron_lm(emit("megatron", model, Layout(dp=2, ep=2), _train("megatron")), 2)
    assert (args.moe_router_topk_scaling_factor or 1.0) == scaling


def test_deepep_is_megatrons_flex_dispatcher():
    v2 = get_model(V2)
    out = emit("megatron", v2, Layout(**V2_LAYOUT), _train("megatron", moe_dispatcher="flex",
                                                           comm_sms=24))
    args = _megatron_lm(out, 8)
    assert (args.moe_token_dispatcher_type, args.moe_flex_dispatcher_backend,
            args.moe_deepep_num_sms) == ("flex", "deepep", 24)


def test_a_yarn_config_without_mscale_is_megatrons_default_mscale():
    v2 = get_model(V2)
    bare = v2.with_(rope_scaling=tuple((k, v) for k, v in v2.rope_scaling
                                       if k not in ("mscale", "mscale_all_dim")))
    args = _megatron_lm(emit("megatron", bare, Layout(**V2_LAYOUT), _train("megatron")), 8)
    from tests.integration.test_megatron_lm import _parse

    default = _parse([])
    assert (args.mscale, args.mscale_all_dim) == (default.mscale, default.mscale_all_dim) == (
        1.0, 0.0)


def test_gpt_oss_without_an_explicit_alpha_is_transformers_alpha():
    """transformers 5.24's GptOssExperts fixes alpha = 1.702 (a config without swiglu_alpha):
    megatron-core's quick GEGLU, the same constant."""
    pytest.importorskip("torch")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(num_local_experts=2, hidden_size=8,
                                         intermediate_size=8))
    assert experts.alpha == QUICK_GELU_ALPHA
    model = get_model("gpt-oss-20b").with_(multipliers=(("swiglu_limit", 7.0),))
    assert {"swiglu_clamp MLP", "scalar multipliers"} <= megatron_builds(model)


def test_more_refusals_exact():
    llama = get_model("llama3-8b")
    assert _refusal("deepspeed", llama, Layout(dp=8), mtp_layers=1) == (
        "--emit deepspeed cannot run mtp_layers 1 as planned: Megatron-DeepSpeed builds no "
        "multi-token-prediction module")
    assert _refusal("megatron", llama, Layout(dp=8), act_fp8_store=True) == (
        "--emit megatron cannot run act_fp8_store as planned: Megatron-LM d98e8a6's parser has "
        "no --activation-func-fp8-input-store (megatron-core 0.16.1's "
        "TransformerConfig.activation_func_fp8_input_store is not exposed)")
    assert model_refusal("megatron", get_model("granite-3.3-8b").with_(
        qk_norm="head"), _train("megatron")) == (
        "granite-3.3-8b has scalar multipliers; Megatron-LM main d98e8a6 has no option this "
        "export has verified to build them (its --qk-layernorm normalises each head alone): "
        "it would train another model")
    assert model_refusal("megatron", get_model("olmo2-32b"), _train("megatron")).startswith(
        "olmo2-32b has QK-norm over 'full', post-norm blocks; ")


def test_a_window_as_long_as_the_sequence_is_full_attention():
    """A window of w keys (transformers: kv > q − w) over a sequence of w is causal attention
    over every earlier key: DeepSpeed exports it; over 2w it is refused."""
    windowed = get_model("mistral-7b").with_(sliding_window=4096)
    assert model_refusal("deepspeed", windowed, _train("deepspeed", seq_len=4096)) is None
    assert model_refusal("deepspeed", windowed, _train("deepspeed", seq_len=8192)) == (
        "mistral-7b's attention is windowed or chunked below --seq 8192; the export's "
        "attention is full causal attention: it would train another model (use a sequence "
        "length within the window)")


def test_torchtitans_deepseek_flavor_note():
    out = emit("torchtitan", get_model(V2), Layout(dp=8, zero=2, ep=8), _train("torchtitan"))
    assert _flag(out, "--config") == "deepseek_v3_16b"
    assert out.notes == (
        "torchtitan's 16B flavor scales YaRN attention by mscale 0.70 (DeepSeek-V2-Lite's "
        "config.json: 0.707) and balances its experts with a router bias (MoE "
        "load_balance_coeff 1e-3), not DeepSeek-V2's auxiliary losses: the same parameters, "
        "FLOPs and traffic",)


def test_deepspeed_moe_every_third_layer_as_megatron_deepspeed_places_it():
    """Megatron-DeepSpeed makes 1-based layer n MoE when n % --expert-interval == 0
    (its pinned `get_num_experts_per_layer`, tests/integration/megatron_deepspeed.moe_layers):
    MoE at 0-based 2, 5, 8, … exports; the same interval shifted by one is refused."""
    from tests.integration import megatron_deepspeed

    model = get_model("mixtral-8x7b").with_(moe_every=3)
    out = emit("deepspeed", model, Layout(dp=16, ep=8, zero=2), _train("deepspeed"))
    placed = megatron_deepspeed.moe_layers(_megatron_deepspeed(out, 16))
    assert placed == [model.is_moe_layer(i) for i in range(model.n_layers)]
    assert placed[:6] == [False, False, True, False, False, True]


def test_deepspeed_moe_refusals_exact():
    message = _refusal("deepspeed", get_model("mixtral-8x7b"), Layout(dp=16, ep=8, zero=3))
    assert "; DeepSpeed refuses its MoE under ZeRO-3 (deepspeed/runtime/engine.py:2215 "\
           "@0.19.8); use zero ≤ 2" in message
    assert _refusal("deepspeed", get_model(V2), Layout(dp=8, ep=8, zero=2)).endswith(
        "cannot run this plan: deepseek-v2-lite has 2 shared expert(s); DeepSpeed-MoE has none "
        "(its --mlp-type residual is PR-MoE's residual MLP mixed by a learned coefficient, "
        "another model)")


def test_one_layer_per_stage_recomputed_is_block_1():
    """A share of 1/8 over 4 stages of 8 layers: the first layer of each, N = 1."""
    out = emit("megatron", get_model("llama3-8b"), Layout(dp=2, tp=2, pp=4, zero=1,
                                                          recompute="full"),
               _train("megatron", recompute_share=0.125))
    assert (_flag(out, "--recompute-method"), _flag(out, "--recompute-num-layers")) == (
        "block", "1")


def test_torchtitan_refuses_a_sequence_past_its_configs_rope_table():
    assert _refusal("torchtitan", get_model(V2), Layout(dp=8, zero=2, ep=8),
                    seq_len=32768) == (
        "torchtitan (torchtitan 0.3.0) cannot run this plan: torchtitan 0.3.0's "
        "deepseek_v3_16b precomputes RoPE for 16384 positions and refuses a longer seq_len "
        "(models/common/decoder.py update_from_config); plan with --seq ≤ 16384, or with "
        "--impl megatron-te for Megatron-LM")
