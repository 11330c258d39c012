"""The fits recover known parameters from synthetic measurements (closed-form references)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.calibration.fit import (
    fit_alpha_beta,
    fit_matmul,
    fit_per_call,
    fit_scale,
    matmul_seconds,
    relative_residuals,
)
from shardwise.errors import ShardwiseError

SHAPES = [(m, k, n) for m in (16, 64, 256, 1024) for k in (32, 128, 512) for n in (8, 256)]


def test_matmul_seconds_is_the_roofline_compute_term():
    # 2·64·64·64 FLOPs at 1e9 · (64/128)³ = 1.25e8 FLOP/s: 524,288 / 1.25e8 s
    assert matmul_seconds(64, 64, 64, 1e9, 64.0) == pytest.approx(524_288 / 1.25e8, rel=1e-15)


@settings(max_examples=25, deadline=None)
@given(peak=st.floats(1e9, 1e15), half=st.floats(1.0, 2000.0),
       launch=st.sampled_from([0.0, 5e-6]))
def test_matmul_fit_recovers_peak_and_half_dim(peak, half, launch):
    m, k, n = (np.array(c, dtype=float) for c in zip(*SHAPES))
    seconds = launch + matmul_seconds(m, k, n, peak, half)
    fit = fit_matmul(m, k, n, seconds, launch=launch)
    assert fit.peak == pytest.approx(peak, rel=1e-5)
    assert fit.half_dim == pytest.approx(half, rel=1e-4)
    assert max(abs(r) for r in fit.residuals) < 1e-6


def test_matmul_fit_is_robust_to_noise():
    rng = np.random.default_rng(0)
    m, k, n = (np.array(c, dtype=float) for c in zip(*SHAPES))
    seconds = matmul_seconds(m, k, n, 5e10, 40.0) * rng.lognormal(0, 0.03, len(m))
    fit = fit_matmul(m, k, n, seconds)
    assert fit.peak == pytest.approx(5e10, rel=0.05)
    assert fit.half_dim == pytest.approx(40.0, rel=0.2)


@given(alpha=st.floats(0.0, 1e-3), beta=st.floats(1e6, 1e12))
def test_alpha_beta_fit_recovers_latency_and_bandwidth(alpha, beta):
    # ring all-reduce on 2, 4, 8 ranks and p2p: rounds 2(N-1) or 1, bytes on the wire
    rounds, wire = [], []
    for n in (2, 4, 8):
        for size in (1e3, 1e5, 1e7):
            rounds.append(2 * (n - 1))
            wire.append(2 * (n - 1) / n * size)
    rounds += [1, 1]
    wire += [1e4, 1e8]
    seconds = np.array(rounds) * alpha + np.array(wire) / beta
    fit = fit_alpha_beta(rounds, wire, seconds)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert np.allclose(fit.seconds(rounds, wire), seconds, rtol=1e-9)


def test_alpha_beta_clamps_a_negative_latency():
    # latency-free data with the small message measured fast: α would come out negative
    fit = fit_alpha_beta([1, 1, 1], [1e3, 1e6, 1e7], [0.5e-6, 1e-3, 1e-2])
    assert fit.alpha == 0.0
    # then 1/β = Σ(b/t) / Σ(b/t)² with b/t = 2e9, 1e9, 1e9 B/s: β = 6e18 / 4e9
    assert fit.beta == pytest.approx(1.5e9, rel=1e-12)


def test_scale_fit_is_the_weighted_least_squares_closed_form():
    base, units, seconds = [0.05, 0.15], [1171.0, 587.0], [0.41, 0.31]
    a, n, t = (np.array(x) for x in (base, units, seconds))
    expected = np.sum(n * (t - a) / t**2) / np.sum(n**2 / t**2)
    fit = fit_scale(base, units, seconds)
    assert fit.scale == pytest.approx(expected, rel=1e-12)
    # exact data: recovered exactly, zero residuals
    exact = fit_scale(base, units, a + 3e-4 * n)
    assert exact.scale == pytest.approx(3e-4, rel=1e-12)
    assert max(map(abs, exact.residuals)) < 1e-12


def test_relative_residuals():
    assert relative_residuals([2.0, 4.0], [1.0, 5.0]).tolist() == [0.5, -0.25]


@pytest.mark.parametrize("call", [
    lambda: fit_alpha_beta([1], [1e3], [1e-3]),                   # one point
    lambda: fit_alpha_beta([1, 1], [1e3, 1e6], [1e-3, -1.0]),     # a negative time
    lambda: fit_alpha_beta([1, 1], [1e3, 1e6], [1e-3, 1e-4]),     # shrinking with size
    lambda: fit_matmul([1, 2], [1, 2], [1], [1.0, 2.0]),          # ragged columns
    lambda: fit_scale([0.0], [1.0], [math.nan]),
])
def test_bad_measurements_are_one_clear_error(call):
    with pytest.raises(ShardwiseError):
        call()


def test_a_non_physical_fit_names_the_measurement():
    with pytest.raises(ShardwiseError, match=r"^copy α-β fit: time does not grow with size"):
        fit_alpha_beta([1, 1, 1], [1e3, 1e5, 1e6], [1e-3, 1e-4, 1e-4], what="copy α-β fit")


@settings(max_examples=25, deadline=None)
@given(a2=st.floats(1e-5, 1e-2), a4=st.floats(1e-5, 1e-2), beta=st.floats(1e7, 1e10))
def test_per_call_fit_recovers_each_collectives_fixed_cost(a2, a4, beta):
    # t = α_call + bytes/β, one α_call per collective and group size, β known
    sizes = [1e3, 1e5, 1e7]
    keys = ["all-reduce/2"] * 3 + ["reduce-scatter/4"] * 3
    wire = sizes + [0.75 * s for s in sizes]
    seconds = [a2 + b / beta for b in wire[:3]] + [a4 + b / beta for b in wire[3:]]
    fits = fit_per_call(keys, wire, seconds, beta)
    assert set(fits) == {"all-reduce/2", "reduce-scatter/4"}
    assert fits["all-reduce/2"].scale == pytest.approx(a2, rel=1e-9)
    assert fits["reduce-scatter/4"].scale == pytest.approx(a4, rel=1e-9)
    assert max(abs(r) for f in fits.values() for r in f.residuals) < 1e-9


def test_per_call_fit_refuses_a_bandwidth_that_is_not_positive():
    with pytest.raises(ShardwiseError, match="bandwidth must be > 0"):
        fit_per_call(["all-reduce/2"], [1e3], [1e-3], 0.0)


def test_per_call_fit_is_the_mean_call_not_a_relative_fit():
    # two noisy points of one call at no bytes: a step pays their mean, 2 ms (a relative
    # least-squares constant would weight the faster one 9× and give 1.2 ms)
    fit = fit_per_call(["p2p/2"] * 2, [0.0, 0.0], [1e-3, 3e-3], 1e9)["p2p/2"]
    assert fit.scale == pytest.approx(2e-3, rel=1e-12)
    assert fit.residuals == pytest.approx((-1.0, 1 / 3), rel=1e-12)
