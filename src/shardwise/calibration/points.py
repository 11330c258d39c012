"""The published component points (`data/components.json`) and what the step model reads of
them directly: the FP8-to-BF16 GEMM ratio (`fp8_gemm_ratio`). `calibration.components`
predicts each point with the model."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from shardwise.hardware import Accelerator, generation, get_accelerator

__all__ = ["GENERATIONS", "accelerator_of", "fp8_gemm_ratio", "load_components"]

GENERATIONS = {"a100": "a100-80gb", "h100": "h100-sxm", "gh200": "gh200-141gb"}
"""A source's accelerator label → the preset it is evaluated on (the other labels are preset
names): an unnamed A100 is an 80 GB SXM, an unnamed H100 an SXM, ml-engineering's GH200 row
the 141 GB 900 W module."""


def load_components() -> dict[str, Any]:
    """The published component points (`data/components.json`)."""
    text = resources.files("shardwise").joinpath("data/components.json").read_text()
    return json.loads(text)


def accelerator_of(label: str) -> Accelerator:
    """The preset a component source's accelerator label names (`GENERATIONS`)."""
    return get_accelerator(GENERATIONS.get(label, label))


@cache
def fp8_gemm_ratio(accelerator: str) -> float:
    """How much of its datasheet peak an FP8 GEMM reaches relative to a BF16 GEMM on the same
    part: `(fp8 / peak_fp8) / (bf16 / peak_bf16)` of the best shapes ml-engineering's MAMF
    harness measured (`data/components.json`, source "mamf": torch._scaled_mm and torch.mm);
    a part with no such pair takes the mean over the pairs of its generation, and 1 where
    there is none (FP8 GEMMs at BF16's share of their peak)."""
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


