"""A small Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU) defined once for one
device, built from a `ModelSpec`.

Each op that keeps tensors for backward is an autograd function that saves exactly what the
generalised activation count of SPEC §3 says (`estimate.memory.saved_tensors_per_layer`):

    RMSNorm      its input and one statistic per row (rstd)
    RoPE         nothing (the backward is the inverse rotation by constant angles)
    attention    Q, K, V and the softmax output (materialised), or Q, K, V, the output and the
                 log-sum-exp per row (FlashAttention-style: the scores are recomputed)
    SwiGLU       gate and up projections; the down projection keeps silu(gate)·up
    linear       its input (the weight is a parameter, not an activation)

so `runtime.measure.saved_bytes_per_layer` can hold the model to the formula. Parallel
versions (tensor, context, pipeline, data) reuse these modules and functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.arch import ModelSpec

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


# --------------------------------------------------------------------------------------- RoPE
def rotary_tables(positions: torch.Tensor, head_dim: int, base: float = 10000.0,
                  dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (s, d) for the given token positions (Su et al. 2021, the
    half-split convention of Llama/GPT-NeoX)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
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
        future = torch.ones(s_q, s_k, dtype=torch.bool).triu(1 + s_k - s_q)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


class AttentionFunction(torch.autograd.Function):
    """softmax(QKᵀ/√d)·V with GQA, inputs and output in (b, s, heads, d).

    `flash=False` saves the softmax output P (`a·s²` per sequence); `flash=True` saves the
    output O and the log-sum-exp L per row and recomputes `P = exp(S - L)` in backward (Dao et
    al. 2022). Backward: `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP - rowsum(dO∘O))`,
    `dQ = dS·K/√d`, `dK = dSᵀ·Q/√d`; kv-head gradients summed over their query group.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                flash: bool) -> torch.Tensor:
        group = q.shape[2] // k.shape[2]
        # (b, s, heads, d) -> (b, heads, s, d) views
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        scores = _scores(qh, _expand_kv(kh, group), causal)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b, a, s, 1)
        probs = torch.exp(scores - lse)
        out = (probs @ _expand_kv(vh, group)).transpose(1, 2).contiguous()  # (b, s, a, d)
        ctx.causal, ctx.flash, ctx.group = causal, flash, group
        if flash:
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            ctx.save_for_backward(q, k, v, probs)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        group = ctx.group
        d_out_h = d_out.transpose(1, 2)  # (b, a, s, d)
        if ctx.flash:
            q, k, v, out, lse = ctx.saved_tensors
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            probs = torch.exp(_scores(qh, _expand_kv(kh, group), ctx.causal) - lse)
            # rowsum(dP∘P) = rowsum(dO∘O): FlashAttention's D, from the saved output
            delta = (d_out_h * out.transpose(1, 2)).sum(-1, keepdim=True)
        else:
            q, k, v, probs = ctx.saved_tensors
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            delta = None
        k_full, v_full = _expand_kv(kh, group), _expand_kv(vh, group)
        d_v = probs.transpose(-1, -2) @ d_out_h
        d_probs = d_out_h @ v_full.transpose(-1, -2)
        if delta is None:
            delta = (d_probs * probs).sum(-1, keepdim=True)
        d_scores = probs * (d_probs - delta)
        scale = 1 / math.sqrt(q.shape[-1])
        d_q = d_scores @ k_full * scale
        d_k = d_scores.transpose(-1, -2) @ qh * scale
        return (d_q.transpose(1, 2), _sum_groups(d_k, group).transpose(1, 2),
                _sum_groups(d_v, group).transpose(1, 2), None, None)


def local_attention(causal: bool, flash: bool) -> AttentionCore:
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return AttentionFunction.apply(q, k, v, causal, flash)

    return core


class Attention(nn.Module):
    """GQA self-attention with RoPE. `core` computes softmax(QKᵀ/√d)V on (b, s, heads, d)
    tensors; context parallelism swaps in ring attention, tensor parallelism shards heads."""

    def __init__(self, spec: ModelSpec, flash: bool, dtype: torch.dtype):
        super().__init__()
        h, d = spec.d_model, spec.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, d
        self.wq = nn.Linear(h, spec.n_heads * d, bias=False, dtype=dtype)
        self.wk = nn.Linear(h, spec.n_kv_heads * d, bias=False, dtype=dtype)
        self.wv = nn.Linear(h, spec.n_kv_heads * d, bias=False, dtype=dtype)
        self.wo = nn.Linear(spec.n_heads * d, h, bias=False, dtype=dtype)
        self.core: AttentionCore = local_attention(causal=True, flash=flash)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, h) -> (b, s, heads, d); heads = what this rank holds
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.wo(out.view(b, s, -1))  # (b, s, heads, d) -> (b, s, heads·d)


# ------------------------------------------------------------------------------------- MLPs
class SwiGLUFunction(torch.autograd.Function):
    """`silu(g)·u` (Shazeer 2020) saving only g and u: `d_u = dy·silu(g)`,
    `d_g = dy·u·σ(g)·(1 + g·(1 - σ(g)))`."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        return dy * up * sig * (1 + gate * (1 - sig)), dy * gate * sig


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dtype: torch.dtype):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.w_up = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.w_down = nn.Linear(d_ff, d_model, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(SwiGLUFunction.apply(self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, spec: ModelSpec, flash: bool, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = RMSNorm(spec.d_model, dtype=dtype)
        self.attention = Attention(spec, flash, dtype)
        self.mlp_norm = RMSNorm(spec.d_model, dtype=dtype)
        self.mlp: nn.Module = SwiGLU(spec.d_model, spec.d_ff, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Embedding → blocks → final norm → head. `forward(tokens)` returns logits (b, s, V);
    `loss(tokens, targets)` the mean next-token cross-entropy."""

    def __init__(self, spec: ModelSpec, *, flash: bool = True, dtype: torch.dtype = torch.float64,
                 seed: int = 0, rope_base: float = 10000.0):
        super().__init__()
        if not spec.gated_mlp or spec.norm != "rmsnorm":
            raise ValueError(f"the runtime model is Llama-style (RMSNorm, SwiGLU); {spec.name} "
                             "is not")
        torch.manual_seed(seed)
        self.spec, self.rope_base, self.dtype = spec, rope_base, dtype
        self.embedding = nn.Embedding(spec.vocab, spec.d_model, dtype=dtype)
        self.blocks = nn.ModuleList(Block(spec, flash, dtype) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, dtype=dtype)
        self.head = nn.Linear(spec.d_model, spec.vocab, bias=False, dtype=dtype)
        if spec.tie_embeddings:
            self.head.weight = self.embedding.weight
        for param in self.parameters():
            if param.dim() == 2:  # GPT-2's initialisation
                nn.init.normal_(param, std=0.02)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(positions, self.spec.head_dim, self.rope_base, self.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]) if positions is None else positions
        cos, sin = self.rotary(positions)
        x = self.embedding(tokens)  # (b, s) -> (b, s, h)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
