"""The predicted side of `shardwise check` (SPEC §9): what the analytic model says one rank of a
layout sends, saves and holds, and the rows comparing it with what a run measured
(`runtime.measure` measures; this package is pure arithmetic, no torch). `rows`: the row, its
targets and the per-stage merge; `traffic`: collectives' payloads and wire bytes; `kept`:
saved activations, state, peak and checkpoint. Targets and the wire's framing allowance:
docs/howto/check.md.
"""

from __future__ import annotations

from shardwise.estimate.check.kept import (
    activation_note,
    checkpoint_rows,
    peak_row,
    predicted_saved,
    state_rows,
    zero_units,
)
from shardwise.estimate.check.rows import (
    COUNTS_OP,
    EXACT,
    FRAMED,
    REPORTED,
    ROUTING_COUNTS_OP,
    ROUTING_GATHER_OP,
    RUNTIME_IMPL,
    WITHIN_1PC,
    CheckRow,
    merge_rows,
)
from shardwise.estimate.check.traffic import (
    FRAMING_PER_PEER,
    OTHER_ALGORITHMS,
    Counted,
    Term,
    Traffic,
    comm_rows,
    predicted_comm,
    ring_factor,
)

__all__ = ["COUNTS_OP", "EXACT", "FRAMED", "FRAMING_PER_PEER", "OTHER_ALGORITHMS", "REPORTED",
           "ROUTING_COUNTS_OP", "ROUTING_GATHER_OP", "RUNTIME_IMPL", "WITHIN_1PC", "CheckRow",
           "Counted", "Term", "Traffic", "activation_note", "checkpoint_rows", "comm_rows",
           "merge_rows", "peak_row", "predicted_comm", "predicted_saved", "ring_factor",
           "state_rows", "zero_units"]
