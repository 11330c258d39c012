"""Ranking: fastest first, ties to the simpler layout; a given layout's position."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.layout import Layout
from shardwise.schedules.registry import (
    DEFAULT_SCHEDULE,
    SCHEDULE_CODES,
)


def _complexity(cand: dict[str, Any]) -> np.ndarray:
    """Tie-break among equally fast layouts: fewer and smaller model-parallel axes, less
    sharding, less recomputation, the simpler schedule."""
    return (cand["cp"] * 1000 + cand["pp"] * 100 + cand["tp"] * 10 + cand["ep"] * 10
            + cand["zero"] * 3 + (cand["zero_group"] > 0) * 2 + cand["recompute"] * 5 + cand["sp"]
            + (cand["schedule"] != SCHEDULE_CODES[DEFAULT_SCHEDULE]) * 4 + cand["chunks"]).astype(np.float64)


def _rank(cand: dict[str, Any], terms: dict[str, Any], fits: np.ndarray) -> np.ndarray:
    """Indices of the fitting layouts, fastest first (ties: the simpler layout)."""
    idx = np.nonzero(fits)[0]
    total = terms["total"][idx]
    rounded = np.round(total / total.min(), 9)  # equal to 1e-9: a tie
    complexity = _complexity({k: v[idx] for k, v in cand.items() if k != "_pairs"})
    return idx[np.lexsort((complexity, rounded))]


def _position(cand: dict[str, Any], terms: dict[str, Any], fits: np.ndarray,
              order: np.ndarray, layout: Layout) -> int | None:
    """1-based rank of `layout` among the fitting layouts (None if absent or not fitting)."""
    wanted = layout.codes()
    partition = layout.partition  # the grid holds the default partition only
    if partition and partition != layout.with_(partition=()).stage_partition(sum(partition)):
        return None
    mask = np.ones(len(cand["tp"]), dtype=bool)
    for key, value in wanted.items():
        mask &= cand[key] == value
    hits = np.nonzero(mask & fits)[0]
    if not len(hits):
        return None
    where = np.nonzero(np.isin(order, hits))[0]
    return int(where[0]) + 1 if len(where) else None
