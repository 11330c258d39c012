"""`shardwise check`'s rows: one predicted-versus-measured item (`CheckRow`), its target
(exact, within 1 %, the wire's algorithm + framing allowance, or reported) and the merge of
every rank's rows into the worst per stage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

EXACT, WITHIN_1PC, REPORTED = "exact", "1%", "-"
FRAMED = "algorithm"  # a wire row: the algorithm's bytes + framing allowance (`_wire_row`)
RUNTIME_IMPL = "shardwise"  # the activation profile the runtime implements (estimate.profiles)
_ROUNDING = 1e-12  # "exact": equal to float rounding
# the op name under which expert parallelism's per-expert row-count exchange is counted
COUNTS_OP = "all-to-all (counts)"
# ... and the all-reduce of an MoE layer's per-expert counts over the ranks sharing its
# sequences (cp, SP), for the load-balancing loss (`runtime.parallelize.apply_sequence_shards`)
ROUTING_COUNTS_OP = "all-reduce (routing counts)"
# ... and the all-gather of their expert choices for the capacity (`_sequence_keep` there)
ROUTING_GATHER_OP = "all-gather (routing)"



# ------------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class CheckRow:
    """One predicted-versus-measured item of one rank (or the worst rank, after merging).

    item: "comm", "activations", "state" or "peak memory"; what: "tp all-reduce", "layer 3",
    "weights"…; predicted, measured: bytes (None where there is nothing to compare); target:
    "exact", "1%", "algorithm" (a wire row: measured within `allowed`, the algorithm's bytes
    plus the framing allowance) or "-"
    (reported, outside the model); note: why they differ, or how the prediction was composed;
    ranks: how many ranks the row stands for.
    """

    item: str
    what: str
    predicted: float | None
    measured: float | None
    target: str = EXACT
    note: str = ""
    rank: int = 0
    stage: int = 0
    ranks: int = 1
    allowed: tuple[float, float] | None = None  # FRAMED: the measured bytes' bounds

    @property
    def error(self) -> float | None:
        """(measured − predicted) / predicted; 0 when both are 0; None without both."""
        if self.predicted is None or self.measured is None:
            return None
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else math.inf
        return (self.measured - self.predicted) / self.predicted

    @property
    def ok(self) -> bool:
        """Whether the row meets its target (a "-" row always does)."""
        error = self.error
        if self.target == REPORTED:
            return True
        if self.target == FRAMED:
            return (self.allowed is not None and self.measured is not None
                    and self.allowed[0] <= self.measured <= self.allowed[1])
        if error is None:
            return False
        return abs(error) <= (_ROUNDING if self.target == EXACT else 0.01)

    def as_dict(self) -> dict[str, Any]:
        error = self.error
        return asdict(self) | {"error": None if error is None or math.isinf(error) else error,
                               "ok": self.ok}


def merge_rows(per_rank: Sequence[Sequence[CheckRow]]) -> list[CheckRow]:
    """One row per (pipeline stage, item, what): the rank with the largest error (a row that
    misses its target first), `ranks` set to how many ranks reported it."""
    groups: dict[tuple[int, str, str], list[CheckRow]] = {}
    for rows in per_rank:
        for row in rows:
            groups.setdefault((row.stage, row.item, row.what), []).append(row)

    def badness(row: CheckRow) -> tuple[bool, float]:
        error = row.error
        return (not row.ok, abs(error) if error is not None else 0.0)

    merged = [replace(max(rows, key=badness), ranks=len(rows)) for rows in groups.values()]
    order = {"comm": 0, "wire": 0, "activations": 1, "state": 2, "peak memory": 3}
    return sorted(merged, key=lambda r: (r.stage, order.get(r.item, 9)))


# ------------------------------------------------------------------------- predictions
