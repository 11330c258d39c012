"""Memory as DeepSeek-V3 and Qwen3-class MoE runs are trained (issue 43 item 3): Megatron's
per-module recompute, the precision-aware optimizer, FP8 SwiGLU inputs and the MTP modules.

References: megatron-core 0.16.1 (installed) — its own `TransformerConfig` for the module names
and refusals, and closed forms of the tensors each module's recompute frees read from
megatron/core/transformer/ (transformer_layer.py, multi_latent_attention.py, moe/experts.py,
moe/moe_layer.py); DeepSeek-V3 §3.3.3 for BF16 moments.
"""

import ast
from dataclasses import replace

import pytest

from shardwise.arch import get_model
from shardwise.choices import RECOMPUTE_MODULES
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.estimate.memory import (
    activation_bytes_per_layer,
    bytes_per_param_training,
    mtp_params,
    train_state_bytes,
    training_memory_per_gpu,
)
from shardwise.layout import Layout, TrainSpec

GiB = 2**30
S, T, EP, ETP = 4096, 2, 8, 1  # tp·ep > 1, etp ≠ tp: every sharding term distinguishable
# MLA (d_k = 192 ≠ d_v = 128, q and kv latents) with 2 shared experts beside 256 routed ones
MODEL = replace(get_model("deepseek-v3"), n_shared_experts=2)


def saved(modules, *, moe=True, fp8_store=False, fp8_inputs=0.0):
    return activation_bytes_per_layer(
        MODEL, S, 1, tp=T, sp=True, recompute="selective", flash=True, moe=moe,
        impl="megatron-te", etp=ETP, modules=modules, act_fp8_store=fp8_store,
        fp8_inputs=fp8_inputs)


def freed(module, *, moe=True):
    """Bytes the module's recompute frees beside Megatron's default (core_attn)."""
    return saved(("core_attn",), moe=moe) - saved(("core_attn", module), moe=moe)


# per rank, bf16 (2 B), one micro-batch of S tokens, sequence parallel over T
H, A = MODEL.d_model, MODEL.n_heads
D_QK = MODEL.qk_nope_head_dim + MODEL.qk_rope_head_dim  # 192: q_head_dim in MLASelfAttention
D_V = MODEL.v_head_dim  # 128
F_E, K = MODEL.expert_d_ff, MODEL.top_k
COPIES = K * S * ETP / T  # routed copies a rank's experts run (its etp group's share)


def test_module_names_are_megatrons():
    """The choices are megatron-core 0.16.1's own list (TransformerConfig refuses others and
    names the allowed ones)."""
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    with pytest.raises(AssertionError, match="Allowed modules are") as err:
        config.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 recompute_granularity="selective",
                                 recompute_modules=["bogus"])
    allowed = ast.literal_eval(str(err.value).split("Allowed modules are: ")[1].strip())
    assert set(RECOMPUTE_MODULES) == allowed


def test_mla_up_proj_needs_mla_as_in_megatron():
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    with pytest.raises(ValueError, match="mla_up_proj"):
        config.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 recompute_granularity="selective",
                                 recompute_modules=["mla_up_proj"])
    train = TrainSpec(seq_len=4096, impl="megatron-te", recompute_modules=("mla_up_proj",))
    with pytest.raises(LayoutError, match="mla_up_proj needs multi-latent attention"):
        Layout(recompute="selective").validate(get_model("llama3-8b"), train=train)
    with pytest.raises(ShardwiseError, match="recompute modules bogus unknown"):
        TrainSpec(recompute_modules="core_attn,bogus", impl="megatron-te").validate()
    with pytest.raises(ShardwiseError, match="Megatron-Core's settings"):
        TrainSpec(recompute_modules="layernorm", impl="torchtitan").validate()


def test_layernorm_frees_the_separate_norms_outputs():
    # MLA's input_layernorm and an MoE model's pre_mlp_layernorm are TENorm modules
    # (gpt_layer_specs.py); CheckpointWithoutOutput discards each output (its linear layers'
    # saved input) and runs without grad, so no rsigma either: 2·(s/t·h·2 + s/t·4)
    assert freed("layernorm") == 2 * (S / T * H * 2 + S / T * 4)


def test_mla_up_proj_frees_q_k_v():
    # qkv_up_checkpoint discards query [s, b, n/t, 192], key [s, b, n/t, 192], value
    # [s, b, n/t, 128] after the core attention (multi_latent_attention.py)
    assert freed("mla_up_proj") == S * (A / T) * (D_QK + D_QK + D_V) * 2


def test_moe_act_frees_the_experts_fc2_input():
    # experts.py TEGroupedMLP: the activation's output (fc2's input) is discarded: copies·f/etp
    assert freed("moe_act") == COPIES * F_E / ETP * 2
    assert freed("moe_act", moe=False) == 0  # dense layers have no experts


def test_shared_experts_frees_their_mlp():
    # fused SwiGLU keeps fc1's output (gate and up, 2f/t), fc2 its input (f/t), per shared expert
    assert freed("shared_experts") == MODEL.n_shared_experts * S * 3 * F_E / T * 2


def test_moe_frees_the_whole_block_but_its_input():
    router = S * MODEL.n_experts * 4  # fp32 probabilities over all experts (÷ nothing)
    experts = COPIES * (H * 2 + 3 * F_E / ETP * 2 + 4)  # input, gate/up/act out, fp32 weight
    shared = MODEL.n_shared_experts * S * 3 * F_E / T * 2
    assert freed("moe") == router + experts + shared


def test_mlp_frees_a_dense_layers_mlp_only():
    assert freed("mlp", moe=False) == S * 3 * MODEL.d_ff / T * 2
    assert freed("mlp") == 0  # an MoE layer's block is "moe"


def test_core_attn_is_megatrons_default():
    # without core_attn the fused attention keeps its fp32 softmax statistics (n/t · s)
    assert (saved(("layernorm",)) - saved(("core_attn", "layernorm"))
            == A / T * S * 4)
    assert saved(None) == saved(("core_attn",))


def test_swiglu_inputs_in_fp8():
    # activation_func_fp8_input_store: fc1's output (gate and up) kept at one byte
    delta = saved(("core_attn",)) - saved(("core_attn",), fp8_store=True)
    assert delta == COPIES * 2 * F_E / ETP + MODEL.n_shared_experts * S * 2 * F_E / T


def test_precision_aware_optimizer_moments():
    # DeepSeek-V3 §3.3.3: BF16 moments, FP32 master weights and gradient accumulation:
    # 2 + 4 + 4 + 2 + 2 = 14 B/param; FP8 moments 12; fp16 master 2 + 4 + 2 + 2 + 2 = 12
    assert bytes_per_param_training("bf16", "fp32", exp_avg_dtype="bf16",
                                    exp_avg_sq_dtype="bf16").total == 14
    assert bytes_per_param_training("bf16", "fp32", exp_avg_dtype="fp8",
                                    exp_avg_sq_dtype="fp8").total == 12
    assert bytes_per_param_training("bf16", "fp32", exp_avg_dtype="bf16",
                                    exp_avg_sq_dtype="bf16",
                                    main_params_dtype="fp16").total == 12
    train = TrainSpec(impl="megatron-te", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert train_state_bytes(train.validate()).moments == 4
    torch = pytest.importorskip("torch")
    optim = pytest.importorskip("megatron.core.optimizer.optimizer_config")
    # "--use-precision-aware-optimizer only supported with distributed optimizer": so ZeRO ≥ 1
    with pytest.raises(AssertionError, match="distributed optimizer"):
        optim.OptimizerConfig(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                              exp_avg_sq_dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="distributed optimizer"):
        Layout(dp=2, ep=2, zero=0).validate(MODEL, train=train)
    Layout(dp=2, ep=2, zero=1).validate(MODEL, train=train)


def test_mtp_module_on_the_heads_stage():
    """One MTP module: `ModelSpec.mtp_params` sharded (tp = ep = 1 gives it back), on the
    stage holding the head, with a second embedding there (pp > 1) and its own logits."""
    dense, expert = mtp_params(MODEL, 1, 1)
    assert dense + expert == MODEL.mtp_params()
    layout = Layout(dp=8, pp=4, ep=8)
    train = TrainSpec(seq_len=4096, global_batch=64, impl="megatron-te")
    with_mtp = training_memory_per_gpu(MODEL, layout, train)
    without = training_memory_per_gpu(MODEL, layout, replace(train, mtp_layers=0))
    assert [a.total for a in with_mtp[:-1]] == [b.total for b in without[:-1]]
    last, base = with_mtp[-1], without[-1]
    d, e = mtp_params(MODEL, 1, 8)
    embedding = MODEL.vocab * MODEL.d_model
    assert last.weights - base.weights == pytest.approx((d + e + embedding) * 2)
    assert last.logits == 2 * base.logits


def test_deepseek_v3_recipe_fits_on_80gb():
    """DeepSeek-V3's layout on 2,048 H800 (pp16, ep64, ZeRO-1, blockwise FP8) with its stated
    techniques (recompute of RMSNorm and the MLA up-projections, FP8-cached activations,
    BF16 moments) fits in 85 % of 80 GiB; without them it does not."""
    model = get_model("deepseek-v3")
    layout = Layout(dp=128, pp=16, ep=64, zero=1)
    plain = TrainSpec(seq_len=4096, global_batch=15360, fp8="blockwise", impl="megatron-te")
    recipe = replace(plain, recompute_modules=("layernorm", "mla_up_proj", "moe_act"),
                     exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", act_fp8_store=True)
    budget = 0.85 * 80 * GiB
    before = max(s.total for s in training_memory_per_gpu(model, layout, plain))
    after = max(s.total for s in training_memory_per_gpu(
        model, replace(layout, recompute="selective"), recipe))
    assert before > budget > after


@pytest.mark.parametrize("name", ["tiny-deepseek", "deepseek-v2-lite"])
def test_planner_arrays_charge_the_recipe_as_the_memory_model(name):
    """The planner's arrays (`plan.evaluate`) and `training_memory_per_gpu` agree under the
    recipe's recompute modules, FP8 SwiGLU inputs, BF16 moments and MTP module."""
    import random

    import numpy as np

    from shardwise.hardware import Cluster
    from shardwise.plan.evaluate import _layout_of, evaluate_candidates
    from shardwise.plan.grid import _enumerate, _flatten, _Rejections
    from shardwise.plan.space import SearchSpace

    model = replace(get_model(name), mtp_layers=1)
    cluster = Cluster.of(32, "h100")
    train = TrainSpec(seq_len=2048, global_batch=64, impl="megatron-te",
                      recompute_modules=("layernorm", "mla_up_proj", "moe_act"),
                      exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16",
                      act_fp8_store=True).validate()
    grid, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    flat, _ = _flatten(grid)
    pick = random.Random(3).sample(range(len(flat["tp"])), min(len(flat["tp"]), 30))
    cand = {k: flat[k][pick] for k in (*Layout().codes(), "m")}
    assert set(cand["recompute"].tolist()) >= {0, 1}  # selective and none both drawn
    terms = evaluate_candidates(model, cluster, train, cand)
    for i in range(len(pick)):
        peak = max(training_memory_per_gpu(model, _layout_of(cand, i), train),
                   key=lambda st: st.total)
        assert terms["memory"][i] == pytest.approx(peak.total, rel=1e-12)
    assert np.all(terms["memory"] > 0)


def test_the_cli_takes_megatrons_flags():
    """`shardwise memory` with Megatron's flag names gives the memory model's figure; a bad
    module is one line and exit 2."""
    from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

    args = ["memory", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--seq", "4096",
            "--global-batch", "15360", "--pp", "16", "--ep", "64", "--zero", "1",
            "--fp8", "blockwise", "--impl", "megatron-te"]
    recipe = ["--recompute", "selective", "--recompute-modules", "layernorm,mla_up_proj,moe_act",
              "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
              "--activation-func-fp8-input-store", "--mtp-num-layers", "0"]
    out = shardwise_json(*args, *recipe)
    train = TrainSpec(seq_len=4096, global_batch=15360, fp8="blockwise", impl="megatron-te",
                      recompute_modules=("layernorm", "mla_up_proj", "moe_act"),
                      exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", act_fp8_store=True,
                      mtp_layers=0)
    stages = training_memory_per_gpu(get_model("deepseek-v3"),
                                     Layout(dp=128, pp=16, ep=64, zero=1, recompute="selective"),
                                     train)
    assert out["fits"] and [s["total"] for s in out["stages"]] == pytest.approx(
        [s.total for s in stages], rel=1e-9)
    assert_one_line_error(shardwise(*args, "--recompute-modules", "attn", check=False),
                          "recompute modules attn unknown")


def test_offload_module_names_are_megatrons():
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    from shardwise.choices import OFFLOAD_MODULES

    with pytest.raises(AssertionError, match="Allowed modules are") as err:
        config.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 fine_grained_activation_offloading=True,
                                 offload_modules=["bogus"])
    assert set(OFFLOAD_MODULES) == ast.literal_eval(
        str(err.value).split("Allowed modules are: ")[1].strip())
    with pytest.raises(ValueError, match="attn_proj"):
        config.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 fine_grained_activation_offloading=True,
                                 offload_modules=["attn_proj"])
    with pytest.raises(ShardwiseError, match="attn_proj needs core_attn"):
        TrainSpec(impl="megatron-te", offload_modules="attn_proj").validate()


def test_offloaded_inputs_leave_the_gpu():
    """--offload-modules: core_attn's input (q, k, v), attn_proj's (the core's output) and
    expert_fc1's (the routed copies) leave the GPU (attention.py, experts.py `off_interface`)."""
    def held(offload):
        return activation_bytes_per_layer(
            MODEL, S, 1, tp=T, sp=True, recompute="none", flash=True, moe=True,
            impl="megatron-te", etp=ETP, offload_modules=offload)

    assert held(()) - held(("core_attn",)) == S * (A / T) * (D_QK + D_QK + D_V) * 2
    assert held(("core_attn",)) - held(("core_attn", "attn_proj")) == S * (A / T) * D_V * 2
    assert held(()) - held(("expert_fc1",)) == COPIES * H * 2


@pytest.mark.parametrize("train", [TrainSpec(seq_len=S, expert_load=1.25),
                                   TrainSpec(seq_len=S, moe_capacity=1.25)],
                         ids=["imbalanced", "capacity"])
def test_routed_copies_scale_with_the_busiest_ranks_load(train):
    """Dropless routing's busiest rank (or padding to a capacity factor) holds λ times the
    balanced routed copies `k·s·etp/t`; each keeps (megatron-te, moe/experts.py) its input
    `h`, gate, up and the SwiGLU product `3·f/etp` in bf16 and its fp32 probability — shared
    experts, router and attention do not grow. Closed form against λ = 1."""
    h, f, k = MODEL.d_model, MODEL.expert_d_ff / ETP, MODEL.top_k
    per_copy = 2 * h + 3 * 2 * f + 4
    copies = k * S * ETP / T

    def layer(load):
        return activation_bytes_per_layer(
            MODEL, S, 1, tp=T, sp=True, recompute="selective", flash=True, moe=True,
            impl="megatron-te", etp=ETP, routed_load=load)
    assert train.routed_load == 1.25
    assert layer(train.routed_load) - layer(1.0) == pytest.approx(0.25 * copies * per_copy)
