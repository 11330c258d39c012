"""The model's value for a component benchmark point (estimate/components.py) written out by
hand: a GEMM's achieved TFLOP/s `2·m·n·k / (overhead + 2mnk/(peak·e))`, an attention kernel's
fwd+bwd rate `3.5 / (1/e_f + 2.5/e_b)` of the BF16 peak (backward 2.5× the forward's FLOPs),
HBM at the datasheet bandwidth × the calibrated efficiency, and a collective's bus bandwidth as
nccl-tests defines it (`S/t · 2(n-1)/n` for all-reduce, `(n-1)/n` for the others) of the α-β
ring inside a node or the hierarchical all-reduce across nodes. Datasheet figures from
hardware.py: H100 SXM 989 TFLOP/s dense BF16, 3.35 TB/s HBM3; NVLink 4 450 GB/s per
direction; NDR InfiniBand 50 GB/s per GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.calibration import default_calibration
from shardwise.estimate.components import predict
from shardwise.estimate.kernels import attention_efficiency, gemm_efficiency
from shardwise.hardware import get_link


def test_gemm_rate_by_hand():
    cal = default_calibration("h100-sxm")
    m, n, k = 1024, 8192, 3072  # all different: the shape's order shows
    flops = 2.0 * m * n * k
    eff = gemm_efficiency(cal, m, k, n)
    want = flops / (cal.kernel_overhead + flops / (989e12 * eff)) / 1e12
    point = {"accelerator": "h100", "dtype": "bf16", "m": m, "n": n, "k": k}
    assert predict("gemm", point) == pytest.approx(want, rel=1e-12)
    # another calibration passed in is the one used
    slow = replace(cal, kernel_overhead=1e-3)
    want = flops / (1e-3 + flops / (989e12 * eff)) / 1e12
    assert predict("gemm", point, slow) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("which", ["fwd", "bwd", "fwd+bwd"])
def test_attention_rate_by_hand(which):
    cal = default_calibration("h100-sxm")
    args = ("fa2", 128, 4096, True, "h100-sxm")
    fwd = attention_efficiency(*args, calibration=cal)
    bwd = attention_efficiency(*args, backward=True, calibration=cal)
    assert fwd != bwd
    eff = {"fwd": fwd, "bwd": bwd, "fwd+bwd": 3.5 / (1 / fwd + 2.5 / bwd)}[which]
    point = {"accelerator": "h100", "kernel": "fa2", "head_dim": 128, "seq": 4096,
             "causal": True, "pass": which}
    assert predict("attention", point) == pytest.approx(float(eff) * 989e12 / 1e12, rel=1e-12)


def test_hbm_by_hand():
    cal = default_calibration("h100-sxm")
    assert predict("hbm", {"accelerator": "h100"}) == pytest.approx(
        3.35e12 * cal.hbm_efficiency / 1e9, rel=1e-12)


@pytest.mark.parametrize("op, factor", [("all-reduce", 2), ("all-gather", 1),
                                        ("reduce-scatter", 1)])
@pytest.mark.parametrize("size", [2**20, None])
def test_one_node_bus_bandwidth_by_hand(op, factor, size):
    """8 ranks on NVLink 4: the ring's `factor·(n-1)` rounds of α + S/(n·β); busbw = S/t ·
    factor·(n-1)/n. No size: a stated plateau, timed at 16 GiB."""
    cal = default_calibration()
    link = cal.link(get_link("nvlink4"))
    assert link.bandwidth == pytest.approx(450e9 * cal.link_efficiency["nvlink4"])
    s, n = size or 16 * 2**30, 8
    t = factor * (n - 1) * (link.latency + s / (n * link.bandwidth))
    point = {"op": op, "ranks": n, "nodes": 1, "intra": "nvlink4", "inter": None,
             "size_bytes": size}
    assert predict("collectives", point) == pytest.approx(
        s / t * factor * (n - 1) / n / 1e9, rel=1e-12)


def test_multi_node_all_reduce_bus_bandwidth_by_hand():
    """32 ranks on 4 nodes of 8: reduce-scatter and all-gather inside the node on NVLink 4,
    ring all-reduce of S/8 across the 4 nodes on NDR."""
    cal = default_calibration()
    intra, inter = cal.link(get_link("nvlink4")), cal.link(get_link("ndr"))
    s, n, g, nodes = 2**28, 32, 8, 4
    t = (2 * (g - 1) * (intra.latency + s / (g * intra.bandwidth))
         + 2 * (nodes - 1) * (inter.latency + (s / g) / (nodes * inter.bandwidth)))
    point = {"op": "all-reduce", "ranks": n, "nodes": nodes, "intra": "nvlink4",
             "inter": "ndr", "size_bytes": s}
    assert predict("collectives", point) == pytest.approx(
        s / t * 2 * (n - 1) / n / 1e9, rel=1e-12)


def test_an_unknown_component_is_refused():
    with pytest.raises(ValueError, match="unknown component 'disk'"):
        predict("disk", {"accelerator": "h100"})
