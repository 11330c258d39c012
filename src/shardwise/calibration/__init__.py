"""Efficiency constants of the step-time model, in one place (`data/calibration.json`).

The step-time model (`estimate.kernels`, `estimate.links`, `estimate.step`) turns FLOPs and
bytes into seconds with the accelerator's datasheet peak and bandwidth times a few
*achievable-fraction* constants (`Calibration`'s fields: GEMM and attention efficiency, HBM
and link efficiency, kernel overhead, overlap contention, sustained compute, …), per
accelerator. The GEMM, attention, HBM and link constants are fitted on published component
benchmarks (`benchmarks/fit_components.py`); three end-to-end constants per generation on
published runs (`benchmarks/validate_published.py --fit`). `SOURCES.md` cites every one.
A JSON file of the same shape overrides any subset (`load_calibration`, `--calibration`);
`shardwise calibrate` writes one with a `machine` and a `measurements` section.
Each constant and its source: docs/howto/calibrate.md ("The constants").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.files import read_json
from shardwise.hardware import Link

# FlexAttention against FlashAttention-2 on H100, forward and backward: "90% of
# FlashAttention2's performance in the forward pass and 85% in the backward pass" (PyTorch
# blog, "FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention",
# 2024-08-07).
FLEX_OF_FA2 = (0.90, 0.85)

__all__ = ["Calibration", "default_calibration", "load_calibration"]

_SCALARS = ("matmul_efficiency", "matmul_half_dim", "attention_efficiency", "hbm_efficiency",
            "kernel_overhead", "dp_bucket_bytes", "overlap_contention",
            "tp_overlap_efficiency", "sustained_compute")
# `machine` (the measured hardware, `calibration.machine`) and `measurements` (raw points and
# fit residuals) are written by `shardwise calibrate`; `sources` cites the public rows each
# generation's constants were fitted on (below); the constants ignore all three.
_SECTIONS = ("default", "accelerators", "links", "link_latency", "machine", "measurements",
             "sources")
_KERNEL_KEYS = ("efficiency", "half_dim", "half_seq", "backward_ratio")


@dataclass(frozen=True)
class Calibration:
    """Achievable fractions of the datasheet figures (see the module docstring)."""

    accelerator: str = "default"
    matmul_efficiency: float = 0.84
    matmul_half_dim: float = 40.0
    attention_efficiency: float = 0.55
    hbm_efficiency: float = 0.80
    kernel_overhead: float = 5e-6
    dp_bucket_bytes: float = 80e6
    overlap_contention: float = 0.15
    tp_overlap_efficiency: float = 0.8
    sustained_compute: float = 1.0
    link_efficiency: dict[str, float] = field(default_factory=dict)
    link_latency: dict[str, float] = field(default_factory=dict)
    collective_call: dict[str, float] = field(default_factory=dict)
    attention_kernels: dict[str, dict[str, float]] = field(default_factory=dict)
    attention_kernel: str = ""
    op_count: str = "fused"
    source: str = "built-in"

    def attention_curve(self, kernel: str) -> tuple[str, tuple[float, float]]:
        """The fitted curve attention `kernel` runs at here, and a (forward, backward) factor
        on it: the kernel's own curve; FlexAttention as FlashAttention-2 × `FLEX_OF_FA2`; a
        kernel without a fitted curve as the accelerator's default kernel
        (`attention_kernel`; "" when none is fitted)."""
        if kernel in self.attention_kernels:
            return kernel, (1.0, 1.0)
        if kernel == "flex" and "fa2" in self.attention_kernels:
            return "fa2", FLEX_OF_FA2
        return self.attention_kernel, (1.0, 1.0)

    def link(self, link: Link) -> Link:
        """The link at its achievable bandwidth (datasheet × efficiency) and its fitted α
        (the preset's latency where none was fitted)."""
        eff = self.link_efficiency.get(link.name, 1.0)
        return Link(link.name, link.bandwidth * eff, self.link_latency.get(link.name,
                                                                           link.latency))

    def validate(self) -> Calibration:
        problems = []
        if not 0 <= self.overlap_contention <= 1:
            problems.append(f"overlap_contention must be in [0, 1], got {self.overlap_contention}")
        for name in ("matmul_efficiency", "attention_efficiency", "hbm_efficiency",
                     "tp_overlap_efficiency", "sustained_compute"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                problems.append(f"{name} must be in (0, 1], got {value}")
        for name in ("matmul_half_dim", "kernel_overhead"):
            if not 0 <= getattr(self, name) < math.inf:
                problems.append(f"{name} must be finite and ≥ 0, got {getattr(self, name)}")
        if self.op_count not in ("fused", "runtime"):
            problems.append(f"op_count must be fused or runtime, got {self.op_count!r}")
        if not 0 < self.dp_bucket_bytes < math.inf:
            problems.append(f"dp_bucket_bytes must be finite and > 0, got {self.dp_bucket_bytes}")
        for name, value in self.link_efficiency.items():
            if not 0 < value <= 1:
                problems.append(f"link efficiency of {name} must be in (0, 1], got {value}")
        for name, value in self.link_latency.items():
            if not value >= 0:
                problems.append(f"latency of {name} must be ≥ 0, got {value}")
        # physical bounds (issue 47): 1e300 s or an efficiency of 1e-300 is one line, not a
        # 300-digit step time (`hardware.RANGES` bounds the accelerator's own figures)
        for name, value, high in (("kernel_overhead", self.kernel_overhead, "1 s"),
                                  ("matmul_half_dim", self.matmul_half_dim, "1e6"),
                                  *((f"latency of {k}", v, "1 s")
                                    for k, v in self.link_latency.items())):
            if value > float(high.split()[0]):
                problems.append(f"{name} must be ≤ {high}, got {value}")
        for name, value in (*((k, getattr(self, k)) for k in (
                "matmul_efficiency", "attention_efficiency", "hbm_efficiency",
                "sustained_compute")), *((f"link efficiency of {k}", v)
                                         for k, v in self.link_efficiency.items())):
            if 0 < value < 1e-3:
                problems.append(f"{name} must be ≥ 0.001, got {value}")
        for kernel, params in self.attention_kernels.items():
            if set(params) != set(_KERNEL_KEYS):
                problems.append(f"attention kernel {kernel} needs exactly "
                                f"{', '.join(_KERNEL_KEYS)}")
                continue
            if not 0 < params["efficiency"] <= 1:
                problems.append(f"attention {kernel} efficiency must be in (0, 1], got "
                                f"{params['efficiency']}")
            if not 0 < params["backward_ratio"] <= 2:
                problems.append(f"attention {kernel} backward_ratio must be in (0, 2], got "
                                f"{params['backward_ratio']}")
            for key in ("half_dim", "half_seq"):
                if not params[key] >= 0:
                    problems.append(f"attention {kernel} {key} must be ≥ 0, got {params[key]}")
        if self.attention_kernel and self.attention_kernel not in self.attention_kernels:
            problems.append(f"attention_kernel {self.attention_kernel!r} has no fitted curve; "
                            f"fitted: {', '.join(self.attention_kernels) or 'none'}")
        for name, value in self.collective_call.items():
            if not 0 <= value < math.inf:
                problems.append(f"per-call cost of {name} must be ≥ 0, got {value}")
        if problems:
            raise ShardwiseError(f"calibration ({self.source}): " + "; ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _read_builtin() -> dict[str, Any]:
    text = resources.files("shardwise").joinpath("data/calibration.json").read_text()
    return json.loads(text)


def _apply(cal: Calibration, data: dict[str, Any], accelerator: str, source: str
           ) -> Calibration:
    if not isinstance(data, dict):
        raise ShardwiseError(f"calibration file {source!r} must hold a JSON object")
    unknown = set(data) - {"_doc", *_SECTIONS}
    if unknown:
        raise ShardwiseError(
            f"calibration file {source!r}: unknown section(s) {', '.join(sorted(unknown))}; "
            f"valid: {', '.join(_SECTIONS)}"
        )
    changes: dict[str, Any] = {}
    from shardwise.validate import finite

    for key in ("default", "accelerators", "links", "link_latency"):
        if not isinstance(data.get(key, {}), dict):
            raise ShardwiseError(f"calibration file {source!r}: {key} must be a JSON object")
    accelerators = data.get("accelerators", {})
    for name, section in accelerators.items():
        if not isinstance(section, dict):
            raise ShardwiseError(f"calibration file {source!r}: accelerators.{name} must be a "
                                 "JSON object")
    kernels = dict(cal.attention_kernels)
    for section in (data.get("default", {}), accelerators.get(accelerator, {})):
        bad = set(section) - set(_SCALARS) - {"attention", "attention_kernel"}
        if bad:
            raise ShardwiseError(
                f"calibration file {source!r}: unknown key(s) {', '.join(sorted(bad))}; "
                f"valid: {', '.join(_SCALARS)}, attention, attention_kernel"
            )
        for key, value in section.items():
            if key == "attention":
                kernels |= _kernels(value, source)
            elif key == "attention_kernel":
                if not isinstance(value, str):
                    raise ShardwiseError(f"calibration file {source!r}: attention_kernel must "
                                         f"be a kernel name, got {value!r}")
                changes[key] = value
            else:
                changes[key] = finite(value, f"calibration file {source!r}: {key}")
    links = dict(cal.link_efficiency)
    for name, value in data.get("links", {}).items():
        links[name] = finite(value, f"calibration file {source!r}: link {name} efficiency")
    latency = dict(cal.link_latency)
    for name, value in data.get("link_latency", {}).items():
        latency[name] = finite(value, f"calibration file {source!r}: link {name} latency")
    return replace(cal, accelerator=accelerator, link_efficiency=links, link_latency=latency,
                   attention_kernels=kernels, source=source, **changes)


def _kernels(value: Any, source: str) -> dict[str, dict[str, float]]:
    """`{"fa2": {"efficiency": …, "half_dim": …, "half_seq": …, "backward_ratio": …}, …}`."""
    from shardwise.validate import finite

    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ShardwiseError(f"calibration file {source!r}: attention must map kernel names "
                             f"to {{{', '.join(_KERNEL_KEYS)}}}")
    out = {}
    for kernel, params in value.items():
        if set(params) != set(_KERNEL_KEYS):
            raise ShardwiseError(f"calibration file {source!r}: attention.{kernel} needs "
                                 f"exactly {', '.join(_KERNEL_KEYS)}")
        out[kernel] = {k: finite(v, f"calibration file {source!r}: attention.{kernel}.{k}")
                       for k, v in params.items()}
    return out


def default_calibration(accelerator: str = "default") -> Calibration:
    """The built-in constants for `accelerator` (`data/calibration.json`)."""
    return _apply(Calibration(), _read_builtin(), accelerator, "built-in").validate()


def load_calibration(accelerator: str = "default", path: str | Path | None = None,
                     links: tuple[str, ...] = ()) -> Calibration:
    """Built-in constants, then the keys a user file names (same JSON shape) on top; an
    accelerator or link it names that is neither a preset nor one of `links` (an accelerator
    file's own) is refused (`hardware.check_constants`)."""
    cal = default_calibration(accelerator)
    if path is None:
        return cal
    data = read_json(path, "calibration file")
    from shardwise.hardware import check_constants

    mine = _apply(cal, data, accelerator, str(path))
    check_constants(data, str(path), (accelerator, *cal.link_efficiency, *links))
    return mine.validate()
