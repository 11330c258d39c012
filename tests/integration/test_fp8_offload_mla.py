"""`--emit` of FP8 recipes, host offload and DeepSeek (MLA, DeepSeekMoE) models, read back by
the frameworks' own code: megatron-core 0.16.1's `MLATransformerConfig` (as Megatron-LM's
`core_transformer_config_from_args` builds it for `--multi-latent-attention`) and, with a
Megatron-LM checkout on PYTHONPATH, its `parse_args` + `validate_args`; DeepSpeed 0.19.8's
`DeepSpeedZeroConfig`; and the recipes against torchao's roofline and the frameworks' names."""

import dataclasses
import typing

import pytest

from shardwise.arch import get_model
from shardwise.fp8 import RECIPES, get_recipe
from shardwise.stacks import STACKS
from tests.integration.conftest import Emit, arg_value, flags, require

pytestmark = pytest.mark.integration

_FIX = "mb=1,cp=1,zero=1,sp=1,recompute=full"
PLANS = {  # the search confined to the given layout, so each plan takes a second
    "deepseek-v3-delayed-offload": [
        "deepseek-v3", "--gpus", "2048", "--seq", "4096", "--global-batch", "4096",
        "--layout", "tp=2,pp=16,ep=64,etp=1,zero=1,sp=1,recompute=full",
        "--fix", f"tp=2,pp=16,ep=64,etp=1,{_FIX}", "--fp8", "delayed",
        "--offload", "optimizer", "--offload-fraction", "0.5"],
    "deepseek-v2-lite-tensorwise": [
        "deepseek-v2-lite", "--gpus", "16", "--seq", "4096", "--global-batch", "256",
        "--layout", "tp=2,ep=8,zero=1,sp=1,recompute=full",
        "--fix", f"tp=2,pp=1,ep=8,{_FIX}", "--fp8", "tensorwise"],
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_megatron_core_reads_back_mla_fp8_and_offload(capsys, monkeypatch, plan):
    require("megatron")
    import megatron.core.optimizer.optimizer_config as oc
    import megatron.core.transformer.transformer_config as tc
    import torch
    import torch.nn.functional as F

    # MoE + FP8 and the precision-aware optimizer ask for Transformer Engine's version (TE
    # needs CUDA, not installed here): a current one
    for module in (tc, oc):
        monkeypatch.setattr(module, "is_te_min_version", lambda *a, **k: True)
    MLATransformerConfig, OptimizerConfig = tc.MLATransformerConfig, oc.OptimizerConfig

    out = Emit(capsys, PLANS[plan], "megatron")
    assert out.code == 0, out.err
    _, argv = out.command()
    args = {k[2:].replace("-", "_"): v for k, v in flags(argv).items()}
    model = get_model(PLANS[plan][0])
    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    kwargs = {k: arg_value(v) for k, v in args.items() if k in names and k not in ("bf16",)}
    # Megatron-LM's parser default for an absent --q-lora-rank (arguments.py: None, a plain
    # q projection), which core_transformer_config_from_args copies over the dataclass's 512
    kwargs.setdefault("q_lora_rank", None)
    kwargs.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                  num_moe_experts=int(args["num_experts"]),
                  gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
                  add_bias_linear=False, fp8=args["fp8_format"],
                  moe_layer_freq=eval(args["moe_layer_freq"]))  # Megatron evals the pattern
    for stage in ("first", "last"):
        if f"decoder_{stage}_pipeline_num_layers" in args:
            kwargs[f"num_layers_in_{stage}_pipeline_stage"] = int(
                args[f"decoder_{stage}_pipeline_num_layers"])
    config = MLATransformerConfig(**kwargs)  # megatron-core's own validation
    # multi-head latent attention
    assert config.multi_latent_attention and config.qk_layernorm
    assert (config.q_lora_rank or 0, config.kv_lora_rank) == (model.q_lora_rank,
                                                              model.kv_lora_rank)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (
        model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim)
    rope = dict(model.rope_scaling)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale,
            config.mscale_all_dim) == ("yarn", rope["factor"], rope["mscale"],
                                       rope["mscale_all_dim"])
    assert (config.beta_fast, config.beta_slow, config.original_max_position_embeddings) == (
        rope["beta_fast"], rope["beta_slow"], rope["original_max_position_embeddings"])
    # DeepSeekMoE: dense first layers, shared experts, the router
    assert [bool(x) for x in config.moe_layer_freq] == [
        model.is_moe_layer(i) for i in range(model.n_layers)]
    assert config.moe_shared_expert_intermediate_size == (
        model.n_shared_experts * model.expert_d_ff)
    assert (config.moe_router_topk, config.moe_ffn_hidden_size) == (model.top_k,
                                                                    model.expert_d_ff)
    assert config.moe_router_score_function == model.router_score
    assert config.moe_router_enable_expert_bias == (model.router_score == "sigmoid")
    assert (config.moe_router_topk_scaling_factor or 1.0) == model.routed_scaling
    assert (config.moe_router_num_groups or 1, config.moe_router_group_topk or 1) == (
        model.expert_groups, model.topk_groups)
    assert config.moe_router_pre_softmax == (model.router_score == "softmax"
                                             and not model.norm_topk)
    assert (config.mtp_num_layers or 0) == model.mtp_layers
    # the FP8 recipe, as the plan names it
    recipe = PLANS[plan][PLANS[plan].index("--fp8") + 1]
    assert (config.fp8, config.fp8_recipe) == ("hybrid", recipe)
    assert config.fp8_amax_history_len == (get_recipe("te", recipe).history or 1)
    # optimizer offload: the optimizer config megatron-core builds
    if "--offload" in PLANS[plan]:
        fraction = float(PLANS[plan][PLANS[plan].index("--offload-fraction") + 1])
        opt = OptimizerConfig(optimizer_cpu_offload=True,
                              optimizer_offload_fraction=float(args["optimizer_offload_fraction"]),
                              use_precision_aware_optimizer="use_precision_aware_optimizer"
                              in args, use_distributed_optimizer="use_distributed_optimizer"
                              in args, overlap_cpu_optimizer_d2h_h2d=True)
        assert opt.optimizer_cpu_offload and opt.optimizer_offload_fraction == fraction


@pytest.mark.parametrize("plan", list(PLANS))
def test_megatron_lm_parser_accepts_mla_fp8_and_offload(capsys, plan):
    """Megatron-LM's parser at the pinned commit (test_megatron_lm.py): every emitted flag
    exists and the `validate_args` rules it reaches hold."""
    from tests.integration.test_megatron_lm import megatron_lm_args

    args = megatron_lm_args(Emit(capsys, PLANS[plan], "megatron"))
    model = get_model(PLANS[plan][0])
    assert args.multi_latent_attention and args.kv_lora_rank == model.kv_lora_rank
    assert args.fp8_recipe == PLANS[plan][PLANS[plan].index("--fp8") + 1]
    assert args.optimizer_cpu_offload == ("--offload" in PLANS[plan])


@pytest.mark.parametrize(("offload", "zero"), [("optimizer", 2), ("params", 3)])
def test_deepspeed_reads_back_the_offload(capsys, offload, zero):
    require("deepspeed")
    import json

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    out = Emit(capsys, ["llama3-8b", "--gpus", "16", "--global-batch", "128",
                        "--impl", "megatron-deepspeed", "--offload", offload,
                        "--layout", f"zero={zero}", "--fix", f"zero={zero},tp=1,pp=1,cp=1,mb=1"],
               "deepspeed")
    assert out.code == 0, out.err
    zero_config = DeepSpeedZeroConfig(**json.loads(out.text)["zero_optimization"])
    assert zero_config.offload_optimizer.device == OffloadDeviceEnum.cpu
    assert zero_config.offload_optimizer.pin_memory
    assert (zero_config.offload_param is not None
            and zero_config.offload_param.device == OffloadDeviceEnum.cpu) == (offload == "params")


def test_exports_refuse_what_the_framework_cannot_run(capsys):
    """One line each: a DeepSeek model whose sigmoid gates Megatron would normalise; FP8 on
    torchtitan outside its llama3_405b config; DeepSpeed with FP8."""
    base = ["llama3-8b", "--gpus", "16", "--global-batch", "128", "--layout", "zero=3",
            "--fix", "zero=3,tp=1,pp=1,cp=1,mb=1"]
    titan = Emit(capsys, [*base, "--impl", "torchtitan", "--fp8", "rowwise"], "torchtitan")
    assert titan.code == 2 and "config function" in titan.err
    ds = Emit(capsys, [*base, "--fp8", "delayed"], "deepspeed")
    assert ds.code == 2 and "megatron-deepspeed has no FP8 training" in ds.err


# ---------------------------------------------------------------- the frameworks' recipes
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_torchao_cast_bytes_are_torchaos_own_roofline(recipe):
    """torchao 0.18.0's roofline of its compiled casts (`get_tensor_memory_traffic_ovhd_s`, at
    1 byte/s, one large tensor per role) against the recipe's bytes per element."""
    pytest.importorskip("sympy")
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    specs = {"peak_mem_bw_bytes_sec": 1.0, "pct_achievable_mem_bw": 1.0}
    numel = 10**9

    def per_element(role):
        kernels = roofline.get_tensor_memory_traffic_ovhd_s(specs, numel, 1, role, recipe, None)
        return sum(float(k) for k in kernels) / numel

    cast = get_recipe("torchao", recipe).cast_bytes("hopper")
    assert cast.input_fwd + cast.input_bwd == pytest.approx(per_element("input"))
    assert cast.grad_bwd == pytest.approx(per_element("grad_output"))
    assert cast.weight_fwd + cast.weight_bwd == pytest.approx(per_element("weight"))


def test_recipes_carry_their_frameworks_names():
    """Megatron-Core 0.16.1's `Fp8Recipe` and torchtitan 0.3.0's converter name what the
    stacks offer."""
    enums = pytest.importorskip("megatron.core.enums")
    assert set(STACKS["megatron-te"].fp8) <= {r.value for r in enums.Fp8Recipe}
    float8 = pytest.importorskip("torchtitan.components.quantization.float8")
    hints = typing.get_type_hints(float8.Float8LinearConverter.Config)
    assert set(typing.get_args(hints["recipe_name"])) == {"rowwise", "rowwise_with_gw_hp"}
    assert set(STACKS["torchtitan"].fp8) == {"rowwise", "rowwise_with_gw_hp", "mxfp8"}
    assert {(s.fp8_framework, r) for s in STACKS.values() for r in s.fp8} <= set(RECIPES)
