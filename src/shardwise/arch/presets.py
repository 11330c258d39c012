"""The preset models (`PRESETS`, each with its source) and `get_model`: a preset by name or a
Hugging Face `config.json` on disk."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from shardwise.arch.hf import from_hf_config
from shardwise.arch.spec import ModelSpec
from shardwise.errors import ShardwiseError


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """GPT-3 family, Brown et al. 2020 Table 2.1: f = 4h, V = 50257, learned positions 2048,
    tied embeddings, LayerNorm, GELU."""
    return ModelSpec(
        name, layers, hidden, heads, heads, 4 * hidden, 50257, gated_mlp=False,
        tie_embeddings=True, norm="layernorm", dropout=True, learned_positions=2048, max_seq=2048,
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ff: int, vocab: int,
           max_seq: int, n_experts: int = 0, top_k: int = 0, **extra: Any) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv, ff, vocab, max_seq=max_seq,
                     n_experts=n_experts, top_k=top_k, **extra)


def _deepseek(name: str, layers: int, hidden: int, heads: int, ff: int, vocab: int,
              **extra: Any) -> ModelSpec:
    """DeepSeek-V2/V3 family: MLA (`kv_lora_rank` 512, `d_nope` 128, `d_R` 64, `d_v` 128),
    DeepSeekMoE, RMSNorm ε 1e-6, RoPE on interleaved pairs, untied embeddings."""
    return ModelSpec(name, layers, hidden, heads, heads, ff, vocab, norm_eps=1e-6,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, rope_interleave=True, **extra)


# YaRN context extension of the DeepSeek checkpoints' config.json ("rope_scaling"):
# deepseek-ai/DeepSeek-V3 (mscale 1.0) and DeepSeek-V2-Lite (mscale 0.707); both pre-trained at
# 4K tokens, extended to 128K / 32K (DeepSeek-V3 §4.3, DeepSeek-V2 §3.1.3).
def _deepseek_yarn(mscale: float) -> tuple[tuple[str, Any], ...]:
    return (("beta_fast", 32), ("beta_slow", 1), ("factor", 40), ("mscale", mscale),
            ("mscale_all_dim", mscale), ("original_max_position_embeddings", 4096),
            ("rope_type", "yarn"))


# Llama 3.1's RoPE scaling (meta-llama/Llama-3.1-405B config.json, "rope_scaling").
_LLAMA31_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                 ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt3("gpt3-125m", 12, 768, 12),
        _gpt3("gpt3-350m", 24, 1024, 16),
        _gpt3("gpt3-1.3b", 24, 2048, 16),
        _gpt3("gpt3-2.7b", 32, 2560, 32),
        _gpt3("gpt3-6.7b", 32, 4096, 32),
        # Brown et al. 2020 print d_model = 5140 for 13B, a typo: 40 heads × d_head 128 = 5120
        # (the paper lists d_head = 128; 5140 is not divisible by 40).
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        # Touvron et al. 2023 (Llama 2), Table 1 / model cards.
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        # Llama 3 herd paper (Dubey et al. 2024), Table 3.
        # rope_theta 500000, rms_norm_eps 1e-5 (meta-llama/Meta-Llama-3-8B config.json);
        # the 405B exists only as Llama 3.1, with its "llama3" RoPE scaling.
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=5e5),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=5e5),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, rope_theta=5e5,
               rope_scaling=_LLAMA31_ROPE),
        # Nemotron-4 340B (NVIDIA 2024, arXiv:2406.11704, Table 1; NeMo's nemotron4_340b
        # config): LayerNorm, squared-ReLU MLP (not gated, 4.0·h wide), RoPE, no biases, GQA with
        # 8 KV groups, untied embeddings, 256k vocabulary, s = 4096.
        ModelSpec("nemotron4-340b", 96, 18432, 96, 8, 73728, 256000, gated_mlp=False,
                  norm="layernorm", max_seq=4096),
        # Mistral / Mixtral config.json on the Hugging Face hub: Mistral-7B-v0.1 rope_theta
        # 10000, rms_norm_eps 1e-5; Mixtral-8x7B-v0.1 and 8x22B-v0.1 rope_theta 1e6, eps 1e-5.
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
        _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, n_experts=8, top_k=2,
               rope_theta=1e6),
        _llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 65536, n_experts=8, top_k=2,
               rope_theta=1e6),
        # Qwen2.5 config.json (untied embeddings for 7B and 72B): rope_theta 1e6,
        # rms_norm_eps 1e-6, Q/K/V biases (Qwen2Attention: bias=True on q/k/v_proj).
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768, rope_theta=1e6,
               norm_eps=1e-6, qkv_bias=True),
        _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 32768, rope_theta=1e6,
               norm_eps=1e-6, qkv_bias=True),
        # DeepSeek-V3 (arXiv:2412.19437 §4.2; deepseek-ai/DeepSeek-V3 config.json, whose sizes
        # are transformers 5.24's DeepseekV3Config defaults): 61 layers, the first 3 dense
        # (f 18432), then 1 shared + 256 routed experts (f 2048), 8 routed per token from 4 of
        # 8 groups, sigmoid scores, gates renormalised × 2.5; q latent 1536; one MTP module.
        _deepseek("deepseek-v3", 61, 7168, 128, 18432, 129280, max_seq=163840,
                  rope_scaling=_deepseek_yarn(1.0), q_lora_rank=1536, n_experts=256,
                  top_k=8, d_ff_expert=2048, n_shared_experts=1, first_dense_layers=3,
                  router_score="sigmoid", routed_scaling=2.5, expert_groups=8, topk_groups=4,
                  mtp_layers=1),
        # DeepSeek-V2-Lite (arXiv:2405.04434 Appendix B; deepseek-ai/DeepSeek-V2-Lite
        # config.json): no q latent, the first layer dense (f 10944), 2 shared + 64 routed
        # experts (f 1408), 6 per token, softmax scores, gates not renormalised.
        _deepseek("deepseek-v2-lite", 27, 2048, 16, 10944, 102400, max_seq=163840,
                  rope_scaling=_deepseek_yarn(0.707), n_experts=64, top_k=6, d_ff_expert=1408,
                  n_shared_experts=2, first_dense_layers=1, norm_topk=False),
        # Small models for the executable runtime.
        _llama("tiny", 4, 64, 4, 2, 128, 256, 64),
        _llama("tiny-moe", 4, 64, 4, 2, 128, 256, 64, n_experts=4, top_k=2),
        # DeepSeek-V3's structure, small: MLA with a q latent and V narrower than Q/K, one
        # dense layer, a shared expert, sigmoid routing in groups with gates scaled.
        ModelSpec("tiny-deepseek", 3, 64, 4, 4, 128, 256, max_seq=64, norm_eps=1e-6,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, rope_interleave=True, n_experts=8, top_k=2, d_ff_expert=32,
                  n_shared_experts=1, first_dense_layers=1, router_score="sigmoid",
                  routed_scaling=2.5, expert_groups=2, topk_groups=1),
    )
}

DEFAULT_MODEL = "llama3-8b"


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive) or a Hugging Face `config.json` on disk."""
    if not isinstance(name_or_path, str | Path):
        raise ShardwiseError(f"model must be a preset name or a config.json path, got "
                             f"{name_or_path!r} (see `shardwise models`)")
    key = str(name_or_path).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        return from_hf_config(path)
    close = difflib.get_close_matches(key, list(PRESETS), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ShardwiseError(
        f"unknown model {name_or_path!r}{hint} (see `shardwise models`, or pass a config.json)"
    )
