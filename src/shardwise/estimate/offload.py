"""Host offload: the optimizer (or every sharded state class) in host memory, its step on the
CPU, and the host↔device copies that costs (docs/concepts/fp8-offload.md#host-offload-the-formulas).

    optimizer offload   host f·P·(master + moments + 4); per step D2H f·P·g, H2D f·P·w
    params offload      host: every sharded state class; per layer and micro-batch H2D of
                        the shard before its gathers, D2H of the gradient shard after
    CPU step            f·P / (rate / GPUs per host)
    exposed (`offload_step`, by `stacks.Offload.overlap`): "backward" (DeepSpeed)
        max(0, D2H − window) + CPU + H2D; "pipelined" (Megatron) max(D2H, CPU, H2D); "none" sum

`P` the parameters whose optimizer state the rank holds, `f` the offloaded share, `g`, `w`
gradient and weight bytes; copies run over the accelerator's `host` link.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.hardware import Accelerator, Link, get_link
from shardwise.stacks import Offload

__all__ = ["CPU_OPTIMIZERS", "GPUS_PER_HOST_CPU", "cpu_step_time", "host_link", "offload_state",
           "offload_step"]

# Parameters per second one host CPU updates with Adam, fp32 master and moments:
# DeepSpeedCPUAdam 11.6e9 parameters in 8.2 s and torch.optim.Adam in 56 s on the same host
# (an 11.6B-parameter GPT-2 under ZeRO-Offload; deepspeedai/DeepSpeed PR #735, 2021-02-08,
# by CPU-Adam's author). torch's fused CPU AdamW (torchtitan's default implementation
# "fused", a vectorised kernel since torch 2.4; Megatron-Core 0.16.1's HybridDeviceOptimizer
# passes `fused=True` too, core/optimizer/__init__.py) is taken at DeepSpeedCPUAdam's rate;
# torch.optim.AdamW with its defaults runs the per-op loop on CPU tensors
# (torch/utils/_foreach_utils.py: no foreach kernels on CPU). One 2021 dual-socket
# Xeon host: a newer host CPU is faster — the figure is a floor, stated where it is used.
CPU_OPTIMIZERS: dict[str, float] = {
    "deepspeed-cpu-adam": 11.6e9 / 8.2,
    "torch-adamw-fused": 11.6e9 / 8.2,
    "torch-adamw": 11.6e9 / 56.0,
}

GPUS_PER_HOST_CPU = {"c2c-gh200": 1, "c2c-gb200": 2}
"""GPUs that share one host CPU where it is not the whole node: a GH200 superchip's Grace
serves its one GPU, a GB200's Grace two. Elsewhere (x86 servers) all GPUs of the node."""


def host_link(accelerator: Accelerator) -> Link:
    """The accelerator's link to host memory (`Accelerator.host`)."""
    return get_link(accelerator.host, accelerator.links)


def cpu_step_time(params: Any, optimizer: str, gpus_per_node: int, host: str) -> Any:
    """Seconds of one rank's CPU optimizer step over `params` parameters: the host's
    `CPU_OPTIMIZERS` rate shared by the GPUs that use that CPU."""
    if optimizer not in CPU_OPTIMIZERS:
        raise ShardwiseError(f"CPU optimizer {optimizer!r} unknown; valid: "
                             f"{', '.join(CPU_OPTIMIZERS)}")
    sharing = GPUS_PER_HOST_CPU.get(host, gpus_per_node)
    return params * sharing / CPU_OPTIMIZERS[optimizer]


def offload_state(kind: str, fraction: float, weights: Any, grads: Any, optimizer: Any,
                  optimizer_bytes_per_param: float) -> dict[str, Any]:
    """Per rank (numbers or arrays): what stays on the GPU of the three state classes and what
    the host holds, for offload `kind` ("none", "optimizer", "params")."""
    zero = 0.0 * optimizer
    if kind == "optimizer":
        moved = fraction * optimizer
        params = moved / optimizer_bytes_per_param if optimizer_bytes_per_param else zero
        return {"weights": weights, "grads": grads, "optimizer": optimizer - moved,
                "host": moved + 4.0 * params}
    if kind == "params":
        return {"weights": zero, "grads": zero, "optimizer": zero,
                "host": weights + grads + optimizer}
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "host": zero}


def offload_step(offload: Offload, params: Any, grad_bytes: float, weight_bytes: float,
                 reductions: Any, window: Any, overlapped: Any,
                 host_copy: Callable[[Any], Any], gpus_per_node: int, host: str) -> Any:
    """Exposed seconds per step of an optimizer offload over `params` parameters of one rank
    (the module docstring): `reductions` gradient copies (ZeRO-2: one per micro-batch),
    `window` the backward they can hide behind when DP traffic is `overlapped`, `host_copy`
    the time of one copy of n bytes on the host link."""
    cpu = cpu_step_time(params, offload.cpu_optimizer, gpus_per_node, host)
    if offload.kind == "params":
        return cpu
    d2h = host_copy(params * grad_bytes)
    h2d = host_copy(params * weight_bytes)
    if offload.overlap == "pipelined":
        return np.maximum(np.maximum(reductions * d2h, cpu), h2d)
    hidden = np.where(overlapped, np.maximum(0.0, d2h - window), d2h)
    if offload.overlap == "backward":
        return reductions * hidden + cpu + h2d
    return reductions * d2h + cpu + h2d
