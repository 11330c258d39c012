"""What shardwise does with each Hugging Face `config.json` field, one `HFFields` table per
model_type (`HF_FIELDS`): read, fixed to the one value implemented, or ignored (with why).
A new model_type adds its table here and its reader to `arch.hf.READERS`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shardwise.errors import ShardwiseError


@dataclass(frozen=True)
class HFFields:
    """What shardwise does with each `config.json` field of one model_type: `read` fields
    shape the `ModelSpec`; `fixed` ones must hold the one value shardwise implements (field →
    (the values, what another value would change)); `ignored` ones are known not to change
    what is trained or counted (field → why). Any other field is refused, naming it."""

    read: frozenset[str]
    fixed: dict[str, tuple[tuple[Any, ...], str]]
    ignored: dict[str, str]

    def check(self, cfg: dict[str, Any], where: str) -> None:
        kind = cfg.get("model_type")
        for key, value in cfg.items():
            if key in self.read or key in self.ignored or key in _HF_IGNORED:
                continue
            if key not in self.fixed:
                raise ShardwiseError(
                    f"config file {where!r}: field {key!r} is not one shardwise knows for "
                    f"model_type {kind!r} (it may change the model); remove it if it does "
                    "not (the fields known: shardwise.arch.HF_FIELDS)")
            values, why = self.fixed[key]
            if not any(_same_json(value, v) for v in values):
                shown = " or ".join(json.dumps(v) for v in values)
                raise ShardwiseError(f"config file {where!r}: {key}={json.dumps(value)} is not "
                                     f"supported ({why}); shardwise implements {key}={shown}")


def _same_json(value: Any, want: Any) -> bool:
    """Equal as JSON values: 0 and 0.0 alike, but false is not 0 and null only null."""
    return ((value is None) == (want is None) and isinstance(value, bool) == isinstance(
        want, bool) and value == want)


# Ignored in every model_type: what transformers' PretrainedConfig writes or pops without
# building anything from it (transformers 5.24 configuration_utils.py: the class attributes
# and `to_dict`; `__post_init__` pops torch_dtype, name_or_path, _commit_hash,
# attn/experts_implementation and every GenerationConfig default; older 4.x versions also
# wrote _attn_implementation_autoset, use_bfloat16, pruned_heads, tf_legacy_loss, ...).
# tests/test_arch.py compares the list with transformers'.
_WHY_BOOKKEEPING = "names, labels and the saved dtype: bookkeeping (the run's --dtype decides)"
_WHY_TOKENS = "token ids: the tokenizer's business"
_WHY_OUTPUTS = "inference and output switches"
_WHY_KERNELS = "which attention or experts kernel transformers runs: the same model"
_WHY_GENERATION = "generation settings (transformers moves them to GenerationConfig)"
HF_GENERATION_KEYS = (
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids",
    "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "encoder_repetition_penalty", "epsilon_cutoff",
    "eta_cutoff", "exponential_decay_length_penalty", "forced_bos_token_id",
    "forced_eos_token_id", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "suppress_tokens", "target_lookbehind", "temperature", "top_k",
    "top_p", "typical_p", "use_cache")
_HF_IGNORED: dict[str, str] = {
    **dict.fromkeys(("_name_or_path", "name_or_path", "_commit_hash", "architectures",
                     "auto_map", "transformers_version", "torch_dtype", "dtype", "use_bfloat16",
                     "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
                     "task_specific_params", "tokenizer_class", "prefix", "pruned_heads",
                     "tf_legacy_loss"), _WHY_BOOKKEEPING),
    **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                     "sep_token_id", "decoder_start_token_id"), _WHY_TOKENS),
    **dict.fromkeys(HF_GENERATION_KEYS, _WHY_GENERATION),
    **dict.fromkeys(("output_attentions", "_output_attentions", "output_hidden_states",
                     "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
                     "is_decoder", "torchscript", "tie_encoder_decoder"), _WHY_OUTPUTS),
    **dict.fromkeys(("_attn_implementation_autoset", "attn_implementation",
                     "_attn_implementation", "_attn_implementation_internal",
                     "experts_implementation", "_experts_implementation",
                     "_experts_implementation_internal"), _WHY_KERNELS),
    "initializer_range": "initialisation only: a run starts from the checkpoint's weights or "
                         "from the runtime's own (std 0.02)",
}
_LLAMA_READ = frozenset((
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings",
    "tie_word_embeddings", "rms_norm_eps", "head_dim", "rope_theta", "rope_scaling",
    "rope_parameters", "attention_dropout"))
_SILU = {"hidden_act": (("silu", "swish"), "the runtime's MLP is SwiGLU")}
_SAME_COUNTS = "the parameter and FLOP counts are the same (the runtime trains Llama-style only)"
_FUSION = "a fusion or numerics switch of Megatron-DeepSpeed: the same parameters and FLOPs"
_DEEPSEEK_READ = frozenset((
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "vocab_size",
    "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor",
    "attention_bias", "mlp_bias"))
_DEEPSEEK_FIXED = _SILU | {
    "moe_layer_freq": ((1,), "transformers makes every layer from first_k_dense_replace on "
                             "MoE (it does not read moe_layer_freq)"),
    "attention_dropout": ((0.0,), "attention dropout is not implemented with MLA")}
_DEEPSEEK_IGNORED = {
    "head_dim": "derived by transformers (qk_rope_head_dim)",
    "qk_head_dim": "derived by transformers (qk_nope_head_dim + qk_rope_head_dim)",
    "pretraining_tp": "transformers 5.24's DeepSeek models do not read it",
    "ep_size": "DeepSeek's own code's expert-parallel degree: a layout choice (--layout ep=…)",
    "quantization_config": "how the released weights are stored (FP8 blocks); the run's "
                           "--dtype and --fp8 decide how it trains",
    **dict.fromkeys(("aux_loss_alpha", "seq_aux", "output_router_logits"),
                    "the load-balancing loss weight is the run's --aux-loss-coef")}
HF_FIELDS: dict[str, HFFields] = {
    "llama": HFFields(
        _LLAMA_READ | {"attention_bias"},
        _SILU | {"mlp_bias": ((False,), "MLP biases are not implemented")},
        {"pretraining_tp": "transformers 5.24's LlamaModel does not read it"}),
    "mistral": HFFields(_LLAMA_READ | {"sliding_window"}, _SILU, {}),
    "mixtral": HFFields(
        _LLAMA_READ | {"sliding_window", "num_local_experts", "num_experts_per_tok"},
        _SILU | {"router_jitter_noise": ((0.0,), "router jitter is not implemented")},
        dict.fromkeys(("router_aux_loss_coef", "output_router_logits"),
                      "the load-balancing loss weight is the run's --aux-loss-coef")),
    "qwen2": HFFields(
        _LLAMA_READ | {"sliding_window", "use_sliding_window", "max_window_layers",
                       "layer_types"}, _SILU, {}),
    "gpt2": HFFields(
        frozenset(("model_type", "n_layer", "n_embd", "n_head", "n_inner", "vocab_size",
                   "n_positions", "resid_pdrop", "attn_pdrop", "embd_pdrop",
                   "tie_word_embeddings", "layer_norm_epsilon")),
        {"scale_attn_weights": ((True,), "attention scores are scaled by 1/√d"),
         "scale_attn_by_inverse_layer_idx": ((False,), "attention is not scaled by layer"),
         "add_cross_attention": ((False,), "the model is decoder-only")},
        {"activation_function": _SAME_COUNTS,
         "n_ctx": "an old name of n_positions that transformers no longer reads",
         "reorder_and_upcast_attn": "numerics of the attention product only",
         **dict.fromkeys(("summary_type", "summary_use_proj", "summary_activation",
                          "summary_proj_to_labels", "summary_first_dropout"),
                         "the sequence-classification head, not the language model")}),
    "gpt_neox": HFFields(
        frozenset(("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                   "intermediate_size", "vocab_size", "max_position_embeddings",
                   "tie_word_embeddings", "layer_norm_eps", "hidden_dropout",
                   "attention_dropout", "rope_theta", "rotary_emb_base", "rope_scaling",
                   "rope_parameters", "rotary_pct", "use_parallel_residual")),
        {"attention_bias": ((True,), "GPT-NeoX's MLP keeps its biases; biases on the MLP "
                                     "alone are not modelled")},
        {"hidden_act": _SAME_COUNTS, "classifier_dropout": "the classification head",
         "partial_rotary_factor": "transformers 5.24's GPTNeoXConfig does not read it at the "
                                  "top level (rotary_pct or rope_parameters)"}),
    "bloom": HFFields(
        frozenset(("model_type", "hidden_size", "n_embed", "n_layer", "num_hidden_layers",
                   "n_head", "num_attention_heads", "vocab_size", "seq_length",
                   "tie_word_embeddings", "hidden_dropout", "attention_dropout",
                   "layer_norm_epsilon")),
        {},
        {"n_inner": "transformers' BloomConfig does not read it (BLOOM's MLP is 4h)",
         "apply_residual_connection_post_layernorm": "the same parameters and FLOPs",
         **dict.fromkeys(("attention_softmax_in_fp32", "masked_softmax_fusion",
                          "bias_dropout_fusion", "skip_bias_add", "skip_bias_add_qkv",
                          "offset_alibi", "slow_but_exact", "pretraining_tp"), _FUSION)}),
    "deepseek_v3": HFFields(
        _DEEPSEEK_READ | {"norm_topk_prob", "n_group", "topk_group", "rope_interleave",
                          "num_nextn_predict_layers"},
        _DEEPSEEK_FIXED | {
            "scoring_func": (("sigmoid",), "DeepSeek-V3 scores experts with a sigmoid"),
            "topk_method": (("noaux_tc",), "DeepSeek-V3 picks experts by the biased scores "
                                           "within the best groups")},
        _DEEPSEEK_IGNORED),
    "deepseek_v2": HFFields(
        _DEEPSEEK_READ | {"n_group", "topk_group"},
        _DEEPSEEK_FIXED | {
            "scoring_func": (("softmax",), "DeepSeek-V2 scores experts with a softmax"),
            # transformers 5.24 DeepseekV2TopkRouter.forward branches on these two only
            "topk_method": (("greedy", "group_limited_greedy"),
                            "transformers' DeepseekV2TopkRouter picks experts greedily or within "
                            "the best groups only")},
        _DEEPSEEK_IGNORED | {"norm_topk_prob": "DeepseekV2TopkRouter does not read it (the "
                                               "gates are never renormalised)"}),
}

# The newer families (arch.hf_families reads them), as transformers 5.24 writes their configs
_BASE = _LLAMA_READ | {"attention_bias"}
_WINDOW = frozenset(("sliding_window", "layer_types"))
_ROUTER_LOSS = dict.fromkeys(("router_aux_loss_coef", "output_router_logits"),
                             "the load-balancing loss weight is the run's --aux-loss-coef")
_GEMMA_ACT = {"hidden_activation": (("gelu_pytorch_tanh",), "Gemma's MLP is GeGLU (tanh GELU)"),
              "hidden_act": (("gelu_pytorch_tanh",), "Gemma's MLP is GeGLU (tanh GELU)"),
              "use_bidirectional_attention": ((False, None), "the model is a causal decoder")}
_GEMMA_READ = _BASE | _WINDOW | {"query_pre_attn_scalar", "attn_logit_softcapping",
                                 "final_logit_softcapping"}
_QWEN3_READ = _BASE | _WINDOW | {"use_sliding_window", "max_window_layers"}
_MOE_READ = frozenset(("num_experts_per_tok", "num_local_experts", "num_experts",
                       "moe_intermediate_size", "norm_topk_prob"))
HF_FIELDS |= {
    "qwen3": HFFields(_QWEN3_READ, _SILU, {}),
    "qwen3_moe": HFFields(
        _QWEN3_READ | _MOE_READ | {"decoder_sparse_step", "mlp_only_layers"},
        _SILU, _ROUTER_LOSS),
    "gemma2": HFFields(_GEMMA_READ, _GEMMA_ACT, {}),
    "gemma3_text": HFFields(
        _GEMMA_READ | {"sliding_window_pattern", "_sliding_window_pattern",
                       "rope_local_base_freq"}, _GEMMA_ACT, {}),
    "phi3": HFFields(
        _LLAMA_READ | {"sliding_window", "partial_rotary_factor"},
        _SILU | {"embd_pdrop": ((0.0,), "dropout is not modelled in a trained Phi-3"),
                 "resid_pdrop": ((0.0,), "dropout is not modelled in a trained Phi-3")},
        {"original_max_position_embeddings": "LongRoPE's switch point (transformers' Phi3 "
                                             "generation cache; LongRoPE's factor lists are "
                                             "refused in rope_scaling): no parameters or FLOPs"}),
    "olmo2": HFFields(_BASE, _SILU, {}),
    "granite": HFFields(
        _BASE | {"mlp_bias", "embedding_multiplier", "residual_multiplier",
                 "attention_multiplier", "logits_scaling"}, _SILU, {}),
    "smollm3": HFFields(
        _BASE | _WINDOW | {"mlp_bias", "use_sliding_window", "no_rope_layers",
                           "no_rope_layer_interval"},
        _SILU, {"max_window_layers": "SmolLM3Config derives layer_types from no_rope_layers"}),
    "gpt_oss": HFFields(
        _BASE | _WINDOW | {"num_local_experts", "num_experts", "num_experts_per_tok",
                           "swiglu_limit", "swiglu_alpha"},
        _SILU, _ROUTER_LOSS),
    "llama4_text": HFFields(
        _BASE | {"attention_chunk_size", "layer_types", "no_rope_layers",
                 "no_rope_layer_interval", "use_qk_norm", "num_local_experts",
                 "num_experts_per_tok", "interleave_moe_layer_step", "moe_layers",
                 "intermediate_size_mlp"},
        _SILU | {"router_jitter_noise": ((0.0,), "router jitter is not implemented")},
        _ROUTER_LOSS | dict.fromkeys(
            ("attn_temperature_tuning", "floor_scale", "attn_scale"),
            "Llama 4's inference-time query scaling of its NoPE layers at long context: "
            "no parameters or FLOPs"),
    ),
    "glm4_moe": HFFields(
        _BASE | {"head_dim", "partial_rotary_factor", "use_qk_norm", "moe_intermediate_size",
                 "n_routed_experts", "num_local_experts", "n_shared_experts",
                 "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
                 "routed_scaling_factor", "n_group", "topk_group", "num_nextn_predict_layers",
                 "num_mtp_layers"},
        _SILU, _ROUTER_LOSS),
}
SUPPORTED_HF_TYPES = tuple(HF_FIELDS)
