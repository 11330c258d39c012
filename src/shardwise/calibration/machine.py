"""The "this machine" hardware preset: a `Cluster` built from a calibration file's `machine`
section (written by `shardwise calibrate`), so the planner, `memory` and `check` predict for
the machine the runtime runs on.

    "machine": {
      "name": "this-machine", "backend": "gloo", "dtype": "fp32",
      "cores": 2,                     CPU cores (or GPUs) the measurements ran on
      "memory_bytes": 2.5e10,         the machine's memory (CPU) or one GPU's (NCCL)
      "peak_flops": 9.1e10,           P∞ of one rank (one thread): the fitted GEMM asymptote
      "memory_bandwidth": 1.2e10,     one rank's copy bandwidth (bytes/s, read + write)
      "link": {"name": "gloo", "bandwidth": 1.1e9, "latency": 4e-5,    fitted α-β
               "per_call": {"all-reduce/2": 7e-4, ...,   fixed seconds per call, by
                            "all-reduce/2@8": 2e-3}}  collective and group size (optional;
                                      `fit.fit_per_call`); "@8": measured with all 8 ranks busy
      "synced_host_factor": 1.2       the per-op host cost of ranks that keep in step, ÷ one
    }                                 rank's alone (optional, 1; below)

With `per_call`, a collective on that many ranks costs `α_call + bytes/β` instead of
`rounds·α + bytes/β` (`estimate.step.group_collective_time`): gloo's cost of a small call
barely depends on its ring rounds. A key "op/n@R" was measured with all R ranks busy in
side-by-side groups of n (`shardwise calibrate --ranks R` with more ranks than cores): a layout
of R ranks takes it as it is, instead of the core-per-member figure time-sliced below.

On a CPU there is no datasheet figure to trust, so the machine's "peak" is the measured
asymptote `P∞ = peak·e_max` and its "HBM bandwidth" a measured copy: `matmul_efficiency`
and `hbm_efficiency` are then relative to those (the fit's free parameters are P∞ and d½;
e_max = 1 by construction).

Ranks share the cores: with `ranks > cores` every rank is time-sliced to `share =
cores/ranks` of a core, so its peak, memory bandwidth and link bandwidth are × share, its
kernel overhead and link latency ÷ share (the model assumes every rank busy at once;
pipeline ranks that wait in their bubble leave their share to the others, which this does
not capture). Each rank's memory is the machine's ÷ ranks. The preset runs shardwise's own runtime, so
`kernel_overhead` (seconds per aten op) is charged for the ops that runtime dispatches
(`op_count = "runtime"`, `estimate.compute.host_ops`). Other jobs on the machine take
cores too, and nothing here sees them: calibrate and run under the same load.

`kernel_overhead` is one rank's, alone on the machine. A layout of more than one rank is
charged `kernel_overhead × synced_host_factor`: `shardwise calibrate` times the same one-rank
steps on a rank per core at once, each rank training its own model, the ranks meeting once a
step in the loss's and gradient norm's all-reduces, fits the per-op cost on the time outside
those calls and divides by the same fit on the steps alone, timed just before (the median of
three such rounds); `shardwise check --calibration` times the same pair again between the
layout's steps. What it does not see: every collective a layout makes costs the ranks more
than its wait — gloo's helper threads burn CPU for every call, and with a core per rank
that CPU comes out of the ranks' compute (README, "Where the model's split is wrong") —
which only the per-call costs timed on the layout's own groups carry. (Until 2026-12-01 the
ranks also all-reduced a scalar after every block's forward and backward while timed, and
the factor, 1.16–2.38 in the day's calibrations, charged every layout those 64 calls' CPU
whatever its own number of calls.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, load_calibration
from shardwise.errors import ShardwiseError
from shardwise.files import read_json
from shardwise.hardware import Accelerator, Cluster, Link
from shardwise.layout import Layout, TrainSpec

if TYPE_CHECKING:
    from shardwise.estimate.step import StepEstimate

__all__ = ["THIS_MACHINE", "MachineSpec", "cluster_of", "machine_cluster", "predict_step",
           "read_machine"]

THIS_MACHINE = "this-machine"


@dataclass(frozen=True)
class MachineSpec:
    """The measured figures of one machine (see the module docstring; SI units)."""

    name: str
    backend: str
    dtype: str
    cores: int
    memory_bytes: float
    peak_flops: float
    memory_bandwidth: float
    link_bandwidth: float
    link_latency: float
    link_name: str = "gloo"
    per_call: tuple[tuple[str, float], ...] = ()
    synced_host_factor: float = 1.0

    def validate(self) -> MachineSpec:
        """Every figure a finite number in range, `cores` an integer, each per-call key
        "op/ranks" or "op/ranks@busy" (`_PER_CALL_KEY`)."""
        import shardwise.validate as v

        checks: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
            ("cores", v.integer, {"low": 1, "high": v.MAX_DEGREE}),
            ("link_latency", v.finite, {"low": 0}),
            ("synced_host_factor", v.positive, {})]
        checks += [(name, v.positive, {}) for name in ("memory_bytes", "peak_flops",
                                                       "memory_bandwidth", "link_bandwidth")]
        problems = []
        for name, check, bounds in checks:
            try:
                check(getattr(self, name), name, **bounds)
            except ShardwiseError as exc:
                problems.append(str(exc))
        for key, cost in self.per_call:
            if not isinstance(key, str) or not _PER_CALL_KEY.fullmatch(key):
                problems.append(f"per-call key {key!r} must be op/ranks or op/ranks@busy with "
                                f"op one of {', '.join(_CALL_OPS)}")
            try:
                v.finite(cost, f"per-call cost of {key}", low=0)
            except ShardwiseError as exc:
                problems.append(str(exc))
        if problems:
            raise ShardwiseError("calibration machine section: " + "; ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "backend": self.backend, "dtype": self.dtype,
                "cores": self.cores, "memory_bytes": self.memory_bytes,
                "peak_flops": self.peak_flops, "memory_bandwidth": self.memory_bandwidth,
                "link": {"name": self.link_name, "bandwidth": self.link_bandwidth,
                         "latency": self.link_latency, "per_call": dict(self.per_call)},
                "synced_host_factor": self.synced_host_factor}

    @classmethod
    def from_dict(cls, data: Any, source: str) -> MachineSpec:
        try:
            link = data["link"]
            per_call = link.get("per_call", {})
            spec = cls(str(data.get("name", THIS_MACHINE)), str(data.get("backend", "gloo")),
                       str(data.get("dtype", "fp32")), data["cores"], data["memory_bytes"],
                       data["peak_flops"], data["memory_bandwidth"], link["bandwidth"],
                       link["latency"], str(link.get("name", "gloo")),
                       tuple(sorted(per_call.items())), data.get("synced_host_factor", 1.0))
        except (AttributeError, KeyError, TypeError) as exc:
            raise ShardwiseError(
                f"calibration file {source!r}: the machine section needs cores, memory_bytes, "
                f"peak_flops, memory_bandwidth and link {{bandwidth, latency[, per_call]}}"
                f"[, synced_host_factor] ({type(exc).__name__}: {exc})"
            ) from None
        try:
            return spec.validate()
        except ShardwiseError as exc:
            raise ShardwiseError(f"calibration file {source!r}: "
                                 f"{str(exc).removeprefix('calibration ')}") from None


# The keys of `per_call`: a collective (estimate.comm.OPS, or "p2p": one message one way) on
# n ranks, "@R" when measured with R ranks busy.
_CALL_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "broadcast", "p2p")
_PER_CALL_KEY = re.compile(rf"(?:{'|'.join(_CALL_OPS)})/[1-9][0-9]{{0,6}}(?:@[1-9][0-9]{{0,6}})?")


def read_machine(path: str | Path | None) -> MachineSpec:
    """The `machine` section of a calibration file written by `shardwise calibrate`."""
    if path is None:
        raise ShardwiseError(f"--gpu {THIS_MACHINE} needs --calibration FILE (write one with "
                             "`shardwise calibrate --out FILE`)")
    data = read_json(path, "calibration file")
    if not isinstance(data, dict) or "machine" not in data:
        raise ShardwiseError(f"calibration file {str(path)!r} has no machine section; write "
                             "one with `shardwise calibrate --out FILE`")
    return MachineSpec.from_dict(data["machine"], str(path))


def machine_cluster(ranks: int, path: str | Path | None) -> tuple[Cluster, Calibration]:
    """One node of `ranks` ranks on the machine a calibration file describes, and the file's
    constants with the kernel overhead of a time-sliced rank (module docstring)."""
    return cluster_of(read_machine(path), load_calibration(THIS_MACHINE, path), ranks)


def cluster_of(spec: MachineSpec, cal: Calibration, ranks: int
               ) -> tuple[Cluster, Calibration]:
    """`machine_cluster` from figures in hand (`shardwise calibrate` fits with it)."""
    if ranks < 1:
        raise ShardwiseError(f"need ≥ 1 rank, got {ranks}")
    share = min(1.0, spec.cores / ranks)
    # The figures were measured in spec.dtype; the same peak stands for every dtype.
    accelerator = Accelerator(THIS_MACHINE, spec.memory_bytes / ranks,
                              spec.memory_bandwidth * share, spec.peak_flops * share,
                              None, spec.peak_flops * share)
    link = Link(spec.link_name, spec.link_bandwidth * share, spec.link_latency / share)
    cluster = Cluster(1, ranks, accelerator, link, link).validate()
    # per-call costs measured with this many ranks busy ("op/n@ranks") stand as measured;
    # the others were measured with a core per member and are time-sliced like the rest
    alone = {k: v / share for k, v in spec.per_call if "@" not in k}
    busy = {k.split("@")[0]: v for k, v in spec.per_call if k.endswith(f"@{ranks}")}
    host = cal.kernel_overhead * (spec.synced_host_factor if ranks > 1 else 1.0)
    cal = replace(cal, accelerator=THIS_MACHINE, kernel_overhead=host / share,
                  collective_call=alone | busy,
                  link_efficiency=cal.link_efficiency | {link.name: 1.0}, op_count="runtime")
    return cluster, cal.validate()


def predict_step(model: ModelSpec, layout: Layout, train: TrainSpec, path: str | Path,
                 per_call: dict[str, float] | None = None,
                 kernel_overhead: float | None = None,
                 synced_host_factor: float | None = None) -> StepEstimate:
    """The step model's prediction for `layout` on `layout.world_size` ranks of the machine
    the calibration file describes (`estimate.step.estimate_step`); `per_call` ("op/n":
    seconds, measured with the layout's ranks busy) replaces the file's per-call costs,
    `kernel_overhead` (one rank's seconds per op) and `synced_host_factor` (measured later)
    the file's."""
    from shardwise.estimate.step import estimate_step

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
