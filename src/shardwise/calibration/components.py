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

import json
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from shardwise.calibration import Calibration, default_calibration
from shardwise.hardware import Accelerator, get_accelerator, get_link

__all__ = ["COMPONENTS", "GENERATIONS", "accelerator_of", "fp8_gemm_ratio", "load_components",
           "measured", "predict", "residual_summary", "ring_model"]

COMPONENTS = ("gemm", "attention", "hbm", "collectives")

GENERATIONS = {"a100": "a100-80gb", "h100": "h100-sxm", "gh200": "gh200-141gb"}
"""A source's accelerator label → the preset it is evaluated on (the other labels are preset
names): an unnamed A100 is an 80 GB SXM, an unnamed H100 an SXM, ml-engineering's GH200 row
the 141 GB 900 W module."""


def load_components() -> dict[str, Any]:
    """The published component points (`data/components.json`)."""
    text = resources.files("shardwise").joinpath("data/components.json").read_text()
    return json.loads(text)


def accelerator_of(label: str) -> Accelerator:
    return get_accelerator(GENERATIONS.get(label, label))


@cache
def fp8_gemm_ratio(accelerator: str) -> float:
    """How much of its datasheet peak an FP8 GEMM reaches relative to a BF16 GEMM on the same
    part: `(fp8 / peak_fp8) / (bf16 / peak_bf16)` of the best shapes ml-engineering's MAMF
    harness measured (`data/components.json`, source "mamf": torch._scaled_mm and torch.mm);
    a part with no such pair takes the mean over the pairs of its generation, and 1 where
    there is none (FP8 GEMMs at BF16's share of their peak)."""
    from shardwise.estimate.uncertainty import generation

    best: dict[str, dict[str, float]] = {}
    for point in load_components()["gemm"]:
        if point["source"] == "mamf":
            part = accelerator_of(point["accelerator"])
            share = point["tflops"] * 1e12 / part.peak_flops(point["dtype"])
            best.setdefault(part.name, {})[point["dtype"]] = share
    ratios = {name: d["fp8"] / d["bf16"] for name, d in best.items() if {"fp8", "bf16"} <= set(d)}
    if accelerator in ratios:
        return ratios[accelerator]
    same = [r for name, r in ratios.items() if generation(name) == generation(accelerator)]
    return float(np.mean(same)) if same else 1.0


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
