"""Gemma 3 and gpt-oss checkpoints for `runtime.hf`: the names and layouts transformers 5.24's
`Gemma3ForCausalLM` / `GptOssForCausalLM` `save_pretrained` writes, and their config.json.

Gemma 3: the sandwich norms (`post_attention_layernorm` is the runtime's `attention_out_norm`,
`pre_feedforward_layernorm` its `mlp_norm`), `self_attn.q_norm`/`k_norm`, weights as stored
(the `(1 + w)` offset is the runtime RMSNorm's). gpt-oss: `self_attn.sinks` (a),
`mlp.router.weight` (E, h) / `.bias` (E), `mlp.experts.gate_up_proj` (E, h, 2f) with gate and
up interleaved along the last dim (`GptOssExperts._apply_gate`: `gate_up[..., ::2]`,
`[..., 1::2]`) and its bias (E, 2f) alike, `down_proj` (E, f, h) and `down_proj_bias` (E, h).
"""

from __future__ import annotations

import re

import torch

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError

_OSS = re.compile(r"model\.layers\.(\d+)\.mlp\.(router\.weight|router\.bias|experts\."
                  r"(?:gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias))")
_FUSED = ("experts.gate_up_proj", "experts.gate_up_proj_bias")
# runtime leaf inside blocks.i.mlp -> the gpt-oss tensor inside model.layers.i.mlp holding it
_OSS_NAMES = {"router": "router.weight", "router_bias": "router.bias",
              "w_gate": "experts.gate_up_proj", "w_up": "experts.gate_up_proj",
              "b_gate": "experts.gate_up_proj_bias", "b_up": "experts.gate_up_proj_bias",
              "w_down": "experts.down_proj", "b_down": "experts.down_proj_bias"}


def family(spec: ModelSpec) -> str:
    """"gemma3_text" or "gpt_oss" when `spec` is one of theirs (by its variants), else ""."""
    if spec.block_norms == "sandwich" and spec.gated_act == "gelu_tanh":
        return "gemma3_text"
    if spec.attention_sinks and spec.gated_act == "swiglu_clamp":
        return "gpt_oss"
    return ""


def sandwich(params: dict[str, torch.Tensor]) -> bool:
    """The model has Gemma's sandwich norms (its norm names differ from Llama's)."""
    return any(n.endswith("attention_out_norm.weight") for n in params)


def _oss(params: dict[str, torch.Tensor], layer: str) -> bool:
    return f"blocks.{layer}.mlp.router_bias" in params


def gpt_oss_views(hf_name: str, params: dict[str, torch.Tensor]
                  ) -> list[tuple[str, int | None, torch.Tensor]] | None:
    """A gpt-oss MoE tensor's destinations as `hf._destinations` gives them (views stacked
    along dim -2 after `reorder`); None for any other name."""
    m = _OSS.fullmatch(hf_name)
    if m is None or not _oss(params, m.group(1)):
        return None
    mlp, what = f"blocks.{m.group(1)}.mlp", m.group(2)
    views: dict[str, list[tuple[str, torch.Tensor]]] = {
        "router.weight": [("router", params[f"{mlp}.router"].T)],
        "router.bias": [("router_bias", params[f"{mlp}.router_bias"])],
        "experts.gate_up_proj": [(w, params[f"{mlp}.{w}"].mT) for w in ("w_gate", "w_up")],
        "experts.gate_up_proj_bias": [(w, params[f"{mlp}.{w}"].unsqueeze(-2))
                                      for w in ("b_gate", "b_up")],
        "experts.down_proj": [("w_down", params[f"{mlp}.w_down"])],
        "experts.down_proj_bias": [("b_down", params[f"{mlp}.b_down"])]}
    return [(f"{mlp}.{n}", None, v) for n, v in views[what]]


def _fused(hf_name: str, params: dict[str, torch.Tensor]) -> bool:
    m = _OSS.fullmatch(hf_name)
    return m is not None and m.group(2) in _FUSED and _oss(params, m.group(1))


def file_shape(hf_name: str, shape: tuple[int, ...], params: dict[str, torch.Tensor]
               ) -> tuple[int, ...]:
    """The shape the file holds for the views' stacked `shape`: gpt-oss's interleaved
    gate_up_proj (E, 2f, h) -> (E, h, 2f), its bias (E, 2, f) -> (E, 2f)."""
    if not _fused(hf_name, params):
        return shape
    if hf_name.endswith("_bias"):
        return (shape[0], shape[1] * shape[2])
    return (shape[0], shape[2], shape[1])


def reorder(hf_name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor]
            ) -> torch.Tensor:
    """A file's tensor in the views' stacked layout (`file_shape`'s inverse): gate columns
    (even) then up columns (odd)."""
    if not _fused(hf_name, params):
        return tensor
    pairs = tensor.unflatten(-1, (-1, 2))  # (E, [h,] f, 2)
    if hf_name.endswith("_bias"):
        return pairs.movedim(-1, 1)  # (E, f, 2) -> (E, 2, f)
    return pairs.movedim(-1, 1).mT.flatten(1, 2)  # (E, h, f, 2) -> (E, 2, f, h) -> (E, 2f, h)


def gpt_oss_tensors(name: str, full: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor] | None:
    """The tensors `save_pretrained` writes for runtime parameter `name` of a gpt-oss MoE
    layer (gate and up fused and interleaved, written with the gate: {} for the up); None
    for any other parameter. `full`: every parameter of the layer, by runtime name."""
    m = re.fullmatch(r"blocks\.(\d+)\.mlp\.(\w+)", name)
    if m is None or not _oss(full, m.group(1)) or m.group(2) not in _OSS_NAMES:
        return None
    leaf, t = m.group(2), full[name]
    key = f"model.layers.{m.group(1)}.mlp.{_OSS_NAMES[leaf]}"
    if leaf in ("w_up", "b_up"):
        return {}
    if leaf in ("w_gate", "b_gate"):  # (E, [h,] f) twice -> (E, [h,] 2f) interleaved
        return {key: torch.stack([t, full[name.replace("_gate", "_up")]], dim=-1).flatten(-2)}
    return {key: t.T if leaf == "router" else t}


def gpt_oss_name(name: str, params: dict[str, torch.Tensor]) -> str | None:
    """The gpt-oss tensor holding runtime parameter `name` (for messages); None if none."""
    m = re.fullmatch(r"blocks\.(\d+)\.mlp\.(\w+)", name)
    if m and _oss(params, m.group(1)) and m.group(2) in _OSS_NAMES:
        return f"model.layers.{m.group(1)}.mlp.{_OSS_NAMES[m.group(2)]}"
    return None


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x  # Gemma3TextConfig's field is an int


def _types(spec: ModelSpec) -> list[str]:
    return [f"{spec.layer_kind(i)}_attention" for i in range(spec.n_layers)]


def hf_config(spec: ModelSpec) -> dict[str, object]:
    """A `config.json` transformers 5.24 reads back as the same Gemma 3 / gpt-oss model (the
    fields `arch.hf_families.read_family` reads); a spec it would not describe exactly (read
    back as another spec) is refused."""
    from shardwise.arch import from_hf_dict

    config = _config(spec)
    if from_hf_dict(config, spec.name) != spec:
        raise ShardwiseError(f"{spec.name}: a {config['model_type']} config.json cannot "
                             "describe this model exactly (it differs from the model "
                             "transformers builds); it cannot be saved in the Hugging Face "
                             "format")
    return config


def _config(spec: ModelSpec) -> dict[str, object]:
    rope: dict[str, object] = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    rope.update(dict(spec.rope_scaling))
    given = dict(spec.multipliers)
    config: dict[str, object] = {
        "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim, "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_seq, "rms_norm_eps": spec.norm_eps,
        "tie_word_embeddings": spec.tie_embeddings, "sliding_window": spec.sliding_window,
        "layer_types": _types(spec), "attention_bias": spec.qkv_bias}
    if family(spec) == "gemma3_text":
        local = {"rope_theta": spec.rope_local_theta or spec.rope_theta, "rope_type": "default"}
        return config | {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "intermediate_size": spec.d_ff, "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _int_if_whole(given["query_pre_attn_scalar"]),
            "rope_parameters": {"full_attention": rope, "sliding_attention": local},
            "attn_logit_softcapping": spec.attn_softcap or None,
            "final_logit_softcapping": spec.final_softcap or None}
    return config | {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "intermediate_size": spec.expert_d_ff, "num_local_experts": spec.n_experts,
        "num_experts_per_tok": spec.top_k, "rope_parameters": rope,
        "swiglu_alpha": given["swiglu_alpha"], "swiglu_limit": given["swiglu_limit"]}
