"""The longest sequence that fits a per-GPU memory budget (the "context wall").

Context parallelism over `c` ranks (ring attention, Liu et al. 2023) gives each rank `s/c` of
every sequence, so the activation terms of SPEC §3–§4 (saved tensors, logits) fall as `1/c`
while the persistent state does not depend on `s`. The longest `s` whose peak per-GPU memory
(`largest_stage_memory`) stays within the budget therefore grows about linearly with `c` — and a
little faster when ZeRO also shards the state over the `c` ranks (`Layout.zero_degree = dp·cp`).

The search treats the memory model as a black box that only grows with `s` (bisection over
the sequence lengths the layout accepts), so it follows the model whatever terms it gains.
"""

from __future__ import annotations

import math
from dataclasses import replace

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import largest_stage_memory
from shardwise.layout import Layout, TrainSpec

__all__ = ["longest_context", "sequence_unit"]

MAX_SEQ_LEN = 1 << 30
"""Search ceiling (about a billion tokens): a longer answer is reported as this bound."""


def sequence_unit(layout: Layout) -> int:
    """The step between sequence lengths the layout accepts: zigzag CP cuts a sequence into
    `2·cp` chunks, sequence parallelism into `tp·cp` slices (`Layout._train_problems`)."""
    unit = 2 * layout.cp if layout.cp > 1 else 1
    if layout.sp:
        unit = math.lcm(unit, layout.tp * layout.cp)
    return unit


def longest_context(model: ModelSpec, layout: Layout, budget_bytes: float,
                    train: TrainSpec | None = None) -> int:
    """Largest `seq_len` (a multiple of `sequence_unit(layout)`, at most `MAX_SEQ_LEN`) whose
    peak per-GPU memory is ≤ `budget_bytes`; 0 when not even the shortest sequence fits (the
    persistent state alone is over budget)."""
    if not budget_bytes > 0:
        raise ShardwiseError(f"the memory budget must be > 0 bytes, got {budget_bytes!r}")
    train = train or TrainSpec()
    unit = sequence_unit(layout)

    def fits(k: int) -> bool:
        spec = replace(train, seq_len=k * unit)
        return largest_stage_memory(model, layout, spec).total <= budget_bytes

    lo, hi = 0, MAX_SEQ_LEN // unit  # fits(lo) holds (or lo = 0); find the last k that fits
    if fits(hi):
        return hi * unit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * unit
