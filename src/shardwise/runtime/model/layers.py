"""The runtime model's small pieces: the swap-point types and defaults (`identity`,
`separate_linears`), RMSNorm and RoPE as autograd functions that save what SPEC §3 counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ShardwiseError

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


