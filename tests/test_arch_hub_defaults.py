"""Hub-style config.json files — only the fields that differ from the config class's defaults,
as the hub writes them — read as transformers 5.24's own config classes fill them in (RoPE θ
per layer type, the rotary share, each layer's window and RoPE, DeepSeek-V3's router), the
GPT-2 / GPT-NeoX / Llama dropout and width fields, ModelSpec's one-line refusals, and the
presets built at test time (a fresh execution of presets.py, as a new process's import builds
them) against published sizes and config.json values.
"""

from __future__ import annotations

import importlib.util

import pytest

from shardwise.arch import ModelSpec, from_hf_dict
from shardwise.arch import presets as presets_module
from shardwise.errors import ShardwiseError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 96, "vocab_size": 300, "head_dim": 24, "pad_token_id": None,
          "bos_token_id": None, "eos_token_id": None}


def _meta_params(config: object) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_gemma3_rope_thetas_are_the_config_classes():
    """Gemma 3: the global θ defaults to 1e6 and the local one to 10000 unless
    rope_local_base_freq says otherwise (Gemma3TextConfig's rope_parameters per layer type)."""
    for extra in ({}, {"rope_local_base_freq": 20000.0}, {"rope_theta": 5e5}):
        hub = {"model_type": "gemma3_text", "num_hidden_layers": 7, **_SMALL, **extra}
        config = transformers.Gemma3TextConfig(**{k: v for k, v in hub.items()
                                                  if k != "model_type"})
        spec = from_hf_dict(hub, "g")
        assert spec.rope_theta == config.rope_parameters["full_attention"]["rope_theta"]
        assert spec.rope_local_theta == config.rope_parameters["sliding_attention"]["rope_theta"]
        assert [spec.layer_kind(i) for i in range(7)] == [  # sliding_window_pattern 6
            t.removesuffix("_attention") for t in config.layer_types]
        assert dict(spec.multipliers)["query_pre_attn_scalar"] == config.query_pre_attn_scalar
        assert spec.count_params().total == _meta_params(config)


@pytest.mark.parametrize("pattern", [{"sliding_window_pattern": 3},
                                     {"_sliding_window_pattern": 3}, {}])
def test_gemma3_layer_types_without_a_list_are_the_config_classes(pattern):
    """Without `layer_types`, Gemma3TextConfig builds them from `sliding_window_pattern`
    (default 6) and overwrites a `_sliding_window_pattern` a saved config.json carries."""
    hub = {"model_type": "gemma3_text", "num_hidden_layers": 8, **_SMALL, **pattern}
    config = transformers.Gemma3TextConfig(**{k: v for k, v in hub.items()
                                              if k != "model_type"})
    spec = from_hf_dict(hub, "g")
    assert [spec.layer_kind(i) for i in range(8)] == [
        t.removesuffix("_attention") for t in config.layer_types]


def test_gpt_oss_and_glm_defaults_are_the_config_classes():
    """gpt-oss: θ 150000 (GptOssConfig); GLM-4.5: RoPE on half of each head by default, or
    the share the file gives."""
    for theta in (None, 20000.0):
        hub = {"model_type": "gpt_oss", "num_hidden_layers": 2, **_SMALL,
               "num_local_experts": 4, "num_experts_per_tok": 2}
        if theta is not None:
            hub["rope_theta"] = theta
        config = transformers.GptOssConfig(**{k: v for k, v in hub.items()
                                              if k != "model_type"})
        spec = from_hf_dict(hub, "o")
        assert spec.rope_theta == config.rope_parameters["rope_theta"] == (theta or 150000)
        assert spec.rotary_percent == 1.0  # RoPE over the whole head
    for share in (None, 0.25):
        hub = {"model_type": "glm4_moe", "num_hidden_layers": 3, **_SMALL,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40}
        if share is not None:
            hub["partial_rotary_factor"] = share
        config = transformers.Glm4MoeConfig(**{k: v for k, v in hub.items()
                                               if k != "model_type"})
        spec = from_hf_dict(hub, "glm")
        assert spec.rotary_percent == config.rope_parameters[
            "partial_rotary_factor"] == (share or 0.5)
        # Glm4MoeConfig's defaults: one dense first layer, one MTP layer
        assert spec.first_dense_layers == config.first_k_dense_replace == 1
        assert spec.mtp_layers == config.num_nextn_predict_layers == 1
        assert spec.max_seq == config.max_position_embeddings
        assert spec.count_params().total == _meta_params(config)


@pytest.mark.parametrize(("kind", "cls", "extra"), [
    ("smollm3", "SmolLM3Config", {"num_hidden_layers": 8, "use_sliding_window": True,
                                  "sliding_window": 16, "no_rope_layer_interval": 3}),
    ("smollm3", "SmolLM3Config", {"num_hidden_layers": 8, "use_sliding_window": True,
                                  "sliding_window": 16}),
    ("smollm3", "SmolLM3Config", {"num_hidden_layers": 8, "sliding_window": 16}),
    ("llama4_text", "Llama4TextConfig", {"num_hidden_layers": 8, "attention_chunk_size": 16,
                                         "num_local_experts": 4}),
    ("llama4_text", "Llama4TextConfig", {"num_hidden_layers": 9, "attention_chunk_size": 16,
                                         "num_local_experts": 4, "no_rope_layer_interval": 3}),
])
def test_layer_kinds_and_nope_layers_are_the_config_classes(kind, cls, extra):
    """Without layer_types / no_rope_layers in the file, each layer's attention kind and RoPE
    are what the config class derives (the window on SmolLM3's NoPE layers)."""
    hub = {"model_type": kind, **_SMALL, **extra}
    config = getattr(transformers, cls)(**{k: v for k, v in hub.items() if k != "model_type"})
    spec = from_hf_dict(hub, kind)
    names = {"full_attention": "full", "sliding_attention": "sliding",
             "chunked_attention": "chunked"}
    if kind == "smollm3":
        expected = [names[t] for t in config.layer_types]
    else:  # Llama 4: chunked attention on the RoPE layers (Llama4TextAttention)
        expected = ["chunked" if r else "full" for r in config.no_rope_layers]
    assert [spec.layer_kind(i) for i in range(spec.n_layers)] == expected
    assert spec.layer_types == (() if set(expected) == {"full"} else tuple(expected))
    assert spec.nope_layers == tuple(i for i, r in enumerate(config.no_rope_layers) if not r)
    assert spec.count_params().total == _meta_params(config)


def test_llama4_moe_layers_off_the_pattern_are_refused_in_one_line():
    hub = {"model_type": "llama4_text", "num_hidden_layers": 4, **_SMALL,
           "interleave_moe_layer_step": 2, "moe_layers": [0, 1]}
    with pytest.raises(ShardwiseError, match=r"moe_layers \[0\] are off the "
                                             "interleave_moe_layer_step=2 pattern") as err:
        from_hf_dict(hub, "l4")
    assert "\n" not in str(err.value)


def test_deepseek_v3_router_rope_and_mtp_are_the_config_classes():
    """DeepSeek-V3 (transformers' DeepseekV3TopkRouter: sigmoid scores, gates renormalised
    when norm_topk_prob; rope_interleave as written; num_nextn_predict_layers MTP modules) and
    V2 (softmax, never renormalised, interleaved pairs, no MTP)."""
    mla = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
           "intermediate_size": 96, "vocab_size": 300, "q_lora_rank": 24, "kv_lora_rank": 16,
           "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 20,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
           "moe_intermediate_size": 40, "first_k_dense_replace": 1, "num_hidden_layers": 3,
           "n_group": 2, "topk_group": 1}
    v3 = from_hf_dict({"model_type": "deepseek_v3", **mla, "rope_interleave": False,
                       "norm_topk_prob": False, "num_nextn_predict_layers": 1}, "v3")
    config = transformers.DeepseekV3Config(**mla, rope_interleave=False, norm_topk_prob=False)
    assert (v3.router_score, v3.norm_topk, v3.rope_interleave, v3.mtp_layers) == (
        "sigmoid", config.norm_topk_prob, config.rope_interleave, 1)
    default = transformers.DeepseekV3Config()  # the MTP modules when the file names none
    assert from_hf_dict({"model_type": "deepseek_v3", **mla}, "v3").mtp_layers == (
        default.num_nextn_predict_layers)
    assert v3.count_params().total == _meta_params(config)
    # deepseek-ai/DeepSeek-V3 config.json writes "moe_layer_freq": 1, which transformers does
    # not read (every layer from first_k_dense_replace on is MoE): 1 is read, 2 refused
    assert from_hf_dict({"model_type": "deepseek_v3", **mla, "moe_layer_freq": 1},
                        "v3").n_experts == 8
    with pytest.raises(ShardwiseError, match="moe_layer_freq=2 is not supported") as err:
        from_hf_dict({"model_type": "deepseek_v3", **mla, "moe_layer_freq": 2}, "v3")
    assert "\n" not in str(err.value)
    v2 = from_hf_dict({"model_type": "deepseek_v2", **mla, "norm_topk_prob": True}, "v2")
    assert (v2.router_score, v2.norm_topk, v2.rope_interleave, v2.mtp_layers) == (
        "softmax", False, True, 0)


def test_gpt2_inner_width_ties_and_dropout_are_the_models():
    """GPT-2: n_inner ≠ 4h, untied head, dropout only on attention — the count equals
    GPT2LMHeadModel's and dropout is on (GPT2Attention's attn_dropout p = 0.1)."""
    fields = {"n_embd": 64, "n_layer": 3, "n_head": 4, "n_inner": 160, "vocab_size": 300,
              "n_positions": 128, "tie_word_embeddings": False, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.1}
    config = transformers.GPT2Config(**fields)
    spec = from_hf_dict({"model_type": "gpt2", **fields}, "g")
    assert spec.d_ff == 160 and not spec.tie_embeddings
    assert spec.count_params().total == _meta_params(config)
    assert spec.dropout
    off = from_hf_dict({"model_type": "gpt2", **fields, "attn_pdrop": 0.0}, "g")
    assert not off.dropout


def test_neox_and_llama_dropout_follow_the_probabilities():
    neox = {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 2}
    assert from_hf_dict(neox | {"hidden_dropout": 0.1}, "n").dropout
    assert not from_hf_dict(neox | {"hidden_dropout": 0.0, "attention_dropout": 0.0}, "n").dropout
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 300,
             "num_hidden_layers": 2}
    assert not from_hf_dict(llama | {"attention_dropout": 0.0}, "l").dropout
    assert from_hf_dict(llama | {"attention_dropout": 0.1}, "l").dropout


_MLA = dict(name="m", n_layers=4, d_model=64, n_heads=4, n_kv_heads=4, d_ff=96, vocab=300,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
            v_head_dim=20, n_experts=8, top_k=2, d_ff_expert=40, n_shared_experts=2,
            first_dense_layers=1, routed_scaling=2.5)


@pytest.mark.parametrize(("change", "message"), [
    ({"v_head_dim": 0}, "multi-head latent attention needs qk_nope_head_dim, qk_rope_head_dim "
                        "and v_head_dim ≥ 1"),
    ({"first_dense_layers": 5}, "first_dense_layers must be in 0..n_layers=4, got 5"),
    ({"name": 3}, "name must be a string, got 3"),
    ({"kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0},
     "q_lora_rank need kv_lora_rank > 0 (multi-head latent attention)"),
    ({"kv_lora_rank": 0, "q_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
      "v_head_dim": 0, "alibi": True, "learned_positions": 128},
     "ALiBi takes no learned positions and no rotary_percent"),
    ({"routed_scaling": 0.0}, "routed_scaling must be a finite number > 0, got 0.0"),
])
def test_spec_refusals_are_one_line(change, message):
    with pytest.raises(ShardwiseError) as err:
        ModelSpec(**(_MLA | change)).validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_layer_dense_is_valid():
    """first_dense_layers = n_layers: the bounds are 0..n_layers inclusive."""
    assert ModelSpec(**(_MLA | {"first_dense_layers": 4})).validate().n_moe_layers == 0


@pytest.fixture
def fresh_presets():
    """presets.py executed anew under its own name (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(presets_module.__name__,
                                                  presets_module.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PRESETS


@pytest.mark.parametrize(("name", "layers", "hidden"), [("gpt3-175b", 96, 12288),
                                                         ("gpt3-1.3b", 24, 2048)])
def test_fresh_gpt3_presets_equal_the_closed_form(fresh_presets, name, layers, hidden):
    """GPT-3 (Brown et al. 2020, Table 2.1; f = 4h, V 50257, 2048 learned positions, tied;
    the preset counts no linear biases): L·(12h² + 4h) + V·h + 2048·h + 2h."""
    h = hidden
    expected = layers * (12 * h * h + 4 * h) + 50257 * h + 2048 * h + 2 * h
    assert fresh_presets[name].count_params().total == expected


def test_fresh_deepseek_presets_equal_published_figures(fresh_presets):
    """DeepSeek-V3: 671,026,404,352 parameters without MTP (transformers 5.24's
    DeepseekV3ForCausalLM with DeepseekV3Config's defaults, the checkpoint's sizes; see
    tests/test_deepseek.py), YaRN as deepseek-ai/DeepSeek-V3 config.json's rope_scaling;
    DeepSeek-V2-Lite: 15.7 B total (arXiv:2405.04434 Appendix B), mscale 0.707 (its
    config.json's rope_scaling)."""
    v3 = fresh_presets["deepseek-v3"]
    assert v3.count_params().total == 671_026_404_352
    assert dict(v3.rope_scaling) == {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                     "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 4096,
                                     "rope_type": "yarn"}
    lite = fresh_presets["deepseek-v2-lite"]
    assert lite.count_params().total / 1e9 == pytest.approx(15.7, abs=0.05)
    assert dict(lite.rope_scaling)["mscale"] == 0.707


def test_older_readers_defaults_and_rope_scaling():
    """BLOOM's attention dropout alone turns dropout on; GPT-NeoX's θ from rotary_emb_base and
    its LayerNorm ε default (GPTNeoXConfig's 1e-5); a rope_scaling dict's rope_type and
    original_max_position_embeddings (the file's max_position_embeddings when unset)."""
    bloom = {"model_type": "bloom", "hidden_size": 64, "n_head": 4, "n_layer": 2,
             "vocab_size": 300}
    assert from_hf_dict(bloom | {"attention_dropout": 0.1}, "b").dropout
    assert not from_hf_dict(bloom, "b").dropout
    neox = {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 2,
            "rotary_emb_base": 20000}
    spec = from_hf_dict(neox, "n")
    assert spec.rope_theta == 20000
    assert spec.norm_eps == transformers.GPTNeoXConfig().layer_norm_eps
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 2,
             "max_position_embeddings": 2048,
             "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert dict(from_hf_dict(llama, "l").rope_scaling) == {
        "factor": 2.0, "rope_type": "linear", "original_max_position_embeddings": 2048}


def test_newer_readers_multipliers_softcaps_and_windows():
    """Granite's multipliers other than 1 kept; Gemma 2's final soft-cap as written; Qwen3-MoE
    drops the window without use_sliding_window (Qwen3MoeConfig)."""
    granite = {"model_type": "granite", "num_hidden_layers": 2, **_SMALL,
               "embedding_multiplier": 12.0, "residual_multiplier": 0.22}
    assert dict(from_hf_dict(granite, "g").multipliers) == {"embedding_multiplier": 12.0,
                                                            "residual_multiplier": 0.22}
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 2, **_SMALL,
              "final_logit_softcapping": 25.0}
    assert from_hf_dict(gemma2, "g2").final_softcap == 25.0
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 2, **_SMALL, "num_experts": 4,
            "num_experts_per_tok": 2, "sliding_window": 16}
    spec = from_hf_dict(qwen, "q")
    assert spec.sliding_window == 0 and spec.layer_types == ()


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ("sliding", "full", "full", "full")},
     "sliding layers need sliding_window > 0"),
    ({"nope_layers": (True,)}, "nope_layers must list layer indices in 0..3"),
    ({"block_norms": "mid"}, "block_norms must be one of 'pre', 'post', 'sandwich', got 'mid'"),
])
def test_variant_refusals_name_what_is_valid(change, message):
    with pytest.raises(ShardwiseError) as err:
        ModelSpec(**(_MLA | change)).validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fresh_mixtral_and_deepseek_structure(fresh_presets):
    """Mixtral 8x7B: 46.7 B total, 12.9 B active (Mistral AI's release post); DeepSeek-V3
    rotates interleaved pairs (DeepseekV3Config's rope_interleave default)."""
    mixtral = fresh_presets["mixtral-8x7b"].count_params()
    assert mixtral.total / 1e9 == pytest.approx(46.7, abs=0.05)
    assert mixtral.active / 1e9 == pytest.approx(12.9, abs=0.05)
    assert fresh_presets["deepseek-v3"].rope_interleave == (
        transformers.DeepseekV3Config().rope_interleave)


def test_qwen2_window_from_max_window_layers():
    """Qwen2 without layer_types: the window on layers max_window_layers.. when
    use_sliding_window (Qwen2Config's derived layer_types)."""
    fields = {"num_hidden_layers": 4, **_SMALL, "sliding_window": 16,
              "use_sliding_window": True, "max_window_layers": 2}
    fields.pop("head_dim")
    config = transformers.Qwen2Config(**fields)
    spec = from_hf_dict({"model_type": "qwen2", **fields}, "q2")
    assert "sliding_attention" in config.layer_types and spec.sliding_window == 16
    assert from_hf_dict({"model_type": "qwen2", **fields, "use_sliding_window": False},
                        "q2").sliding_window == 0


@pytest.mark.parametrize(("use", "types"), [
    (False, ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
    (True, ["full_attention"] * 4), (True, ["full_attention", "sliding_attention"] * 2)])
def test_qwen2_window_with_layer_types_is_the_config_classes(use, types):
    """Qwen2 with `layer_types`: the window applies on the sliding layers it names, and only
    under use_sliding_window (Qwen2Config sets sliding_window to None otherwise), whatever
    max_window_layers says."""
    fields = {"num_hidden_layers": 4, **_SMALL, "sliding_window": 16, "max_window_layers": 1,
              "use_sliding_window": use, "layer_types": types}
    fields.pop("head_dim")
    config = transformers.Qwen2Config(**fields)
    spec = from_hf_dict({"model_type": "qwen2", **fields}, "q2")
    windowed = config.sliding_window is not None and "sliding_attention" in config.layer_types
    assert spec.sliding_window == (config.sliding_window if windowed else 0)


@pytest.mark.parametrize(("theta", "qk_norm", "chunk"), [(None, None, 16),
                                                       (20000.0, False, 0)])
def test_llama4_theta_qk_norm_and_chunking_are_the_config_classes(theta, qk_norm, chunk):
    """Llama 4: θ 500000 unless the file says (Llama4TextConfig), the L2 QK norm when
    use_qk_norm (its default: on), chunked attention only with a chunk size."""
    hub = {"model_type": "llama4_text", "num_hidden_layers": 4, **_SMALL,
           "num_local_experts": 4, "attention_chunk_size": chunk}
    hub |= {k: v for k, v in (("rope_theta", theta), ("use_qk_norm", qk_norm)) if v is not None}
    config = transformers.Llama4TextConfig(**{k: v for k, v in hub.items() if k != "model_type"})
    spec = from_hf_dict(hub, "l4")
    assert spec.rope_theta == config.rope_parameters["rope_theta"] == (theta or 500000.0)
    assert spec.qk_norm == ("l2" if config.use_qk_norm else "")
    assert spec.attention_chunk == config.attention_chunk_size == chunk
    assert spec.count_params().total == _meta_params(config)


def test_qwen3_moe_expert_count_defaults_to_the_config_classes():
    """A Qwen3-MoE config.json without num_experts: Qwen3MoeConfig's 128 experts."""
    hub = {"model_type": "qwen3_moe", "num_hidden_layers": 2, **_SMALL,
           "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in hub.items() if k != "model_type"})
    spec = from_hf_dict(hub, "q3")
    assert spec.n_experts == config.num_experts == 128
    assert spec.count_params().total == _meta_params(config)


def _family_tables():
    from shardwise.arch.hf import _DEEPSEEK_DEFAULTS
    from shardwise.arch.hf_families import _DEFAULTS

    return [(kind, values) for table in (_DEFAULTS, _DEEPSEEK_DEFAULTS)
            for kind, values in sorted(table.items())]


@pytest.mark.parametrize(("kind", "values"), _family_tables(),
                         ids=[kind for kind, _ in _family_tables()])
def test_every_family_default_is_its_config_class_default(kind, values):
    """The defaults a config.json may leave out, family by family, are transformers 5.24's
    config classes' own (`AutoConfig.for_model`; a private `_name` attribute where the class
    keeps one; Qwen3 keeps its 4096 window only with use_sliding_window)."""
    extra = {"use_sliding_window": True} if kind in ("qwen3", "qwen3_moe") else {}
    config = transformers.AutoConfig.for_model(kind, **extra)
    for key, value in values.items():
        assert getattr(config, key, getattr(config, "_" + key, None)) == value, key


@pytest.mark.parametrize("use", [False, True])
def test_qwen3_windows_and_given_layer_types_are_the_config_classes(use):
    """Qwen3 keeps its sliding window only with use_sliding_window, then on the layers from
    max_window_layers on (Qwen3Config.layer_types); a config.json's own layer_types list is
    taken as written (Gemma 3 with an irregular list)."""
    hub = {"model_type": "qwen3", "num_hidden_layers": 5, **_SMALL, "sliding_window": 64,
           "max_window_layers": 2, "use_sliding_window": use}
    config = transformers.Qwen3Config(**{k: v for k, v in hub.items() if k != "model_type"})
    spec = from_hf_dict(hub, "q")
    assert [spec.layer_kind(i) for i in range(5)] == [
        t.removesuffix("_attention") for t in config.layer_types]
    assert ("sliding" in config.layer_types[-1]) is use  # both cases distinguishable
    listed = ["full_attention", "full_attention", "sliding_attention", "full_attention",
              "sliding_attention"]
    gemma = {"model_type": "gemma3_text", "num_hidden_layers": 5, **_SMALL,
             "layer_types": listed}
    assert [from_hf_dict(gemma, "g").layer_kind(i) for i in range(5)] == [
        t.removesuffix("_attention") for t in transformers.Gemma3TextConfig(
            **{k: v for k, v in gemma.items() if k != "model_type"}).layer_types]


def test_gemma_scales_its_embeddings_by_the_root_of_the_width():
    """Gemma's embedding output × √h (transformers' Gemma3TextScaledWordEmbedding embed_scale
    = hidden_size ** 0.5)."""
    hub = {"model_type": "gemma3_text", "num_hidden_layers": 2, **_SMALL}
    spec = from_hf_dict(hub, "g")
    assert dict(spec.multipliers)["embedding_multiplier"] == pytest.approx(64 ** 0.5)
