"""A small Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU or top-k MoE layers, tied
or untied embeddings) defined once for one device, built from a `ModelSpec`.

Each op that keeps tensors for backward is an autograd function that saves exactly what the
generalised activation count of SPEC §3 says (`estimate.memory.saved_tensors_per_layer`):

    RMSNorm      its input and one statistic per row (rstd)
    RoPE         nothing (the backward is the inverse rotation by constant angles)
    attention    Q, K, V and the softmax output (materialised), or Q, K, V, the output and the
                 log-sum-exp per row (torch's fused flash kernel: the scores are recomputed)
    MLA          the latents' norms (their input: for kv the whole r_kv + d_R output of W_DKV —
                 a view of it — and rstd), the normed latents (the up-projections' input), then
                 Q, K, V at their head widths as attention does (`LatentAttention`)
    SwiGLU       gate and up projections; the down projection keeps silu(gate)·up
    linear       its input (the weight is a parameter, not an activation)
    MoE          the router input and probabilities; per routed row the expert's input, gate,
                 up and down-projection input, and its output (`ops.moe.moe_layer`); per
                 shared expert the gate, up and down-projection input of every token

so `runtime.measure.saved_bytes_per_layer` can hold the model to the formula.

The parallel versions (`runtime.parallelize`) change this model in place, one axis at a time,
through a few swap points and nothing else:

    Attention.enter / .leave, SwiGLU.enter / .leave   identity here; Megatron's f and g (or
                        sequence parallelism's reduce-scatter as `leave`) under TP
    Attention.project, SwiGLU.project   the column linears (Q, K, V; gate, up) on the entered
                        input: one nn.Linear each here; under sequence parallelism the
                        all-gather fused with them, which keeps only the sequence shard
    Attention.core      local attention here; ring attention under CP; checkpointed when
                        recomputing selectively
    MoE.experts         every expert on this device here; all-to-all dispatch under EP
    Transformer.cross_entropy   per-token loss; vocabulary-parallel under TP
    Block.recompute     full recompute of the block in backward
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.ops.attention import fused_backward, fused_forward
from shardwise.ops.moe import MoEParams, RoutingRule, SequenceShards, expert_mlp, moe_layer
from shardwise.ops.swiglu import SwiGLUFunction
from shardwise.runtime.mixed_precision import loss_dtype

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
TensorMap = Callable[[torch.Tensor], torch.Tensor]
# (input, weights) -> one output per weight: the column linears that share an input
Projection = Callable[[torch.Tensor, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


def identity(x: torch.Tensor) -> torch.Tensor:
    """`x` unchanged: the projection of a layer without tensor parallelism."""
    return x


def separate_linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...]
                     ) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w)` for each weight: each saves x for its weight gradient (one storage)."""
    return tuple(F.linear(x, w) for w in weights)


# ------------------------------------------------------------------------------------ RMSNorm
class RMSNormFunction(torch.autograd.Function):
    """`y = x · rstd · w`, `rstd = 1/sqrt(mean(x²) + ε)` (Zhang & Sennrich 2019).

    Backward with `x̂ = x·rstd`, `g = dy·w`: `dx = rstd·(g - x̂·mean(g·x̂))`, `dw = Σ dy·x̂`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x * rstd
        g = dy * weight
        dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        dw = (dy * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return dx, dw, None


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale, through `RMSNormFunction` (saves x and rstd)."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


# --------------------------------------------------------------------------------------- RoPE
def inverse_frequencies(head_dim: int, base: float = 10000.0,
                        scaling: tuple[tuple[str, object], ...] = ()) -> torch.Tensor:
    """RoPE's `θ^(-2i/d)`, i = 0…d/2-1, in fp64 (Su et al. 2021), optionally with Llama 3.1's
    frequency scaling (`rope_type` "llama3"; Meta's `apply_scaling` in llama-models, the same
    as transformers' `_compute_llama3_parameters`): with wavelength λ = 2π/ω and the original
    context C, λ < C/high_freq_factor keeps ω, λ > C/low_freq_factor divides it by `factor`,
    and between them `ω·((1-α)/factor + α)`, `α = (C/λ - low)/(high - low)`."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    params = dict(scaling)
    kind = params.get("rope_type", "default")
    if kind not in ("default", "llama3"):
        raise ShardwiseError(f"RoPE scaling {kind!r} is not supported by the runtime model; "
                             "valid: default, llama3")
    if kind == "default":
        return inv_freq
    factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor",  # type: ignore
                                                    "high_freq_factor"))
    context = float(params["original_max_position_embeddings"])  # type: ignore[arg-type]
    wavelength = 2 * math.pi / inv_freq
    alpha = (context / wavelength - low) / (high - low)
    smoothed = inv_freq * ((1 - alpha) / factor + alpha)
    return torch.where(wavelength < context / high, inv_freq,
                       torch.where(wavelength > context / low, inv_freq / factor, smoothed))


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float = 10000.0,
                  dtype: torch.dtype = torch.float64,
                  scaling: tuple[tuple[str, object], ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (s, d) for the given token positions (Su et al. 2021, the
    half-split convention of Llama/GPT-NeoX)."""
    inv_freq = inverse_frequencies(head_dim, base, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (s, d/2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, -x1], dim=-1)


class RotaryFunction(torch.autograd.Function):
    """`y = x·cos + rotate_half(x)·sin`; backward `dx = dy·cos + rotate_halfᵀ(dy·sin)`.
    The angles are constants of the positions, kept on `ctx`, not saved activations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.tables = (cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.tables
        return dy * cos + _rotate_half_transposed(dy * sin), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, s, heads, d); cos, sin: (s, d)."""
    return RotaryFunction.apply(x, cos[:, None, :], sin[:, None, :])


# ---------------------------------------------------------------------------------- attention
def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(b, a_kv, s, d) -> (b, a_kv·group, s, d): each kv head serves `group` query heads."""
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _sum_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """(b, a, s, d) -> (b, a/group, s, d): gradients of shared kv heads add up."""
    if group == 1:
        return t
    b, a, s, d = t.shape
    return t.view(b, a // group, group, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """q: (b, a, s_q, d), k: (b, a, s_k, d) -> scaled scores (b, a, s_q, s_k), future masked."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = scores.shape[-2:]
        future = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1 + s_k - s_q)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (…, d) zero-padded to (…, width) on the last dim (t itself when d = width)."""
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


class AttentionFunction(torch.autograd.Function):
    """softmax(QKᵀ/√d)·V with GQA, inputs and output in (b, s, heads, d); V (and the output)
    may be narrower than Q and K (MLA's `d_v`).

    `flash=True` runs the fused kernel of `ops.attention.fused_forward` (on CPU torch's flash
    kernel, what `F.scaled_dot_product_attention` runs) and saves Q, K, V, the output O and the
    log-sum-exp L per row (fp32 for 16-bit activations); its backward recomputes
    `P = exp(S - L)` blockwise (Dao et al. 2022; `fused_backward`). The CPU kernel needs equal
    head widths: a narrower V is zero-padded for the call and the output's zero columns cut
    off; backward pads V, O and dO again (O enters only through `D = rowsum(dO ∘ O)`, where
    zero columns add nothing), so what is saved is V and O at `d_v`. `flash=False` materialises
    and saves the softmax output P (`a·s²` per sequence) — the count without FlashAttention —
    with the hand-written backward `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP - rowsum(dP∘P))`,
    `dQ = dS·K/√d`, `dK = dSᵀ·Q/√d`; kv-head gradients summed over their query group.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                flash: bool) -> torch.Tensor:
        ctx.causal, ctx.flash, ctx.scale = causal, flash, 1 / math.sqrt(q.shape[-1])
        if flash:
            width, d_v = q.shape[-1], v.shape[-1]
            out, lse = fused_forward(q, k, _pad_to(v, width), ctx.scale, causal)
            if d_v < width:  # (b, s, a, d) -> (b, s, a, d_v), contiguous: O's input keeps it
                out = out[..., :d_v].contiguous()
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        group = q.shape[2] // k.shape[2]
        # (b, s, heads, d) -> (b, heads, s, d) views
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        probs = torch.softmax(_scores(qh, _expand_kv(kh, group), causal), dim=-1)
        out = (probs @ _expand_kv(vh, group)).transpose(1, 2).contiguous()  # (b, s, a, d)
        ctx.group = group
        ctx.save_for_backward(q, k, v, probs)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        if ctx.flash:
            q, k, v, out, lse = ctx.saved_tensors
            width = q.shape[-1]
            d_q, d_k, d_v = fused_backward(_pad_to(d_out, width), q, k, _pad_to(v, width),
                                           _pad_to(out, width), lse, ctx.scale, ctx.causal)
            return d_q, d_k, d_v[..., :v.shape[-1]], None, None
        group = ctx.group
        q, k, v, probs = ctx.saved_tensors
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        d_out_h = d_out.transpose(1, 2)  # (b, a, s, d)
        k_full, v_full = _expand_kv(kh, group), _expand_kv(vh, group)
        d_v = probs.transpose(-1, -2) @ d_out_h
        d_probs = d_out_h @ v_full.transpose(-1, -2)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        d_q = d_scores @ k_full * ctx.scale
        d_k = d_scores.transpose(-1, -2) @ qh * ctx.scale
        return (d_q.transpose(1, 2), _sum_groups(d_k, group).transpose(1, 2),
                _sum_groups(d_v, group).transpose(1, 2), None, None)


def local_attention(causal: bool, flash: bool) -> AttentionCore:
    """The attention core of one rank holding every position: `AttentionFunction` (causal or
    not; `flash`: the fused kernel)."""
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return AttentionFunction.apply(q, k, v, causal, flash)

    return core


class Attention(nn.Module):
    """GQA self-attention with RoPE. `core` computes softmax(QKᵀ/√d)V on (b, s, heads, d)
    tensors; context parallelism swaps in ring attention, tensor parallelism shards heads and
    sets `enter` (before Q, K, V) and `leave` (after O) to its conjugate operators, sequence
    parallelism `project` (Q, K, V from the entered input) to the fused all-gather."""

    def __init__(self, spec: ModelSpec, flash: bool, dtype: torch.dtype):
        super().__init__()
        h, d = spec.d_model, spec.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, d
        qkv_bias, out_bias = spec.bias or spec.qkv_bias, spec.bias or spec.out_bias
        self.wq = nn.Linear(h, spec.n_heads * d, bias=qkv_bias, dtype=dtype)
        self.wk = nn.Linear(h, spec.n_kv_heads * d, bias=qkv_bias, dtype=dtype)
        self.wv = nn.Linear(h, spec.n_kv_heads * d, bias=qkv_bias, dtype=dtype)
        self.wo = nn.Linear(spec.n_heads * d, h, bias=out_bias, dtype=dtype)
        self.core: AttentionCore = local_attention(causal=True, flash=flash)
        self.enter: TensorMap = identity
        self.project: Projection = separate_linears
        self.leave: TensorMap = identity

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(self.enter(x),
                               (self.wq.weight, self.wk.weight, self.wv.weight))
        if self.wq.bias is not None:  # Qwen2's q/k/v biases, added after the projection
            q, k, v = q + self.wq.bias, k + self.wk.bias, v + self.wv.bias
        b, s, _ = q.shape  # s: the whole sequence (SP's project gathers it)
        # (b, s, heads·d) -> (b, s, heads, d); heads = what this rank holds
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
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


# ------------------------------------------------------------------------------------- MLPs
class SwiGLU(nn.Module):
    """`W_down(silu(W_gate x)·W_up x)`; tensor parallelism splits f and sets `enter`/`leave`
    (and, with sequence parallelism, `project`: gate and up from the entered input)."""

    def __init__(self, d_model: int, d_ff: int, dtype: torch.dtype):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.w_up = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.w_down = nn.Linear(d_ff, d_model, bias=False, dtype=dtype)
        self.enter: TensorMap = identity
        self.project: Projection = separate_linears
        self.leave: TensorMap = identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(self.enter(x), (self.w_gate.weight, self.w_up.weight))
        return self.leave(self.w_down(SwiGLUFunction.apply(gate, up)))


class AuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: forward returns `y` unchanged, backward
    passes `dy` through and seeds the loss's gradient with `scale` (Megatron-LM's
    `MoEAuxLossAutoScaler`). The layer's loss joins the objective wherever the layer runs —
    on any pipeline stage — without travelling to the last stage."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, torch.full((), ctx.scale, dtype=dy.dtype, device=dy.device), None


# (T, h) tokens -> (output (T, h), the layer's load-balancing loss)
Experts = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Shazeer et al. 2017; Mixtral's renormalised gates) plus
    `n_shared_experts` always-on SwiGLU experts (DeepSeekMoE, Dai et al. 2024):

        y = Σ_{s shared} E_s(x) + Σ_{i ∈ topk(softmax(x W_r)), kept} g_i · E_i(x)

    per token. Parameters as `ops.moe.MoEParams`: router (h, E), w_gate, w_up (E, h, f),
    w_down (E, f, h); shared_gate, shared_up (S, h, f), shared_down (S, f, h).

    `capacity_factor` (None: no limit, nothing dropped) caps every expert at
    `⌈cf · T·k / E⌉` assignments from the T tokens of one call — one micro-batch on one rank
    (GShard's group; under expert parallelism the rank's own tokens, before dispatch, as
    Megatron-LM and Switch compute it; with the sequences split over cp or SP ranks, the
    whole micro-batch's, `sequence_shards`); `ops.moe` keeps them in token order. With
    `aux_loss_coef` α > 0 the objective gains `α · L_aux` of every MoE layer (Switch's
    `E · Σ_i f_i P_i` over the call's tokens), scaled by `aux_loss_scale` (1/m over m
    micro-batches, as the cross-entropy is); `aux_loss` keeps the last call's value (this
    rank's share when `sequence_shards` is set).
    `experts` maps tokens (T, h) -> (y, L_aux); expert parallelism swaps it."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        h, f, e, s = spec.d_model, spec.expert_d_ff, spec.n_experts, spec.n_shared_experts
        self.top_k = spec.top_k
        self.routing = {"normalize": spec.norm_topk, "score": spec.router_score,
                        "scale": spec.routed_scaling, "groups": spec.expert_groups,
                        "topk_groups": spec.topk_groups}
        # DeepSeek-V3's e_score_correction_bias: fixed here (loaded with a checkpoint; its
        # aux-loss-free update between steps is not run), in at least fp32 as transformers
        self.score_bias: torch.Tensor | None
        self.register_buffer("score_bias", torch.zeros(
            e, dtype=torch.promote_types(dtype, torch.float32))
            if spec.router_score == "sigmoid" else None)
        self.router = nn.Parameter(torch.empty(h, e, dtype=dtype))
        self.w_gate = nn.Parameter(torch.empty(e, h, f, dtype=dtype))
        self.w_up = nn.Parameter(torch.empty(e, h, f, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(e, f, h, dtype=dtype))
        if s:
            self.shared_gate = nn.Parameter(torch.empty(s, h, f, dtype=dtype))
            self.shared_up = nn.Parameter(torch.empty(s, h, f, dtype=dtype))
            self.shared_down = nn.Parameter(torch.empty(s, f, h, dtype=dtype))
        self.n_shared = s
        self.capacity_factor: float | None = None
        self.aux_loss_coef = 0.0
        self.aux_loss_scale = 1.0
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0  # assignments of the last call's tokens dropped at the capacity
        self.expert_rows: torch.Tensor | None = None  # (experts here,) rows each ran, last call
        # the call's tokens are part of sequences split over other ranks (cp, SP): the aux
        # loss is this rank's share of their group's (`ops.moe.load_balancing_loss`)
        self.sequence_shards: SequenceShards | None = None
        self.experts: Experts = self.all_experts

    @property
    def routing_shards(self) -> SequenceShards | None:
        """`sequence_shards` as this layer uses them: the counts summed over the shards only
        when the aux loss joins the objective (otherwise each rank keeps its own, unused,
        value), the choices exchanged only under a capacity factor."""
        s = self.sequence_shards
        if s is None:
            return None
        return replace(s, total=s.total if self.aux_loss_coef else None,
                       keep=s.keep if self.capacity_factor is not None else None)

    def rule(self) -> RoutingRule:
        """The router's rule: top-k, scores, groups, bias and scale (`ops.moe.RoutingRule`)."""
        return RoutingRule(self.top_k, bias=self.score_bias, **self.routing)

    def all_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = MoEParams(self.router, self.w_gate, self.w_up, self.w_down)
        result = moe_layer(x, params, self.top_k, capacity_factor=self.capacity_factor,
                           shards=self.routing_shards, routing=self.rule())
        self.dropped, self.expert_rows = result.dropped, result.kept
        return result.out, result.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (b, s, h) -> (b·s, h)
        y, aux = self.experts(tokens)
        self.aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():
            y = AuxLossAutoScaler.apply(y, aux, self.aux_loss_coef * self.aux_loss_scale)
        for i in range(self.n_shared):  # the shared experts see every token
            y = y + expert_mlp(tokens, self.shared_gate[i], self.shared_up[i],
                               self.shared_down[i])
        return y.view(shape)


def configure_moe(model: nn.Module, capacity_factor: float | None = None,
                  aux_loss_coef: float = 0.0) -> None:
    """Set the capacity factor and the auxiliary-loss coefficient of every MoE layer."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.capacity_factor, module.aux_loss_coef = capacity_factor, aux_loss_coef


class Block(nn.Module):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`. With
    `recompute` set, backward recomputes the block's forward instead of keeping its
    activations (full recompute; Chen et al. 2016)."""

    def __init__(self, spec: ModelSpec, flash: bool, dtype: torch.dtype, moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(spec.d_model, spec.norm_eps, dtype=dtype)
        self.attention: nn.Module = (LatentAttention(spec, flash, dtype) if spec.is_mla
                                     else Attention(spec, flash, dtype))
        self.mlp_norm = RMSNorm(spec.d_model, spec.norm_eps, dtype=dtype)
        self.mlp: nn.Module = MoE(spec, dtype) if moe else SwiGLU(spec.d_model, spec.d_ff, dtype)
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
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token loss (b, s) from logits (b, s, V)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                           reduction="none").view(targets.shape)


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device)  # (s,): 0, 1, …, s-1


class Transformer(nn.Module):
    """Embedding → blocks → final norm → head. `forward(tokens)` returns logits (b, s, V);
    `loss(tokens, targets)` the mean next-token cross-entropy. `positions` (s,) are the global
    positions of the tokens given (a context-parallel rank holds a subset)."""

    def __init__(self, spec: ModelSpec, *, flash: bool = True, dtype: torch.dtype = torch.float64,
                 seed: int = 0):
        super().__init__()
        if not spec.gated_mlp or spec.norm != "rmsnorm":
            raise ValueError(f"the runtime model is Llama-style (RMSNorm, SwiGLU); {spec.name} "
                             "is not")
        torch.manual_seed(seed)
        self.spec, self.dtype = spec, dtype
        self.embedding = nn.Embedding(spec.vocab, spec.d_model, dtype=dtype)
        self.blocks = nn.ModuleList(Block(spec, flash, dtype, spec.is_moe_layer(i))
                                    for i in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, spec.norm_eps, dtype=dtype)
        self.head = nn.Linear(spec.d_model, spec.vocab, bias=False, dtype=dtype)
        if spec.tie_embeddings:
            self.head.weight = self.embedding.weight
        self.cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            token_cross_entropy)
        for param in self.parameters():
            if param.dim() >= 2:  # GPT-2's initialisation (experts too)
                nn.init.normal_(param, std=0.02)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):  # biases start at zero (as under HF's _init_weights)
                nn.init.zeros_(param)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        return rotary_tables(positions, spec.rope_dim, spec.rope_theta, self.dtype,
                             spec.rope_scaling)

    def run_blocks(self, x: torch.Tensor, layers: range | tuple[int, ...],
                   positions: torch.Tensor) -> torch.Tensor:
        """Blocks `layers` on activations x (b, s, h); a pipeline stage runs a subset."""
        cos, sin = self.rotary(positions)
        for k in layers:
            x = self.blocks[k](x, cos, sin)
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
