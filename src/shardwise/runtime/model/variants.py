"""Which parallelisms the runtime model's Gemma 3 / gpt-oss variants run under, and what it
refuses (one sentence each, for `parallelize.runtime_problems`).

Data parallelism, ZeRO, pipeline stages and full recompute see whole blocks and run them all.
Tensor and expert parallelism and context parallelism swap pieces of the block (heads, experts,
the attention core) that do not carry the variants: sinks and QK-norm weights are per head or
replicated without their tp reduction, gpt-oss's expert biases and clamped activation are not
in the expert-parallel kernels, and ring/Ulysses attention has neither windows, sinks nor the
query_pre_attn_scalar scale. Those combinations are refused, never run approximately.
"""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.layout import Layout


def _block_variants(model: ModelSpec) -> list[str]:
    out = ["attention sinks"] if model.attention_sinks else []
    out += ["QK-norm"] if model.qk_norm else []
    out += ["sandwich norms"] if model.block_norms != "pre" else []
    out += [f"the {model.gated_act} MLP"] if model.gated_act != "silu" else []
    out += ["expert and router biases"] if model.mlp_bias or model.router_bias else []
    out += ["query_pre_attn_scalar"] if "query_pre_attn_scalar" in dict(model.multipliers) else []
    return out


def variant_problems(layout: Layout, model: ModelSpec, seq_len: int | None = None
                     ) -> list[str]:
    """What of `model`'s attention and block variants this layout cannot run. Windows under
    context parallelism: refused when the sequence (None: unknown) is longer than the
    smallest window — up to it a window is full causal attention."""
    out = []
    variants = _block_variants(model)
    for axis, size in (("tp", layout.tp), ("ep", layout.ep), ("cp", layout.cp)):
        if size > 1 and variants:
            out.append(f"{axis}={size} with {', '.join(variants)} ({model.name}) is not "
                       f"supported by the training runtime; use {axis}=1 (dp, ZeRO and pp "
                       "run them)")
    windows = [model.attention_span(i) for i in range(model.n_layers)
               if model.layer_kind(i) == "sliding" and model.sliding_window]
    if layout.cp > 1 and windows and (seq_len is None or seq_len > min(windows)):
        out.append(f"context parallelism with sliding-window attention longer than the window "
                   f"({min(windows)} < sequence {seq_len or 'unknown'}) is not supported by the "
                   "training runtime (ring and Ulysses attention attend over every earlier "
                   "key); use cp=1 or a sequence length ≤ the window")
    if model.rope_type == "yarn" and model.is_mla:
        out.append("YaRN RoPE with multi-head latent attention (DeepSeek's softmax mscale) is "
                   "not supported by the training runtime")
    return out
