"""DeepSeek-V3 / V2 in the analytic side: parameter counts against transformers' own models
(built on the meta device), FLOPs and the KV cache against closed forms from the module
shapes, and expert tensor parallelism's rank layout against megatron-core's own
`RankGenerator`."""

import json

import pytest

from shardwise.arch import PRESETS, from_hf_dict, get_model
from shardwise.emit import _refusals, megatron_args
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.estimate.memory import (
    kv_cache_bytes_per_token,
    layer_params,
    moe_layers_on_stage,
    stage_layers,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.placement import MeshShape
from shardwise.plan.space import SearchSpace
from tests.cli_helpers import shardwise

# deepseek-ai/DeepSeek-V2-Lite config.json (the sizes; its rope and routing fields are the
# preset's, `deepseek-v2-lite`)
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
               moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
               num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
               routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
               qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
               num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False,
               topk_method="greedy", n_group=1, topk_group=1)


def _hf(kind: str):
    """(config, model on the meta device) of transformers' DeepseekV3 (defaults) or
    DeepseekV2 (V2-Lite's sizes)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if kind == "v3":
        config = transformers.DeepseekV3Config()
        cls = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.DeepseekV2Config(**V2_LITE)
        cls = transformers.DeepseekV2ForCausalLM
    with torch.device("meta"):
        return config, cls(config)


def _hf_active(model, experts: int, top_k: int) -> float:
    """What one token uses of HF's model: every parameter, the routed experts' k/E."""
    return sum(p.numel() * (top_k / experts if ".mlp.experts." in name else 1)
               for name, p in model.named_parameters())


@pytest.mark.parametrize("kind, preset", [("v3", "deepseek-v3"), ("v2", "deepseek-v2-lite")])
def test_parameters_equal_transformers(kind, preset):
    config, model = _hf(kind)
    hf_total = sum(p.numel() for p in model.parameters())
    ours = PRESETS[preset].count_params()
    parsed = from_hf_dict(config.to_dict(), preset).count_params()
    assert ours.total == parsed.total == hf_total
    assert ours.active == parsed.active == _hf_active(model, config.n_routed_experts,
                                                      config.num_experts_per_tok)
    if kind == "v3":  # the issue's figure: transformers' DeepseekV3ForCausalLM, defaults
        assert hf_total == 671_026_404_352


def test_mtp_modules_are_counted_apart():
    """DeepSeek-V3 §2.2: a module = RMSNorms of its two inputs, the 2h → h projection, one
    Transformer layer (an MoE layer: HF's DeepseekV3DecoderLayer past first_k_dense_replace)
    and its head's norm; embedding and head shared. transformers builds none of them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = transformers.DeepseekV3Config()
    with torch.device("meta"):
        layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
    h = config.hidden_size
    module = sum(p.numel() for p in layer.parameters()) + 2 * h + 2 * h * h + h
    v3 = get_model("deepseek-v3")
    assert v3.mtp_layers == 1 and v3.count_params().mtp == module
    assert v3.count_params().total == 671_026_404_352  # MTP not in it
    # DeepSeek-V3's checkpoint, 685B "including 671B of the main model and 14B of the MTP
    # module" (its model card), stores its own embedding and head copies: 2·V·h more
    assert (v3.count_params().total + module + 2 * v3.vocab * h) / 1e9 == pytest.approx(685, abs=1)


def test_forward_flops_from_the_module_shapes():
    """2 FLOPs per active matmul weight (HF's Linear layers and experts, routed ones at k/E,
    the router, the head) + per layer scores at d_nope + d_R and P·V at d_v."""
    config, model = _hf("v3")
    matmul = 0.0
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "embed_tokens" not in name:
            share = config.num_experts_per_tok / config.n_routed_experts
            matmul += p.numel() * (share if ".mlp.experts." in name else 1)
    s, heads = 4096, config.num_attention_heads
    qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    attention = config.num_hidden_layers * 2 * s * heads * (qk + v)
    v3 = get_model("deepseek-v3")
    assert v3.forward_flops_per_token(s) == pytest.approx(2 * matmul + attention, rel=1e-12)
    assert v3.training_flops_per_token(s) == pytest.approx(3 * (2 * matmul + attention),
                                                           rel=1e-12)


def test_mla_kv_cache_is_the_latent_and_the_rope_key():
    """DeepSeek-V2 Table 1: MLA caches (d_c + d_h^R)·l elements per token."""
    v3 = get_model("deepseek-v3")
    assert kv_cache_bytes_per_token(v3, "bf16") == 61 * (512 + 64) * 2
    llama = get_model("llama3-8b")  # standard: 2·L·a_kv·d
    assert kv_cache_bytes_per_token(llama, "bf16") == 2 * 32 * 8 * 128 * 2


def test_deepseek_config_errors():
    with pytest.raises(ShardwiseError, match="biases"):
        from_hf_dict({"model_type": "deepseek_v3", "attention_bias": True}, "x")
    with pytest.raises(ShardwiseError, match="num_key_value_heads=8"):
        from_hf_dict({"model_type": "deepseek_v3", "num_key_value_heads": 8}, "x")
    with pytest.raises(ShardwiseError, match="topk_groups"):
        get_model("deepseek-v3").with_(topk_groups=9)


# ------------------------------------------------------------- expert tensor parallelism
def test_etp_validation():
    v3 = get_model("deepseek-v3")
    assert Layout(dp=64, tp=2, ep=64, etp=1).validate(v3)  # ep spans tp ranks too
    with pytest.raises(LayoutError, match=r"etp·ep=1·256 must divide tp·dp·cp=128"):
        Layout(dp=64, tp=2, ep=256, etp=1).validate(v3)
    with pytest.raises(LayoutError, match="ep=128 must divide dp·cp=64"):
        Layout(dp=64, tp=2, ep=128).validate(v3)
    with pytest.raises(LayoutError, match="etp=3 does not divide the expert d_ff=2048"):
        Layout(dp=3, ep=1, etp=3).validate(v3)
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        Layout(dp=2, tp=2, etp=1).validate(get_model("llama3-8b"))
    assert Layout(dp=8, tp=2, ep=8, etp=1).short() == "dp8 tp2 ep8 etp1 mb1"


@pytest.mark.parametrize("pp, dp, cp, tp, ep, etp", [
    (2, 4, 1, 2, 4, 0), (2, 4, 1, 2, 8, 1), (1, 2, 2, 4, 4, 2), (2, 2, 2, 2, 2, 1),
    (1, 4, 1, 4, 16, 1)])
def test_expert_groups_are_megatron_cores(pp, dp, cp, tp, ep, etp):
    """megatron-core 0.16.1's expert rank generator (parallel_state.initialize_model_parallel:
    tp=etp, ep, dp=world/(etp·ep·pp), pp, cp=1, order "tp-cp-ep-dp-pp") gives the same ep and
    expert-data-parallel groups as `placement`."""
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    shape = MeshShape(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, etp=etp)
    et = etp or tp
    generator = RankGenerator(tp=et, ep=ep, dp=shape.world_size // (et * ep * pp), pp=pp, cp=1,
                              order="tp-cp-ep-dp-pp", rank_offset=0)
    for ours, theirs in (("ep", "ep"), ("edp", "dp")):
        assert sorted(shape.groups(ours)) == sorted(map(tuple, generator.get_ranks(theirs)))
    # the attention layers' groups are megatron's too (the expert generator keeps pp)
    assert sorted(shape.groups("pp")) == sorted(map(tuple, generator.get_ranks("pp")))


def test_etp_in_memory_and_the_planner_space():
    v3 = get_model("deepseek-v3")
    h, f = v3.d_model, v3.expert_d_ff
    _, _, experts = layer_params(v3, tp=2, ep=8, etp=1)
    assert experts == 256 / 8 * 3 * h * f  # the routed experts split over ep only
    _, _, experts = layer_params(v3, tp=2, ep=8)  # etp = 0: tp
    assert experts == 256 / 8 * 3 * h * f / 2
    axes = SearchSpace().resolve(v3, Cluster.of(64, "h100"), TrainSpec(global_batch=64))
    assert axes["etp"] == [0, 1]
    assert SearchSpace().resolve(get_model("llama3-8b"), Cluster.of(64, "h100"),
                                 TrainSpec(global_batch=64))["etp"] == [0]


def test_emit_expert_tensor_parallel_size():
    model, train = get_model("mixtral-8x7b"), TrainSpec(seq_len=4096, global_batch=64)
    layout = Layout(dp=8, tp=2, ep=8, etp=1, sp=True)
    args = megatron_args(model, layout, train).text
    assert "--expert-tensor-parallel-size 1" in args
    assert "--expert-tensor-parallel-size" not in megatron_args(
        model, layout.with_(etp=0), train).text  # Megatron's default: tp
    titan = TrainSpec(seq_len=4096, global_batch=64, impl="torchtitan")
    assert any("torchtitan 0.3.0 has no expert tensor" in problem
               for problem in _refusals("torchtitan", model, layout.with_(zero=2), titan))


@pytest.mark.parametrize("pp, chunks, partition", [(16, 1, ()), (4, 1, (10, 17, 17, 17)),
                                                   (2, 1, ())])
def test_moe_layers_per_stage_skip_the_dense_first_layers(pp, chunks, partition):
    """The memory model's MoE count per stage equals the layers' own `is_moe_layer` (the
    first 3 of DeepSeek-V3's 61 are dense)."""
    v3 = get_model("deepseek-v3")
    layout = Layout(pp=pp, dp=8, chunks=chunks, partition=partition)
    for stage in range(pp):
        held = stage_layers(v3, layout, stage)
        assert moe_layers_on_stage(v3, pp, chunks, stage, partition) == sum(
            v3.is_moe_layer(k) for k in held)
    assert v3.n_moe_layers == 58 and not any(v3.is_moe_layer(k) for k in range(3))


def test_memory_answers_for_deepseek_v3_on_2048_gpus():
    out = shardwise("memory", "deepseek-v3", "--gpus", "2048", "--pp", "16", "--ep", "64",
                    "--zero", "1", "--json")
    stages = json.loads(out.stdout)["stages"]
    assert len(stages) == 16 and all(s["total"] > 0 for s in stages)


def test_v2_topk_methods_are_those_transformers_routes():
    """DeepSeek-V2's `topk_method`: exactly the values transformers 5.24's
    DeepseekV2TopkRouter.forward branches on are accepted (any other leaves its top-k
    undefined); another is refused in one line naming them."""
    import ast
    import inspect

    modeling = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
    tree = ast.parse(inspect.getsource(modeling.DeepseekV2TopkRouter.forward).lstrip())
    routed = {node.comparators[0].value for node in ast.walk(tree)
              if isinstance(node, ast.Compare) and "topk_method" in ast.unparse(node.left)}
    from shardwise.arch import HF_FIELDS

    assert set(HF_FIELDS["deepseek_v2"].fixed["topk_method"][0]) == routed
    cfg = dict(V2_LITE, model_type="deepseek_v2")
    for method in sorted(routed):
        from_hf_dict(cfg | {"topk_method": method, "n_group": 8, "topk_group": 3}, "v2")
    for bad in ("noaux_tc", "sigmoid", "", None):
        with pytest.raises(ShardwiseError, match="topk_method") as err:
            from_hf_dict(cfg | {"topk_method": bad}, "v2")
        assert "\n" not in str(err.value)
        assert bad is None or "topk_method=\"greedy\" or \"group_limited_greedy\"" in str(
            err.value)


def test_v2_group_limited_greedy_routes_in_groups_as_transformers():
    """group_limited_greedy limits the choice to `topk_group` of `n_group` groups (the runtime's
    softmax rule scores a group by its best expert, as DeepseekV2TopkRouter does); greedy
    ignores the groups; group_limited_greedy without groups (transformers cannot build it) is
    refused."""
    cfg = dict(V2_LITE, model_type="deepseek_v2")
    grouped = from_hf_dict(cfg | {"topk_method": "group_limited_greedy", "n_group": 8,
                                  "topk_group": 3}, "v2")
    assert (grouped.expert_groups, grouped.topk_groups) == (8, 3)
    greedy = from_hf_dict(cfg | {"topk_method": "greedy", "n_group": 8, "topk_group": 3}, "v2")
    assert (greedy.expert_groups, greedy.topk_groups) == (1, 1)
    for missing in ({"n_group": None}, {"topk_group": None}):
        with pytest.raises(ShardwiseError, match="'group_limited_greedy' needs n_group"):
            from_hf_dict(cfg | {"topk_method": "group_limited_greedy", "n_group": 8,
                                "topk_group": 3} | missing, "v2")
