"""The step-time rows of `shardwise check`: the step model's prediction (`estimate.step`,
SPEC §7) for the layout on this machine against the measured median step.

`check_layout` measures rank 0's step time (the median and the fastest of the steps after
the checked ones, outside the saved-tensor hooks and byte counters) and, in the median step,
the time it spent blocked in each axis's collectives (`collectives.clocking`: from a call to
its completion, or inside `wait` for an overlapped one — the communication the step did not
hide, waiting for the slowest peer included); `with_prediction` adds the prediction from a
calibration file written by `shardwise calibrate` (its `machine` section is the hardware, its
constants the efficiencies) and one row per component of the model's step (compute, exposed
communication per axis, bubble, optimizer), then the clock's rows against the components
that charge them (`AXIS_COMPONENTS`: tp comm; cp comm exposed; ep comm; pp p2p + bubble,
which a stage's waits for its neighbour cannot tell apart; dp comm exposed) and the rest of
the step, `OUTSIDE`, against compute + optimizer. The world's two scalar all-reduces (loss,
gradient norm) are reported measured only: the model charges them inside the optimizer.

Then the same model again with the machine as it is *now*: a shared machine's speed drifts
10–50 % within minutes (measured here between `calibrate` and `check` a minute apart: the
one-rank step ran 0.8–1.5× its calibrated time), so the file's figures are timed again beside
the run, each between the layout's timed steps, so that it sees the machine they ran on.
`HOST_RETIMED`: the host's per-op cost (`kernel_overhead`), refitted as `calibrate` fits it on
`calibrate`'s own one-rank `tiny` step, one after each timed step, the ranks taking turns
(`REFERENCE_ROW`, `measure._Reference`; `host_cost_now`; the row carries the file's own
figure for that step, and says the file is stale when the two differ by more than
`DRIFT_TARGET`), and `synced_host_factor`, refitted the same way on that step run by every
rank at once right after (`IN_STEP_ROW`): its per-op cost ÷ the one alone, × the share of a
core each rank has (`calibration.machine`: the model divides by it again, and with more
ranks than cores every rank of the layout was busy). `RETIMED`: that, and the per-call cost
of each collective the layout makes,
timed on its own groups in a burst after each step (`runtime.calibrate.time_layout_calls`,
the "per call: …" rows; they swing by 2× from one check to the next, and how the model splits
a call's cost between the call and the compute around it is its least certain part — README,
"Where the model's split is wrong" — so this row is the noisier of the two). The GEMM,
memory and attention constants and the link's α-β stay the file's. The rows are reported, not targets
(`check`'s exit code ignores them): a step time on a shared CPU is noisy;
`benchmarks/bench_check_step.py` measures the accuracy over repeats.

For an MoE model every prediction takes the routing the checked steps drew (the `routing:`
rows, `measure.EXPERT_LOAD_ROWS`: the busiest ep rank's expert rows ÷ the balanced share, and
the share of its experts that ran rows; `TrainSpec.expert_load`, `experts_active`), as the
activation rows do: the ranks of an ep group wait for each other at every all-to-all, so the
step runs at the busiest one's pace, and on this host an expert that receives no row launches
nothing (a fresh `tiny-moe` routes most rows of a layer to one rank's experts; the planner
assumes balanced routing).

Without `--calibration` the built-in constants (`data/calibration.json`) apply, and they
describe datasheet GPUs: on a CPU there is no hardware to predict with, so the row says so.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shardwise.arch import get_model
from shardwise.calibration.machine import read_machine
from shardwise.errors import ShardwiseError
from shardwise.estimate.machine import predict_step
from shardwise.estimate.step import StepEstimate
from shardwise.layout import Layout
from shardwise.runtime.calibrate import REFERENCE_STEP, host_cost_now
from shardwise.runtime.measure import (
    CALL_ROW,
    EXPERT_LOAD_ROWS,
    IN_STEP_ROW,
    REFERENCE_ROW,
    REPORTED,
    WAITED_ROW,
    CheckRow,
)
from shardwise.runtime.train import TrainConfig

__all__ = ["AXIS_COMPONENTS", "COMPONENTS", "HOST_RETIMED", "OUTSIDE", "RETIMED",
           "with_prediction"]

HOST_RETIMED = "step, host re-timed (s)"  # the per-op host cost timed beside the run
RETIMED = "step, host and collectives re-timed (s)"  # and the per-call costs

OUTSIDE = "outside collectives (s)"  # the measured step less its time in collectives
DRIFT_TARGET = 0.2  # the reference step off the file's figure by more: say the file is stale

# StepEstimate field -> row label (the model's breakdown, SPEC §7)
COMPONENTS = {"compute": "compute", "tp_comm": "tp comm", "cp_comm_exposed": "cp comm exposed",
              "ep_comm": "ep comm", "pp_comm": "pp p2p", "bubble": "bubble",
              "dp_comm_exposed": "dp comm exposed", "optimizer": "optimizer"}
# mesh axis -> the StepEstimate fields that charge the time a rank spends blocked in its
# collectives (pp: waiting for a neighbour is the p2p and the bubble alike)
AXIS_COMPONENTS = {"tp": ("tp_comm",), "cp": ("cp_comm_exposed",),
                   "cp_a2a": ("cp_comm_exposed",), "cp_ring": ("cp_comm_exposed",),
                   "ep": ("ep_comm",),
                   "pp": ("pp_comm", "bubble"), "dp": ("dp_comm_exposed",),
                   "dp_cp": ("dp_comm_exposed",), "edp": ("dp_comm_exposed",)}


def _by_name(rows: list[CheckRow], prefix: str) -> dict[str, float]:
    """{name: measured} of the rows labelled `f"{prefix}{name} (s)"`."""
    return {r.what.removeprefix(prefix).removesuffix(" (s)"): r.measured for r in rows
            if r.what.startswith(prefix)}


def _waited_rows(waited: dict[str, float], step: StepEstimate, median: float
                 ) -> list[CheckRow]:
    """The measured time in collectives per axis (`WAITED_ROW` rows: the median step's) against
    the components the model charges for it (`AXIS_COMPONENTS`), and the rest of the step
    against compute + optimizer."""
    rows = []
    for names in dict.fromkeys(AXIS_COMPONENTS.values()):
        axes = [a for a, n in AXIS_COMPONENTS.items() if n == names and a in waited]
        if axes:
            rows.append(CheckRow("step time", f"{WAITED_ROW}{', '.join(axes)} (s)",
                                 sum(getattr(step, n) for n in names),
                                 sum(waited[a] for a in axes), REPORTED,
                                 "measured: rank 0 blocked in these collectives in the median "
                                 "step; predicted: " + " + ".join(COMPONENTS[n] for n in names)))
    rows += [CheckRow("step time", f"{WAITED_ROW}{axis} (s)", None, seconds, REPORTED,
                      "measured only: the loss and gradient-norm all-reduces, charged "
                      "inside the model's optimizer")
             for axis, seconds in waited.items() if axis not in AXIS_COMPONENTS]
    if waited:
        rows.append(CheckRow("step time", OUTSIDE, step.compute + step.optimizer,
                             median - sum(waited.values()), REPORTED,
                             "measured: the median step less its time in collectives; "
                             "predicted: compute + optimizer"))
    return rows


def _reference_row(row: CheckRow, config: TrainConfig, calibration: str | Path) -> CheckRow:
    """The one-rank reference row (`REFERENCE_ROW`) with the file's prediction for that step:
    how far the machine has drifted since it was calibrated."""
    seq, mbs = REFERENCE_STEP
    tiny, one = get_model("tiny"), Layout(micro_batch=mbs)
    train = TrainConfig(tiny, one, seq_len=seq, global_batch=8, dtype=config.dtype).train_spec()
    predicted = predict_step(tiny, one, train, calibration).total
    drift = row.measured / predicted
    note = (f"{row.note}; predicted: the calibration file's figure for it (the machine ran it "
            f"at {drift:.2f}× that)")
    if abs(drift - 1) > DRIFT_TARGET:
        note += (f"; more than ±{DRIFT_TARGET:.0%}: the rows predicted from the file alone are "
                 "off by about as much, the re-timed ones less (the file was written on a "
                 "slower or faster machine than this run's: `shardwise calibrate` again)")
    return replace(row, predicted=predicted, note=note)


def with_prediction(rows: list[CheckRow], config: TrainConfig,
                    calibration: str | Path | None) -> list[CheckRow]:
    """`rows` with the measured step-time rows (median and fastest step) completed by the
    prediction and followed by the predicted components (non-zero ones) and the clock's rows
    (`WAITED_ROW`) set against them (`_waited_rows`), then the step
    re-timed where `rows` carry costs timed beside the steps: the one-rank reference step
    (`REFERENCE_ROW`: `HOST_RETIMED`) and with per-call rows (`CALL_ROW`) too (`RETIMED`)."""
    beside = [r for r in rows if r.item == "step time" and (
        r.what.startswith(CALL_ROW)
        or r.what in (REFERENCE_ROW, IN_STEP_ROW, *EXPERT_LOAD_ROWS.values()))]
    blocked = [r for r in rows if r.item == "step time" and r.what.startswith(WAITED_ROW)]
    measured = [i for i, r in enumerate(rows) if r.item == "step time"
                and r not in beside and r not in blocked]
    if not measured:
        return rows
    rest = [r for r in rows if r.item != "step time"]
    if calibration is None:
        note = ("calibration: built-in (data/calibration.json, datasheet GPUs): no figures for "
                "the machine this ran on; run `shardwise calibrate --out FILE` and pass "
                "--calibration FILE")
        return (rest + [replace(rows[i], note=f"{rows[i].note}; {note}") for i in measured]
                + blocked + beside)
    model, layout = config.model, config.layout
    load = {name: r.measured for r in beside for name, label in EXPERT_LOAD_ROWS.items()
            if r.what == label}  # the routing drawn (MoE)
    train = replace(config.train_spec(), **load)
    try:
        step = predict_step(model, layout, train, calibration)
    except ShardwiseError as exc:
        return (rest + [replace(rows[i], note=f"{rows[i].note}; no prediction: {exc}")
                        for i in measured] + blocked + beside)
    source = f"predicted by the step model (SPEC §7), calibration: {calibration}" + (
        ", at the routing the checked steps drew (the routing rows)" if load else "")
    totals = [replace(rows[i], predicted=step.total, note=f"{rows[i].note}; {source}")
              for i in measured]
    parts = [CheckRow("step time", f"{label} (s)", getattr(step, name), None, REPORTED,
                      "predicted component")
             for name, label in COMPONENTS.items() if getattr(step, name) > 0]
    parts += _waited_rows(_by_name(blocked, WAITED_ROW), step, rows[measured[0]].measured)
    # the same model with the machine's costs as timed beside the steps: the host's, then
    # the collectives' too
    per_op = {r.what: host_cost_now([[*REFERENCE_STEP, r.measured]], str(calibration))
              for r in beside if r.what in (REFERENCE_ROW, IN_STEP_ROW)}
    host, in_step = per_op.get(REFERENCE_ROW), per_op.get(IN_STEP_ROW)
    factor = None  # synced_host_factor now: the per-op cost of every rank busy ÷ alone,
    if host is not None and in_step is not None and layout.world_size > 1:  # × the share
        factor = in_step / host * min(1.0, read_machine(calibration).cores / layout.world_size)
    beside = [_reference_row(r, config, calibration) if r.what == REFERENCE_ROW else r
              for r in beside]
    now = _by_name(beside, CALL_ROW)
    timed = "the per-op host cost refitted on the one-rank reference step" + (
        f", synced_host_factor {factor:.2f} from it on every rank at once" if factor is not None
        else "")

    def retimed(label: str, calls: dict[str, float], what: str) -> CheckRow:
        again = predict_step(model, layout, train, calibration, per_call=calls,
                             kernel_overhead=host, synced_host_factor=factor)
        return CheckRow("step time", label, again.total, rows[measured[0]].measured, REPORTED,
                        f"the step model with {what} (rows below, timed now), the rest from "
                        "the file")

    if host is not None:
        parts.append(retimed(HOST_RETIMED, {}, timed))
        if now:
            parts.append(retimed(RETIMED, now, f"{timed} and the per-call costs timed on this "
                                               "layout's groups"))
    return rest + totals + parts + beside
