"""The "this machine" hardware preset: a `Cluster` and `Calibration` built from a calibration
file's `machine` section (written by `shardwise calibrate`: cores, memory, the fitted GEMM
asymptote P∞ as the "peak", a copy bandwidth as the "HBM", the fitted α-β link with its
per-call costs, the synced-host factor), so the planner, `memory` and `check` predict for the
machine the runtime runs on. With more ranks than cores every rank is time-sliced to
`cores/ranks` of a core. The step model's prediction on it is `estimate.machine.predict_step`
(the estimate side; this module never imports it). The section's fields and the derivation:
docs/howto/calibrate.md ("The this-machine preset").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardwise.calibration import Calibration, load_calibration
from shardwise.errors import ShardwiseError
from shardwise.files import read_json
from shardwise.hardware import THIS_MACHINE, Accelerator, Cluster, Link

__all__ = ["THIS_MACHINE", "MachineSpec", "cluster_of", "machine_cluster", "read_machine"]



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
        from shardwise.units import DTYPE_BYTES

        for name in ("name", "backend", "link_name"):  # printed: no control characters
            try:
                v.label(getattr(self, name), name)
            except ShardwiseError as exc:
                problems.append(str(exc))
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got "
                            f"{self.dtype!r}"[:200])
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
