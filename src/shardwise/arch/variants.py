"""The attention and block variants of `ModelSpec` (windows, chunks, QK-norm, sandwich norms,
sinks, …): keys per query under windows and chunks, the fields' checks, and what the training
runtime does not implement. Formulas and which model uses which: docs/concepts/attention.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from shardwise.arch.spec import ModelSpec

LAYER_KINDS = ("full", "sliding", "chunked")
CHOICES = {"qk_norm": ("", "head", "full", "l2"), "block_norms": ("pre", "post", "sandwich"),
           "gated_act": ("silu", "gelu_tanh", "swiglu_clamp")}
# what the training runtime lacks, by field (a field set to anything but its default)
_RUNTIME_LACKS = {
    "qk_norm": "QK-norm", "attention_sinks": "attention sinks",
    "attn_softcap": "attention logit soft-capping", "final_softcap": "final logit soft-capping",
    "nope_layers": "layers without RoPE", "rope_local_theta": "a second RoPE θ for sliding layers",
    "mlp_bias": "MLP biases", "router_bias": "a router bias",
    "mlp_only_layers": "dense layers among MoE ones (mlp_only_layers)",
    "multipliers": "scalar multipliers"}


def attention_keys(model: ModelSpec, seq_len: Any, causal: bool = True) -> Any:
    """Keys per query, averaged over the layers, in the area convention of the causal `s/2`.
    Full: `s` (causal `s/2`); a window `w < s`: `w` (causal `w - w²/2s`, the band's area per
    row); chunks of `c`: `min(c, s)` (causal `(⌊s/c⌋·c²/2 + r²/2)/s`, r = s mod c).
    Array-polymorphic in `seq_len`; exactly the full expression when no layer is windowed."""
    full = seq_len * 0.5 if causal else seq_len
    kinds = [model.layer_kind(i) for i in range(model.n_layers)]
    if all(k == "full" or (k == "sliding" and not model.sliding_window) for k in kinds):
        return full
    total: Any = 0.0
    for kind in kinds:
        if kind == "chunked":
            total = total + _chunk_keys(seq_len, model.attention_chunk, causal)
        elif kind == "sliding" and model.sliding_window:
            w = np.minimum(model.sliding_window, seq_len)
            total = total + (w - w * w / (2 * seq_len) if causal else w)
        else:
            total = total + full
    return total / model.n_layers


def _chunk_keys(seq_len: Any, chunk: int, causal: bool) -> Any:
    if not causal:
        return np.minimum(chunk, seq_len)
    whole = np.floor(seq_len / chunk)
    rest = seq_len - whole * chunk
    return (whole * chunk * chunk / 2 + rest * rest / 2) / seq_len


def variant_problems(model: ModelSpec) -> list[str]:
    """The variant fields' problems (for `ModelSpec.validate`)."""
    out = []
    types, layers = model.layer_types, model.n_layers
    if not isinstance(types, tuple) or (types and (
            len(types) != layers or any(k not in LAYER_KINDS for k in types))):
        out.append(f"layer_types must be empty or name one of {', '.join(LAYER_KINDS)} for "
                   f"each of the {layers} layers")
    elif "sliding" in types and not model.sliding_window:
        out.append("sliding layers need sliding_window > 0")
    elif "chunked" in types and not model.attention_chunk:
        out.append("chunked layers need attention_chunk > 0")
    for field in ("nope_layers", "mlp_only_layers"):
        value = getattr(model, field)
        if not isinstance(value, tuple) or any(
                not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers
                for i in value):
            out.append(f"{field} must list layer indices in 0..{layers - 1}")
    out += [f"{f} must be one of {', '.join(map(repr, c))}, got {getattr(model, f)!r}"
            for f, c in CHOICES.items() if getattr(model, f) not in c]
    if not isinstance(model.multipliers, tuple) or any(
            not isinstance(p, tuple) or len(p) != 2 or not isinstance(p[0], str)
            or isinstance(p[1], bool) or not isinstance(p[1], int | float)
            for p in model.multipliers):
        out.append("multipliers must be (name, number) pairs")
    return out


def runtime_variants(model: ModelSpec) -> list[str]:
    """The variants `model` has beyond Llama's block (the analytic side models them all;
    exports refuse them without a verified option); windows and chunks are limits on the
    sequence instead. Of these the training runtime runs Gemma 3's and gpt-oss's
    (`runtime_lacks`)."""
    out = [why for field, why in _RUNTIME_LACKS.items() if getattr(model, field)]
    out += [f"{model.block_norms}-norm blocks"] if model.block_norms != "pre" else []
    out += [f"{model.gated_act} MLP"] if model.gated_act != "silu" else []
    return out


# what the training runtime runs (runtime/model: Gemma 3's and gpt-oss's, tested against
# transformers' own models in tests/runtime/test_gemma3.py, test_gpt_oss.py)
_RUNTIME_RUNS = {"QK-norm", "attention sinks", "a second RoPE θ for sliding layers",
                 "a router bias", "sandwich-norm blocks", "gelu_tanh MLP", "swiglu_clamp MLP"}
_RUNTIME_MULTIPLIERS = ("embedding_multiplier", "query_pre_attn_scalar", "swiglu_alpha",
                        "swiglu_limit")


def runtime_lacks(model: ModelSpec) -> list[str]:
    """The variants of `runtime_variants` the training runtime does not implement: all but
    Gemma 3's per-head QK-norm with (1 + w), sandwich norms and GeGLU, gpt-oss's sinks,
    expert and router biases and clamped SwiGLU (on MoE layers), the local RoPE θ and the
    named multipliers."""
    gemma_qk = model.qk_norm == "head" and model.block_norms == "sandwich"
    out = [v for v in runtime_variants(model) if v not in _RUNTIME_RUNS
           and v not in ("MLP biases", "scalar multipliers")]
    out += ["QK-norm"] if model.qk_norm and not gemma_qk else []
    out += ["MLP biases on dense layers"] if model.mlp_bias and model.n_dense_layers else []
    out += ["scalar multipliers"] if any(
        k not in _RUNTIME_MULTIPLIERS for k, _ in model.multipliers) else []
    return out
