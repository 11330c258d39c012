"""Tiny Gemma 3 and gpt-oss models built by transformers' own config and model classes, in
float64 with HF's float32 islands removed, for the runtime's tests against them
(test_gemma3.py, test_gpt_oss.py).

The islands (transformers 5.24): `Gemma3RMSNorm` / `GptOssRMSNorm` compute in `x.float()`;
both rotary modules compute their inverse frequencies and angles in float32; Gemma's
embedding scale √h is a float32 buffer. Each is replaced by the same formula in float64 (the
inverse frequencies by HF's own RoPE functions — default, linear, YaRN — run with
`torch.float` meaning float64); nothing else of HF's code changes.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import transformers
from transformers import modeling_rope_utils

SEQ = 12  # longer than WINDOW: the sliding layers' window bites
WINDOW = 4
GEMMA = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
             sliding_window_pattern=2, query_pre_attn_scalar=12, rms_norm_eps=1e-6,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                 "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 1e4}})
# swiglu_limit 1: the clamps bite on random weights; YaRN with a small original context
OSS = dict(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
           num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0, rms_norm_eps=1e-5,
           rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 16})


class _F64:
    def __getattr__(self, name: str):
        return torch.float64 if name in ("float", "float32") else getattr(torch, name)


def _norm_forward(self, x):  # Gemma3RMSNorm / GptOssRMSNorm in the input dtype
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps_)
    return out * (1.0 + self.weight) if self.gemma_ else self.weight * out


def hf_model(kind: str, seed: int = 0):
    """The HF model (float64, islands removed), its norms, biases and sinks randomised."""
    if kind == "gemma3_text":
        config = transformers.Gemma3TextConfig(**GEMMA, attn_implementation="sdpa")
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.GptOssConfig(**OSS, attn_implementation="eager",
                                           experts_implementation="eager")
        cls = transformers.GptOssForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif "experts" in name or "router" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    _fp64_islands(model, kind)
    return model


def _fp64_islands(model, kind: str) -> None:
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.eps_ = getattr(module, "eps", getattr(module, "variance_epsilon", None))
            module.gemma_ = name.startswith("Gemma")
            module.forward = _norm_forward.__get__(module)
    config, rotary = model.config, model.model.rotary_emb
    patch = pytest.MonkeyPatch()
    for module in (modeling_rope_utils, sys.modules[type(rotary).__module__]):
        patch.setattr(module, "torch", _F64())  # HF's own RoPE code, `torch.float` → float64
    try:
        if kind == "gemma3_text":
            model.model.embed_tokens.embed_scale = torch.tensor(math.sqrt(config.hidden_size),
                                                                dtype=torch.float64)
            tables = {}
            for layer_type, params in config.rope_parameters.items():
                init = (rotary.compute_default_rope_parameters
                        if params["rope_type"] == "default"
                        else modeling_rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]])
                tables[layer_type] = init(config, None, layer_type=layer_type)
        else:
            tables = {None: modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config)}
    finally:
        patch.undo()
    assert all(inv.dtype == torch.float64 for inv, _ in tables.values())

    def rotary_forward(x, position_ids, layer_type=None):  # HF's formula, float64 angles
        inv_freq, scale = tables[layer_type]
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        if kind == "gemma3_text":  # gpt-oss rotates halves: cos, sin (…, d/2)
            freqs = torch.cat((freqs, freqs), dim=-1)
        return (freqs.cos() * scale).to(x.dtype), (freqs.sin() * scale).to(x.dtype)

    rotary.forward = rotary_forward


def tokens(seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 300, (batch, SEQ), generator=torch.Generator().manual_seed(seed))
