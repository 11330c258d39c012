"""What a search returns: ranked entries, rejected regions, statistics, alternatives."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration
from shardwise.estimate.goodput import Goodput, Reliability
from shardwise.estimate.memory import (
    MemoryBreakdown,
)
from shardwise.estimate.step import (
    FLOP_CONVENTION,
    StepEstimate,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec


@dataclass(frozen=True)
class Rejection:
    """A rejected region of the search space: why, how many grid points, an example."""

    reason: str
    count: int
    example: str = ""
    category: str = "constraint"


@dataclass(frozen=True)
class PlanEntry:
    """One evaluated layout: its step estimate, its largest stage's memory, the budget, and
    what failures and checkpoints leave of its time (`estimate.goodput`)."""

    layout: Layout
    estimate: StepEstimate
    memory: MemoryBreakdown
    budget: float
    rank: int | None = None
    variants: int = 0  # other fitting layouts that differ only in second-order knobs
    goodput: Goodput | None = None

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget

    def figure(self, rank_by: str = "step") -> float:
        """What the planner ranks by: the step time, or (`rank_by="goodput"`) the effective
        step time, step ÷ goodput."""
        if rank_by == "goodput":
            assert self.goodput is not None
            return self.goodput.effective_step_s
        return self.estimate.total

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "variants": self.variants,
                "layout": self.layout.to_dict(), "short": self.layout.short(),
                "estimate": self.estimate.to_dict(),
                "memory": self.memory.as_dict() | {"stage": self.memory.stage,
                                                   "in_flight": self.memory.in_flight},
                "budget_bytes": self.budget, "fits": self.fits,
                "goodput": self.goodput.to_dict() if self.goodput else None}


@dataclass(frozen=True)
class Alternative:
    """The best layout when one axis is held at another value (for the explanation);
    `best_total`: its figure (`PlanEntry.figure`: the step time, or step ÷ goodput)."""

    axis: str
    value: Any
    best_total: float | None
    best_layout: str | None
    min_memory: float | None


@dataclass(frozen=True)
class SearchStats:
    """How big the search was and how long it took: grid points, layouts evaluated, layouts
    that fit, seconds."""

    grid: int
    evaluated: int
    fits: int
    seconds: float
    evaluation_seconds: float
    simulated: int = 0  # layouts the ranking ran through the schedule simulator
    timed: int = 0  # layouts whose step time was evaluated (all valid ones unless pruned)

    @property
    def layouts_per_s(self) -> float:
        return self.evaluated / self.evaluation_seconds if self.evaluation_seconds else 0.0


@dataclass(frozen=True)
class PlanResult:
    """What `plan` returns: the ranked layouts, the rejected regions, the baseline, the
    search's statistics and its inputs."""

    model: ModelSpec
    cluster: Cluster
    train: TrainSpec
    headroom: float
    budget: float
    calibration: Calibration
    ranked: list[PlanEntry]
    rejected: list[Rejection]
    stats: SearchStats
    baseline: PlanEntry | None = None
    baseline_note: str = ""
    given: PlanEntry | None = None
    given_note: str = ""
    alternatives: list[Alternative] = field(default_factory=list)
    simplest: PlanEntry | None = None  # fewest non-trivial axes within 1 % of the best
    constraint: str = ""  # the user's --fix / --max, as `Constraint.describe` writes it
    all_variants: bool = False  # rows list every variant (else one row per family)
    rank_by: str = "step"  # "step" or "goodput" (`PlanEntry.figure`)
    reliability: Reliability = field(default_factory=Reliability)  # the goodput inputs
    choose: str = "simplest"  # the recommendation inside the first tier (`rank.CHOOSE`)

    @property
    def best(self) -> PlanEntry:
        return self.ranked[0]

    @cached_property
    def tiering(self) -> Any:
        """The rows' tiers and the recommendation (`rank.tiering`)."""
        from shardwise.plan.tiers import tiering

        return tiering(self)

    @property
    def recommended(self) -> PlanEntry:
        """The layout the headline, the explanation and the exports use (`rank.recommend`)."""
        return self.ranked[self.tiering.recommended]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "cluster": {"gpus": self.cluster.n_gpus, "gpus_per_node": self.cluster.gpus_per_node,
                        "accelerator": self.cluster.accelerator.name,
                        "intra": self.cluster.intra.name, "inter": self.cluster.inter.name},
            "train": asdict(self.train), "headroom": self.headroom, "budget_bytes": self.budget,
            "ranked": [e.to_dict() | {"tier": t} for e, t in zip(self.ranked,
                                                                  self.tiering.tier)],
            "tiers": self.tiering.to_dict(), "choose": self.choose,
            "recommended": self.recommended.to_dict()
            | {"tier": self.tiering.tier[self.tiering.recommended]},
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "baseline_note": self.baseline_note,
            "given": self.given.to_dict() if self.given else None, "given_note": self.given_note,
            "rejected": [asdict(r) for r in self.rejected],
            "alternatives": [asdict(a) for a in self.alternatives],
            "simplest": self.simplest.to_dict() if self.simplest else None,
            "constraint": self.constraint, "all_variants": self.all_variants,
            "rank_by": self.rank_by, "reliability": self.reliability.to_dict(),
            "stats": asdict(self.stats) | {"layouts_per_s": self.stats.layouts_per_s},
            "calibration": self.calibration.to_dict(),
            "flop_convention": FLOP_CONVENTION,
        }
