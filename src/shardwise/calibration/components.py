"""The step model's prediction for each published component benchmark (`data/components.json`).

One function per component, each evaluated with the model's own code, so a residual here is
the model's error on that measurement:

    gemm        TFLOP/s = 2·M·N·K / (kernel_overhead + 2·M·N·K / (peak·gemm_efficiency))
                (the model charges `kernel_overhead` per kernel, `estimate.compute`)
    attention   TFLOP/s = peak·attention_efficiency (fwd, bwd); fwd+bwd: 3.5 / (1/e_f + 2.5/e_b)
    hbm         GB/s = hbm_bandwidth·hbm_efficiency
    collective  bus bandwidth (nccl-tests' convention) of `estimate.comm.collective_time` on the
                calibrated links: the ring on one node, the hierarchical all-reduce across nodes

NCCL's NVLink SHARP (`algorithm` "nvls") and its own algorithm choice ("auto") are not in the
model (a ring); those points, and the few flagged `model_gap` (a topology the link presets do
not describe), are reported apart (`ring_model`). `links` holds direct link measurements
(wire efficiency), used as constants rather than predicted.
Residuals are `(measured − predicted) / measured` (`calibration.fit.relative_residuals`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.calibration import Calibration, default_calibration
from shardwise.calibration.points import (
    GENERATIONS,
    accelerator_of,
    fp8_gemm_ratio,
    load_components,
)
from shardwise.hardware import get_link

__all__ = ["COMPONENTS", "GENERATIONS", "accelerator_of", "fp8_gemm_ratio", "load_components",
           "measured", "predict", "residual_summary", "ring_model"]

COMPONENTS = ("gemm", "attention", "hbm", "collectives")

def ring_model(point: dict[str, Any]) -> bool:
    """A collective point the model's ring describes (not NVLS, not NCCL's own choice, not a
    configuration the link presets do not describe: `model_gap`)."""
    return point["algorithm"] == "ring" and "model_gap" not in point


def predict(component: str, point: dict[str, Any], cal: Calibration | None = None) -> float:
    """The model's value of `point` in the point's unit (TFLOP/s, GB/s), with `cal` (default:
    the built-in constants of the point's accelerator)."""
    from shardwise.estimate.comm import bus_bandwidth, collective_time
    from shardwise.estimate.compute import attention_efficiency, gemm_efficiency

    if component == "collectives":
        cal = cal or default_calibration()  # links are calibrated for every accelerator
        intra = cal.link(get_link(point["intra"]))
        size = point["size_bytes"] or 16 * 2**30  # a stated plateau: a 16 GiB message
        if point["nodes"] == 1:
            seconds = collective_time(point["op"], size, point["ranks"], intra)
        else:
            seconds = collective_time(point["op"], size, point["ranks"], intra, "hierarchical",
                                      nodes=point["nodes"],
                                      inter=cal.link(get_link(point["inter"])))
        return bus_bandwidth(point["op"], size, point["ranks"], seconds) / 1e9
    acc = accelerator_of(point["accelerator"])
    cal = cal or default_calibration(acc.calibration_name)
    if component == "gemm":
        flops = 2.0 * point["m"] * point["n"] * point["k"]
        peak = acc.peak_flops(point["dtype"])
        eff = gemm_efficiency(cal, point["m"], point["k"], point["n"])
        return flops / (cal.kernel_overhead + flops / (peak * eff)) / 1e12
    if component == "attention":
        args = (point["kernel"], point["head_dim"], point["seq"], point["causal"], acc)
        fwd = attention_efficiency(*args, calibration=cal)
        bwd = attention_efficiency(*args, backward=True, calibration=cal)
        eff = {"fwd": fwd, "bwd": bwd, "fwd+bwd": 3.5 / (1 / fwd + 2.5 / bwd)}[point["pass"]]
        return float(eff) * acc.peak_bf16 / 1e12
    if component == "hbm":
        return acc.hbm_bandwidth * cal.hbm_efficiency / 1e9
    raise ValueError(f"unknown component {component!r}")


def measured(component: str, point: dict[str, Any]) -> float:
    """The point's published value (TFLOP/s or GB/s)."""
    return point["busbw_gbps" if component == "collectives" else
                 "gbps" if component == "hbm" else "tflops"]


def residual_summary(residuals: Any) -> dict[str, float]:
    """Count, median and largest |residual|."""
    r = np.abs(np.asarray(residuals, dtype=float))
    return {"points": int(r.size), "median_abs": float(np.median(r)), "max_abs": float(r.max())}
