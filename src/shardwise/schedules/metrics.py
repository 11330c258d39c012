"""Closed forms: pipeline bubble, micro-batches for a target bubble, layers per stage (SPEC §6).

With `p` stages, `m` micro-batches and `v` chunks per stage (v = 1 for GPipe and 1F1B), the
pipeline fills and drains in `(p-1)/v` stage-times of `t_f + t_b` (Huang et al. 2019; Narayanan
et al. 2021), against `m` of useful work:

    bubble fraction      (p-1) / (v·m + p-1)     idle share of p × makespan
    bubble over ideal    (p-1) / (v·m)           idle time over the bubble-free time
"""

from __future__ import annotations

import heapq
import math
from fractions import Fraction
from itertools import accumulate

import shardwise.validate as validate
from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import check_dimensions


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """`(p-1)/(v·m + p-1)`: 3/11 for p=4, m=8; 7/15 for p=8, m=8."""
    check_dimensions(p, m, v)
    return (p - 1) / (v * m + p - 1)


def bubble_over_ideal(p: int, m: int, v: int = 1) -> float:
    """`(p-1)/(v·m)`, the bubble relative to the ideal time (Narayanan et al. 2021, §2.2)."""
    check_dimensions(p, m, v)
    return (p - 1) / (v * m)


def microbatches_for_bubble(p: int, target: float, v: int = 1) -> int:
    """Smallest `m` with `bubble_fraction(p, m, v) ≤ target`.

    `(p-1)/(v·m + p-1) ≤ β  ⇔  m ≥ (p-1)(1-β)/(v·β)`, so `m = ceil((p-1)(1-β)/(v·β))`, at least 1.
    For `v > 1` it is rounded up to a multiple of `p`, as interleaved 1F1B requires. `target` is
    read as the decimal it prints as (0.1 is 1/10, not the binary float above it), so (8, 0.1)
    gives exactly 63 and (16, 0.05) gives 285.
    """
    check_dimensions(p, 1, v)
    validate.finite(target, "target bubble fraction", low=0, high=1, low_open=True,
                    high_open=True)
    beta = Fraction(str(target))  # in (0, 1): `finite` refused the rest
    m = max(1, math.ceil((p - 1) * (1 - beta) / (v * beta)))
    return -(-m // p) * p if v > 1 else m


def partition_layers(n_layers: int, n_stages: int, *, first_stage_extra: float = 0.0,
                     last_stage_extra: float = 0.0) -> list[list[int]]:
    """Contiguous layer indices for each stage, balancing `layers + extra` per stage.

    Each stage gets one layer, then each remaining layer goes to the stage with the lowest cost
    so far, the lowest-numbered on ties. Without extras the first `n_layers % n_stages` stages
    get one layer more: 10 over 4 -> sizes [3, 3, 2, 2]. `first_stage_extra` and
    `last_stage_extra` are the embedding's and the LM head's costs in layer-equivalents (a single
    stage carries both). For interleaved schedules, partition over the `p·v` virtual stages.
    """
    validate.integer(n_layers, "n_layers", low=1, high=validate.MAX_DEGREE)
    validate.degree(n_stages, "n_stages")
    validate.finite(first_stage_extra, "first_stage_extra", low=0)
    validate.finite(last_stage_extra, "last_stage_extra", low=0)
    if n_layers < n_stages:
        raise ShardwiseError(f"need at least one layer per stage: n_layers={n_layers}, "
                             f"n_stages={n_stages}")
    sizes = [1] * n_stages
    extras = [0.0] * n_stages
    extras[0] += first_stage_extra
    extras[-1] += last_stage_extra
    heap = [(1 + extra, stage) for stage, extra in enumerate(extras)]
    heapq.heapify(heap)
    for _ in range(n_layers - n_stages):
        cost, stage = heapq.heappop(heap)
        sizes[stage] += 1
        heapq.heappush(heap, (cost + 1, stage))
    ends = list(accumulate(sizes))
    return [list(range(end - size, end)) for end, size in zip(ends, sizes)]
