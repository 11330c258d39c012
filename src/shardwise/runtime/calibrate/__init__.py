"""`shardwise calibrate`: measure this machine and fit the step-time model's constants.

Modules: `plan` (what to measure, the timer), `compute` (one rank: GEMMs, memory-bound
kernels, attention, host cost per op, one-rank steps), `comm` (N ranks: collectives, a
layout's own groups), `fit` (measurements → constants), `run` (`calibrate`, plot, table).
What is measured and how each constant is fitted: docs/concepts/runtime.md#calibration.
"""

from shardwise.runtime.calibrate.comm import (
    AXIS_CALLS,
    _dispatch,
    _group_seconds,
    time_layout_calls,
)
from shardwise.runtime.calibrate.compute import (
    HOST_PROBE,
    REFERENCE_STEP,
    STEP_CONFIGS,
    one_rank_state,
    one_rank_steps,
    step_outside_world,
)
from shardwise.runtime.calibrate.fit import fit_measurements, host_cost_now
from shardwise.runtime.calibrate.plan import COLLECTIVES, Plan, _seconds, _sync
from shardwise.runtime.calibrate.run import calibrate, plot_calibration, summary_rows

__all__ = ["AXIS_CALLS", "COLLECTIVES", "HOST_PROBE", "REFERENCE_STEP", "STEP_CONFIGS", "Plan",
           "_dispatch", "_group_seconds", "_seconds", "_sync", "calibrate", "fit_measurements",
           "host_cost_now", "one_rank_state", "one_rank_steps", "plot_calibration",
           "step_outside_world", "summary_rows", "time_layout_calls"]
