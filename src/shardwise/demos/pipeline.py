"""`shardwise demo pipeline`: run a schedule on real ranks and check it (SPEC §6, §8, §9).

Design notes: docs/concepts/runtime.md#demos-pipeline.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from statistics import mean
from typing import Any

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import pp_comm_bytes_per_microbatch
from shardwise.schedules import (
    Timeline,
    get_schedule,
    make_schedule,
    peak_in_flight,
    render_ascii,
    simulate,
    split_backwards,
    stage_of,
    validate_schedule,
)

__all__ = ["format_pipeline_demo", "run_pipeline_demo"]

_TOL = 1e-12
_DTYPE_BYTES = 8  # float64


def _demo_worker(p: int, dp: int, schedule: str, m: int, v: int, sizes: tuple[int, int, int, int],
                 seq_len: int, micro_batch: int, seed: int) -> dict[str, Any]:
    """One rank: the pipeline step, the single-device reference, what was measured."""
    import torch

    from shardwise.layout import Layout
    from shardwise.runtime import collectives as C
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.pipeline import PipelineModel, run_pipeline

    n_layers, hidden, ffn, vocab = sizes
    mesh = Mesh.from_layout(Layout(pp=p, dp=dp, schedule=schedule, chunks=v))
    gen = torch.Generator().manual_seed(seed + 1)
    rows = dp * m * micro_batch
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    targets = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    share = slice(mesh.rank("dp") * m * micro_batch, (mesh.rank("dp") + 1) * m * micro_batch)

    model = PipelineModel.build(n_layers, hidden, ffn, vocab, seed)
    plan = make_schedule(schedule, p, m, v)
    dp_axis = "dp" if dp > 1 else None
    # A warm-up step first: the first backward of a process pays one-off costs (autograd
    # imports torch.fx/sympy lazily, ~1 s) that would dwarf the timeline. Its result is discarded.
    placement = get_schedule(schedule).placement
    with C.counting():
        run_pipeline(model, plan, tokens[share], targets[share], "pp", dp_axis,
                     placement=placement)
    with C.counting() as counter:
        result = run_pipeline(model, plan, tokens[share], targets[share], "pp", dp_axis,
                              placement=placement)

    reference = PipelineModel.build(n_layers, hidden, ffn, vocab, seed)
    loss = reference.forward(tokens, targets)  # the whole batch on one device
    loss.backward()
    ref = reference.named_parameters()
    rel = max(float((g - ref[n].grad).abs().max() / ref[n].grad.abs().max().clamp_min(1e-300))
              for n, g in result.grads.items())
    result.grads = {}  # the parent needs the measurements, not the tensors
    return {"result": result, "dp_rank": mesh.rank("dp"), "host": socket.gethostname(),
            "loss_ref": float(loss.detach()),
            "grad_rel_error": rel, "pp_bytes": counter.bytes("pp", "send"),
            "dp_allreduces": counter.calls("dp", "all-reduce")}


def run_pipeline_demo(ranks: int = 4, schedule: str = "1f1b", microbatches: int = 8,
                      chunks: int | None = None, *, dp: int = 1, model: str = "tiny",
                      seq_len: int = 32,
                      micro_batch: int = 4, seed: int = 0, width: int = 160,
                      timeout_s: float = 120) -> dict[str, Any]:
    """Run `schedule` on `ranks` processes (`p = ranks / dp` pipeline stages) and check it.

    Returns {"ranks", "dp", "p", "m", "v", "schedule", "model", "rows": [{"check", "measured",
    "expected", "ok"}], "ok" (all rows ok), "measured_timeline", "simulated_timeline" (ASCII),
    "measured_makespan_s", "simulated_makespan_s", "measured_bubble", "simulated_bubble"}.
    `format_pipeline_demo(report)` prints it. `chunks` defaults to the schedule's own
    (`ScheduleInfo.default_chunks`: 2 for interleaved, ZBV and DualPipeV). Raises
    `ShardwiseError` for bad arguments before starting any process.
    """
    from shardwise.runtime.launch import launch
    from shardwise.runtime.pipeline import measured_timeline

    if ranks < 1 or dp < 1 or ranks % dp:
        raise ShardwiseError(f"ranks={ranks} must be a positive multiple of dp={dp}")
    info = get_schedule(schedule)
    if info.bidirectional:  # two model copies and directions: not in the executor
        raise ShardwiseError(f"the pipeline demo cannot run {schedule}: {info.no_stack}")
    p, m = ranks // dp, microbatches
    v = chunks or info.default_chunks
    plan = make_schedule(schedule, p, m, v)
    validate_schedule(plan, p, m, v, info.placement)
    spec = get_model(model)
    n_layers = max(spec.n_layers, p * v)  # at least one layer per virtual stage
    sizes = (n_layers, spec.d_model, spec.d_ff, spec.vocab)
    outputs = launch(_demo_worker, ranks, p, dp, schedule, m, v, sizes, seq_len, micro_batch,
                     seed, timeout_s=timeout_s)

    replica = [o for o in outputs if o["dp_rank"] == 0]
    results = [o["result"] for o in replica]
    split = any(split_backwards(actions) for actions in plan.values())
    losses = [o["result"].loss for o in outputs if o["result"].loss is not None]
    loss = sum(losses) / len(losses)  # replicas' means over equal shares
    loss_ref = outputs[0]["loss_ref"]
    grad_error = max(o["grad_rel_error"] for o in outputs)
    peaks = tuple(r.peak_alive for r in sorted(results, key=lambda r: r.stage))
    boundaries = sum(stage_of(vs, p, info.placement) != stage_of(vs + 1, p, info.placement)
                     for vs in range(p * v - 1))  # between virtual stages on two ranks
    per_boundary = (sum(o["pp_bytes"] for o in replica) / (boundaries * m)) if boundaries else 0.0
    expected_bytes = pp_comm_bytes_per_microbatch(seq_len, micro_batch, spec.d_model,
                                                  _DTYPE_BYTES) if boundaries else 0.0

    rows: list[dict[str, Any]] = [
        {"check": "loss vs single device", "measured": loss,
         "expected": loss_ref, "ok": abs(loss - loss_ref) <= _TOL * max(1.0, abs(loss_ref))},
        {"check": "gradients vs single device (max rel. error)", "measured": grad_error,
         "expected": f"≤ {_TOL:g}", "ok": grad_error <= _TOL},
        {"check": "peak micro-batches alive per stage (F→B)", "measured": _mbs(peaks, v),
         "expected": _mbs(peak_in_flight(plan), v), "ok": peaks == peak_in_flight(plan)},
    ]
    if split:
        peaks_w = tuple(r.peak_alive_until_w for r in sorted(results, key=lambda r: r.stage))
        rows.append({"check": "peak alive counted until W", "measured": _mbs(peaks_w, v),
                     "expected": _mbs(peak_in_flight(plan, until="W"), v),
                     "ok": peaks_w == peak_in_flight(plan, until="W")})
    rows.append({"check": "p2p bytes per boundary per micro-batch", "measured": per_boundary,
                 "expected": expected_bytes, "ok": per_boundary == expected_bytes})
    if dp > 1:
        calls = sorted({o["dp_allreduces"] for o in outputs})
        rows.append({"check": "dp all-reduces per rank per step (after the last micro-batch)",
                     "measured": float(max(calls)), "expected": 1.0, "ok": calls == [1]})

    measured = measured_timeline(results, same_clock=len({o["host"] for o in replica}) == 1)
    simulated = _simulated_like(plan, measured, info.placement)
    # one time grid for both charts, coarse enough that the longer one fits in `width`
    label = len(f"F{m - 1}") + (len(f".{v - 1}") if v > 1 else 0)
    cells = max(8, (width - len(str(p - 1)) - 3) // (label + 1))
    slot = max(min(e.end - e.start for e in simulated.events),
               max(measured.makespan, simulated.makespan) / cells)
    return {
        "ranks": ranks, "dp": dp, "p": p, "m": m, "v": v, "schedule": schedule,
        "model": {"n_layers": n_layers, "hidden": spec.d_model, "ffn": spec.d_ff,
                  "vocab": spec.vocab, "seq_len": seq_len, "micro_batch": micro_batch,
                  "dtype": "float64"},
        "rows": rows,
        "ok": all(row["ok"] for row in rows),
        "measured_timeline": render_ascii(measured, width=width, slot=slot),
        "simulated_timeline": render_ascii(simulated, width=width, slot=slot),
        "measured_makespan_s": measured.makespan,
        "simulated_makespan_s": simulated.makespan,
        "measured_bubble": measured.bubble_fraction,
        "simulated_bubble": simulated.bubble_fraction,
    }


def _mbs(chunks_alive: tuple[int, ...], v: int) -> str:
    """Per-stage peaks in micro-batches, `(5.5, 4.5)`: a chunk is `1/v` of one."""
    return "(" + ", ".join(f"{n / v:g}" for n in chunks_alive) + ")"


def _simulated_like(plan: Mapping[int, Any], measured: Timeline, placement: Any) -> Timeline:
    """The simulator's timeline with the measured mean times: F; W; a whole backward — the
    unsplit Bs', else a split B's plus W's (a split B then takes the whole less W)."""
    split = {(e.stage, e.action.micro_batch, e.action.chunk) for e in measured.events
             if e.action.kind == "W"}

    def mean_of(kind: str, split_b: bool | None = None) -> float | None:
        values = [e.end - e.start for e in measured.events if e.action.kind == kind
                  and (split_b is None or ((e.stage, e.action.micro_batch, e.action.chunk)
                                           in split) == split_b)]
        return max(mean(values), 1e-9) if values else None

    t_f, t_w = mean_of("F") or 1e-9, mean_of("W")
    whole = mean_of("B", False)
    t_b = whole if whole is not None else (mean_of("B", True) or 1e-9) + (t_w or 0.0)
    if t_w is not None and t_w >= t_b:  # noisy clocks: keep W a part of the backward
        t_w = t_b / 2
    return simulate(plan, t_f, t_b, t_w, placement=placement)


def format_pipeline_demo(report: Mapping[str, Any]) -> str:
    """The demo's report as text: the rows, then the measured and simulated timelines."""
    lines = [f"pipeline {report['schedule']}: p={report['p']} stages × dp={report['dp']}, "
             f"m={report['m']} micro-batches, v={report['v']} chunks (float64, gloo)"]
    for row in report["rows"]:
        lines.append(f"  {'ok  ' if row['ok'] else 'FAIL'} {row['check']}: "
                     f"{_fmt(row['measured'])} (expected {_fmt(row['expected'])})")
    lines.append(f"measured timeline ({report['measured_makespan_s'] * 1e3:.2f} ms, bubble "
                 f"{report['measured_bubble']:.2f}; a few CPU ranks sharing cores are noisy):")
    lines.append(report["measured_timeline"])
    lines.append(f"simulated timeline with the measured mean action times "
                 f"({report['simulated_makespan_s'] * 1e3:.2f} ms, bubble "
                 f"{report['simulated_bubble']:.2f}):")
    lines.append(report["simulated_timeline"])
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
