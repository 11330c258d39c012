"""Readers of the model_types transformers 5.24 added after Llama's family: qwen3, qwen3_moe,
gemma2, gemma3_text, phi3, olmo2, granite, smollm3, gpt_oss, llama4_text, glm4_moe — each as
its `configuration_*.py` derives the fields and its `modeling_*.py` builds the modules (the
variants: docs/concepts/attention.md). Registered in `arch.hf.READERS`."""

from __future__ import annotations

import math
from typing import Any

from shardwise.arch.spec import ModelSpec
from shardwise.errors import ShardwiseError

# transformers 5.24 config-class defaults of the fields read below (configuration_<type>.py)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "max_window_layers": 28, "sliding_window": 4096},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "sliding_window": 4096, "decoder_sparse_step": 1,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False},
    "gemma2": {"head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
               "sliding_window": 4096, "tie_word_embeddings": True,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 256},
    "gemma3_text": {"head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                    "sliding_window": 4096, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window_pattern": 6},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "olmo2": {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
    "granite": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "smollm3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                "tie_word_embeddings": True, "no_rope_layer_interval": 4},
    "gpt_oss": {"head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "sliding_window": 128, "attention_bias": True, "num_local_experts": 128,
                "num_experts_per_tok": 4, "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
    "llama4_text": {"head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                    "attention_chunk_size": 8192, "num_local_experts": 16,
                    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                    "intermediate_size_mlp": 16384, "no_rope_layer_interval": 4,
                    "use_qk_norm": True},
    "glm4_moe": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "n_group": 1,
                 "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
                 "n_routed_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 1408, "norm_topk_prob": True,
                 "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1},
}
_KINDS = {"full_attention": "full", "sliding_attention": "sliding",
          "chunked_attention": "chunked"}


def _hf_rope(cfg: dict, kind: str) -> dict[str, Any]:
    """RoPE θ and scaling from `rope_parameters` (transformers ≥ 5), or the older top-level
    `rope_theta` + `rope_scaling`. Default θ as transformers 5.24: 1e6 for Mixtral
    (MixtralConfig.default_theta), else 10000."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta"))
    theta = theta if theta is not None else (1e6 if kind == "mixtral" else 10000.0)
    kind_ = params.pop("rope_type", params.pop("type", "default"))
    scaling: tuple[tuple[str, Any], ...] = ()
    if kind_ != "default":
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 4096))
        scaling = tuple(sorted({**params, "rope_type": kind_}.items()))
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def _layer_types(c: dict, kind: str, layers: int, window: int) -> tuple[str, ...]:
    """Each layer's attention as the config class derives `layer_types` when it is unset."""
    given = c.get("layer_types")
    if given:
        if len(given) != layers or any(t not in _KINDS for t in given):
            raise ShardwiseError(f"layer_types must name one of {', '.join(_KINDS)} for each "
                                 f"of the {layers} layers")
        types = [_KINDS[t] for t in given]
    elif kind in ("gemma2", "gpt_oss"):  # even layers sliding
        types = ["sliding" if (i + 1) % 2 else "full" for i in range(layers)]
    elif kind == "gemma3_text":  # (pattern - 1) sliding, then one full; Gemma3TextConfig
        # reads `sliding_window_pattern` and sets its own `_sliding_window_pattern` from it
        pattern = c["sliding_window_pattern"]
        types = ["sliding" if (i + 1) % pattern else "full" for i in range(layers)]
    elif kind == "qwen3":
        types = ["sliding" if window and i >= c["max_window_layers"] else "full"
                 for i in range(layers)]
    elif kind == "smollm3":  # the window on the NoPE layers (SmolLM3Config)
        types = ["sliding" if window and not _rope_layers(c, layers)[i] else "full"
                 for i in range(layers)]
    elif kind == "llama4_text":
        chunked = c["attention_chunk_size"]
        types = ["chunked" if rope and chunked else "full"
                 for rope in _rope_layers(c, layers)]
    else:  # phi3, qwen3_moe: the window (if any) in every layer
        types = ["sliding" if window else "full"] * layers
    if not window:  # transformers' attention passes sliding_window=None
        types = ["full" if t == "sliding" else t for t in types]
    return tuple(types)


def _rope_layers(c: dict, layers: int) -> list[int]:
    """`no_rope_layers` (1: RoPE, 0: none; SmolLM3, Llama 4), by default every
    `no_rope_layer_interval`-th layer without RoPE."""
    given = c.get("no_rope_layers")
    if given:
        if len(given) != layers:
            raise ShardwiseError(f"no_rope_layers must hold one 0/1 per layer ({layers})")
        return [int(x) for x in given]
    step = c["no_rope_layer_interval"]
    return [int((i + 1) % step != 0) for i in range(layers)]


def _rope(c: dict, kind: str) -> tuple[dict[str, Any], float, float]:
    """(rope_theta and rope_scaling, local θ, rotary share): transformers 5.24's
    `rope_parameters` — per layer type for Gemma 3 — or the older top-level fields."""

    params = c.get("rope_parameters") or {}
    local = 0.0
    if kind == "gemma3_text":
        if "full_attention" in params or "sliding_attention" in params:
            local = float((params.get("sliding_attention") or {}).get("rope_theta", 10000.0))
            c = c | {"rope_parameters": params.get("full_attention") or {}}
        else:
            local = float(c.get("rope_local_base_freq", 10000.0))
        c = c | ({} if "rope_theta" in c or c.get("rope_parameters") else {"rope_theta": 1e6})
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    default_share = 0.5 if kind == "glm4_moe" else 1.0
    share = float(params.pop("partial_rotary_factor", c.get("partial_rotary_factor",
                                                            default_share)))
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    rope = _hf_rope(c | ({key: params} if params else {}), kind)
    if kind == "gpt_oss" and "rope_theta" not in (c.get("rope_parameters") or {}):
        rope["rope_theta"] = float(c.get("rope_theta", 150000.0))
    if kind == "llama4_text" and "rope_theta" not in (c.get("rope_parameters") or {}):
        rope["rope_theta"] = float(c.get("rope_theta", 500000.0))
    return rope, local, share


def _moe(c: dict, kind: str, layers: int) -> dict[str, Any]:
    """The experts: which layers, how many, how routed (each family's modeling_*.py)."""
    if kind == "qwen3_moe":  # (i + 1) % decoder_sparse_step == 0, minus mlp_only_layers
        # the hub's configs name them num_experts; 5.24 writes num_local_experts
        experts = c.get("num_local_experts", c.get("num_experts", 128))
        if not experts:
            return {}
        return {"n_experts": experts, "top_k": c["num_experts_per_tok"],
                "d_ff_expert": c["moe_intermediate_size"], "moe_every": c["decoder_sparse_step"],
                "mlp_only_layers": tuple(sorted(set(c.get("mlp_only_layers") or ()))),
                "norm_topk": bool(c["norm_topk_prob"])}
    if kind == "gpt_oss":  # every layer; softmax over the top-k logits; biased router
        return {"n_experts": c["num_local_experts"], "top_k": c["num_experts_per_tok"],
                "router_bias": True}
    if kind == "llama4_text":  # moe_layers, else every interleave_moe_layer_step-th
        step = c["interleave_moe_layer_step"]
        pattern = set(range(step - 1, layers, step))
        chosen = set(c["moe_layers"]) if c.get("moe_layers") is not None else pattern
        if not chosen <= pattern:
            raise ShardwiseError(f"moe_layers {sorted(chosen - pattern)} are off the "
                                 f"interleave_moe_layer_step={step} pattern; shardwise places "
                                 "MoE layers every step-th layer (some may be dense)")
        # sigmoid of the top-1 logit as the gate, not renormalised; one shared expert
        return {"n_experts": c["num_local_experts"], "top_k": c["num_experts_per_tok"],
                "d_ff_expert": c["intermediate_size"], "n_shared_experts": 1,
                "moe_every": step, "mlp_only_layers": tuple(sorted(pattern - chosen)),
                "router_score": "sigmoid", "norm_topk": False}
    if kind == "glm4_moe":  # DeepSeek-V3's router and layer placement
        return {"n_experts": c["n_routed_experts"], "top_k": c["num_experts_per_tok"],
                "d_ff_expert": c["moe_intermediate_size"],
                "n_shared_experts": c["n_shared_experts"],
                "first_dense_layers": c["first_k_dense_replace"], "router_score": "sigmoid",
                "norm_topk": bool(c["norm_topk_prob"]),
                "routed_scaling": float(c["routed_scaling_factor"]),
                "expert_groups": c.get("n_group") or 1, "topk_groups": c.get("topk_group") or 1,
                "mtp_layers": c.get("num_nextn_predict_layers") or 0}
    return {}


def read_family(cfg: dict, name: str, kind: str) -> ModelSpec:
    """One of this module's model_types → `ModelSpec`; unset fields take transformers'
    defaults (`_DEFAULTS`)."""
    c = {**_DEFAULTS[kind], **{k: v for k, v in cfg.items() if v is not None}}
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    # the class default window (Gemma, gpt-oss, Qwen3) unless the file says null
    window = 0 if "sliding_window" in cfg and cfg["sliding_window"] is None else int(
        c.get("sliding_window") or 0)
    if kind in ("qwen3", "qwen3_moe", "smollm3") and not c.get("use_sliding_window"):
        window = 0  # Qwen3Config / SmolLM3 drop the window unless use_sliding_window
    types = _layer_types(c, kind, layers, window)
    rope, local_theta, share = _rope(c, kind)
    bias = bool(c.get("attention_bias", False))
    extra: dict[str, Any] = {}
    if kind in ("gemma2", "gemma3_text"):
        # Gemma: pre- and post-norms, GeGLU, embeddings × √h (GemmaTextScaledWordEmbedding),
        # scores × query_pre_attn_scalar^-½; Gemma 2 caps scores and logits with tanh
        extra = {"block_norms": "sandwich", "gated_act": "gelu_tanh",
                 "attn_softcap": float(c.get("attn_logit_softcapping") or 0.0),
                 "final_softcap": float(c.get("final_logit_softcapping") or 0.0),
                 "multipliers": (("embedding_multiplier", math.sqrt(hidden)),
                                 ("query_pre_attn_scalar", float(c["query_pre_attn_scalar"])))}
    elif kind == "granite":
        extra = {"multipliers": tuple(sorted(
            (k, float(c.get(k, 1.0))) for k in ("attention_multiplier", "embedding_multiplier",
                                                 "logits_scaling", "residual_multiplier")
            if float(c.get(k, 1.0)) != 1.0))}
    elif kind == "gpt_oss":
        extra = {"attention_sinks": True, "gated_act": "swiglu_clamp",
                 "multipliers": (("swiglu_alpha", float(c["swiglu_alpha"])),
                                 ("swiglu_limit", float(c["swiglu_limit"])))}
    if kind == "olmo2":
        extra["block_norms"] = "post"
    qk = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "full",
          "glm4_moe": "head" if c.get("use_qk_norm") else "",
          "llama4_text": "l2" if c.get("use_qk_norm") else ""}.get(kind, "")
    nope: tuple[int, ...] = ()
    if kind in ("smollm3", "llama4_text"):
        nope = tuple(i for i, r in enumerate(_rope_layers(c, layers)) if not r)
    chunk = int(c.get("attention_chunk_size") or 0) if "chunked" in types else 0
    d_ff = c["intermediate_size_mlp"] if kind == "llama4_text" else c["intermediate_size"]
    return ModelSpec(
        name=name, n_layers=layers, d_model=hidden, n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, d_ff=d_ff, vocab=c["vocab_size"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq=c["max_position_embeddings"], norm_eps=float(c["rms_norm_eps"]),
        d_head=int(c.get("head_dim") or 0),
        # Phi-3 has no attention biases; GLM-4.5's attention_bias is on Q, K, V only
        qkv_bias=bias, out_bias=bias and kind != "glm4_moe",
        mlp_bias=bool(c.get("mlp_bias", kind == "gpt_oss")),  # gpt-oss: expert biases
        dropout=float(c.get("attention_dropout", 0.0)) > 0,
        sliding_window=window if "sliding" in types else 0,
        layer_types=() if set(types) == {"full"} else types, attention_chunk=chunk,
        nope_layers=nope, qk_norm=qk, rope_local_theta=local_theta, rotary_percent=share,
        **rope, **extra, **_moe(c, kind, layers),
    )
