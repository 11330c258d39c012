"""The layout planner: an exhaustive, vectorised search over every layout (SPEC §7).

    plan(model, cluster, train, top=10) -> PlanResult

The search space is the Cartesian product of

    tp (divisors of gpus-per-node) × pp (divisors of n_layers) × cp (powers of two) ×
    ep (divisors of n_experts) × micro-batch (1..16) × schedule (1F1B, ZB-H1, interleaved
    with every v that divides the layers) × ZeRO (0-3, and hybrid shard over groups of
    2, 4, 8, … ranks for stages 1-3) × sequence parallel × recompute (none, selective, full)

with `dp = GPUs / (tp·pp·cp)`, confined to the user's `Constraint` (`--fix tp=8 --max pp=8`:
what it excludes is counted first). It is pruned level by level (structure, micro-batch, schedule,
ZeRO, per-rank options), each rejected region counted with its reason (the rules are
`Layout.problems`'), and the survivors are evaluated *as arrays*: the step-time model of
`estimate.step` (the same `step_terms` function the scalar `estimate_step` calls, with the
per-layer compute costs evaluated once per distinct `(tp, cp, micro-batch, sp, recompute)` and
gathered) and per-stage memory (`estimate.memory.peak_stage_total`, the same array-generic
code `training_memory_per_gpu` runs for one layout). Layouts whose largest stage exceeds GPU memory ×
headroom are rejected with the amount they miss by; the rest are ranked by the step time the
report shows (`rank`: exact, the schedule simulator's bubble for uneven pipelines, found
without simulating every layout; ties to the simpler layout), one row per family of layouts
that differ only in second-order knobs. The rows are re-evaluated with the scalar code
(`estimate_step`, `training_memory_per_gpu`, the simulator for the bubble), put in the order
of the figures they show, and explained.

`choose_parallelism` is SPEC §7's decision procedure, kept as the baseline the search is
compared with.

Modules, one job each:

    space       SearchSpace: the values each axis may take
    grid        enumeration and pruning, each rejected region counted with its reason
    evaluate    the array kernel (step time, rates, memory) and one layout's scalar evaluation
    prune       large grids: every layout's memory, step times only under the thresholds
                the answer depends on; `search_size` before a search runs
    rank        exact figure, fastest first, ties to the simpler layout, variants folded; a
                given layout's position
    explain     the best layout per axis value, the simplest near the best; what would help
    baseline    SPEC §7's decision procedure
    results     PlanEntry, PlanResult, Rejection, SearchStats, Alternative
    search      `plan()`, which runs them in that order
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
