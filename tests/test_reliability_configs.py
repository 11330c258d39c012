"""One reading of a Hugging Face config.json (issue 32, class 1): the model shardwise plans
and trains is the model transformers builds from the same file, or the file is refused in one
line naming the field.

References: transformers 5.24's own config classes (every field their `to_dict()` writes is
read, fixed or ignored in `arch.HF_FIELDS`) and models (the parameter count of the model
transformers builds, on the meta device, equals shardwise's count; BLOOM's embedding
LayerNorm, 2h, is the one documented omission).
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.arch import HF_FIELDS, SUPPORTED_HF_TYPES, from_hf_dict
from shardwise.errors import ShardwiseError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# model_type → (config class, model class, the config's dimension keyword names)
HF = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "bloom": ("BloomConfig", "BloomForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
}
NOT_COUNTED = {"bloom": lambda h: 2 * h}  # the LayerNorm after BLOOM's embedding


@st.composite
def hf_configs(draw, kinds=tuple(HF)):
    """(model_type, a small transformers config of that type) with drawn dimensions."""
    kind = draw(st.sampled_from(kinds))
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    hidden = heads * draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(1, 3))
    vocab = draw(st.integers(16, 300))
    tied = draw(st.booleans())
    ff = draw(st.sampled_from([32, 48, 96]))
    mla = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
               intermediate_size=ff, num_hidden_layers=layers, vocab_size=vocab,
               tie_word_embeddings=tied, kv_lora_rank=8, q_lora_rank=draw(st.sampled_from(
                   [None, 8])), qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               n_shared_experts=draw(st.integers(0, 1)),
               first_k_dense_replace=draw(st.integers(0, layers)))
    kw = {
        "llama": dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=ff, num_hidden_layers=layers, vocab_size=vocab,
                      tie_word_embeddings=tied, attention_bias=draw(st.booleans()),
                      head_dim=draw(st.sampled_from([None, 8, 16]))),
        "mistral": dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                        intermediate_size=ff, num_hidden_layers=layers, vocab_size=vocab,
                        tie_word_embeddings=tied, sliding_window=None),
        "mixtral": dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                        intermediate_size=ff, num_hidden_layers=layers, vocab_size=vocab,
                        tie_word_embeddings=tied, num_local_experts=draw(st.integers(2, 4)),
                        num_experts_per_tok=2, router_jitter_noise=0.0),
        "qwen2": dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=ff, num_hidden_layers=layers, vocab_size=vocab,
                      tie_word_embeddings=tied),
        "gpt2": dict(n_embd=hidden, n_head=heads, n_layer=layers, vocab_size=vocab,
                     n_positions=draw(st.integers(8, 64)), tie_word_embeddings=tied,
                     n_inner=draw(st.sampled_from([None, ff]))),
        "gpt_neox": dict(hidden_size=hidden, num_attention_heads=heads, intermediate_size=ff,
                         num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=tied),
        "bloom": dict(hidden_size=hidden, n_head=heads, n_layer=layers, vocab_size=vocab,
                      tie_word_embeddings=tied),
        "deepseek_v3": dict(mla, n_group=2, topk_group=1, num_nextn_predict_layers=0),
        "deepseek_v2": dict(mla, topk_method=draw(st.sampled_from(
            ["greedy", "group_limited_greedy"])), n_group=2, topk_group=1),
    }[kind]
    return kind, getattr(transformers, HF[kind][0])(**kw)


def as_file(config) -> dict:
    """The config as its config.json holds it: every field, through JSON."""
    return json.loads(json.dumps(config.to_dict()))


def hf_parameters(kind: str, config) -> int:
    with torch.device("meta"):
        model = getattr(transformers, HF[kind][1])(config)
    return sum(p.numel() for p in model.parameters())


# the newer types, each counted against transformers in tests/test_model_types.py
NEWER = {"qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3",
         "gpt_oss", "llama4_text", "glm4_moe"}


def test_every_supported_type_has_a_field_table():
    assert set(HF_FIELDS) == set(SUPPORTED_HF_TYPES) == set(HF) | NEWER


@settings(max_examples=25, deadline=None)
@given(case=hf_configs())
def test_the_model_counted_is_the_model_transformers_builds(case):
    """Every field transformers writes is known, and the count is transformers' count."""
    kind, config = case
    spec = from_hf_dict(as_file(config), kind)
    omitted = NOT_COUNTED.get(kind, lambda h: 0)(spec.d_model)
    assert spec.count_params().total + omitted == hf_parameters(kind, config)
    assert spec.tie_embeddings == config.tie_word_embeddings


def _one_line(call, *fragments: str) -> str:
    with pytest.raises(ShardwiseError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


@settings(max_examples=25, deadline=None)
@given(case=hf_configs(), data=st.data())
def test_a_field_is_read_fixed_ignored_or_refused(case, data):
    """Changing a field: an ignored one changes nothing; a fixed one to another value is
    refused naming it; a read one changes the model or is refused; an unknown one is refused
    naming it. Never: a changed file read as the same model without a word."""
    kind, config = case
    cfg = as_file(config)
    base = from_hf_dict(cfg, kind)
    table = HF_FIELDS[kind]
    key = data.draw(st.sampled_from(sorted(cfg)), label="field")
    if key in table.fixed:
        values, _ = table.fixed[key]
        other = data.draw(st.sampled_from([v for v in ("gelu", 0.1, True, False, 2, None)
                                           if not any(v == w and type(v) is type(w)
                                                      for w in values)]))
        _one_line(lambda: from_hf_dict(cfg | {key: other}, kind), key)
    elif key in table.read and isinstance(cfg[key], int) and not isinstance(cfg[key], bool):
        bigger = cfg | {key: cfg[key] * 2}
        try:
            changed = from_hf_dict(bigger, kind)
        except ShardwiseError as exc:
            assert "\n" not in str(exc)
        else:
            assert changed != base, key
    elif key not in table.read and key != "model_type":  # ignored: any value, the same model
        assert from_hf_dict(cfg | {key: "anything"}, kind) == base
    unknown = data.draw(st.text("abcdefghij_", min_size=3, max_size=12), label="unknown")
    if unknown not in cfg and unknown not in table.read and unknown not in table.ignored \
            and unknown not in table.fixed and not unknown.startswith("_"):
        from shardwise.arch import _HF_IGNORED

        if unknown not in _HF_IGNORED:
            _one_line(lambda: from_hf_dict(cfg | {unknown: 1}, kind), repr(unknown))


JSON_JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=5),
                      st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 2**45),
                      st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                           st.integers(),
                                                                           max_size=2))


@settings(max_examples=60, deadline=None)
@given(case=hf_configs(), data=st.data(), junk=JSON_JUNK)
def test_any_value_of_any_field_is_a_model_or_one_line(case, data, junk):
    """A field of the wrong type or out of range ("false" for a boolean, NaN, 2^45 layers,
    a list…): `ShardwiseError` in one line or a valid model, never another exception."""
    kind, config = case
    cfg = as_file(config)
    key = data.draw(st.sampled_from(sorted(cfg)), label="field")
    try:
        spec = from_hf_dict(cfg | {key: junk}, kind)
    except ShardwiseError as exc:
        assert "\n" not in str(exc)
        return
    assert spec.validate() is spec
    assert all(math.isfinite(x) for x in (spec.norm_eps, spec.rope_theta))
    if key == "tie_word_embeddings":
        assert junk is None or isinstance(junk, bool)


@pytest.mark.parametrize(("change", "fragment"), [
    ({"model_type": "qwen2_moe", "num_experts": 60, "moe_intermediate_size": 1408,
      "shared_expert_intermediate_size": 5632}, "unsupported model_type 'qwen2_moe'"),
    ({"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported'),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"quantization_config": {"bits": 4}}, "'quantization_config' is not one shardwise knows"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number"),
    ({"num_hidden_layers": 10**12}, "n_layers must be an integer in [1, 100,000]"),
])
def test_the_issue_examples_are_one_line(change, fragment):
    base = as_file(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                            intermediate_size=96, num_hidden_layers=2,
                                            vocab_size=256))
    _one_line(lambda: from_hf_dict(base | change, "x"), fragment)


@settings(max_examples=20, deadline=None)
@given(window=st.integers(1, 64), seq=st.integers(1, 128),
       kind=st.sampled_from(["mistral", "mixtral", "qwen2"]))
def test_a_sliding_window_is_never_refused(window, seq, kind):
    """The runtime attends within the window at any sequence length (its core masks the band,
    `ops.attention.window_bias`; against transformers: tests/runtime/test_gemma3.py)."""
    extra = ({"use_sliding_window": True, "max_window_layers": 0, "layer_types": None}
             if kind == "qwen2" else {})
    config = getattr(transformers, HF[kind][0])(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=2, vocab_size=256, sliding_window=window, **extra)
    spec = from_hf_dict(as_file(config), kind)
    assert spec.sliding_window == window and spec.seq_problems(seq) == []
