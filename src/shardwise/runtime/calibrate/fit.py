"""The fits: raw measurements → the calibration file's constants (`fit_measurements`), the
host cost per op now (`host_cost_now`) and the one-rank steps' residuals.
The formulas: docs/concepts/runtime.md#calibration.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from shardwise.arch import get_model
from shardwise.calibration import Calibration, default_calibration, load_calibration
from shardwise.calibration.fit import (
    fit_alpha_beta,
    fit_matmul,
    fit_per_call,
    fit_scale,
    relative_residuals,
)
from shardwise.calibration.machine import THIS_MACHINE, MachineSpec, cluster_of, read_machine
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ring_bytes_on_wire, ring_steps
from shardwise.layout import Layout
from shardwise.runtime.calibrate.compute import HOST_PROBE
from shardwise.runtime.calibrate.plan import COLLECTIVES, PER_CALL_BELOW, Plan


def _wire_bytes(op: str, size: float, n: int) -> float:
    """Bytes one rank puts on the wire: a p2p message's own, a collective's by SPEC §5."""
    return size if op == "p2p" else ring_bytes_on_wire(op, size, n)


def _memory_bytes(device: str) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _clamped(value: float, notes: list[str], name: str) -> float:
    if value > 1:
        notes.append(f"{name} fitted {value:.3f} > 1 of the reference; stored as 1")
    return min(value, 1.0)


def fit_measurements(raw: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The calibration file (`calibration` format + `machine` + `measurements`) from the raw
    points: every constant fitted in the model's own form (docs/concepts/runtime.md#calibration)."""
    notes: list[str] = []
    mm = raw["matmul"]
    # the launch is timed apart; under load a tiny GEMM can come out faster than it
    launch_s = min(raw["launch"], 0.5 * min(p[3] for p in mm))
    gemm = fit_matmul(*zip(*mm, strict=True), launch=launch_s)
    copy = fit_alpha_beta([1] * len(raw["copy"]), *zip(*raw["copy"], strict=True),
                          what="copy α-β fit")
    kern = fit_alpha_beta([1] * len(raw["kernels"]), [p[1] for p in raw["kernels"]],
                          [p[2] for p in raw["kernels"]], what="memory-bound kernels' α-β fit")
    hbm = _clamped(kern.beta / copy.beta, notes, "hbm_efficiency")
    # attention: t = (3.5 · 2·s²·d·heads) / (P∞ · η · d/(d+d½)) → 1/η is a scale
    unit = [3.5 * 2 * s * s * d * h / (gemm.peak * d / (d + gemm.half_dim))
            for s, d, h, _ in raw["attention"]]
    attn = fit_scale([0.0] * len(unit), unit, [p[3] for p in raw["attention"]])
    attention = _clamped(1 / attn.scale, notes, "attention_efficiency")
    # collectives: one α-β link over every op and group size, and one per op for reference
    coll = raw["collectives"]

    cores = plan.ranks if plan.backend == "nccl" else len(os.sched_getaffinity(0))

    def rounds_bytes(points: list[list[Any]]) -> tuple[list[float], list[float], list[float]]:
        """Rounds, bytes on the wire and seconds of one rank with a core to itself: a group
        of n > cores ranks is time-sliced, its times ÷ n/cores (`calibration.machine`)."""
        r, b, t = [], [], []
        for op, n, size, seconds in points:
            r.append(1 if op == "p2p" else ring_steps(op, n))
            b.append(_wire_bytes(op, size, n))
            t.append(seconds / max(1.0, n / cores))
        return r, b, t

    link = fit_alpha_beta(*rounds_bytes(coll), what="collectives' α-β fit")
    per_op = {}
    for op in (*COLLECTIVES, "p2p"):  # for reference; noise may defeat a fit on few points
        try:
            per_op[op] = fit_alpha_beta(*rounds_bytes([p for p in coll if p[0] == op])).to_dict()
        except ShardwiseError as exc:
            per_op[op] = {"error": str(exc)}
    # a fixed cost per call for each collective and group size, at the link's β (the step
    # model charges it in place of the ring rounds' α: `estimate.step.group_collective_time`)
    # ("p2p/2": one message one way, half a ping-pong), on the messages where it dominates
    small = [p for p in coll if p[2] < PER_CALL_BELOW]
    _, wire, secs = rounds_bytes(small)
    per_call = fit_per_call([f"{op}/{n}" for op, n, *_ in small], wire, secs, link.beta)
    # and as measured with all `plan.ranks` ranks busy in side-by-side groups ("op/n@ranks",
    # not divided by the time-slicing: `calibration.machine.cluster_of` takes them as they
    # are for a layout of that many ranks)
    busy = [p for p in raw.get("collectives_busy") or [] if p[2] < PER_CALL_BELOW]
    if busy:
        wire = [_wire_bytes(op, size, n) for op, n, size, _ in busy]
        per_call |= fit_per_call([f"{op}/{n}@{plan.ranks}" for op, n, *_ in busy], wire,
                                 [p[3] for p in busy], link.beta)
    machine = MachineSpec(THIS_MACHINE, plan.backend, raw["dtype"], cores,
                          _memory_bytes(raw["device"]), gemm.peak, copy.beta, link.beta,
                          link.alpha,
                          per_call=tuple((k, f.scale) for k, f in per_call.items())).validate()
    per_group = {}
    for n in sorted({p[1] for p in coll}):  # α-β at each group size, for reference
        try:
            per_group[str(n)] = fit_alpha_beta(*rounds_bytes(
                [p for p in coll if p[1] == n])).to_dict()
        except ShardwiseError as exc:
            per_group[str(n)] = {"error": str(exc)}
    op_seconds, op_count = raw["host_ops"]
    probe = replace(default_calibration(), matmul_efficiency=1.0,
                    matmul_half_dim=gemm.half_dim, attention_efficiency=attention,
                    hbm_efficiency=hbm, kernel_overhead=op_seconds).validate()
    cal = replace(probe, kernel_overhead=_fit_host_cost(raw["steps"], machine, probe,
                                                        notes)).validate()
    steps = _step_residuals(raw["steps"], machine, cal)
    # the same steps with a rank on every core, kept in step, over the same steps alone just
    # before: the same fit on each, their ratio; the median over the rounds
    factors = [_fit_host_cost(synced, machine, probe, notes)
               / _fit_host_cost(alone, machine, probe, notes)
               for alone, synced in raw["synced_rounds"]]
    machine = replace(machine, synced_host_factor=statistics.median(factors)).validate()
    constants = {"matmul_efficiency": 1.0, "matmul_half_dim": gemm.half_dim,
                 "attention_efficiency": attention, "hbm_efficiency": hbm,
                 "kernel_overhead": cal.kernel_overhead}
    return {
        "_doc": [
            f"Written by `shardwise calibrate --backend {plan.backend} --ranks {plan.ranks}"
            f"{' --quick' if plan.quick else ''}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "machine: the 'this-machine' hardware preset (`--gpu this-machine --calibration "
            "FILE`): peak_flops is one rank's fitted GEMM asymptote P∞ (so matmul_efficiency "
            "= 1 by construction), memory_bandwidth one rank's copy bandwidth, link the α-β "
            "fitted over every collective (SPEC §5 ring rounds and bytes).",
            "Not measured, built-in values kept: dp_bucket_bytes, overlap_contention.",
            *notes,
        ],
        "default": constants,
        "machine": machine.to_dict(),
        "measurements": {
            "matmul": {"points [M, K, N, s]": mm, "launch_s": launch_s,  # the one fitted with
                       "launch_timed_s": raw["launch"],
                       "fit": gemm.to_dict()},
            "copy": {"points [bytes moved, s]": raw["copy"], "fit": copy.to_dict()},
            "memory_kernels": {"points [kernel, bytes moved, s]": raw["kernels"],
                               "fit": kern.to_dict()},
            "attention": {"points [s, d, heads, s fwd+bwd]": raw["attention"],
                          "fit (scale = 1/attention_efficiency)": attn.to_dict()},
            "host_ops": {"probe: seconds per aten op": op_seconds,
                         "aten ops of the probe block (forward + backward)": op_count,
                         "probe block": HOST_PROBE,
                         "fitted on the one-rank steps: seconds per aten op":
                             cal.kernel_overhead},
            "collectives": {"points [op, ranks, bytes, s]": coll, "fit": link.to_dict(),
                            f"points with all {plan.ranks} ranks busy [op, ranks, bytes, s]":
                                busy,
                            "per_op": per_op, "per_group_size": per_group,
                            "per_call (α_call of t = α_call + bytes/β)":
                                {k: f.to_dict() for k, f in per_call.items()}},
            "steps": steps,
            "synced_steps": {
                "rounds: points [seq, micro_batch, s] alone, then kept in step (s outside "
                "the all-reduces)": raw["synced_rounds"],
                "factor per round (fitted per-op cost kept in step ÷ alone)": factors},
        },
    }


def _predicted_steps(points: list[list[float]], machine: MachineSpec, cal: Calibration
                     ) -> list[float]:
    """The step model's one-rank `tiny` step (`estimate_step` on the "this machine" preset)
    for each [seq, micro_batch, s] point."""
    from shardwise.estimate.step import estimate_step
    from shardwise.layout import TrainSpec

    cluster, c = cluster_of(machine, cal, 1)
    return [estimate_step(get_model("tiny"), cluster, Layout(micro_batch=int(mbs)),
                          TrainSpec(seq_len=int(seq), global_batch=8, dtype="fp32"), c).total
            for seq, mbs, _ in points]


def _fit_host_cost(points: list[list[float]], machine: MachineSpec, probe: Calibration,
                   notes: list[str]) -> float:
    """`kernel_overhead` k at which the model's one-rank steps match the measured ones: one
    rank has no communication, so its predicted step is linear in k, `t = a + k·n` (a: the
    step at k = 0, n: its aten ops) — `fit_scale` (relative least squares). The probe's
    figure where the fit is degenerate (a note says so)."""
    k0 = probe.kernel_overhead
    base = _predicted_steps(points, machine, replace(probe, kernel_overhead=0.0))
    ops = [(t - a) / k0 for t, a in zip(_predicted_steps(points, machine, probe), base,
                                        strict=True)]
    k = fit_scale(base, ops, [p[2] for p in points]).scale
    if not k > 0:
        notes.append(f"kernel_overhead: the one-rank steps gave {k:.3g} s per op; the probe "
                     f"block's {k0:.3g} s kept")
        return k0
    return k


def host_cost_now(points: list[list[float]], path: str) -> float:
    """`kernel_overhead` refitted on one-rank steps timed later (`one_rank_steps`) than the
    calibration file `path`, everything else from the file: the host's cost per op as it is
    now (a shared machine's speed drifts 10–50 % within minutes here)."""
    notes: list[str] = []
    return _fit_host_cost(points, read_machine(path), load_calibration(THIS_MACHINE, path),
                          notes)


def _step_residuals(points: list[list[float]], machine: MachineSpec, cal: Calibration
                    ) -> dict[str, Any]:
    """The measured one-rank steps against the model's with the fitted constants (the
    residuals of the `kernel_overhead` fit)."""
    predicted = _predicted_steps(points, machine, cal)
    residuals = relative_residuals([p[2] for p in points], predicted)
    return {"points [seq, micro_batch, s]": points, "predicted_s": predicted,
            "residuals": residuals.tolist(),
            "rms": float(np.sqrt(np.mean(residuals ** 2))),
            "max_abs": float(np.max(np.abs(residuals)))}


