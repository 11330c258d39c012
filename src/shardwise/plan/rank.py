"""Ranking: fastest first, ties to the simpler layout; a given layout's position."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.layout import Balanced, Layout
from shardwise.schedules.registry import (
    DEFAULT_SCHEDULE,
    SCHEDULE_CODES,
)


def _complexity(cand: dict[str, Any]) -> np.ndarray:
    """Tie-break among equally fast layouts: fewer and smaller model-parallel axes, less
    sharding, less recomputation, the simpler schedule, the default stage partition."""
    return (cand["cp"] * 1000 + cand["pp"] * 100 + cand["tp"] * 10 + cand["ep"] * 10
            + cand["zero"] * 3 + (cand["zero_group"] > 0) * 2 + cand["recompute"] * 5 + cand["sp"]
            + (cand["schedule"] != SCHEDULE_CODES[DEFAULT_SCHEDULE]) * 4 + cand["chunks"]
            + _searched(cand) * 2).astype(np.float64)


def _searched(cand: dict[str, Any]) -> Any:
    """Which layouts have a searched, not the default, stage partition (`Balanced.default`)."""
    if "first_less" not in cand:
        return 0
    return Balanced(cand["first_less"], cand["last_less"]).searched(cand["_n_layers"], cand["pp"])


def _rank(cand: dict[str, Any], terms: dict[str, Any], fits: np.ndarray) -> np.ndarray:
    """Indices of the fitting layouts, fastest first (ties: the simpler layout)."""
    idx = np.nonzero(fits)[0]
    total = terms["total"][idx]
    rounded = np.round(total / total.min(), 9)  # equal to 1e-9: a tie
    complexity = _complexity({k: v if k.startswith("_") else v[idx] for k, v in cand.items()})
    return idx[np.lexsort((complexity, rounded))]


def _position(cand: dict[str, Any], terms: dict[str, Any], fits: np.ndarray,
              order: np.ndarray, layout: Layout) -> int | None:
    """1-based rank of `layout` among the fitting layouts (None if absent or not fitting)."""
    wanted = layout.codes()
    mask = np.ones(len(cand["tp"]), dtype=bool)
    for key, value in wanted.items():
        mask &= cand[key] == value
    # the searched partitions of its pp: () for the default (`grid._partitions`)
    split = layout.partition
    if split and split == layout.with_(partition=()).stage_partition(sum(split)):
        split = ()
    ends = [(a, z) for (p, a, z), option in cand.get("_partitions", {}).items()
            if p == layout.pp and option == split]
    if "first_less" in cand:
        mask &= np.any([(cand["first_less"] == a) & (cand["last_less"] == z) for a, z in ends]
                       or [False], axis=0)
    elif split:
        return None
    hits = np.nonzero(mask & fits)[0]
    if not len(hits):
        return None
    where = np.nonzero(np.isin(order, hits))[0]
    return int(where[0]) + 1 if len(where) else None
