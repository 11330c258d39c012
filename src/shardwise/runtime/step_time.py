"""The step-time rows of `shardwise check`: the step model's prediction (`estimate.step`,
SPEC §7) for the layout on this machine against the measured median step.

`check_layout` measures rank 0's step time (the median and the fastest of the steps after
the checked ones, outside the saved-tensor hooks and byte counters); `with_prediction` adds
the prediction from a calibration file written by `shardwise calibrate` (its `machine` section is the hardware, its constants the
efficiencies) and one row per component of the model's step: compute, exposed communication
per axis, bubble, optimizer. The components are predicted only: the runtime does not time
them apart (a rank waiting in a collective and a rank computing look alike from the step
clock). Then the same model again with the per-call costs of the layout's collectives timed
on its own groups right after its steps (`runtime.calibrate.time_layout_calls`; the
"per call: …" rows): the file's compute constants, the collectives as they cost now. The rows
are reported, not targets (`check`'s exit code ignores them): a step time on
a shared CPU is noisy; `benchmarks/bench_check_step.py` measures the accuracy over repeats.

Without `--calibration` the built-in constants (`data/calibration.json`) apply, and they
describe datasheet GPUs: on a CPU there is no hardware to predict with, so the row says so.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shardwise.calibration.machine import predict_step
from shardwise.errors import ShardwiseError
from shardwise.runtime.measure import CALL_ROW, REPORTED, CheckRow
from shardwise.runtime.train import TrainConfig

__all__ = ["COMPONENTS", "RETIMED", "with_prediction"]

RETIMED = "step, collectives re-timed (s)"

# StepEstimate field -> row label (the model's breakdown, SPEC §7)
COMPONENTS = {"compute": "compute", "tp_comm": "tp comm", "cp_comm_exposed": "cp comm exposed",
              "ep_comm": "ep comm", "pp_comm": "pp p2p", "bubble": "bubble",
              "dp_comm_exposed": "dp comm exposed", "optimizer": "optimizer"}


def with_prediction(rows: list[CheckRow], config: TrainConfig,
                    calibration: str | Path | None) -> list[CheckRow]:
    """`rows` with the measured step-time rows (median and fastest step) completed by the
    prediction and followed by the predicted components (non-zero ones)."""
    measured = [i for i, r in enumerate(rows) if r.item == "step time"
                and not r.what.startswith(CALL_ROW)]
    if not measured:
        return rows
    calls = [r for r in rows if r.item == "step time" and r.what.startswith(CALL_ROW)]
    rest = [r for r in rows if r.item != "step time"]
    if calibration is None:
        note = ("calibration: built-in (data/calibration.json, datasheet GPUs): no figures for "
                "the machine this ran on; run `shardwise calibrate --out FILE` and pass "
                "--calibration FILE")
        return rest + [replace(rows[i], note=f"{rows[i].note}; {note}") for i in measured] + calls
    try:
        step = predict_step(config.model, config.layout, config.train_spec(), calibration)
    except ShardwiseError as exc:
        return rest + [replace(rows[i], note=f"{rows[i].note}; no prediction: {exc}")
                       for i in measured] + calls
    source = f"predicted by the step model (SPEC §7), calibration: {calibration}"
    totals = [replace(rows[i], predicted=step.total, note=f"{rows[i].note}; {source}")
              for i in measured]
    parts = [CheckRow("step time", f"{label} (s)", getattr(step, name), None, REPORTED,
                      "predicted component (not timed apart by the runtime)")
             for name, label in COMPONENTS.items() if getattr(step, name) > 0]
    if calls:  # the same model with the collectives' costs timed beside the steps
        now = {r.what.removeprefix(CALL_ROW).removesuffix(" (s)"): r.measured for r in calls}
        retimed = predict_step(config.model, config.layout, config.train_spec(), calibration,
                               per_call=now).total
        median = rows[measured[0]]
        parts.append(CheckRow("step time", RETIMED, retimed, median.measured, REPORTED,
                              "the step model with the file's compute constants and the "
                              "per-call costs below (timed now on this layout's groups)"))
    return rest + totals + parts + calls
