"""The step model's value for a published component benchmark (`data/components.json`,
`calibration.components`): a GEMM's TFLOP/s with the kernel overhead, a fused attention
kernel's, the HBM bandwidth, and a collective's bus bandwidth (nccl-tests' convention) of
`estimate.comm.collective_time` on the calibrated links — each with the model's own code.
"""

from __future__ import annotations

from typing import Any

from shardwise.calibration import Calibration, default_calibration
from shardwise.calibration.points import accelerator_of
from shardwise.estimate.comm import bus_bandwidth, collective_time
from shardwise.estimate.kernels import attention_efficiency, gemm_efficiency
from shardwise.hardware import get_link

__all__ = ["predict"]


def predict(component: str, point: dict[str, Any], cal: Calibration | None = None) -> float:
    """The model's value of `point` in the point's unit (TFLOP/s, GB/s), with `cal` (default:
    the built-in constants of the point's accelerator)."""
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
