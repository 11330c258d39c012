"""`Block` and `Transformer`: the decoder built from a `ModelSpec` for one device, with
per-block recompute and the per-token cross-entropy swap point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from shardwise.arch import ModelSpec
from shardwise.runtime.mixed_precision import loss_dtype
from shardwise.runtime.model.attention import Attention, LatentAttention
from shardwise.runtime.model.layers import RMSNorm, rotary_tables
from shardwise.runtime.model.mlp import MoE, SwiGLU


def norm_offset(spec: ModelSpec) -> float:
    """1 for Gemma's RMSNorms, `x̂·(1 + w)` (the sandwich-norm family), else 0."""
    return 1.0 if spec.block_norms == "sandwich" else 0.0


class Block(nn.Module):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; Gemma's
    sandwich (`block_norms`): `x + norm(attn(norm(x)))`, `x + norm(mlp(norm(x)))`
    (`attention_out_norm`, `mlp_out_norm`). With `recompute` set, backward recomputes the
    block's forward instead of keeping its activations (full recompute; Chen et al. 2016)."""

    def __init__(self, spec: ModelSpec, flash: bool, dtype: torch.dtype, moe: bool = False,
                 layer: int = 0):
        super().__init__()
        h, eps, offset = spec.d_model, spec.norm_eps, norm_offset(spec)
        self.attention_norm = RMSNorm(h, eps, dtype, offset)
        self.attention: nn.Module = (LatentAttention(spec, flash, dtype) if spec.is_mla
                                     else Attention(spec, flash, dtype, layer))
        self.mlp_norm = RMSNorm(h, eps, dtype, offset)
        self.mlp: nn.Module = (MoE(spec, dtype) if moe else
                               SwiGLU(h, spec.d_ff, dtype, spec.gated_act))
        if spec.block_norms == "sandwich":
            self.attention_out_norm = RMSNorm(h, eps, dtype, offset)
            self.mlp_out_norm = RMSNorm(h, eps, dtype, offset)
        self.recompute = False
        # checkpoint's context_fn: (forward context, replay context); the pipeline's ZB-H1
        # replays under `defer_linears` (`pipeline.replay_contexts`)
        self.recompute_contexts: Callable[[], tuple[Any, Any]] = noop_context_fn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False,
                              context_fn=self.recompute_contexts)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "mlp_out_norm"):
            x = x + self.attention_out_norm(self.attention(self.attention_norm(x), cos, sin))
            return x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token loss (b, s) from logits (b, s, V)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                           reduction="none").view(targets.shape)


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device)  # (s,): 0, 1, …, s-1


class ScaledEmbedding(nn.Embedding):
    """`nn.Embedding` × a constant (Gemma's √h, transformers 5.24
    `Gemma3TextScaledWordEmbedding`; `embedding_multiplier`); saves nothing more."""

    def __init__(self, vocab: int, dim: int, scale: float, dtype: torch.dtype):
        super().__init__(vocab, dim, dtype=dtype)
        self.scale = scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale


class Transformer(nn.Module):
    """Embedding → blocks → final norm → head. `forward(tokens)` returns logits (b, s, V);
    `loss(tokens, targets)` the mean next-token cross-entropy. `positions` (s,) are the global
    positions of the tokens given (a context-parallel rank holds a subset). Sliding layers
    rotate with `rope_local_theta` when set (Gemma 3's local base)."""

    def __init__(self, spec: ModelSpec, *, flash: bool = True, dtype: torch.dtype = torch.float64,
                 seed: int = 0):
        super().__init__()
        if not spec.gated_mlp or spec.norm != "rmsnorm":
            raise ValueError(f"the runtime model is Llama-style (RMSNorm, SwiGLU); {spec.name} "
                             "is not")
        torch.manual_seed(seed)
        self.spec, self.dtype = spec, dtype
        scale = dict(spec.multipliers).get("embedding_multiplier")
        self.embedding = (nn.Embedding(spec.vocab, spec.d_model, dtype=dtype) if scale is None
                          else ScaledEmbedding(spec.vocab, spec.d_model, scale, dtype))
        self.blocks = nn.ModuleList(Block(spec, flash, dtype, spec.is_moe_layer(i), i)
                                    for i in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, spec.norm_eps, dtype, norm_offset(spec))
        self.head = nn.Linear(spec.d_model, spec.vocab, bias=False, dtype=dtype)
        if spec.tie_embeddings:
            self.head.weight = self.embedding.weight
        self.cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            token_cross_entropy)
        for param in self.parameters():
            if param.dim() >= 2:  # GPT-2's initialisation (experts too)
                nn.init.normal_(param, std=0.02)
        for name, param in self.named_parameters():
            if name.endswith(("bias", ".b_gate", ".b_up", ".b_down")):  # biases start at zero
                nn.init.zeros_(param)  # (as under HF's _init_weights)

    def rotary(self, positions: torch.Tensor, local: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (s, d); `local`: a sliding layer's, at `rope_local_theta` without
        scaling (Gemma 3's `rope_parameters["sliding_attention"]`)."""
        spec = self.spec
        if local and spec.rope_local_theta:
            return rotary_tables(positions, spec.rope_dim, spec.rope_local_theta, self.dtype)
        return rotary_tables(positions, spec.rope_dim, spec.rope_theta, self.dtype,
                             spec.rope_scaling)

    def run_blocks(self, x: torch.Tensor, layers: range | tuple[int, ...],
                   positions: torch.Tensor) -> torch.Tensor:
        """Blocks `layers` on activations x (b, s, h); a pipeline stage runs a subset."""
        tables = {False: self.rotary(positions)}
        if self.spec.rope_local_theta:  # both kinds' tables in one storage (4, s, d): under
            # full recompute every layer's checkpoint keeps it, a pass's shared constant
            both = torch.stack([*tables[False], *self.rotary(positions, local=True)])
            tables = {False: (both[0], both[1]), True: (both[2], both[3])}
        for k in layers:
            local = self.spec.rope_local_theta > 0 and self.spec.layer_kind(k) == "sliding"
            x = self.blocks[k](x, *tables[local])
        return x

    def mean_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, head and the mean cross-entropy over the tokens of `targets` (in at
        least fp32: bf16 logits are cast up first, `runtime.mixed_precision`)."""
        logits = self.head(self.norm(x))
        return self.cross_entropy(logits.to(loss_dtype(logits.dtype)), targets).mean()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        positions = _positions(tokens) if positions is None else positions
        x = self.embedding(tokens)  # (b, s) -> (b, s, h)
        return self.head(self.norm(self.run_blocks(x, range(len(self.blocks)), positions)))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        positions = _positions(tokens) if positions is None else positions
        x = self.run_blocks(self.embedding(tokens), range(len(self.blocks)), positions)
        return self.mean_loss(x, targets)
