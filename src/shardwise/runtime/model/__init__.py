"""A small Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU or top-k MoE layers, tied
or untied embeddings) defined once for one device, built from a `ModelSpec`; with Gemma 3's
and gpt-oss's variants (sliding windows, sinks, QK-norm, sandwich norms, GeGLU, clamped SwiGLU
with biases: docs/concepts/attention.md#what-runs-where).

Each op that keeps tensors for backward saves exactly what SPEC §3 counts
(`estimate.memory.saved_tensors_per_layer`); the parallel versions (`runtime.parallelize`)
change it in place through a few swap points. Modules: `layers` (RMSNorm, RoPE), `attention`
(GQA, MLA), `mlp` (SwiGLU, MoE), `transformer` (`Block`, `Transformer`).
What each op saves, and the swap points: docs/concepts/runtime.md#the-runtime-model.
"""

from shardwise.ops.swiglu import SwiGLUFunction
from shardwise.runtime.model.attention import (
    LATENT_NORM_EPS,
    Attention,
    AttentionFunction,
    LatentAttention,
    deinterleave,
    local_attention,
)
from shardwise.runtime.model.layers import (
    AttentionCore,
    Projection,
    RMSNorm,
    RMSNormFunction,
    RotaryFunction,
    TensorMap,
    apply_rotary,
    identity,
    inverse_frequencies,
    rotary_tables,
    separate_linears,
)
from shardwise.runtime.model.mlp import AuxLossAutoScaler, Experts, MoE, SwiGLU, configure_moe
from shardwise.runtime.model.transformer import Block, Transformer, token_cross_entropy

__all__ = ["LATENT_NORM_EPS", "Attention", "AttentionCore", "AttentionFunction",
           "AuxLossAutoScaler", "Block", "Experts", "LatentAttention", "MoE",
           "Projection", "RMSNorm", "RMSNormFunction", "RotaryFunction", "SwiGLU",
           "SwiGLUFunction", "TensorMap", "Transformer", "apply_rotary",
           "configure_moe", "deinterleave", "identity", "inverse_frequencies",
           "local_attention", "rotary_tables", "separate_linears", "token_cross_entropy"]
