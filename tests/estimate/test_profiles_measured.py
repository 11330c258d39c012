"""Implementation profiles against the real code, measured on CPU.

Hugging Face transformers' Llama/Mistral/Qwen2 decoder layers (and torchtitan's Llama 3 block) are
built from config objects — no hub — run forward under autograd's saved-tensor hooks, and every
storage they save is counted once (`runtime.measure.saved_bytes_per_layer`: parameters and
buffers excluded, a storage two layers save charged to the first). Two layers are stacked and
the second is compared: the RoPE cos/sin tables are computed once per forward and kept by every
layer, so the first layer carries them (a per-model item, not a per-layer one).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardwise.arch import from_hf_config  # noqa: E402
from shardwise.estimate.profiles import saved_tensors  # noqa: E402
from shardwise.runtime.measure import saved_bytes_per_layer  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BYTES = {"bf16": 2, "fp32": 4}

# (hidden, heads, kv heads, ffn, seq, batch, dtype): GQA and MHA, two sequence lengths.
SHAPES = [
    (256, 8, 2, 688, 128, 2, "bf16"),   # GQA
    (192, 6, 6, 512, 256, 1, "fp32"),   # MHA
    (128, 4, 1, 352, 512, 1, "bf16"),   # GQA, longer sequence
]


def _hf_layers(family: str, shape: tuple, attention: str, tmp_path):
    h, a, kv, f, s, b, dtype = shape
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config}[family]
    config = config_cls(hidden_size=h, num_attention_heads=a, num_key_value_heads=kv,
                        intermediate_size=f, num_hidden_layers=2, vocab_size=64,
                        max_position_embeddings=max(s, 4096), attn_implementation=attention)
    config.save_pretrained(tmp_path)  # shardwise reads the same config.json a user has
    model_cls = {"llama": transformers.LlamaModel, "mistral": transformers.MistralModel,
                 "qwen2": transformers.Qwen2Model}[family]
    torch.manual_seed(0)
    model = model_cls(config).to(DTYPES[dtype]).train()
    ids = torch.randint(0, 64, (b, s))
    measured = saved_bytes_per_layer(model, list(model.layers), lambda: model(input_ids=ids))
    spec = from_hf_config(tmp_path / "config.json")
    return spec, measured


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa-bf16", "mha-fp32", "gqa-long-bf16"])
@pytest.mark.parametrize(("attention", "impl"), [("sdpa", "hf-sdpa"), ("eager", "hf-eager")])
def test_hf_llama_layer_within_1pc(shape, attention, impl, tmp_path):
    spec, measured = _hf_layers("llama", shape, attention, tmp_path)
    h, a, _, _, s, b, dtype = shape
    predicted = sum(saved_tensors(impl, spec, s, b, dtype_bytes_=BYTES[dtype]).values())
    assert measured[1] == pytest.approx(predicted, rel=0.01)
    # The first layer also holds the shared RoPE tables, (b, s, d) cos and sin.
    tables = 2 * b * s * (h // a) * BYTES[dtype]
    assert measured[0] == pytest.approx(predicted + tables, rel=0.01)
    # and the shardwise count is not what HF keeps (the point)
    shardwise = sum(saved_tensors("shardwise", spec, s, b, flash=attention == "sdpa",
                                  dtype_bytes_=BYTES[dtype]).values())
    assert measured[1] > 1.1 * shardwise


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_hf_mistral_qwen2_layers_match_hf_sdpa(family, tmp_path):
    shape = SHAPES[0]
    spec, measured = _hf_layers(family, shape, "sdpa", tmp_path)
    *_, s, b, dtype = shape
    predicted = sum(saved_tensors("hf-sdpa", spec, s, b, dtype_bytes_=BYTES[dtype]).values())
    assert measured[1] == pytest.approx(predicted, rel=0.01)


def test_hf_mixtral_moe_layer(tmp_path):
    """Mixtral's sparse MoE block: router probabilities (fp32), its indices and weights, and
    per routed copy the expert input, the fused gate/up output, act(gate), the product and the
    expert output — the routing is data-dependent but every token has exactly k copies."""
    h, a, kv, f, s, b = 128, 4, 2, 256, 128, 2
    config = transformers.MixtralConfig(
        hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, intermediate_size=f,
        num_hidden_layers=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=2,
        attn_implementation="sdpa")
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = transformers.MixtralModel(config).to(torch.bfloat16).train()
    ids = torch.randint(0, 64, (b, s))
    measured = saved_bytes_per_layer(model, list(model.layers), lambda: model(input_ids=ids))
    spec = from_hf_config(tmp_path / "config.json")
    predicted = sum(saved_tensors("hf-sdpa", spec, s, b, dtype_bytes_=2, moe=True).values())
    assert measured[1] == pytest.approx(predicted, rel=0.01)


def test_hf_attention_dropout_keeps_mask_and_output(tmp_path):
    """Eager attention with attention_dropout > 0 keeps the 1-byte mask and the dropped-out
    probabilities instead of the cast (the profile's `model.dropout` branch)."""
    h, a, kv, f, s, b = 128, 4, 2, 352, 128, 1
    config = transformers.LlamaConfig(
        hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, intermediate_size=f,
        num_hidden_layers=2, vocab_size=64, attention_dropout=0.1, attn_implementation="eager")
    config.save_pretrained(tmp_path)
    model = transformers.LlamaModel(config).to(torch.bfloat16).train()
    ids = torch.randint(0, 64, (b, s))
    measured = saved_bytes_per_layer(model, list(model.layers), lambda: model(input_ids=ids))
    # shardwise's config.json reader does not map attention_dropout; say it here
    spec = dataclasses.replace(from_hf_config(tmp_path / "config.json"), dropout=True)
    saved = saved_tensors("hf-eager", spec, s, b, dtype_bytes_=2)
    scores = a * s * s * b
    assert saved["attention_dropout_mask"] == scores  # CUDA's native_dropout: a bool mask
    # On CPU torch's dropout is `input * noise` (aten `_dropout_impl`), its mask in bf16.
    predicted = sum(saved.values()) + scores * (2 - 1)
    assert measured[1] == pytest.approx(predicted, rel=0.01)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=["gqa-bf16", "mha-fp32"])
def test_torchtitan_llama3_block(shape, monkeypatch):
    """torchtitan 0.3.0's Llama 3 block (fused QKV, complex RoPE, nn.RMSNorm, SwiGLU) measured
    with its FlexAttention core run as SDPA: torch 2.13 has no FlexAttention backward on CPU.
    SDPA's fused kernel keeps q, k, v, out and the log-sum-exp; FlexAttention's autograd op
    keeps those and the fp32 row maxima (torch/_higher_order_ops/flex_attention.py), which the
    profile adds as `flex_max_scores` — taken out here."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import _build_llama3_layers

    from shardwise.arch import ModelSpec

    def sdpa(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kw):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            scale=scale, enable_gqa=enable_gqa)  # (B, N, L, H) → back to (B, L, N, H)
        return out.transpose(1, 2)

    monkeypatch.setattr(FlexAttention, "forward", sdpa)
    h, a, kv, f, s, b, dtype = shape
    configs = _build_llama3_layers(
        n_layers=2, dim=h, n_heads=a, n_kv_heads=kv, hidden_dim=f, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=h // a, max_seq_len=4096, theta=500000))
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(config.build() for config in configs).train()
    for block in blocks:
        for module in block.modules():
            if hasattr(module, "_init_self_buffers"):  # the RoPE cache (complex, kept fp32)
                module._init_self_buffers(buffer_device=torch.device("cpu"))
        for p in block.parameters():
            p.data = p.data.to(DTYPES[dtype])
    x = torch.randn(b, s, h, dtype=DTYPES[dtype], requires_grad=True)

    def run():
        y = x
        for block in blocks:
            y = block(y, None)

    measured = saved_bytes_per_layer(blocks, list(blocks), run)
    spec = ModelSpec("tt-small", 2, h, a, kv, f, 64)
    saved = saved_tensors("torchtitan", spec, s, b, dtype_bytes_=BYTES[dtype])
    assert saved["flex_max_scores"] == a * s * b * 4
    predicted = sum(saved.values()) - saved["flex_max_scores"]
    assert measured[1] == pytest.approx(predicted, rel=0.01)
