"""Explanation material: the best layout with each axis held at another value, the simplest
layout close to the winner, and what would help when nothing fits."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.estimate.memory import (
    bytes_per_param_training,
)
from shardwise.hardware import Cluster
from shardwise.layout import AXES, CP_KINDS, TrainSpec
from shardwise.plan.evaluate import RC_NAMES, _layout_of
from shardwise.plan.rank import Ranking, nontrivial_axes
from shardwise.plan.results import Alternative
from shardwise.schedules.registry import (
    get_schedule,
)

_ALTERNATIVE_AXES = (*AXES[1:], "cp_kind", "zero", "recompute", "schedule", "micro_batch",
                     "sp")
SIMPLEST_WITHIN = 0.01  # the explanation names the simplest layout this close to the winner


def _alternatives(ranking: Ranking, best: int, values: dict[str, list[int]] | None = None,
                  least: dict[tuple[str, int], float] | None = None) -> list[Alternative]:
    """For each axis and each value other than the winner's: the fastest fitting layout with
    that value by the figures the ranking knows (`Ranking.top(refine=False)`: the closed form's
    upper bound for uneven pipelines it did not simulate, so the best such layout is at least
    this fast), shown with its exact figure; or, if none fits, the least memory any such
    layout needs. `values` (each axis' values) and `least` (the least memory per axis value)
    over the whole grid when the ranking holds only part of it (`prune.Pruned`)."""
    out = []
    cand, memory = ranking.cand, ranking.terms["memory"]
    for axis in _ALTERNATIVE_AXES:
        for value in np.unique(cand[axis]) if values is None else values[axis]:
            if value == cand[axis][best]:
                continue
            mask = cand[axis] == value
            if axis == "cp_kind":  # only layouts with context parallelism have a kind
                mask &= cand["cp"] > 1
                if not mask.any() and values is None:
                    continue
            shown: Any = int(value)
            if axis == "recompute":
                shown = RC_NAMES[int(value)]
            elif axis == "schedule":
                shown = get_schedule(int(value)).name
            elif axis == "sp":
                shown = bool(value)
            elif axis == "cp_kind":
                shown = CP_KINDS[int(value)]
            rows = ranking.top(1, within=mask, fold=False, refine=False)
            if len(rows):
                i = int(rows[0])
                out.append(Alternative(axis, shown, float(ranking.figure(i)),
                                       _layout_of(cand, i).short(), None))
            else:
                out.append(Alternative(axis, shown, None, None, float(
                    memory[mask].min() if least is None else least[(axis, int(value))])))
    return out


def _simplest(ranking: Ranking, best: int, within: float = SIMPLEST_WITHIN) -> int:
    """The layout with the fewest non-trivial axes (`rank.nontrivial_axes`) whose exact figure
    (step time, or effective step time) is within `within` of the winner's (the fastest such; ties `rank.SIMPLER`)."""
    axes = nontrivial_axes(ranking.cand)
    limit = ranking.figure(best) * (1 + within)
    # a layout whose lower bound is past the limit cannot be the answer: not simulated
    near = ranking.lower * ranking.scale <= limit
    for count in range(int(axes[best])):
        rows = ranking.top(1, within=near & (axes == count), fold=False)
        if len(rows) and ranking.figure(rows[0]) <= limit:
            return int(rows[0])
    return best


def _no_fit_message(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                    cand: dict[str, Any], terms: dict[str, Any], budget: float,
                    headroom: float) -> str:
    i = int(np.argmin(terms["memory"]))
    need = float(terms["memory"][i])
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    total_state = model.count_params().total * state.total
    gpus_for_state = math.ceil(total_state / budget)
    helps = []
    if gpus_for_state > cluster.n_gpus:
        helps.append(f"at least {gpus_for_state} GPUs just for the training state "
                     f"({total_state / 1e9:,.0f} GB with {state.total:g} B/param)")
    else:
        helps.append("more GPUs (more ways to shard)")
    helps.append("a shorter sequence or a smaller global batch per replica")
    if train.optimizer == "adam":
        helps.append("an 8-bit optimizer")
    return (f"no layout of {model.name} fits {cluster.n_gpus}× {cluster.accelerator.name} at "
            f"s={train.seq_len}: the leanest ({_layout_of(cand, i).short()}) needs "
            f"{need / 2**30:.1f} GiB per GPU, {(need - budget) / 2**30:.1f} GiB over the "
            f"{budget / 2**30:.1f} GiB budget ({headroom:.0%} of "
            f"{cluster.accelerator.memory_bytes / 2**30:.0f} GiB); would help: "
            + "; ".join(helps))
