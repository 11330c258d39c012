"""Attention: the core as an autograd function (materialised softmax, or torch's fused flash
kernel; sliding windows and sinks), GQA `Attention` (with QK-norm), and DeepSeek's
multi-head latent attention (`LatentAttention`).
What each saves for backward: docs/concepts/runtime.md#the-runtime-model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.arch import ModelSpec
from shardwise.ops.attention import (
    add_sinks,
    fused_backward,
    fused_forward,
    sink_grad,
    window_bias,
)
from shardwise.runtime.model.layers import (
    AttentionCore,
    Projection,
    RMSNorm,
    TensorMap,
    apply_rotary,
    identity,
    separate_linears,
)


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(b, a_kv, s, d) -> (b, a_kv·group, s, d): each kv head serves `group` query heads."""
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _sum_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """(b, a, s, d) -> (b, a/group, s, d): gradients of shared kv heads add up."""
    if group == 1:
        return t
    b, a, s, d = t.shape
    return t.view(b, a // group, group, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            window: int = 0) -> torch.Tensor:
    """q: (b, a, s_q, d), k: (b, a, s_k, d) -> scaled scores (b, a, s_q, s_k), future (and,
    with a `window`, keys more than `window - 1` back) masked."""
    scores = q @ k.transpose(-1, -2) * scale
    if 0 < window < scores.shape[-1]:
        return scores + window_bias(scores.shape[-1], window, scores.device, scores.dtype)
    if causal:
        s_q, s_k = scores.shape[-2:]
        future = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1 + s_k - s_q)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (…, d) zero-padded to (…, width) on the last dim (t itself when d = width)."""
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


class AttentionFunction(torch.autograd.Function):
    """softmax(QKᵀ·scale)·V with GQA, inputs and output in (b, s, heads, d); V (and the output)
    may be narrower than Q and K (MLA's `d_v`). `scale` None: 1/√d; `window` > 0: each query
    sees its last `window` keys (`ops.attention.window_bias`); `sinks` (heads,): a learned
    logit per head in each row's denominator (`ops.attention.add_sinks`; gpt-oss).

    `flash=True` runs the fused kernel of `ops.attention.fused_forward` (on CPU torch's flash
    kernel, what `F.scaled_dot_product_attention` runs) and saves Q, K, V, the output O and the
    log-sum-exp L per row (fp32 for 16-bit activations); its backward recomputes
    `P = exp(S - L)` blockwise (Dao et al. 2022; `fused_backward`). The CPU kernel needs equal
    head widths: a narrower V is zero-padded for the call and the output's zero columns cut
    off; backward pads V, O and dO again (O enters only through `D = rowsum(dO ∘ O)`, where
    zero columns add nothing), so what is saved is V and O at `d_v`. `flash=False` materialises
    and saves the softmax output P (`a·s²` per sequence) — the count without FlashAttention —
    with the hand-written backward `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP - rowsum(dP∘P))`,
    `dQ = dS·K·scale`, `dK = dSᵀ·Q·scale`; kv-head gradients summed over their query group;
    a sink's share is `1 - rowsum(P)`, `dσ = -Σ_rows (1 - rowsum P)·rowsum(dP∘P)`.
    Windows and sinks save nothing more.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                flash: bool, scale: float | None = None, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        ctx.causal, ctx.flash, ctx.scale, ctx.window = causal, flash, scale, window
        ctx.sinks = sinks is not None
        if flash:
            width, d_v = q.shape[-1], v.shape[-1]
            out, lse = fused_forward(q, k, _pad_to(v, width), scale, causal, window)
            if sinks is not None:
                out, lse = add_sinks(out, lse, sinks)
            if d_v < width or sinks is not None:  # (b, s, a, d) -> (b, s, a, d_v), contiguous
                out = out[..., :d_v].contiguous()
            ctx.save_for_backward(q, k, v, out, lse, sinks)
            return out
        group = q.shape[2] // k.shape[2]
        # (b, s, heads, d) -> (b, heads, s, d) views
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        scores = _scores(qh, _expand_kv(kh, group), causal, scale, window)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink's logit as one more column, dropped after the softmax
            column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
            probs = probs.contiguous()
        out = (probs @ _expand_kv(vh, group)).transpose(1, 2).contiguous()  # (b, s, a, d)
        ctx.group = group
        ctx.save_for_backward(q, k, v, probs, sinks)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        if ctx.flash:
            q, k, v, out, lse, sinks = ctx.saved_tensors
            width = q.shape[-1]
            d_q, d_k, d_v = fused_backward(_pad_to(d_out, width), q, k, _pad_to(v, width),
                                           _pad_to(out, width), lse, ctx.scale, ctx.causal,
                                           ctx.window)
            d_sinks = sink_grad(d_out, out, lse, sinks) if ctx.sinks else None
            return d_q, d_k, d_v[..., :v.shape[-1]], None, None, None, None, d_sinks
        group = ctx.group
        q, k, v, probs, sinks = ctx.saved_tensors
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        d_out_h = d_out.transpose(1, 2)  # (b, a, s, d)
        k_full, v_full = _expand_kv(kh, group), _expand_kv(vh, group)
        d_v = probs.transpose(-1, -2) @ d_out_h
        d_probs = d_out_h @ v_full.transpose(-1, -2)
        row = (d_probs * probs).sum(-1, keepdim=True)  # (b, a, s, 1)
        d_scores = probs * (d_probs - row)
        d_q = d_scores @ k_full * ctx.scale
        d_k = d_scores.transpose(-1, -2) @ qh * ctx.scale
        d_sinks = None
        if ctx.sinks:  # the sink's share 1 - rowsum(P)
            d_sinks = -((1 - probs.sum(-1, keepdim=True)) * row).sum(dim=(0, 2, 3))
            d_sinks = d_sinks.to(sinks.dtype)
        return (d_q.transpose(1, 2), _sum_groups(d_k, group).transpose(1, 2),
                _sum_groups(d_v, group).transpose(1, 2), None, None, None, None, d_sinks)


def local_attention(causal: bool, flash: bool, scale: float | None = None,
                    window: int = 0) -> AttentionCore:
    """The attention core of one rank holding every position: `AttentionFunction` (causal or
    not; `flash`: the fused kernel; `scale`, `window` as there)."""
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return AttentionFunction.apply(q, k, v, causal, flash, scale, window)

    return core


class Attention(nn.Module):
    """GQA self-attention with RoPE. `core` computes softmax(QKᵀ/√d)V on (b, s, heads, d)
    tensors; context parallelism swaps in ring attention, tensor parallelism shards heads and
    sets `enter` (before Q, K, V) and `leave` (after O) to its conjugate operators, sequence
    parallelism `project` (Q, K, V from the entered input) to the fused all-gather.

    Layer `layer`'s variants (docs/concepts/attention.md): its sliding window (`window`,
    `ModelSpec.layer_kind`), attention sinks (`sinks` (a,), gpt-oss), QK-norm (`q_norm`,
    `k_norm`: RMSNorm over each head's d, Gemma's `(1 + w)`, before RoPE) and Gemma's
    `query_pre_attn_scalar^-½` as the scale; with any of them the local core runs them
    (`variant_core`) and the model refuses context parallelism."""

    def __init__(self, spec: ModelSpec, flash: bool, dtype: torch.dtype, layer: int = 0):
        super().__init__()
        h, d = spec.d_model, spec.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, d
        qkv_bias, out_bias = spec.bias or spec.qkv_bias, spec.bias or spec.out_bias
        self.wq = nn.Linear(h, spec.n_heads * d, bias=qkv_bias, dtype=dtype)
        self.wk = nn.Linear(h, spec.n_kv_heads * d, bias=qkv_bias, dtype=dtype)
        self.wv = nn.Linear(h, spec.n_kv_heads * d, bias=qkv_bias, dtype=dtype)
        self.wo = nn.Linear(spec.n_heads * d, h, bias=out_bias, dtype=dtype)
        self.flash = flash
        self.window = spec.sliding_window if spec.layer_kind(layer) == "sliding" else 0
        pre_attn = dict(spec.multipliers).get("query_pre_attn_scalar")
        self.scale = None if pre_attn is None else pre_attn ** -0.5
        self.sinks = (nn.Parameter(torch.zeros(spec.n_heads, dtype=dtype))
                      if spec.attention_sinks else None)
        if spec.qk_norm == "head":  # Gemma 3 (the (1 + w) form), Qwen3's plain one
            offset = 1.0 if spec.block_norms == "sandwich" else 0.0
            self.q_norm = RMSNorm(d, spec.norm_eps, dtype, offset)
            self.k_norm = RMSNorm(d, spec.norm_eps, dtype, offset)
        variant = self.window or self.sinks is not None or self.scale is not None
        self.core: AttentionCore = (self.variant_core if variant
                                    else local_attention(causal=True, flash=flash))
        self.enter: TensorMap = identity
        self.project: Projection = separate_linears
        self.leave: TensorMap = identity

    def variant_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The local core with this layer's scale, window and sinks."""
        return AttentionFunction.apply(q, k, v, True, self.flash, self.scale, self.window,
                                       self.sinks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(self.enter(x),
                               (self.wq.weight, self.wk.weight, self.wv.weight))
        if self.wq.bias is not None:  # Qwen2's q/k/v biases, added after the projection
            q, k, v = q + self.wq.bias, k + self.wk.bias, v + self.wv.bias
        b, s, _ = q.shape  # s: the whole sequence (SP's project gathers it)
        # (b, s, heads·d) -> (b, s, heads, d); heads = what this rank holds
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.leave(self.wo(out.reshape(b, s, -1)))  # (b, s, heads, d) -> (b, s, heads·d)


# ------------------------------------------------------------------ multi-head latent attention
def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(…, d) as pairs (x0, x1), (x2, x3), … -> (x0, x2, …, x1, x3, …): DeepSeek's interleaved
    RoPE layout turned into the half-split one `apply_rotary` rotates — each pair rotates by
    its own angle in both, and q and k are permuted alike, so q·k is unchanged (transformers'
    `apply_rotary_pos_emb_interleave` returns this layout too). A copy that saves nothing."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # (…, d/2, 2) -> (…, 2, d/2)


# transformers builds MLA's latent norms with DeepseekV3RMSNorm's default ε, not rms_norm_eps
# (as DeepSeek's reference inference/model.py: RMSNorm(q_lora_rank))
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 §2.1; transformers'
    `DeepseekV3Attention`):

        c_q = RMSNorm(x W_DQ)   (b, s, r_q)       q = c_q W_UQ   (x W_Q without a q latent)
        [c_kv, k_R] = x W_DKV   (b, s, r_kv + d_R)
        [k_nope, v] = RMSNorm(c_kv) W_UKV          per head d_nope + d_v
        q = [q_nope, RoPE(q_R)],  k = [k_nope, RoPE(k_R)]   k_R (one head) shared by all heads
        O = softmax(q kᵀ / √(d_nope + d_R)) v W_O

    Keeps for backward the normed input (both down-projections share it), each latent norm's
    input and rstd (the kv norm's input is a view of W_DKV's output: its storage, r_kv + d_R
    wide, stays), the normed latents (the up-projections' input), and q, k, v, the output
    and the log-sum-exp (or the softmax) of `AttentionFunction`; RoPE, the concatenations and
    the expansion of k_R keep nothing.

    Swap points as `Attention`: tensor parallelism splits the heads — W_UQ (W_Q) and W_UKV by
    output rows, W_O by input columns — with `enter`/`leave` its f and g; the down-projections
    and latent norms stay whole on every rank (Megatron-Core's duplicated `linear_q_down_proj`
    / `linear_kv_down_proj`), so their gradients are partial sums over tp
    (`ParamShard.sequence_parallel`)."""

    def __init__(self, spec: ModelSpec, flash: bool, dtype: torch.dtype):
        super().__init__()
        h, a = spec.d_model, spec.n_heads
        self.d_nope, self.d_rope, self.d_v = (spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                                              spec.v_head_dim)
        self.head_dim, self.interleave = spec.head_dim, spec.rope_interleave
        self.kv_rank = spec.kv_lora_rank
        if spec.q_lora_rank:
            self.wq_a = nn.Linear(h, spec.q_lora_rank, bias=False, dtype=dtype)
            self.q_norm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.wq_b = nn.Linear(spec.q_lora_rank, a * self.head_dim, bias=False, dtype=dtype)
        else:
            self.wq = nn.Linear(h, a * self.head_dim, bias=False, dtype=dtype)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.d_rope, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, dtype=dtype)
        self.wkv_b = nn.Linear(self.kv_rank, a * (self.d_nope + self.d_v), bias=False,
                               dtype=dtype)
        self.wo = nn.Linear(a * self.d_v, h, bias=False, dtype=dtype)
        self.core: AttentionCore = local_attention(causal=True, flash=flash)
        self.enter: TensorMap = identity
        self.leave: TensorMap = identity

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(deinterleave(x) if self.interleave else x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.d_rope], dim=-1)  # views
        kv = self.wkv_b(self.kv_norm(latent))
        # (b, s, heads·d) -> (b, s, heads, d); heads = what this rank holds
        q = q.view(b, s, -1, self.head_dim)
        kv = kv.view(b, s, -1, self.d_nope + self.d_v)
        heads = q.shape[2]
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        k_rope = self._rope(k_rope.view(b, s, 1, self.d_rope), cos, sin)  # one shared head
        q = torch.cat([q_nope, self._rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, s, heads, self.d_rope)], dim=-1)
        out = self.core(q, k, v.contiguous())  # (b, s, heads, d_v)
        return self.leave(self.wo(out.reshape(b, s, -1)))  # (b, s, heads, d_v) -> (b, s, ·)


