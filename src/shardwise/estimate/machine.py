"""The step model's prediction on the "this machine" preset: `estimate_step` on the `Cluster`
and `Calibration` a calibration file's `machine` section describes
(`calibration.machine.cluster_of`), with the per-call costs, per-op host cost and synced-host
factor measured later replacing the file's (`shardwise check`, `shardwise calibrate`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shardwise.arch import ModelSpec
from shardwise.calibration import load_calibration
from shardwise.calibration.machine import THIS_MACHINE, cluster_of, read_machine
from shardwise.errors import ShardwiseError
from shardwise.estimate.step import StepEstimate, estimate_step
from shardwise.layout import Layout, TrainSpec

__all__ = ["predict_step"]


def predict_step(model: ModelSpec, layout: Layout, train: TrainSpec, path: str | Path,
                 per_call: dict[str, float] | None = None,
                 kernel_overhead: float | None = None,
                 synced_host_factor: float | None = None) -> StepEstimate:
    """The step model's prediction for `layout` on `layout.world_size` ranks of the machine
    the calibration file describes (`estimate.step.estimate_step`); `per_call` ("op/n":
    seconds, measured with the layout's ranks busy) replaces the file's per-call costs,
    `kernel_overhead` (one rank's seconds per op) and `synced_host_factor` (measured later)
    the file's."""
    spec = read_machine(path)
    if synced_host_factor is not None:
        spec = replace(spec, synced_host_factor=synced_host_factor).validate()
    if train.dtype != spec.dtype:
        raise ShardwiseError(f"the calibration {str(path)!r} was measured in {spec.dtype}; "
                             f"this run is {train.dtype} (calibrate in the same dtype)")
    cal = load_calibration(THIS_MACHINE, path)
    if kernel_overhead is not None:
        cal = replace(cal, kernel_overhead=kernel_overhead)
    cluster, cal = cluster_of(spec, cal, layout.world_size)
    if per_call:
        cal = replace(cal, collective_call=cal.collective_call | per_call).validate()
    return estimate_step(model, cluster, layout, train, cal)

