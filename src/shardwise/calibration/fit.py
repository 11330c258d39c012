"""Fit the step-time model's constants to measurements (NumPy least squares; no torch), each in
the model's own form (`estimate.kernels`, `estimate.comm`), residuals relative
(`(measured − fitted) / measured`):

    GEMM      t = t₀ + 2·M·K·N / (P∞ · M/(M+d½) · K/(K+d½) · N/(N+d½))  → P∞, d½
    α-β       t = rounds·α + bytes/β                                     → α, β
    per call  t = α_call + bytes/β, β given                              → α_call
    scale     t_i = a_i + k·n_i                                          → k

How each fit runs: docs/howto/calibrate.md ("The fits").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError

__all__ = ["AlphaBeta", "MatmulFit", "ScaleFit", "fit_alpha_beta", "fit_matmul",
           "fit_per_call", "fit_scale", "matmul_seconds", "relative_residuals"]


def relative_residuals(measured: Any, fitted: Any) -> np.ndarray:
    """`(measured − fitted) / measured`, element-wise."""
    measured = np.asarray(measured, dtype=float)
    return (measured - np.asarray(fitted, dtype=float)) / measured


def _summary(residuals: np.ndarray) -> dict[str, float]:
    return {"rms": float(np.sqrt(np.mean(residuals ** 2))),
            "max_abs": float(np.max(np.abs(residuals)))}


def _points(*columns: Sequence[float], what: str, need: int) -> list[np.ndarray]:
    arrays = [np.asarray(c, dtype=float) for c in columns]
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ShardwiseError(f"{what}: columns of different lengths")
    if n < need:
        raise ShardwiseError(f"{what}: need at least {need} measurements, got {n}")
    if not all(np.all(np.isfinite(a)) for a in arrays) or np.any(arrays[-1] <= 0):
        raise ShardwiseError(f"{what}: times must be finite and > 0")
    return arrays


# ------------------------------------------------------------------------------------ GEMM
def matmul_seconds(m: Any, k: Any, n: Any, peak: float, half_dim: float) -> Any:
    """`2·M·K·N / (P∞ · Π d/(d+d½))` — `estimate.compute.matmul_time`'s compute term."""
    sat = (m / (m + half_dim)) * (k / (k + half_dim)) * (n / (n + half_dim))
    return 2.0 * m * k * n / (peak * sat)


@dataclass(frozen=True)
class MatmulFit:
    """`peak` = P∞ (FLOP/s of a large GEMM), `half_dim` = d½, and the relative residuals."""

    peak: float
    half_dim: float
    residuals: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"peak_flops": self.peak, "half_dim": self.half_dim,
                "residuals": list(self.residuals),
                **_summary(np.asarray(self.residuals))}


def _best_scale(g: np.ndarray, t: np.ndarray, a: Any = 0.0) -> float:
    """argmin_x Σ((t − a − x·g)/t)² = Σ g(t − a)/t² / Σ g²/t²."""
    return float(np.sum(g * (t - a) / t**2) / np.sum(g**2 / t**2))


def fit_matmul(m: Sequence[float], k: Sequence[float], n: Sequence[float],
               seconds: Sequence[float], launch: float = 0.0,
               half_dim_range: tuple[float, float] = (1e-3, 1e5)) -> MatmulFit:
    """P∞ and d½ of `t = launch + 2MKN / (P∞·Π d/(d+d½))`. `launch`: the fixed cost of one
    call, measured apart (the model charges it as `kernel_overhead`, not in the GEMM's
    efficiency). Robust to a few outliers (a shared machine): for each d½, 1/P∞ is the median
    of `(t − launch)/(2MKN/Π sat)`, and d½ minimises the squared log residuals."""
    m_, k_, n_, t = _points(m, k, n, seconds, what="matmul fit", need=2)

    if np.any(t <= launch):
        raise ShardwiseError("matmul fit: a GEMM measured no slower than the launch cost; "
                             "measure larger shapes")

    def loss(log_half: float) -> tuple[float, float]:
        half = math.exp(log_half)
        g = matmul_seconds(m_, k_, n_, 1.0, half)
        x = math.exp(float(np.median(np.log((t - launch) / g))))
        return float(np.sum(np.log(t / (launch + x * g)) ** 2)), x

    lo, hi = (math.log(v) for v in half_dim_range)
    grid = np.linspace(lo, hi, 121)  # coarse scan, then golden section around the best
    losses = [loss(v)[0] for v in grid]
    i = int(np.argmin(losses))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if loss(c)[0] < loss(d)[0]:
            b = d
        else:
            a = c
    log_half = (a + b) / 2
    x = loss(log_half)[1]
    half = math.exp(log_half)
    fitted = launch + x * matmul_seconds(m_, k_, n_, 1.0, half)
    return MatmulFit(1.0 / x, half, tuple(relative_residuals(t, fitted).tolist()))


# ------------------------------------------------------------------------------------ α-β
@dataclass(frozen=True)
class AlphaBeta:
    """`alpha` seconds per round (latency), `beta` bytes/s, relative residuals."""

    alpha: float
    beta: float
    residuals: tuple[float, ...]

    def seconds(self, rounds: Any, n_bytes: Any) -> Any:
        return np.asarray(rounds) * self.alpha + np.asarray(n_bytes) / self.beta

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta, "residuals": list(self.residuals),
                **_summary(np.asarray(self.residuals))}


def fit_alpha_beta(rounds: Sequence[float], n_bytes: Sequence[float],
                   seconds: Sequence[float], what: str = "alpha-beta fit") -> AlphaBeta:
    """α ≥ 0 and β > 0 of `t = rounds·α + bytes/β`, relative least squares (rows of the
    design matrix divided by t). A negative α (noise on latency-free data) is clamped to 0
    and 1/β refitted alone."""
    r, nb, t = _points(rounds, n_bytes, seconds, what=what, need=2)
    design = np.stack([r / t, nb / t], axis=1)
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, inv_beta = 0.0, _best_scale(nb, t)
    if inv_beta <= 0:
        raise ShardwiseError(f"{what}: time does not grow with size (bandwidth ≤ 0); "
                             "measure larger messages")
    fit = AlphaBeta(float(alpha), float(1.0 / inv_beta), ())
    return AlphaBeta(fit.alpha, fit.beta, tuple(relative_residuals(t, fit.seconds(r, nb))))


# ---------------------------------------------------------------------------------- scale
@dataclass(frozen=True)
class ScaleFit:
    """`scale` k of `t = a + k·n` and the relative residuals."""

    scale: float
    residuals: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "residuals": list(self.residuals),
                **_summary(np.asarray(self.residuals))}


def fit_scale(base: Sequence[float], per_unit: Sequence[float], seconds: Sequence[float]
              ) -> ScaleFit:
    """k ≥ 0 of `t_i = a_i + k·n_i` minimising Σ((t_i − a_i − k·n_i)/t_i)²:
    `k = Σ n_i(t_i − a_i)/t_i² / Σ n_i²/t_i²`."""
    a, n, t = _points(base, per_unit, seconds, what="scale fit", need=1)
    k = max(_best_scale(n, t, a), 0.0)
    return ScaleFit(k, tuple(relative_residuals(t, a + k * n).tolist()))


def fit_per_call(keys: Sequence[str], n_bytes: Sequence[float], seconds: Sequence[float],
                 beta: float) -> dict[str, ScaleFit]:
    """α_call ≥ 0 of `t = α_call + bytes/β` for each key (a collective and group size, e.g.
    "all-reduce/2"), β given: the mean of `t − bytes/β` (absolute least squares), with
    relative residuals. Absolute, not relative like the other fits: each point is already a
    mean call, and a step pays the mean; relative weights (1/t²) favour the fastest points,
    which on gloo's long-tailed small calls put p2p/2's fixed cost at 217 µs where its own
    1–128 KiB points averaged 319 µs (calibration of 2026-12-01 12:23 UTC)."""
    if not beta > 0:
        raise ShardwiseError(f"per-call fit: bandwidth must be > 0, got {beta}")
    _, nb, t = _points([0.0] * len(keys), n_bytes, seconds, what="per-call fit", need=1)
    fits = {}
    for key in sorted(set(keys)):
        rows = np.array([k == key for k in keys])
        base = nb[rows] / beta
        alpha = max(float(np.mean(t[rows] - base)), 0.0)
        fits[key] = ScaleFit(alpha, tuple(relative_residuals(t[rows], base + alpha).tolist()))
    return fits
