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
    """`y = x · rstd · (w + o)`, `rstd = 1/sqrt(mean(x²) + ε)` (Zhang & Sennrich 2019); the
    offset `o` is 0, or 1 for Gemma's `(1 + w)` (transformers 5.24 `Gemma3RMSNorm`). The
    statistic is computed and kept in at least fp32 (SPEC §3's count; fused norm kernels keep
    rstd in fp32), `x·rstd` rounded to x's dtype before the weight multiplies it (as
    transformers' `LlamaRMSNorm`).

    Backward with `x̂ = x·rstd`, `g = dy·(w + o)`: `dx = rstd·(g - x̂·mean(g·x̂))`,
    `dw = Σ dy·x̂`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,
                offset: float = 0.0) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, rstd, weight)
        ctx.offset = offset
        return (wide * rstd).to(x.dtype) * (weight + offset if offset else weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        g = dy.to(rstd.dtype) * (weight + ctx.offset if ctx.offset else weight)
        dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        dw = (dy.to(rstd.dtype) * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale, through `RMSNormFunction` (saves x and rstd); `offset`
    1: Gemma's `x̂·(1 + w)`, whose weight starts at 0."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype = torch.float64,
                 offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps, self.offset)


# --------------------------------------------------------------------------------------- RoPE
def inverse_frequencies(head_dim: int, base: float = 10000.0,
                        scaling: tuple[tuple[str, object], ...] = ()) -> torch.Tensor:
    """RoPE's `θ^(-2i/d)`, i = 0…d/2-1, in fp64 (Su et al. 2021), optionally with Llama 3.1's
    frequency scaling (`rope_type` "llama3"; Meta's `apply_scaling` in llama-models, the same
    as transformers' `_compute_llama3_parameters`): with wavelength λ = 2π/ω and the original
    context C, λ < C/high_freq_factor keeps ω, λ > C/low_freq_factor divides it by `factor`,
    and between them `ω·((1-α)/factor + α)`, `α = (C/λ - low)/(high - low)`; or YaRN's
    (`yarn_frequencies`), or linear scaling's `ω/factor`."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    params = dict(scaling)
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ShardwiseError(f"RoPE scaling {kind!r} is not supported by the runtime model; "
                             f"valid: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return inv_freq
    if kind == "yarn":
        return yarn_frequencies(inv_freq, head_dim, base, params)
    if kind == "linear":  # positions ÷ factor (Gemma 3's global layers; transformers 5.24
        return inv_freq / float(params["factor"])  # _compute_linear_scaling_rope_parameters)
    factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor",  # type: ignore
                                                    "high_freq_factor"))
    context = float(params["original_max_position_embeddings"])  # type: ignore[arg-type]
    wavelength = 2 * math.pi / inv_freq
    alpha = (context / wavelength - low) / (high - low)
    smoothed = inv_freq * ((1 - alpha) / factor + alpha)
    return torch.where(wavelength < context / high, inv_freq,
                       torch.where(wavelength > context / low, inv_freq / factor, smoothed))


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, base: float,
                     params: dict[str, object]) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, arXiv:2309.00071; transformers 5.24
    `_compute_yarn_parameters`): with `factor` s, the original context C and the correction
    range [lo, hi] = the dims where C/(2π·β·λ_unit) rotations fall between beta_fast and
    beta_slow (`d·ln(C/(2πβ))/(2 ln θ)`, floored/ceiled unless `truncate` is false, clipped
    to [0, d-1]), dim i keeps `ω_i` below lo, `ω_i/s` above hi, a linear ramp between."""
    factor = float(params["factor"])  # type: ignore[arg-type]
    context = float(params["original_max_position_embeddings"])  # type: ignore[arg-type]
    fast = float(params.get("beta_fast") or 32)  # type: ignore[arg-type]
    slow = float(params.get("beta_slow") or 1)  # type: ignore[arg-type]

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: tuple[tuple[str, object], ...] = ()) -> float:
    """The factor YaRN multiplies cos and sin by: `attention_factor`, else
    `0.1·ln(s) + 1` (s > 1; with `mscale` and `mscale_all_dim` their ratio), as transformers
    5.24 `_compute_yarn_parameters`; 1 for the other RoPE types."""
    params = dict(scaling)
    if params.get("rope_type") != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])  # type: ignore[arg-type]
    factor = float(params["factor"])  # type: ignore[arg-type]

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(float(m)) / mscale(float(m_all))  # type: ignore[arg-type]
    return mscale(1.0)


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float = 10000.0,
                  dtype: torch.dtype = torch.float64,
                  scaling: tuple[tuple[str, object], ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (s, d) for the given token positions (Su et al. 2021, the
    half-split convention of Llama/GPT-NeoX)."""
    inv_freq = inverse_frequencies(head_dim, base, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (s, d/2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, d)
    scale = rope_attention_factor(scaling)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


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


