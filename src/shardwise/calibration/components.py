"""The published component benchmarks (`data/components.json`) and the bookkeeping of their
residuals: what each point measured (`measured`), which collective points the model's ring
describes (`ring_model`), and the summary of residuals. The step model's value for each point
is `estimate.components.predict` (the model's own code, so a residual is its error there):

    gemm        TFLOP/s = 2·M·N·K / (kernel_overhead + 2·M·N·K / (peak·gemm_efficiency))
    attention   TFLOP/s = peak·attention_efficiency (fwd, bwd); fwd+bwd: 3.5 / (1/e_f + 2.5/e_b)
    hbm         GB/s = hbm_bandwidth·hbm_efficiency
    collective  bus bandwidth (nccl-tests') of `estimate.comm.collective_time`

NVLS and NCCL's own algorithm choice are not the model's ring (`ring_model`); residuals are
`(measured − predicted) / measured`. More: docs/accuracy/components.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.calibration.points import (
    GENERATIONS,
    accelerator_of,
    fp8_gemm_ratio,
    load_components,
)

__all__ = ["COMPONENTS", "GENERATIONS", "accelerator_of", "fp8_gemm_ratio", "load_components",
           "measured", "residual_summary", "ring_model"]

COMPONENTS = ("gemm", "attention", "hbm", "collectives")

def ring_model(point: dict[str, Any]) -> bool:
    """A collective point the model's ring describes (not NVLS, not NCCL's own choice, not a
    configuration the link presets do not describe: `model_gap`)."""
    return point["algorithm"] == "ring" and "model_gap" not in point


def measured(component: str, point: dict[str, Any]) -> float:
    """The point's published value (TFLOP/s or GB/s)."""
    return point["busbw_gbps" if component == "collectives" else
                 "gbps" if component == "hbm" else "tflops"]


def residual_summary(residuals: Any) -> dict[str, float]:
    """Count, median and largest |residual|."""
    r = np.abs(np.asarray(residuals, dtype=float))
    return {"points": int(r.size), "median_abs": float(np.median(r)), "max_abs": float(r.max())}
