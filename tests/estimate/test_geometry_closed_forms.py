"""Stage geometry (estimate/geometry.py) against independent references: a layer's parameters
against transformers' own DeepseekV3 and Qwen2 modules (MLA with a q latent and V narrower
than Q/K, a dense first layer, a shared expert, QKV biases), their tensor/expert-parallel
shards by hand, the stages' parameters summing to the model's count, the MoE layers of a stage
counted layer by layer, and each schedule's in-flight micro-batches by its paper's rule."""

import numpy as np
import pytest

from shardwise.arch import from_hf_dict, get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.geometry import (
    StageGeometry,
    candidate_stages,
    fp8_linear_params,
    in_flight_per_stage,
    layer_params,
    moe_layers_on_stage,
    mtp_params,
    placement_of,
    stage_layer_count,
    stage_layers,
    stage_params,
)
from shardwise.fp8 import get_recipe
from shardwise.layout import Layout

TINY = get_model("tiny")  # 4 layers, h 64, 4 heads of 16, 2 kv heads, f 128, V 256
TINY_DS = get_model("tiny-deepseek")  # 3 layers; MLA q 32, kv 16, nope 16, rope 8, v 16
DS_CONFIG = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                 first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256,
                 n_group=2, topk_group=1)
QWEN_CONFIG = dict(model_type="qwen2", hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=100, max_position_embeddings=128, rms_norm_eps=1e-6,
                   tie_word_embeddings=False)


def _hf_layers(config_class, model_class, **fields):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    return [{name: p.numel() for name, p in layer.named_parameters()}
            for layer in hf.model.layers]


def test_layer_params_equal_transformers_deepseek_v3_layers():
    dense_hf, moe_hf = _hf_layers("DeepseekV3Config", "DeepseekV3ForCausalLM", **DS_CONFIG)[:2]
    dense, moe, experts = layer_params(TINY_DS, 1, 1)
    assert dense == sum(dense_hf.values())
    routed = sum(n for name, n in moe_hf.items() if name.startswith("mlp.experts."))
    assert (moe, experts) == (sum(moe_hf.values()) - routed, routed)


def test_layer_params_equal_transformers_qwen2_layer_with_qkv_biases():
    cfg = {k: v for k, v in QWEN_CONFIG.items() if k != "model_type"}
    (layer, _) = _hf_layers("Qwen2Config", "Qwen2ForCausalLM", **cfg)
    model = from_hf_dict(QWEN_CONFIG, "qwen2-small")
    assert model.qkv_bias
    assert layer_params(model, 1, 1)[0] == sum(layer.values())
    # tp = 2: Q, K, V (with their biases), O and the MLP halved; the two norms replicated
    assert layer_params(model, 2, 1)[0] == (sum(layer.values()) - 2 * 64) / 2 + 2 * 64


def test_tensor_and_expert_parallel_shards_by_hand():
    # MLA at tp = 2: q_a (64·32), kv_a (64·24) and the latent norms (32 + 16) replicated,
    # q_b (32·96), kv_b (16·128) and o (64·64) split; the layer norms (2·64) replicated
    attention = 64 * 32 + 64 * 24 + 48 + (32 * 96 + 16 * 128 + 64 * 64) / 2 + 128
    dense, moe, experts = layer_params(TINY_DS, 2, 2)
    assert dense == attention + 3 * 64 * 128 / 2
    assert moe == attention + 8 * 64 + 3 * 64 * 32 / 2  # router replicated, shared expert ÷ tp
    assert experts == 8 * 3 * 64 * 32 / (2 * 2)  # routed ÷ (ep · etp), etp = tp by default
    assert layer_params(TINY_DS, 2, 2, 1)[2] == 8 * 3 * 64 * 32 / 2  # etp = 1
    # GQA with fewer kv heads (2) than tp (4): one K and one V head of 16 on every rank
    assert layer_params(TINY, 4, 1)[0] == 2 * 64 * 64 / 4 + 2 * 64 * 16 + 128 + 3 * 64 * 128 / 4
    assert layer_params(TINY, 2, 1)[0] == (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) / 2 + 128


@pytest.mark.parametrize(("model", "layout"), [
    (TINY, "pp=2"), (TINY, "pp=2,schedule=interleaved,chunks=2"), (TINY_DS, "pp=3"),
    (TINY_DS, "pp=3,ep=2,dp=2"), (TINY.with_(tie_embeddings=True), "pp=1"),
    (TINY_DS, "pp=3,schedule=zbv")])
def test_the_stages_hold_the_whole_model_once(model, layout):
    layout = Layout.parse(layout)
    total = 0.0
    for stage in range(layout.pp):
        dense, experts = stage_params(model, layout, stage)
        total += dense + experts * layout.ep
    assert total == model.count_params().total


def test_a_tied_head_on_another_stage_is_a_second_copy():
    tied = TINY.with_(tie_embeddings=True)
    pp = Layout.parse("pp=2")
    total = sum(sum(stage_params(tied, pp, s)) for s in range(2))
    assert total == tied.count_params().total + 256 * 64
    # the head and final norm on the last stage, the embedding on the first
    assert stage_params(tied, pp, 0)[0] == 256 * 64 + 2 * layer_params(tied, 1, 1)[0]
    assert stage_params(tied, pp, 1)[0] == 2 * layer_params(tied, 1, 1)[0] + 64 + 256 * 64


@pytest.mark.parametrize("layout", ["pp=2", "pp=3", "pp=2,schedule=interleaved,chunks=2",
                                    "pp=2,schedule=zbv"])
def test_moe_layers_on_a_stage_counted_layer_by_layer(layout):
    layout = Layout.parse(layout)
    lite = get_model("deepseek-v2-lite")  # 27 layers, the first dense
    every_other = TINY_DS.with_(n_layers=12, moe_every=2)  # layers 1, 3, 5, … are MoE
    for model in (lite, every_other, TINY_DS):
        for stage in range(layout.pp):
            layers = stage_layers(model, layout, stage)
            assert stage_layer_count(model, layout.pp, layout.chunks, stage, (),
                                     layout.placement) == len(layers)
            want = sum(model.is_moe_layer(k) for k in layers)
            assert moe_layers_on_stage(model, layout.pp, layout.chunks, stage, (),
                                       layout.placement) == want, (model.name, stage)
    assert moe_layers_on_stage(TINY, 2, 1, 0) == 0


@pytest.mark.parametrize(("schedule", "p", "m", "v", "expected"), [
    ("gpipe", 4, 8, 1, [8, 8, 8, 8]),  # every micro-batch's forward before any backward
    ("1f1b", 4, 8, 1, [4, 3, 2, 1]),  # min(p - i, m)
    ("1f1b", 4, 2, 1, [2, 2, 2, 1]),
    ("zb-h1", 4, 8, 1, [4, 3, 2, 1]),
    # Megatron's interleaved warm-up (p - i - 1)·2 + (v - 1)·p, plus one
    ("interleaved", 4, 8, 2, [11, 9, 7, 5]),
    ("interleaved", 4, 8, 3, [15, 13, 11, 9]),
    ("interleaved", 2, 2, 2, [4, 3]),  # at most m·v
    ("zbv", 3, 5, 2, [6, 6, 6]),  # 2p once m ≥ 2p - 1
    ("dualpipev", 4, 8, 2, [9, 9, 9, 9]),  # 2p + 1
])
def test_in_flight_per_stage_by_each_schedules_rule(schedule, p, m, v, expected):
    assert in_flight_per_stage(schedule, p, m, v) == expected


def test_mtp_module_parameters():
    """DeepSeek-V3 §2.2: an MTP module is a Transformer layer of the model's last kind, the
    projection M (2h → h) and the norms of its two inputs and its output."""
    h = TINY_DS.d_model
    _, moe, experts = layer_params(TINY_DS, 2, 2)
    assert mtp_params(TINY_DS, 2, 2) == (moe + 2 * h * h / 2 + 3 * h, experts)
    dense_l, _, _ = layer_params(TINY, 1, 1)
    assert mtp_params(TINY, 1, 1) == (dense_l + 2 * 64 * 64 + 3 * 64, 0)


def test_fp8_linear_params_leave_norms_and_router_in_bf16():
    norms = 2 * 64 + 32 + 16  # the layer norms and MLA's latent norms
    dense, moe, experts = layer_params(TINY_DS, 1, 2)
    te = get_recipe("te", "delayed")  # Transformer Engine: grouped expert GEMMs in FP8
    # MLA with a q latent: q-down, q-up, kv-down, kv-up, out-proj; + fc1, fc2 each MLP
    assert fp8_linear_params(TINY_DS, te, 1, 2) == (
        dense - norms, moe - norms - 8 * 64 + experts, 5 + 2, 5 + 2 * 1 + 2 * 8 / 2)
    assert te.experts_fp8
    dense_t, _, _ = layer_params(TINY, 2, 1)
    assert fp8_linear_params(TINY, te, 2, 1)[0::2] == (dense_t - 2 * 64, 2 + 2)


def test_candidate_stages_for_the_peak():
    """A model whose stages differ only at the ends: the first (embedding), the second (the
    most in flight after it) and the last (head, logits); an MoE model with dense first
    layers: every stage (its MoE layers per stage vary)."""
    assert [int(s) for s in candidate_stages(TINY, 4)] == [0, 1, 3]
    assert [int(s) for s in candidate_stages(TINY, 1)] == [0, 0, 0]
    assert [int(s) for s in candidate_stages(TINY_DS, 3)] == [0, 1, 2]
    every_other = TINY.with_(n_experts=4, top_k=2, moe_every=2)
    assert [int(s) for s in candidate_stages(every_other, 4)] == [0, 1, 2, 3]
    assert [int(s) for s in candidate_stages(get_model("tiny-moe"), 4)] == [0, 1, 3]
    # arrays of pp: each stage index capped at pp - 1
    stages = candidate_stages(TINY_DS, np.array([1, 3]))
    assert [list(s) for s in stages] == [[0, 0], [0, 1], [0, 2]]


def test_mtp_and_fp8_linears_of_an_moe_with_expert_tp_apart():
    """tiny-deepseek (8 experts of f 32, h 64, one shared expert; MLA with a q latent) at
    tp = 2, ep = 2, etp = 1: an MTP module's experts are whole on each rank, 4·3·64·32; a
    recipe without FP8 experts (torchao's rowwise) runs the MoE layer's attention GEMMs (5)
    and the shared expert's two in FP8, Transformer Engine's blockwise also each local
    expert's two (2·8/2) and their weights (4·3·64·32/2 at etp = tp)."""
    assert mtp_params(TINY_DS, 2, 2, 1)[1] == 4 * 3 * 64 * 32
    no_experts = fp8_linear_params(TINY_DS, get_recipe("torchao", "rowwise"), 2, 2)
    experts = fp8_linear_params(TINY_DS, get_recipe("te", "blockwise"), 2, 2)
    assert (no_experts[3], experts[3]) == (5 + 2, 5 + 2 + 2 * 8 / 2)
    assert experts[1] - no_experts[1] == 4 * 3 * 64 * 32 / 2


def test_dualpipe_heads_sit_on_the_last_stage_and_one_f_one_b_loops():
    """DualPipe's geometry names stage p−1 as the last (each direction's head apart from its
    embedding); a unidirectional schedule places its chunks in Megatron's loop; the
    micro-batch count is named when it is not positive."""
    layout = Layout.parse("pp=4,dp=2,schedule=dualpipe")
    assert StageGeometry.of_layout(TINY, layout, 8, 1).last_stage == 3
    codes = [Layout.parse(text).codes()["schedule"]
             for text in ("pp=4", "pp=4,schedule=zbv,chunks=2")]
    assert list(placement_of(np.array(codes))) == ["loop", "v"]  # an array of layouts
    with pytest.raises(ShardwiseError, match=r"^m \(micro-batches\) "):
        in_flight_per_stage("1f1b", 4, 0)


def test_a_dualpipe_stage_holds_its_own_and_its_mirrors_layers():
    """DualPipe (chunks 2) runs stages i and p−1−i of each direction's p-way split on rank i:
    30 layers over 4 stages split 7, 8, 8, 7 each way, so the ranks hold 14, 16, 16, 14 and,
    with one dense first layer, 13, 16, 16, 13 MoE layers (an uneven split, by hand)."""
    model = get_model("tiny-deepseek").with_(n_layers=30)
    layout = Layout(pp=4, schedule="dualpipe", chunks=2, dp=2)
    one_way = Layout(pp=4).stage_layers(30)
    assert one_way == (7, 8, 8, 7) and model.first_dense_layers == 1
    geometry = [StageGeometry.of_layout(model, layout, 8, stage) for stage in range(4)]
    assert [int(g.layers) for g in geometry] == [one_way[s] + one_way[3 - s] for s in range(4)]
    assert [int(g.moe_layers) for g in geometry] == [13, 16, 16, 13]
