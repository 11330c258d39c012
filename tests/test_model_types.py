"""The newer Hugging Face model_types (issue 51, issue 43 item 6) read as transformers 5.24 reads
them: a config its own config class writes is read, and `count_params` equals the parameters of
transformers' own model built on the meta device."""

import json
from pathlib import Path

import pytest

from shardwise.arch import PRESETS, from_hf_dict
from shardwise.errors import ShardwiseError
from tests.cli_helpers import shardwise

HF = Path(__file__).parent / "fixtures" / "hf"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# small, non-degenerate configs: head_dim ≠ h/a, GQA, windows shorter than max_position with
# both sliding and full layers, MoE every k-th layer or with dense layers, shared experts
_SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 96, "vocab_size": 300, "pad_token_id": None,
          "bos_token_id": None, "eos_token_id": None}
CASES = {
    "qwen3": ("Qwen3Config", {"num_hidden_layers": 4, "head_dim": 24,
                              "use_sliding_window": True, "sliding_window": 16,
                              "max_window_layers": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_hidden_layers": 6, "head_dim": 24,
                                     "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                     "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 40, "norm_topk_prob": True}),
    "gemma2": ("Gemma2Config", {"num_hidden_layers": 4, "head_dim": 32, "sliding_window": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"num_hidden_layers": 7, "head_dim": 32,
                                         "sliding_window": 16, "sliding_window_pattern": 3}),
    "phi3": ("Phi3Config", {"num_hidden_layers": 3, "sliding_window": 16,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.75}}),
    "olmo2": ("Olmo2Config", {"num_hidden_layers": 3, "attention_bias": True}),
    "granite": ("GraniteConfig", {"num_hidden_layers": 3, "mlp_bias": True,
                                  "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "attention_multiplier": 0.0078125, "logits_scaling": 8.0}),
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 8, "use_sliding_window": True,
                                  "sliding_window": 16, "tie_word_embeddings": False}),
    "gpt_oss": ("GptOssConfig", {"num_hidden_layers": 4, "head_dim": 24, "sliding_window": 16,
                                 "num_local_experts": 8, "num_experts_per_tok": 2}),
    "llama4_text": ("Llama4TextConfig", {"num_hidden_layers": 8, "head_dim": 24,
                                         "intermediate_size_mlp": 112,
                                         "attention_chunk_size": 16, "num_local_experts": 4,
                                         "interleave_moe_layer_step": 2}),
    "glm4_moe": ("Glm4MoeConfig", {"num_hidden_layers": 4, "head_dim": 24,
                                   "attention_bias": True, "use_qk_norm": True,
                                   "n_routed_experts": 8, "num_experts_per_tok": 2,
                                   "n_shared_experts": 2, "moe_intermediate_size": 40,
                                   "first_k_dense_replace": 1, "n_group": 2,
                                   "topk_group": 1}),
}


def _saved(kind: str) -> tuple[object, dict]:
    cls, fields = CASES[kind]
    config = getattr(transformers, cls)(**(_SMALL | fields))
    return config, json.loads(config.to_json_string(use_diff=False))


def _hf_params(config: object) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied tables once


@pytest.mark.parametrize("kind", sorted(CASES))
def test_count_equals_transformers_model(kind):
    config, saved = _saved(kind)
    spec = from_hf_dict(saved, kind)
    assert spec.count_params().total == _hf_params(config)
    # a key transformers never writes is still refused, in one line
    with pytest.raises(ShardwiseError, match="'per_layer_config'") as err:
        from_hf_dict(saved | {"per_layer_config": {}}, kind)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_layer_kinds_and_experts_as_transformers_builds_them(kind):
    """Each layer's attention window and MLP kind equal the module transformers builds."""
    config, saved = _saved(kind)
    spec = from_hf_dict(saved, kind)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    for i, layer in enumerate(model.model.layers):
        window = (config.sliding_window if kind == "phi3"  # passed to every layer's kernel
                  else getattr(layer.self_attn, "sliding_window", None) or 0)
        if spec.layer_kind(i) == "sliding":
            assert window == spec.sliding_window > 0
        else:
            assert not window
        mlp = getattr(layer, "mlp", None) or layer.feed_forward
        has_experts = any("experts" in n for n, _ in mlp.named_modules()) or hasattr(
            mlp, "experts")
        assert has_experts == spec.is_moe_layer(i), i
    if kind == "llama4_text":
        assert [spec.layer_kind(i) == "chunked" for i in range(spec.n_layers)] == [
            bool(r) for r in config.no_rope_layers]
        assert spec.attention_chunk == 16 and spec.nope_layers == (3, 7)


def test_qwen3_moe_hub_names_and_tied_embeddings():
    """The hub's Qwen3-MoE configs name the experts `num_experts` (5.24 writes
    num_local_experts); tie_word_embeddings is read as written."""
    config, saved = _saved("qwen3_moe")
    hub = {k: v for k, v in saved.items() if k != "num_local_experts"} | {
        "num_experts": 8, "tie_word_embeddings": True}
    spec = from_hf_dict(hub, "q")
    config.tie_word_embeddings = True
    assert spec.tie_embeddings and spec.n_experts == 8
    assert spec.count_params().total == _hf_params(config)


# Published sizes of the presets (model cards; total parameters)
@pytest.mark.parametrize(("name", "billions", "active"), [
    ("qwen3-235b-a22b", 235, 22), ("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-8b", 8.2, None),
    ("kimi-k2", 1040, 32)])
def test_preset_sizes_match_model_cards(name, billions, active):
    counts = PRESETS[name].count_params()
    assert counts.total / 1e9 == pytest.approx(billions, rel=0.02)
    if active:
        assert counts.active / 1e9 == pytest.approx(active, rel=0.05)


@pytest.mark.parametrize(("name", "cls"), [
    ("qwen3-235b-a22b", "Qwen3MoeConfig"), ("qwen3-30b-a3b", "Qwen3MoeConfig"),
    ("qwen3-8b", "Qwen3Config")])
def test_qwen3_presets_equal_transformers_on_their_hub_configs(name, cls):
    preset = PRESETS[name]
    fields = {"num_hidden_layers": preset.n_layers, "hidden_size": preset.d_model,
              "num_attention_heads": preset.n_heads, "num_key_value_heads": preset.n_kv_heads,
              "head_dim": preset.head_dim, "intermediate_size": preset.d_ff,
              "vocab_size": preset.vocab, "tie_word_embeddings": preset.tie_embeddings}
    if preset.is_moe:
        fields |= {"num_experts": preset.n_experts, "num_experts_per_tok": preset.top_k,
                   "moe_intermediate_size": preset.d_ff_expert, "norm_topk_prob": True}
    config = getattr(transformers, cls)(**fields)
    assert preset.count_params().total == _hf_params(config)


def test_kimi_k2_equals_transformers_deepseek_v3_reading():
    """Kimi K2 is DeepSeek-V3's architecture (model_type deepseek_v3): transformers'
    DeepseekV3ForCausalLM built from the preset's config values has its parameters."""
    k2 = PRESETS["kimi-k2"]
    config = transformers.DeepseekV3Config(
        num_hidden_layers=61, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_attention_heads=64, num_key_value_heads=64,
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        vocab_size=163840)
    assert k2.count_params().total == _hf_params(config)
    assert (k2.n_experts, k2.top_k, k2.n_shared_experts, k2.expert_groups) == (384, 8, 1, 1)
    assert k2.router_score == "sigmoid" and k2.norm_topk and k2.mtp_layers == 0


# Published totals (billions): model cards / reports of each checkpoint (text model only)
@pytest.mark.parametrize(("name", "billions"), [
    ("gemma3-27b", 27.0),      # Gemma 3 report (arXiv:2503.19786) Table 1: 25.6 B + 1.4 B emb.
    ("gemma2-27b", 27.2),      # Gemma 2 report (arXiv:2408.00118): 27.2 B
    ("gpt-oss-120b", 116.8),   # gpt-oss model card: 116.83 B total
    ("llama4-scout", 108),     # Llama 4 Scout: 109 B with its vision encoder
    ("phi-4", 14.7),           # Phi-4 technical report: 14 B (14.7 B on the hub)
    ("olmo2-32b", 32.2),       # OLMo 2 32B (hub: 32.2 B)
    ("granite-3.3-8b", 8.17),  # granite-3.3-8b-base (hub: 8.17 B)
    ("smollm3-3b", 3.08),      # SmolLM3-3B (hub: 3.08 B)
    ("glm-4.5", 355)])         # GLM-4.5 report: 355 B total (here + its MTP layer)
def test_newer_presets_match_published_sizes(name, billions):
    counts = PRESETS[name].count_params()
    assert (counts.total + counts.mtp) / 1e9 == pytest.approx(billions, rel=0.02)


# ------------------------------------------------------------------ attention variants' FLOPs
def _windowed():
    """4 layers, sliding (w = 1024) / full alternating, a·d = 4·48 ≠ h = 128, s = 4096."""
    from shardwise.arch import ModelSpec

    return ModelSpec("win", 4, 128, 4, 2, 256, 1000, d_head=48, sliding_window=1024,
                     layer_types=("sliding", "full", "sliding", "full"), max_seq=8192)


def test_windowed_attention_flops_closed_form():
    """Worked by hand, s = 4096, w = 1024: a sliding layer's causal query sees on average
    w − w²/2s = 1024 − 128 = 896 keys, a full one s/2 = 2048; non-causal 1024 and 4096.
    Scores + P·V: 2·keys·(a·d + a·d_v) FLOPs per token per layer."""
    model, s = _windowed(), 4096
    full = model.with_(sliding_window=0, layer_types=())
    ad = 4 * 48
    assert model.attention_keys(s) == (896 + 2048 + 896 + 2048) / 4
    causal = 2 * (896 + 2048 + 896 + 2048) * 2 * ad
    non_causal = 2 * (1024 + 4096 + 1024 + 4096) * 2 * ad
    matmul = full.forward_flops_per_token(s) - 4 * 2 * 4096 * 2 * ad
    assert model.forward_flops_per_token(s, causal=True) == matmul + causal
    assert model.forward_flops_per_token(s) == matmul + non_causal
    # a window at least as long as the sequence changes nothing
    assert model.forward_flops_per_token(1024, causal=True) == full.forward_flops_per_token(
        1024, causal=True)


@pytest.mark.parametrize(("kind", "span"), [("sliding", 7), ("chunked", 5)])
def test_keys_per_query_equal_transformers_masks(kind, span):
    """The keys each query sees under transformers' own mask functions (masking_utils) are
    `attention_keys` in the area convention of the causal `s/2` (s²/2 of the s(s+1)/2 mask
    entries): the mask's area drops half the diagonal of each triangle — s/2 for a causal
    mask or a row of chunks, min(s, w)/2 for a band (only its first triangle)."""
    from shardwise.arch import ModelSpec

    masking = pytest.importorskip("transformers.masking_utils")
    s = 23
    if kind == "sliding":
        fn = masking.sliding_window_causal_mask_function(span)
        model = ModelSpec("m", 2, 64, 4, 4, 64, 100, sliding_window=span,
                          layer_types=("sliding", "full"))
    else:
        fn = masking.chunked_causal_mask_function(span, torch.zeros(1, dtype=torch.long))
        model = ModelSpec("m", 2, 64, 4, 4, 64, 100, attention_chunk=span,
                          layer_types=("chunked", "full"))
    t = torch.tensor
    visible = sum(bool(fn(t(0), t(0), t(q), t(k))) for q in range(s) for k in range(s))
    diagonal = s / 2
    windowed = visible - (min(s, span) / 2 if kind == "sliding" else diagonal)
    full = s * (s + 1) / 2 - diagonal
    assert model.attention_keys(s) * s == pytest.approx((windowed + full) / 2)


def test_attention_time_follows_the_window():
    """The fused kernel's time (estimate.compute) scales with the keys it visits: Gemma 3's
    1024-token windows in 5 of 6 layers at 32k tokens."""
    from shardwise.estimate.compute import layer_model_flops

    gemma = PRESETS["gemma3-27b"]
    full = gemma.with_(layer_types=(), sliding_window=0)
    s = 32768
    keys = gemma.attention_keys(s)
    sliding = 1024 - 1024**2 / (2 * s)
    assert keys == pytest.approx((52 * sliding + 10 * s / 2) / 62)
    att = layer_model_flops(gemma, s) - layer_model_flops(full, s)
    assert att == pytest.approx(4 * s * (keys - s / 2) * gemma.d_model)


NEW_PRESETS = ["qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-8b", "kimi-k2", "gemma3-27b",
               "gemma2-27b", "gpt-oss-120b", "llama4-scout", "phi-4", "olmo2-32b",
               "granite-3.3-8b", "smollm3-3b", "glm-4.5", "llama4-maverick", "gpt-oss-20b"]


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_memory_answers_for_every_new_preset(name):
    from click.testing import CliRunner

    from shardwise.cli import cli

    result = CliRunner().invoke(cli, ["memory", name, "--gpus", "8", "--seq", "32768"])
    assert result.exit_code == 0, result.output[-500:]


_SLOW = pytest.mark.slow  # MoE searches take 20 s and more on 2 cores (issue 43 item 7)


@pytest.mark.parametrize(("name", "gpus"), [
    ("qwen3-8b", 8), ("gemma3-27b", 16), ("gemma2-27b", 16), ("phi-4", 16), ("olmo2-32b", 16),
    ("granite-3.3-8b", 8), ("smollm3-3b", 8),
    *(pytest.param(name, gpus, marks=_SLOW) for name, gpus in (
        ("gpt-oss-120b", 64), ("llama4-scout", 64), ("qwen3-30b-a3b", 64),
        ("qwen3-235b-a22b", 256), ("glm-4.5", 256), ("kimi-k2", 1024)))])
def test_plan_answers_for_new_presets(name, gpus):
    from click.testing import CliRunner

    from shardwise.cli import cli

    result = CliRunner().invoke(cli, ["plan", name, "--gpus", str(gpus), "--seq", "8192"])
    assert result.exit_code == 0, result.output[-500:]
    assert name in result.output


def test_models_lists_the_new_presets():
    # the real entry point at a stated width (a runner's COLUMNS=80 wraps the names)
    table = shardwise("models").stdout
    assert [name for name in NEW_PRESETS if name not in table] == []


def test_runtime_refuses_what_it_does_not_implement(tmp_path, capsys):
    """`train` (the runtime) refuses a variant it does not implement, in one line, exit 2."""
    from shardwise.cli import main

    assert PRESETS["llama3-8b"].seq_problems(8192) == []
    _, saved = _saved("qwen3")
    (tmp_path / "config.json").write_text(json.dumps(saved | {"vocab_size": 512}))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(tmp_path / "config.json"), "--seq", "8", "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "QK-norm" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("name", "seq", "why"), [
    ("olmo2-32b", 4096, "QK-norm over 'full'"), ("gemma3-27b", 4096, "sandwich-norm"),
    ("mistral-window", 8192, "windowed or chunked below --seq 8192")])
def test_exports_refuse_what_they_cannot_express(tmp_path, capsys, name, seq, why):
    """An export never trains another model: variants without a verified option, and windows
    shorter than the sequence, are refused in one line (exit 2, the entry point users run)."""
    from shardwise.cli import main

    if name == "mistral-window":
        cfg = json.loads((HF / "mistral-7b" / "config.json").read_text())
        assert cfg["sliding_window"] == 4096
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        name = str(tmp_path / "config.json")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", name, "--gpus", "16", "--seq", str(seq), "--emit",  # Megatron builds
              "deepspeed" if str(name).endswith("config.json") else "megatron"])  # windows
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and why in err and err.count("\n") == 1, err


# ------------------------------------------------------------- the variants' activation memory
@pytest.mark.parametrize("kind", ["qwen3", "olmo2", "gemma3_text"])
def test_saved_activations_equal_transformers_measured(kind):
    """QK-norm (per head: Qwen3, Gemma 3; over a·d: OLMo 2) and Gemma's extra block norms,
    under the hf-sdpa profile, equal what transformers' decoder layer saves for backward
    (autograd's saved-tensor hooks, `runtime.measure`), bf16, head_dim ≠ h/a, GQA."""
    from shardwise.estimate.profiles import saved_tensors
    from shardwise.runtime.measure import saved_bytes_per_layer

    h, a, kv, f, s, b = 256, 8, 2, 688, 128, 2
    cls, model_cls = {"qwen3": ("Qwen3Config", "Qwen3Model"),
                      "olmo2": ("Olmo2Config", "Olmo2Model"),
                      "gemma3_text": ("Gemma3TextConfig", "Gemma3TextModel")}[kind]
    extra = {} if kind == "olmo2" else {"head_dim": 48}
    config = getattr(transformers, cls)(
        hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, intermediate_size=f,
        num_hidden_layers=2, vocab_size=64, attn_implementation="sdpa", pad_token_id=None,
        bos_token_id=None, eos_token_id=None, **extra)
    spec = from_hf_dict(json.loads(config.to_json_string(use_diff=False)), kind)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16).train()
    ids = torch.randint(0, 64, (b, s))
    measured = saved_bytes_per_layer(model, list(model.layers), lambda: model(input_ids=ids))
    predicted = sum(saved_tensors("hf-sdpa", spec, s, b, dtype_bytes_=2).values())
    plain = sum(saved_tensors("hf-sdpa", spec.with_(qk_norm="", block_norms="pre"), s, b,
                              dtype_bytes_=2).values())
    assert measured[1] == pytest.approx(predicted, rel=0.002)
    assert measured[1] - plain > 0.15 * plain  # the variants' share is not noise


@pytest.mark.parametrize(("kind", "fields"), [
    ("qwen3", {"use_sliding_window": True, "max_window_layers": 1}),  # window: class default
    ("gemma2", {"sliding_window": None}), ("gpt_oss", {}), ("smollm3", {})])
def test_windows_unset_or_null_as_the_config_class_reads_them(kind, fields):
    """A hub-style file that omits `sliding_window` (or writes null) gets the window the config
    class gives the model's layers."""
    cls = CASES[kind][0]
    base = {"model_type": kind, "num_hidden_layers": 4, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "vocab_size": 300, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    spec = from_hf_dict(base | fields, kind)
    config = getattr(transformers, cls)(**{k: v for k, v in (base | fields).items()
                                           if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    windows = [getattr(layer.self_attn, "sliding_window", None) or 0
               for layer in model.model.layers]
    assert windows == [spec.sliding_window if spec.layer_kind(i) == "sliding" else 0
                       for i in range(4)]


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_memory_holds_every_parameter_the_count_has(name):
    """One rank of a one-stage, unsharded layout holds exactly `count_params().total`
    (estimate.geometry: sinks, QK-norm, extra block norms, expert and router biases)."""
    from shardwise.estimate.geometry import stage_param_counts

    model = PRESETS[name]
    dense, experts = stage_param_counts(model, tp=1, pp=1, ep=1, chunks=1, stage=0)
    assert dense + experts == model.count_params().total
