"""SPEC §1: parameter counts against published sizes, HF configs, FLOPs per token."""

import json
from pathlib import Path

import pytest

from shardwise.arch import PRESETS, ModelSpec, from_hf_config, from_hf_dict, get_model
from shardwise.errors import ShardwiseError

HF = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama2-7b", 6.74), ("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9)],
)
def test_spec_acceptance_param_counts(name, billions):
    total = PRESETS[name].count_params().total / 1e9
    decimals = len(str(billions).split(".")[1])
    assert round(total, decimals) == billions


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        # Published sizes (model cards / papers).
        ("gpt3-125m", 0.125), ("gpt3-350m", 0.35), ("gpt3-1.3b", 1.3), ("gpt3-2.7b", 2.7),
        ("gpt3-6.7b", 6.7), ("gpt3-13b", 13.0), ("gpt3-175b", 175.0), ("llama2-13b", 13.0),
        ("llama2-70b", 69.0), ("mistral-7b", 7.24), ("qwen2.5-7b", 7.61), ("qwen2.5-72b", 72.7),
        ("mixtral-8x22b", 141.0), ("nemotron4-340b", 340.0),
    ],
)
def test_presets_match_published_sizes(name, billions):
    assert PRESETS[name].count_params().total / 1e9 == pytest.approx(billions, rel=0.03)


def test_llama2_7b_by_hand():
    # 32 layers of (4·4096² + 3·4096·11008 + 2·4096) plus two 32000×4096 tables and a norm.
    per_layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert PRESETS["llama2-7b"].count_params().total == 32 * per_layer + 2 * 32000 * 4096 + 4096


def test_mixtral_total_and_active_from_config():
    model = from_hf_config(HF / "mixtral-8x7b" / "config.json")
    counts = model.count_params()
    assert counts.total / 1e9 == pytest.approx(46.7, abs=0.05)
    assert counts.active / 1e9 == pytest.approx(12.9, abs=0.05)
    assert model.n_experts == 8 and model.top_k == 2


@pytest.mark.parametrize(
    ("folder", "billions"),
    [("llama3-8b", 8.03), ("mistral-7b", 7.24), ("qwen2.5-7b", 7.62), ("gpt2", 0.124),
     ("pythia-1.4b", 1.41)],
)
def test_hf_configs_match_published_sizes(folder, billions):
    # A folder works as well as the file inside it.
    model = get_model(str(HF / folder))
    assert model.count_params().total / 1e9 == pytest.approx(billions, rel=0.005)


def test_bloom_config_is_read_like_transformers_reads_it():
    """BLOOM-176B's config.json (BigScience): 70 layers, 14,336 wide, 112 heads, ALiBi."""
    transformers = pytest.importorskip("transformers")
    model = get_model(str(HF / "bloom"))
    ref = transformers.BloomConfig.from_json_file(str(HF / "bloom" / "config.json"))
    assert (model.n_layers, model.d_model, model.n_heads, model.vocab) == (
        ref.n_layer, ref.hidden_size, ref.n_head, ref.vocab_size)
    assert model.n_kv_heads == model.n_heads and not model.gated_mlp and model.bias
    assert model.norm == "layernorm" and model.learned_positions == 0 and model.tie_embeddings
    # ALiBi: transformers' BloomModel builds the attention biases, it has no rotary module
    modeling = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    assert model.alibi and hasattr(modeling, "build_alibi_tensor")
    assert not any("Rotary" in name for name in dir(modeling))
    # BigScience's model card: 176,247,271,424 parameters (ours omits the embedding
    # LayerNorm's 2h = 28,672)
    assert model.count_params().total + 2 * model.d_model == 176_247_271_424


def test_bloom_parameter_count_equals_transformers_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(hidden_size=64, n_layer=3, n_head=8, vocab_size=1000)
    with torch.device("meta"):
        hf = transformers.BloomForCausalLM(config)
    path = HF / "bloom" / "config.json"
    ours = from_hf_config(path).with_(n_layers=3, d_model=64, n_heads=8,
                                                n_kv_heads=8, d_ff=256, vocab=1000)
    embedding_norm = 2 * 64
    assert ours.count_params().total + embedding_norm == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("fields", [
    {}, {"rotary_pct": 0.5}, {"use_parallel_residual": False},
    {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "rope_type": "default"}},
    {"partial_rotary_factor": 0.5}])  # not read at the top level by transformers
def test_gpt_neox_rotary_share_and_block_as_transformers_reads_them(tmp_path, fields):
    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in json.loads((HF / "pythia-1.4b" / "config.json").read_text()).items()
           if k != "rotary_pct"} | fields
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = from_hf_config(tmp_path / "config.json")
    ref = transformers.GPTNeoXConfig(**cfg)
    assert model.rotary_percent == ref.rope_parameters["partial_rotary_factor"]
    assert model.parallel_residual == ref.use_parallel_residual
    assert model.rope_dim == int(model.head_dim * model.rotary_percent)


def test_hf_config_equals_preset():
    assert from_hf_config(HF / "llama3-8b").count_params() == PRESETS["llama3-8b"].count_params()


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "llama3-405b"])
def test_llama3_presets_keep_the_8k_context_of_their_pretraining(name):
    # Dubey et al. 2024 §3.4.1: pre-trained at an 8K context before the long-context stage;
    # Meta-Llama-3-8B's config.json (the fixture) max_position_embeddings 8192
    assert PRESETS[name].max_seq == from_hf_config(HF / "llama3-8b").max_seq == 8192


def test_hf_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "t5", "d_model": 512}')
    with pytest.raises(ShardwiseError, match="unsupported model_type 't5'.*llama.*gpt2"):
        from_hf_config(bad)
    bad.write_text("{not json")
    with pytest.raises(ShardwiseError, match="not valid JSON"):
        from_hf_config(bad)
    bad.write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ShardwiseError, match="lacks the field"):
        from_hf_config(bad)
    with pytest.raises(ShardwiseError, match="not found"):
        from_hf_config(tmp_path / "missing.json")


def test_unknown_model_suggests_close_names():
    with pytest.raises(ShardwiseError, match="did you mean llama3-8b"):
        get_model("lama3-8b")
    # every preset within difflib's ratio 0.5, best first
    with pytest.raises(ShardwiseError, match="did you mean deepseek-v3, tiny-deepseek?"):
        get_model("deeps")


def test_invalid_spec_is_reported():
    with pytest.raises(ShardwiseError, match="n_heads=5 does not divide d_model=64"):
        ModelSpec("bad", 2, 64, 5, 5, 128, 100).validate()
    # every problem in one line
    with pytest.raises(ShardwiseError) as info:
        ModelSpec("bad", 2, 64, 5, 3, 128, 100).validate()
    assert str(info.value) == ("model bad: n_heads=5 does not divide d_model=64; n_kv_heads=3 "
                               "does not divide n_heads=5")


def test_sigmoid_group_routing_needs_two_experts_a_group():
    """DeepSeek-V3's group-limited routing scores a group by the sum of its two best sigmoid
    affinities (§2.1.2; transformers' `DeepseekV3TopkRouter`): 8 experts in 8 groups cannot;
    softmax scores (DeepSeek-V2's group max) can."""
    def spec(score):
        return ModelSpec("g", 2, 64, 4, 4, 128, 100, n_experts=8, top_k=2, d_ff_expert=32,
                         router_score=score, expert_groups=8, topk_groups=2)

    with pytest.raises(ShardwiseError, match="expert_groups=8 needs ≥ 2 experts each"):
        spec("sigmoid").validate()
    spec("softmax").validate()
    # at the threshold: two groups of one expert each
    with pytest.raises(ShardwiseError, match="expert_groups=2 needs ≥ 2 experts each"):
        ModelSpec("g", 2, 64, 4, 4, 128, 100, n_experts=2, top_k=1, d_ff_expert=32,
                  router_score="sigmoid", expert_groups=2, topk_groups=1).validate()


def test_op_sac_recomputed_flops_of_a_two_matrix_moe_by_hand():
    """Per token 2·(dense: wo + w2 (no gate: w2 runs again); MoE: wo, every routed matmul —
    two per copy without a gate — the shared experts' second matmul and the router)."""
    model = ModelSpec("ng", 4, 64, 4, 4, 128, 100, n_experts=8, top_k=2, d_ff_expert=32,
                      n_shared_experts=1, gated_mlp=False, first_dense_layers=1).validate()
    h, wo = 64, 64 * 64
    dense = wo + h * 128
    moe = wo + (2 * 2 + 1) * h * 32 + h * 8
    assert model.op_sac_recomputed_flops() == 2.0 * (1 * dense + 3 * moe)


def test_flops_per_token_closed_form():
    # Dense, untied: forward = 2·(non-embedding params + head) + 4·s·h·L (non-causal).
    model = PRESETS["llama2-7b"]
    counts = model.count_params()
    matmul = counts.total - counts.embedding - counts.norms
    s = 4096
    forward = 2 * matmul + 4 * s * model.d_model * model.n_layers
    assert model.forward_flops_per_token(s) == forward
    assert model.training_flops_per_token(s) == 3 * forward
    causal = 2 * matmul + 2 * s * model.d_model * model.n_layers
    assert model.forward_flops_per_token(s, causal=True) == causal
    # the longest sequence counted is validate.MAX_SEQUENCES (2⁴⁰)
    assert model.forward_flops_per_token(2**40) > 0
    with pytest.raises(ShardwiseError, match=r"^seq_len must be an integer in \[1, "
                                             r"1,099,511,627,776\]"):
        model.forward_flops_per_token(2**40 + 1)


def test_narayanan_hardware_flops_with_full_recompute():
    # Narayanan et al. 2021: FLOPs per iteration with full recompute
    # 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) for a GPT with f = 4h, tied embeddings.
    l, h, s, V, B = 24, 2304, 2048, 51200, 1
    model = ModelSpec("gpt", l, h, 24, 24, 4 * h, V, gated_mlp=False, tie_embeddings=True,
                      norm="layernorm")
    published = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    ours = model.training_flops_per_token(s, recompute="full") * s * B
    # Their count omits the norms and the ~h-sized terms: agree to well under 0.1 %.
    assert ours == pytest.approx(published, rel=1e-3)


def test_moe_active_flops_use_top_k():
    model = PRESETS["mixtral-8x7b"]
    counts = model.count_params()
    dense_equivalent = 2 * (counts.active - counts.embedding - counts.norms)
    assert model.forward_flops_per_token(1, causal=True) == pytest.approx(
        dense_equivalent + 2 * 1 * model.d_model * model.n_layers)


@pytest.mark.parametrize("name", ["llama3-8b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b"])
def test_presets_carry_the_hub_configs_rope_norm_and_biases(name):
    """The hub's config.json (fixtures) and the preset agree on θ, ε, head width, biases."""
    hub, preset = from_hf_config(HF / name), PRESETS[name]
    fields = ("rope_theta", "rope_scaling", "norm_eps", "head_dim", "qkv_bias", "out_bias")
    assert {f: getattr(hub, f) for f in fields} == {f: getattr(preset, f) for f in fields}
    assert hub.count_params() == preset.count_params()


def test_qwen25_7b_count_includes_qkv_biases():
    # Qwen/Qwen2.5-7B model.safetensors.index.json: total_size 15,231,233,024 bytes of bf16
    assert PRESETS["qwen2.5-7b"].count_params().total == 15_231_233_024 // 2


def test_explicit_head_dim_changes_attention_params_and_flops():
    base = PRESETS["tiny"]
    wide = base.with_(d_head=32)  # a·d = 128 ≠ h = 64
    h, L = base.d_model, base.n_layers
    assert wide.count_params().attention - base.count_params().attention == L * (
        2 * h * 64 + 2 * h * 32)  # Q, O grow by h·64 each; K, V by h·(2·16) each
    extra = 2 * (wide.count_params().active - base.count_params().active) + L * 4 * 10 * 64
    assert wide.forward_flops_per_token(10) - base.forward_flops_per_token(10) == extra


def test_other_rope_scalings_are_planned_and_refused_only_by_the_runtime():
    cfg = json.loads((HF / "qwen2.5-7b" / "config.json").read_text())
    cfg["rope_scaling"] = {"factor": 4.0, "original_max_position_embeddings": 32768,
                           "type": "yarn"}  # Qwen2.5's long-context recipe (its model card)
    spec = from_hf_dict(cfg, "qwen-yarn")
    assert spec.rope_type == "yarn" and spec.count_params() == PRESETS["qwen2.5-7b"].count_params()


# transformers' config classes of the supported model_types, built with their defaults
HF_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig",
                     "mixtral": "MixtralConfig", "qwen2": "Qwen2Config", "gpt2": "GPT2Config",
                     "gpt_neox": "GPTNeoXConfig", "bloom": "BloomConfig",
                     "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}


def test_the_bookkeeping_list_is_transformers_own():
    """The keys transformers 5.24 writes into every config.json (`PretrainedConfig.to_dict`)
    and the generation settings it pops from one (`GenerationConfig`'s defaults) are all in
    the reader's ignore list, kept in the code so the analytic side never imports transformers."""
    transformers = pytest.importorskip("transformers")
    from shardwise.arch.hf_fields import _HF_IGNORED, HF_GENERATION_KEYS

    written = set(transformers.PretrainedConfig().to_dict()) - {"model_type"}
    generation = set(transformers.GenerationConfig._get_default_generation_params())
    assert written <= set(_HF_IGNORED), written - set(_HF_IGNORED)
    assert generation == set(HF_GENERATION_KEYS)


@pytest.mark.parametrize("kind", sorted(HF_CONFIG_CLASSES))
def test_a_config_json_transformers_saves_is_read(kind):
    """A config.json as transformers saves it (every field, its bookkeeping and the keys older
    versions wrote: `_attn_implementation_autoset`, `torch_dtype`, generation settings) is
    read, and one truly unknown key is still refused in one line."""
    transformers = pytest.importorskip("transformers")
    extra = {"num_experts_per_tok": 6} if kind == "deepseek_v2" else {}  # its default is None
    config = getattr(transformers, HF_CONFIG_CLASSES[kind])(**extra)
    saved = json.loads(config.to_json_string(use_diff=False))
    assert "transformers_version" in saved
    legacy = {"_attn_implementation_autoset": True, "torch_dtype": "bfloat16",
              "_name_or_path": "org/model", "architectures": [config.__class__.__name__[:-6]],
              "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "max_length": 20,
              "do_sample": False, "use_bfloat16": False, "tf_legacy_loss": False}
    model = from_hf_dict(saved | legacy, kind)
    assert model.n_layers == config.num_hidden_layers
    with pytest.raises(ShardwiseError, match="'per_layer_config'") as err:
        from_hf_dict(saved | {"per_layer_config": {"0": {}}}, kind)
    assert "\n" not in str(err.value)


def test_mla_head_widths_of_one_are_the_smallest_valid():
    """MLA needs qk_nope, qk_rope and v head widths ≥ 1: 1 is valid for the no-RoPE and value
    parts (the RoPE part must be even: 2), 0 is refused."""
    mla = dict(name="mla-edge", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=128,
               vocab=128, kv_lora_rank=16, qk_nope_head_dim=1, qk_rope_head_dim=2,
               v_head_dim=1)
    ModelSpec(**mla).validate()
    with pytest.raises(ShardwiseError, match="v_head_dim ≥ 1"):
        ModelSpec(**(mla | {"v_head_dim": 0})).validate()


def test_the_runtime_names_dense_mlp_biases_it_lacks():
    """A model with MLP biases and dense layers: the runtime says it lacks them, by name."""
    from shardwise.arch.variants import runtime_lacks

    biased = ModelSpec("mlp-bias", 2, 64, 4, 4, 128, 128, mlp_bias=True).validate()
    assert "MLP biases on dense layers" in runtime_lacks(biased)
    assert "MLP biases on dense layers" not in runtime_lacks(get_model("tiny"))
