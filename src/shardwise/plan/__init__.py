"""The layout planner: a vectorised search over every layout (SPEC §7).

    plan(model, cluster, train, top=10) -> PlanResult

tp × pp × cp × ep × micro-batch × schedule × ZeRO (and hybrid groups) × SP × recompute,
`dp = GPUs / (tp·pp·cp)`, within the user's `Constraint`; pruned level by level with each
rejected region counted, the survivors evaluated as arrays by the same functions the scalar
`estimate_step` and `training_memory_per_gpu` run, ranked exactly, tiered, re-evaluated with
the scalar code and explained. Modules: `space` (axis values), `grid` (enumeration, pruning),
`evaluate` (the array kernel), `prune` (large grids), `rank` (exact order), `tiers` (ties and
the recommendation), `explain`, `baseline` (SPEC §7's procedure), `results`, `search`
(`plan()`). The search in full: docs/concepts/planner.md#the-search-in-full.
"""

from shardwise.plan.baseline import choose_parallelism
from shardwise.plan.evaluate import _layout_of, evaluate_candidates, evaluate_layout
from shardwise.plan.grid import _enumerate, _flatten, _Rejections
from shardwise.plan.prune import SearchSize, search_size
from shardwise.plan.results import Alternative, PlanEntry, PlanResult, Rejection, SearchStats
from shardwise.plan.search import plan
from shardwise.plan.space import DEFAULT_HEADROOM, Constraint, SearchSpace

__all__ = [
    "DEFAULT_HEADROOM",
    "Alternative",
    "Constraint",
    "PlanEntry",
    "PlanResult",
    "Rejection",
    "SearchSize",
    "SearchSpace",
    "SearchStats",
    "_Rejections",
    "_enumerate",
    "_flatten",
    "_layout_of",
    "choose_parallelism",
    "evaluate_candidates",
    "evaluate_layout",
    "plan",
    "search_size",
]
