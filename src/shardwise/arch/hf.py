"""Hugging Face `config.json` → `ModelSpec` as transformers 5.24 builds the model: one reader per
model_type (`READERS`), after the fields are checked against `arch.hf_fields.HF_FIELDS`. No
network, no transformers import."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.arch.hf_families import _hf_rope, read_family
from shardwise.arch.hf_fields import HF_FIELDS, SUPPORTED_HF_TYPES
from shardwise.arch.spec import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.files import read_json


def _window(cfg: dict, kind: str) -> int:
    """The sliding-window width the config's attention uses in some layer (0: none):
    Mistral's and Mixtral's `sliding_window`; Qwen2's only under `use_sliding_window` (else
    Qwen2Config drops the window), on the layers `layer_types` names "sliding_attention" or,
    without them, from `max_window_layers` on (transformers 5.24's Qwen2Config)."""
    width = cfg.get("sliding_window") or 0
    if kind == "qwen2":
        if not cfg.get("use_sliding_window", False):
            return 0
        layers = cfg.get("layer_types") or []
        windowed = "sliding_attention" in layers or (
            not layers and cfg.get("max_window_layers", 28) < cfg["num_hidden_layers"])
        return width if windowed else 0
    return width


def _llama_like(cfg: dict, name: str, kind: str) -> ModelSpec:
    """Llama, Mistral, Mixtral and Qwen2 (transformers 5.24's LlamaConfig, MistralConfig,
    MixtralConfig, Qwen2Config)."""
    heads = cfg["num_attention_heads"]
    moe = {}
    if kind == "mixtral":
        moe = {"n_experts": cfg["num_local_experts"], "top_k": cfg["num_experts_per_tok"]}
    attention_bias = cfg.get("attention_bias", False)
    return ModelSpec(
        name=name,
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        d_ff=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        max_seq=cfg.get("max_position_embeddings", 4096),
        # transformers 5.24 defaults: rms_norm_eps 1e-6 (LlamaConfig, MistralConfig,
        # Qwen2Config) and 1e-5 (MixtralConfig); head_dim None → h/a
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if kind == "mixtral" else 1e-6)),
        d_head=int(cfg.get("head_dim") or 0),
        qkv_bias=kind == "qwen2" or attention_bias,
        out_bias=attention_bias,
        dropout=cfg.get("attention_dropout", 0.0) > 0,
        sliding_window=_window(cfg, kind),
        **_hf_rope(cfg, kind),
        **moe,
    )


def _gpt2(cfg: dict, name: str, kind: str) -> ModelSpec:
    """GPT-2 (transformers 5.24's GPT2Config): learned positions, LayerNorm, GELU, biases."""
    hidden = cfg["n_embd"]
    dropout = max(cfg.get(k, 0.1) for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
    return ModelSpec(
        name=name, n_layers=cfg["n_layer"], d_model=hidden, n_heads=cfg["n_head"],
        n_kv_heads=cfg["n_head"], d_ff=cfg.get("n_inner") or 4 * hidden,
        vocab=cfg["vocab_size"], gated_mlp=False, bias=True,
        tie_embeddings=cfg.get("tie_word_embeddings", True), norm="layernorm",
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), dropout=dropout > 0,
        learned_positions=cfg["n_positions"], max_seq=cfg["n_positions"],
    )


def _gpt_neox(cfg: dict, name: str, kind: str) -> ModelSpec:
    """GPT-NeoX: partial RoPE, parallel residual."""
    # GPT-NeoX (transformers 5.24's GPTNeoXConfig): LayerNorm, GELU MLP, biases on every
    # linear (attention_bias, default true, and the MLP's always), partial RoPE.
    # RoPE turns `partial_rotary_factor` of each head (rope_parameters), else rotary_pct,
    # default 0.25; attention and MLP in parallel (use_parallel_residual, default true).
    heads = cfg["num_attention_heads"]
    dropout = max(cfg.get("hidden_dropout", 0.0), cfg.get("attention_dropout", 0.0))
    theta = cfg.get("rope_theta", cfg.get("rotary_emb_base"))
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    percent = rope.pop("partial_rotary_factor", cfg.get("rotary_pct", 0.25))
    if cfg.get("rope_parameters"):
        cfg = cfg | {"rope_parameters": rope}
    elif cfg.get("rope_scaling"):
        cfg = cfg | {"rope_scaling": rope}
    return ModelSpec(
        name=name, n_layers=cfg["num_hidden_layers"], d_model=cfg["hidden_size"],
        n_heads=heads, n_kv_heads=heads, d_ff=cfg["intermediate_size"],
        vocab=cfg["vocab_size"], gated_mlp=False,
        tie_embeddings=cfg.get("tie_word_embeddings", False), norm="layernorm",
        norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), bias=True, dropout=dropout > 0,
        max_seq=cfg.get("max_position_embeddings", 2048), rotary_percent=float(percent),
        parallel_residual=cfg.get("use_parallel_residual", True),
        **_hf_rope(cfg | ({"rope_theta": theta} if theta is not None else {}), kind),
    )


def _bloom(cfg: dict, name: str, kind: str) -> ModelSpec:
    """BLOOM: ALiBi."""
    # BLOOM (BigScience 2022): ALiBi (no rotary, no position table), LayerNorm, MHA, GELU
    # MLP of 4h, biases everywhere, tied embeddings. transformers' BloomConfig also reads
    # the older names n_embed / num_attention_heads. Not counted: the LayerNorm after the
    # embedding (2h parameters).
    hidden = cfg.get("hidden_size") or cfg["n_embed"]
    heads = cfg.get("n_head") or cfg["num_attention_heads"]
    return ModelSpec(
        name=name, n_layers=cfg.get("n_layer") or cfg["num_hidden_layers"], d_model=hidden,
        n_heads=heads, n_kv_heads=heads, d_ff=4 * hidden, vocab=cfg["vocab_size"],
        gated_mlp=False, tie_embeddings=cfg.get("tie_word_embeddings", True),
        norm="layernorm", norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), bias=True,
        dropout=max(cfg.get("hidden_dropout", 0.0), cfg.get("attention_dropout", 0.0)) > 0,
        max_seq=cfg.get("seq_length", 2048), alibi=True,
    )


# transformers 5.24 DeepseekV3Config / DeepseekV2Config defaults for the fields read below
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
        "rope_interleave": True, "num_nextn_predict_layers": 1},
    "deepseek_v2": {
        "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
        "moe_intermediate_size": 1407, "num_hidden_layers": 32, "num_attention_heads": 32,
        "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "first_k_dense_replace": 0, "max_position_embeddings": 2048,
        "topk_method": "greedy"},
}


def _from_deepseek(cfg: dict, name: str, kind: str) -> ModelSpec:
    """DeepSeek-V2/V3 as transformers 5.24 builds them (`DeepseekV3ForCausalLM`,
    `DeepseekV2ForCausalLM`): every layer from `first_k_dense_replace` on is MoE
    (`moe_layer_freq` is not read by either); V3 scores experts with a sigmoid (+ the
    correction bias) and picks top-k among the `topk_group` best of `n_group` groups
    (group score: the sum of its two best experts), gates renormalised when `norm_topk_prob`;
    V2 scores with a softmax, "greedy" or "group_limited_greedy" (group score: its best
    expert) and never renormalises (`DeepseekV2TopkRouter` ignores `norm_topk_prob`). Both
    scale the gates by `routed_scaling_factor`. Unset fields take transformers' defaults."""
    # a null field takes the default, but a null q_lora_rank means no q latent
    c = {**_DEEPSEEK_DEFAULTS[kind], **{k: v for k, v in cfg.items() if v is not None}}
    if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
        c["q_lora_rank"] = 0
    heads = c["num_attention_heads"]
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ShardwiseError(f"config {name!r}: biases (attention_bias, mlp_bias) are not "
                             "supported with multi-head latent attention")
    kv_heads = c.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ShardwiseError(f"config {name!r}: num_key_value_heads={kv_heads} ≠ "
                             f"num_attention_heads={heads}; MLA expands the latent to every head")
    v3 = kind == "deepseek_v3"
    grouped = v3 or c.get("topk_method") == "group_limited_greedy"
    if grouped and not v3 and not (cfg.get("n_group") and cfg.get("topk_group")):
        raise ShardwiseError(f"config {name!r}: topk_method 'group_limited_greedy' needs "
                             "n_group and topk_group (transformers' DeepseekV2TopkRouter splits "
                             "the experts into n_group groups); set them, or use 'greedy'")
    return ModelSpec(
        name=name, n_layers=c["num_hidden_layers"], d_model=c["hidden_size"], n_heads=heads,
        n_kv_heads=heads, d_ff=c["intermediate_size"], vocab=c["vocab_size"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq=c["max_position_embeddings"], norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        # V2's rotary multiplies interleaved pairs as complex numbers: the same rotation
        rope_interleave=bool(c.get("rope_interleave", True)) if v3 else True,
        n_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"],
        d_ff_expert=c["moe_intermediate_size"], n_shared_experts=c["n_shared_experts"],
        first_dense_layers=c["first_k_dense_replace"],
        router_score="sigmoid" if v3 else "softmax",
        norm_topk=bool(c.get("norm_topk_prob")) if v3 else False,
        routed_scaling=float(c["routed_scaling_factor"]),
        expert_groups=(c.get("n_group") or 1) if grouped else 1,
        topk_groups=(c.get("topk_group") or 1) if grouped else 1,
        mtp_layers=c.get("num_nextn_predict_layers", 0) if v3 else 0,
        **_hf_rope(cfg, kind),
    )


# model_type -> reader(cfg, name, model_type); a new model_type adds its reader here and its
# fields table to `arch.hf_fields.HF_FIELDS`
READERS: dict[str, Callable[[dict, str, str], ModelSpec]] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2"), _llama_like),
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "bloom": _bloom,
    **dict.fromkeys(("deepseek_v2", "deepseek_v3"), _from_deepseek),
    **dict.fromkeys(("qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
                     "smollm3", "gpt_oss", "llama4_text", "glm4_moe"), read_family),
}


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face `config.json` (a file, or a folder that holds one). No network."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    name = path.parent.name if path.name == "config.json" else path.stem
    return from_hf_dict(read_json(path, "config file"), name or "model", str(path))


def from_hf_dict(cfg: Any, name: str, where: str = "uploaded") -> ModelSpec:
    """A parsed Hugging Face `config.json` (e.g. an upload to the web app) → `ModelSpec`;
    `where` names its origin in error messages. Every field is read, fixed or ignored
    (`HF_FIELDS`); anything else, a value of the wrong type, a non-finite number or a nest
    deeper than any config is refused in one line."""
    from shardwise.files import check_json
    from shardwise.validate import hf_config

    if not isinstance(cfg, dict):
        raise ShardwiseError(f"config file {where!r} must hold a JSON object")
    if not isinstance(name, str):
        raise ShardwiseError(f"the model name must be a string, got {name!r}")
    check_json(cfg, f"config file {where!r}")
    kind = cfg.get("model_type")
    if kind not in HF_FIELDS or kind not in READERS:
        raise ShardwiseError(f"config file {where!r}: unsupported model_type {kind!r}; "
                             f"supported: {', '.join(SUPPORTED_HF_TYPES)}")
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and kind in ("gemma3_text", "gpt_oss"):
        # Gemma 3: one RoPE per layer type; gpt-oss: YaRN's `truncate` flag (a boolean)
        nested = rope if kind == "gemma3_text" and any(
            isinstance(v, dict) for v in rope.values()) else {"": rope}
        for layer_type, params in nested.items():
            if isinstance(params, dict):
                params = {k: v for k, v in params.items() if not isinstance(v, bool)}
            hf_config({"rope_parameters": params}, f"{where} {layer_type}".strip())
        hf_config({k: v for k, v in cfg.items() if k != "rope_parameters"}, where)
    else:
        hf_config(cfg, where)
    HF_FIELDS[kind].check(cfg, where)
    try:
        return READERS[kind](cfg, name, kind)
    except ShardwiseError as exc:  # the model it describes is not a valid one
        raise ShardwiseError(f"config file {where!r}: {exc}") from None
    except KeyError as exc:
        raise ShardwiseError(
            f"config file {where!r} ({cfg.get('model_type')}) lacks the field {exc}"
        ) from None
    except (TypeError, ValueError) as exc:
        raise ShardwiseError(f"config file {where!r} has a field of the wrong type ({exc})"
                             ) from None
