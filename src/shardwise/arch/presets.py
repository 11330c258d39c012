"""The preset models (`PRESETS`, each with its source) and `get_model`: a preset by name or a
Hugging Face `config.json` on disk."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from shardwise.arch.hf import from_hf_config, from_hf_dict
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


# The config.json values each hub preset is read from (`_hub`): tests build transformers'
# own model from them on the meta device and compare the parameter count.
HUB_CONFIGS: dict[str, dict[str, Any]] = {}


def _hub(name: str, kind: str, **fields: Any) -> ModelSpec:
    """A preset as its Hugging Face config.json reads (`fields`: the checkpoint's values of
    the fields that differ from transformers 5.24's defaults for `kind`), through the same
    reader as a user's file."""
    HUB_CONFIGS[name] = {"model_type": kind, **fields}
    return from_hf_dict(HUB_CONFIGS[name], name, f"preset {name}")


_QWEN3 = {"head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": 151936,
          "max_position_embeddings": 40960, "tie_word_embeddings": False}
# Each hub preset below was checked field by field against its published config.json as
# vendored verbatim by the repository named (path, commit) beside it; HUB_CONFIGS' counts
# equal transformers 5.24's model on the meta device (tests/test_presets.py).
# AIC: ai-dynamo/aiconfigurator at commit 095f58a, aic-core/src/aiconfigurator_core/model_configs
_NEWER = (
    # Qwen/Qwen3-235B-A22B, Qwen3-30B-A3B, Qwen3-8B config.json (AIC/Qwen--Qwen3-235B-
    # A22B_config.json, Qwen--Qwen3-30B-A3B_config.json, Qwen--Qwen3-8B_config.json): QK-norm,
    # head_dim 128, every layer MoE (decoder_sparse_step 1, mlp_only_layers []), no shared
    # expert, top-k gates renormalised, untied, 40960 positions, θ 1e6 (the 2507 releases:
    # θ 5e6/1e7, 262144 positions).
    _hub("qwen3-235b-a22b", "qwen3_moe", **_QWEN3, num_hidden_layers=94, hidden_size=4096,
         num_attention_heads=64, num_key_value_heads=4, intermediate_size=12288,
         moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
         norm_topk_prob=True),
    _hub("qwen3-30b-a3b", "qwen3_moe", **_QWEN3, num_hidden_layers=48, hidden_size=2048,
         num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144,
         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
         norm_topk_prob=True),
    _hub("qwen3-8b", "qwen3", **_QWEN3, num_hidden_layers=36, hidden_size=4096,
         num_attention_heads=32, num_key_value_heads=8, intermediate_size=12288),
    # moonshotai/Kimi-K2-Base config.json (the Instruct release's, same architecture:
    # AIC/moonshotai--Kimi-K2-Instruct_config.json): DeepSeek-V3's architecture (model_type
    # deepseek_v3) with 64 heads, 384 routed + 1 shared experts (8 per token, one group),
    # one dense layer, gates × 2.827, vocabulary 163840, RoPE θ 50000 with YaRN ×32, no MTP
    # module in the release. Kimi K2's tech report (arXiv:2507.20534) gives 1.04 T total and
    # 32 B activated; transformers' DeepseekV3ForCausalLM on these values holds 1.026 T.
    _hub("kimi-k2", "deepseek_v3", num_hidden_layers=61, hidden_size=7168,
         intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64,
         num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1,
         num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
         routed_scaling_factor=2.827, vocab_size=163840, num_nextn_predict_layers=0,
         max_position_embeddings=131072, rms_norm_eps=1e-6,
         rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                       "mscale": 1.0, "mscale_all_dim": 1.0,
                       "original_max_position_embeddings": 4096}, rope_theta=50000.0),
    # google/gemma-3-27b-pt's text_config (quoted as the hub writes it in NVIDIA/TensorRT-LLM
    # @fe6fa01 tests/unittest/_torch/modeling/test_modeling_gemma3.py GEMMA3_27B_CONFIG; the
    # fields it omits are Gemma3TextConfig's defaults: vocabulary 262208, θ 1e6 global / 1e4
    # local, 131072 positions): 62 layers, 5 sliding (window 1024) then 1 global, QK-norm,
    # sandwich norms, GeGLU, scores × 168^-½, global RoPE with linear ×8.
    _hub("gemma3-27b", "gemma3_text", num_hidden_layers=62, hidden_size=5376,
         num_attention_heads=32, num_key_value_heads=16, head_dim=128,
         intermediate_size=21504, vocab_size=262208, sliding_window=1024,
         sliding_window_pattern=6, query_pre_attn_scalar=168,
         rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6,
         rope_local_base_freq=10000.0),
    # google/gemma-2-27b config.json (AI-Hypercomputer/maxtext@14b30db src/MaxText/utils/
    # ckpt_conversion/utils/hf_model_configs.py gemma2_27b_config): alternating sliding
    # (4096) and global layers, score and logit soft-capping (50, 30), scores × 144^-½.
    _hub("gemma2-27b", "gemma2", num_hidden_layers=46, hidden_size=4608,
         num_attention_heads=32, num_key_value_heads=16, head_dim=128,
         intermediate_size=36864, vocab_size=256000, sliding_window=4096,
         query_pre_attn_scalar=144),
    # openai/gpt-oss-120b config.json (AIC/openai--gpt-oss-120b_config.json; maxtext
    # @14b30db hf_model_configs.py gpt_oss_120b_dict; the rest are GptOssConfig's defaults:
    # YaRN ×32 over θ 150000 from 4096, swiglu_limit 7, attention biases): 36 layers
    # alternating a 128-token window and full attention, sinks, 128 experts (4 per token).
    _hub("gpt-oss-120b", "gpt_oss", num_hidden_layers=36, hidden_size=2880,
         num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
         num_local_experts=128, num_experts_per_tok=4, vocab_size=201088, sliding_window=128),
    # openai/gpt-oss-20b config.json (AIC/openai--gpt-oss-20b_config.json): gpt-oss-120b's
    # blocks, 24 layers, 32 experts.
    _hub("gpt-oss-20b", "gpt_oss", num_hidden_layers=24, hidden_size=2880,
         num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
         num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, sliding_window=128),
    # meta-llama/Llama-4-Scout-17B-16E's text_config (AIC/meta-llama--Llama-4-Scout-17B-
    # 16E-Instruct_config.json; transformers 5.24's Llama4TextConfig defaults are Scout's
    # sizes): 16 experts (top-1) + a shared expert in every layer,
    # chunked attention (8192) with every 4th layer global and without RoPE.
    _hub("llama4-scout", "llama4_text", num_hidden_layers=48, hidden_size=5120,
         num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
         intermediate_size_mlp=16384, num_local_experts=16, num_experts_per_tok=1,
         interleave_moe_layer_step=1, vocab_size=202048, attention_chunk_size=8192,
         max_position_embeddings=10485760,
         rope_scaling={"rope_type": "llama3", "factor": 16.0, "high_freq_factor": 1.0,
                       "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
    # meta-llama/Llama-4-Maverick-17B-128E's text_config (AIC/meta-llama--Llama-4-Maverick-
    # 17B-128E-Instruct_config.json): Scout's blocks, 128 experts (top-1) + a shared expert in
    # every 2nd layer (the others dense, f 16384), no QK-norm, no RoPE scaling, 1M positions.
    _hub("llama4-maverick", "llama4_text", num_hidden_layers=48, hidden_size=5120,
         num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
         intermediate_size_mlp=16384, num_local_experts=128, num_experts_per_tok=1,
         interleave_moe_layer_step=2, vocab_size=202048, attention_chunk_size=8192,
         max_position_embeddings=1048576, use_qk_norm=False, rope_scaling=None),
    # microsoft/phi-4 config.json (model_type phi3): fused QKV and gate-up, no window. Not
    # found vendored in a citable repository; its sizes as quoted in third-party code agree.
    _hub("phi-4", "phi3", num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
         num_key_value_heads=10, intermediate_size=17920, vocab_size=100352,
         max_position_embeddings=16384, rope_theta=250000.0),
    # allenai/OLMo-2-0325-32B config.json (mlc-ai/mlc-llm@79d603f python/mlc_llm/model/
    # model_preset.py "olmo2_32b"): post-norm blocks, QK-norm over a·d and a_kv·d.
    _hub("olmo2-32b", "olmo2", num_hidden_layers=64, hidden_size=5120, num_attention_heads=40,
         num_key_value_heads=8, intermediate_size=27648, vocab_size=100352,
         max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-6),
    # ibm-granite/granite-3.3-8b-base config.json: Granite's four multipliers, tied. Not
    # found vendored in a citable repository; a granite 8B config.json quoted in third-party
    # notes (transformers 4.49.0) has these values.
    _hub("granite-3.3-8b", "granite", num_hidden_layers=40, hidden_size=4096,
         num_attention_heads=32, num_key_value_heads=8, intermediate_size=12800,
         vocab_size=49159, tie_word_embeddings=True, embedding_multiplier=12.0,
         residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
         max_position_embeddings=131072, rope_theta=10000000.0),
    # HuggingFaceTB/SmolLM3-3B config.json: every 4th layer without RoPE, tied. The config.json
    # itself not found in a citable repository; huggingface/blog@124475d smollm3.md states
    # tied embeddings, 4 KV groups, NoPE every 4th layer, θ raised to 5M for 64k positions.
    _hub("smollm3-3b", "smollm3", num_hidden_layers=36, hidden_size=2048,
         num_attention_heads=16, num_key_value_heads=4, intermediate_size=11008,
         vocab_size=128256, max_position_embeddings=65536, rope_theta=5000000.0),
    # zai-org/GLM-4.5 config.json: 92 layers (3 dense), 160 routed + 1 shared experts (8 per
    # token, sigmoid, × 2.5), head_dim 128 ≠ h/a, QK-norm, Q/K/V biases, RoPE on half of
    # each head, one MTP layer (the same sizes in Megatron-Bridge docs/models/llm/glm45.md
    # and THUDM/slime scripts/models/glm4.5-355B-A32B.sh; 355 B total, 32 B active).
    _hub("glm-4.5", "glm4_moe", num_hidden_layers=92, hidden_size=5120,
         num_attention_heads=96, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
         moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=1,
         num_experts_per_tok=8, first_k_dense_replace=3, routed_scaling_factor=2.5,
         vocab_size=151552, use_qk_norm=True, attention_bias=True,
         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                          "partial_rotary_factor": 0.5}),
)


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
        *_NEWER,
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
