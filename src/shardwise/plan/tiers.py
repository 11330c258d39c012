"""Ties said as ties: rows the model cannot order share a tier, and one rule recommends a row
of the first (docs/howto/plan.md).

    tier boundary: sorted by the figure ranked, a new tier begins at a figure ≥ the previous
                   one × (1 + resolution)   (`estimate.uncertainty.resolution`)
    recommendation (`choose="simplest"`): fewest parallel axes, then least exposed
                   communication, then most memory headroom; `choose="fastest"`: the first row
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.layout import AXES, Layout

CHOOSE = ("simplest", "fastest")  # the recommendation inside the first tier
TIER_RULE = ("rows are sorted by the figure ranked; a new tier starts where a row's figure "
             "exceeds the previous row's by the resolution or more, so rows closer than the "
             "resolution always share a tier (a tier may chain wider than it)")
SIMPLEST_RULE = ("inside the first tier: fewest parallel axes (dp, tp, pp, cp, ep > 1), then "
                 "least exposed communication, then the most memory headroom")


def tiers(figures: Sequence[float], resolution: float) -> list[int]:
    """The tier (1 = first) of each figure, in the order given (`TIER_RULE`): sorted, a new
    tier begins at a figure ≥ the previous one × (1 + `resolution`). Two figures closer than
    that (relative to the smaller) are in one tier; two in one tier are linked by a chain of
    neighbours each closer than that."""
    order = sorted(range(len(figures)), key=lambda i: figures[i])
    out = [0] * len(figures)
    tier, previous = 0, None
    for i in order:
        if previous is None or figures[i] >= previous * (1 + resolution):
            tier += 1
        out[i], previous = tier, figures[i]
    return out


def exposed_comm(estimate: Any) -> float:
    """Seconds of the step spent in communication nothing hides (TP, CP, EP, PP, DP)."""
    return float(estimate.tp_comm + estimate.cp_comm_exposed + estimate.ep_comm
                 + estimate.pp_comm + estimate.dp_comm_exposed)


def parallel_axes(layout: Layout) -> int:
    """How many of dp, tp, pp, cp, ep are > 1."""
    return sum(getattr(layout, axis) > 1 for axis in AXES)


@dataclass(frozen=True)
class Tiers:
    """The tiers of a plan's rows (`tier[i]` of `ranked[i]`), the relative `resolution` they
    use and its `basis`, the rows in the first tier (`count`), how the recommendation was
    chosen (`choose`, one of `CHOOSE`) and the recommended row's index (`recommended`)."""

    tier: tuple[int, ...]
    resolution: float
    basis: str
    choose: str
    recommended: int

    @property
    def count(self) -> int:
        return self.tier.count(1)

    def to_dict(self) -> dict[str, Any]:
        return {"resolution": self.resolution, "rule": TIER_RULE, "count": self.count,
                "basis": self.basis,
                "recommendation": SIMPLEST_RULE if self.choose == "simplest"
                else "the fastest row"}


def recommend(entries: Sequence[Any], tier: Sequence[int], choose: str,
              rank_by: str = "step") -> int:
    """The index of the recommended entry (`PlanEntry`s): in the first tier, with
    `choose="simplest"` by `SIMPLEST_RULE` (ties: the earlier row), else the fastest."""
    first = [i for i, t in enumerate(tier) if t == 1]
    if choose == "fastest":
        return min(first, key=lambda i: (entries[i].figure(rank_by), i))
    return min(first, key=lambda i: (parallel_axes(entries[i].layout),
                                      exposed_comm(entries[i].estimate),
                                      entries[i].memory.total - entries[i].budget, i))


def tiering(result: Any) -> Tiers:
    """`result`'s (`PlanResult`) tiers at the model's resolution for its accelerator and stack
    (`estimate.uncertainty.resolution`) and its recommendation (`result.choose`)."""
    from shardwise.errors import ShardwiseError
    from shardwise.estimate.uncertainty import resolution

    if result.choose not in CHOOSE:
        raise ShardwiseError(f"choose must be one of {', '.join(CHOOSE)}, got "
                             f"{result.choose!r}")
    value, basis = resolution(result.cluster.accelerator.name, result.train.impl)
    figures = [entry.figure(result.rank_by) for entry in result.ranked]
    tier = tiers(figures, value)
    best = recommend(result.ranked, tier, result.choose, result.rank_by)
    return Tiers(tuple(tier), value, basis, result.choose, best)
