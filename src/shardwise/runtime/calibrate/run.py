"""`calibrate` (spawn the ranks, measure, fit), its plot and its summary table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from shardwise.calibration.fit import (
    matmul_seconds,
)
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ring_steps
from shardwise.runtime import launch
from shardwise.runtime.calibrate.comm import _collective_ranks
from shardwise.runtime.calibrate.compute import (
    FACTOR_ROUNDS,
    _compute_rank,
    _step_plan,
    _synced_ranks,
    one_rank_steps,
)
from shardwise.runtime.calibrate.fit import _wire_bytes, fit_measurements
from shardwise.runtime.calibrate.plan import COLLECTIVES, Plan


def calibrate(plan: Plan, progress: Callable[[str], None] = lambda msg: None
              ) -> dict[str, Any]:
    """Measure (one rank: compute; `plan.ranks` ranks: collectives) and fit; returns the
    calibration file's content. A fit that comes out non-physical (on a loaded machine a
    small point can time slower than a large one) is measured once more before it fails."""
    plan.validate()
    try:
        return fit_measurements(_measure(plan, progress), plan)
    except ShardwiseError as exc:
        progress(f"{exc}: measuring once more")
    return fit_measurements(_measure(plan, progress), plan)


def _measure(plan: Plan, progress: Callable[[str], None]) -> dict[str, Any]:
    """The raw points: compute on one rank, the one-rank steps alone and kept in step, the
    collectives on `plan.ranks` ranks."""
    progress("GEMMs, memory-bound kernels, attention, one-rank training steps")
    raw = launch.spawn(_compute_rank, 1, plan, timeout_s=600, backend=plan.backend)[0]
    ranks = plan.ranks if plan.backend == "nccl" else min(plan.ranks, len(os.sched_getaffinity(0)))
    rounds = 1 if plan.quick else FACTOR_ROUNDS
    progress(f"the one-rank steps alone, then on {ranks} ranks kept in step, × {rounds}")
    raw["synced_rounds"] = [
        [launch.spawn(one_rank_steps, 1, raw["dtype"], *_step_plan(plan), timeout_s=600,
                      backend=plan.backend)[0],
         launch.spawn(_synced_ranks, ranks, plan, raw["dtype"], timeout_s=600,
                      backend=plan.backend)[0]]
        for _ in range(rounds)]
    progress(f"collectives on {plan.ranks} ranks ({plan.backend})")
    raw["collectives"] = launch.spawn(_collective_ranks, plan.ranks, plan, timeout_s=600,
                                      backend=plan.backend)[0]
    if plan.ranks > len(os.sched_getaffinity(0)) and plan.backend == "gloo":
        progress(f"collectives with all {plan.ranks} ranks busy (more ranks than cores)")
        raw["collectives_busy"] = launch.spawn(_collective_ranks, plan.ranks, plan, True,
                                               timeout_s=600, backend=plan.backend)[0]
    progress("fitting")
    return raw


def plot_calibration(data: dict[str, Any], path: str) -> None:
    """Measured points against the fitted curves: GEMM throughput, memory-bound kernels,
    collectives (matplotlib, `pip install 'shardwise[plot]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardwiseError("--plot needs matplotlib: pip install 'shardwise[plot]'") from None
    meas, machine = data["measurements"], data["machine"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    # GEMM: GFLOP/s against FLOPs
    mm = meas["matmul"]["points [M, K, N, s]"]
    fit = meas["matmul"]["fit"]
    flops = [2 * m * k * n for m, k, n, _ in mm]
    ax = axes[0]
    ax.scatter(flops, [f / t / 1e9 for f, (*_, t) in zip(flops, mm)], label="measured")
    launch = meas["matmul"]["launch_s"]
    fitted = [f / (launch + matmul_seconds(m, k, n, fit["peak_flops"], fit["half_dim"])) / 1e9
              for f, (m, k, n, _) in zip(flops, mm)]
    ax.scatter(flops, fitted, marker="x", label=f"fit P∞={fit['peak_flops'] / 1e9:.1f} "
                                                  f"GFLOP/s, d½={fit['half_dim']:.0f}")
    ax.set(xscale="log", xlabel="FLOPs of one GEMM (2MKN)", ylabel="GFLOP/s", title="GEMM")
    # memory-bound kernels: seconds against bytes moved
    ax = axes[1]
    for name, key in (("copy", "copy"), ("kernels", "memory_kernels")):
        pts = meas[key][next(k for k in meas[key] if k.startswith("points"))]
        f = meas[key]["fit"]
        xs = [p[-2] for p in pts]
        ax.scatter(xs, [p[-1] for p in pts], label=f"{name} measured")
        line = sorted(xs)
        ax.plot(line, [f["alpha"] + x / f["beta"] for x in line],
                label=f"{name} fit {f['beta'] / 1e9:.1f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="bytes moved", ylabel="s",
           title="memory-bound kernels")
    # collectives: seconds against size, fitted link
    ax = axes[2]
    link = machine["link"]
    for op, n, size, seconds in meas["collectives"]["points [op, ranks, bytes, s]"]:
        rounds = 1 if op == "p2p" else ring_steps(op, n)
        wire = _wire_bytes(op, size, n)
        sliced = max(1.0, n / machine["cores"])  # more ranks than cores: time-sliced
        model = sliced * (rounds * link["latency"] + wire / link["bandwidth"])
        ax.scatter(size, seconds, s=12, color=f"C{[*COLLECTIVES, 'p2p'].index(op)}")
        ax.scatter(size, model, s=12, marker="x", color=f"C{[*COLLECTIVES, 'p2p'].index(op)}")
    for i, op in enumerate((*COLLECTIVES, "p2p")):
        ax.scatter([], [], color=f"C{i}", label=op)
    ax.set(xscale="log", yscale="log", xlabel="message bytes (full tensor)", ylabel="s",
           title=f"collectives (o measured, x α-β: α={link['latency'] * 1e6:.0f} µs, "
                 f"β={link['bandwidth'] / 1e9:.2f} GB/s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    """[quantity, value, fit residual (rms / max, relative)] for the summary table."""
    meas, machine, const = data["measurements"], data["machine"], data["default"]

    def res(fit: dict[str, Any]) -> str:
        return f"{fit['rms']:.1%} / {fit['max_abs']:.1%}"

    link = machine["link"]
    rows = [
        ["GEMM asymptote P∞ (one rank)", f"{machine['peak_flops'] / 1e9:.2f} GFLOP/s "
                                         f"{machine['dtype']}", res(meas["matmul"]["fit"])],
        ["GEMM half dimension d½", f"{const['matmul_half_dim']:.1f}", ""],
        ["copy bandwidth (one rank)", f"{machine['memory_bandwidth'] / 1e9:.2f} GB/s",
         res(meas["copy"]["fit"])],
        ["hbm_efficiency (norm, add, softmax ÷ copy)", f"{const['hbm_efficiency']:.3f}",
         res(meas["memory_kernels"]["fit"])],
        ["attention_efficiency (causal convention)", f"{const['attention_efficiency']:.3f}",
         res(meas["attention"]["fit (scale = 1/attention_efficiency)"])],
        ["kernel_overhead (per aten op; fitted on the one-rank steps)",
         f"{const['kernel_overhead'] * 1e6:.2f} µs",
         f"probe block {meas['host_ops']['probe: seconds per aten op'] * 1e6:.2f} µs"],
        ["synced_host_factor (per-op cost of ranks kept in step ÷ alone)",
         f"{machine['synced_host_factor']:.3f}", ""],
        ["one-rank tiny step: model vs measured", ", ".join(
            f"{p * 1e3:.0f} vs {m[2] * 1e3:.0f} ms" for p, m in zip(
                meas["steps"]["predicted_s"], meas["steps"]["points [seq, micro_batch, s]"])),
         res(meas["steps"])],
        [f"link α ({machine['backend']})", f"{link['latency'] * 1e6:.1f} µs",
         res(meas["collectives"]["fit"])],
        [f"link β ({machine['backend']})", f"{link['bandwidth'] / 1e9:.3f} GB/s", ""],
    ]
    for n, fit in meas["collectives"]["per_group_size"].items():
        if "error" not in fit:
            rows.append([f"  {n} ranks: α, β", f"{fit['alpha'] * 1e6:.1f} µs, "
                                               f"{fit['beta'] / 1e9:.3f} GB/s", res(fit)])
    for op, fit in meas["collectives"]["per_op"].items():
        if "error" in fit:
            rows.append([f"  {op} alone", "no fit", fit["error"]])
            continue
        rows.append([f"  {op} alone: α, β", f"{fit['alpha'] * 1e6:.1f} µs, "
                                            f"{fit['beta'] / 1e9:.3f} GB/s", res(fit)])
    calls = meas["collectives"].get("per_call (α_call of t = α_call + bytes/β)", {})
    for key, fit in calls.items():  # what the step model charges per call (at the link's β)
        op, n = key.split("/")
        rows.append([f"  {op}, {n} ranks: per call", f"{fit['scale'] * 1e6:.1f} µs", res(fit)])
    rows.append(["cores, memory", f"{machine['cores']}, {machine['memory_bytes'] / 2**30:.1f} "
                                  "GiB", ""])
    return rows
