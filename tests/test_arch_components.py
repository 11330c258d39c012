"""`count_params` component by component (attention, MLP total and active, norms, embedding,
head) against transformers 5.24's own model built on the meta device from the same
config.json, read through `from_hf_dict` (what a user's file goes through). Non-degenerate:
MLA with a query latent and d_v ≠ d_nope ≠ d_R, two shared experts, a dense first layer,
grouped routing; MLA without a query latent (DeepSeek-V2-Lite's form); GQA with QKV biases
and a head_dim ≠ h/a with tied embeddings; learned positions with LayerNorm and biases.
The active count: the total less the routed experts a token skips, (E − k) experts per MoE
layer, each expert's size read from transformers' expert tensors.
"""

from __future__ import annotations

import json

import pytest

from shardwise.arch import from_hf_dict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
CASES = {
    "deepseek_v3": ("DeepseekV3Config", {
        "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 112,
        "moe_intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 40, "kv_lora_rank": 20, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "vocab_size": 300, "tie_word_embeddings": False}),
    "deepseek_v2": ("DeepseekV2Config", {
        "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 112,
        "moe_intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 20, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "vocab_size": 300, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128,
                            "vocab_size": 300}),
}


def _built(kind: str):
    """(transformers' model on the meta device, the config.json its config class writes)."""
    cls, fields = CASES[kind]
    config = getattr(transformers, cls)(**fields, **_IDS)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model, json.loads(config.to_json_string(use_diff=False))


def _component(name: str) -> str:
    """Which `ParamCount` field a transformers parameter belongs to, by its module path."""
    if "norm" in name or ".ln_" in name or name.startswith("transformer.ln_f"):
        return "norms"
    if "embed_tokens" in name or name.startswith(("transformer.wte", "transformer.wpe")):
        return "embedding"
    if name.startswith("lm_head"):
        return "head"
    if ".self_attn." in name or ".attn." in name:
        return "attention"
    assert ".mlp." in name, name
    return "mlp"


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_component_is_transformers_own(kind):
    model, saved = _built(kind)
    spec = from_hf_dict(saved, kind)
    ours = spec.count_params()
    theirs = dict.fromkeys(("attention", "mlp", "norms", "embedding", "head"), 0)
    for name, p in model.named_parameters():  # tied tables once
        theirs[_component(name)] += p.numel()
    assert {k: getattr(ours, k) for k in theirs} == theirs
    assert ours.total == sum(p.numel() for p in model.parameters())
    # active: each MoE layer uses k of its E routed experts (shared ones always)
    routed = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    skipped = 0
    for experts in routed:
        per_expert = sum(p.numel() for p in experts.parameters()) // saved["n_routed_experts"]
        skipped += (saved["n_routed_experts"] - saved["num_experts_per_tok"]) * per_expert
    assert len(routed) == spec.n_moe_layers
    assert ours.active == ours.total - skipped
    assert (skipped > 0) == kind.startswith("deepseek")
