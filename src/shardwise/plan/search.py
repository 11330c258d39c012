"""The search: enumerate (within the user's constraints), evaluate, reject what does not fit,
rank by the exact figure (`rank.Ranking`), re-evaluate the rows shown with the scalar models,
and gather the baseline, the alternatives and the simplest layout near the best."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import MIN_GOODPUT, RANK_BY, Reliability, no_progress
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec, check_specs
from shardwise.plan.baseline import choose_parallelism
from shardwise.plan.evaluate import (
    _layout_of,
    candidate_goodput,
    evaluate_candidates,
    evaluate_layout,
)
from shardwise.plan.explain import SIMPLEST_WITHIN, _alternatives, _no_fit_message, _simplest
from shardwise.plan.grid import _enumerate, _flatten, _Rejections, _structure_reason
from shardwise.plan.prune import (
    PRUNE_ABOVE,
    BoundBroken,
    Pruned,
    family_fits,
    prune_evaluate,
    rank_bounds,
)
from shardwise.plan.rank import Ranking, _find, rounded
from shardwise.plan.results import PlanEntry, PlanResult, SearchStats
from shardwise.plan.space import DEFAULT_HEADROOM, SearchSpace


def plan(model: ModelSpec, cluster: Cluster, train: TrainSpec, top: int = 10, *,
         headroom: float = DEFAULT_HEADROOM, calib: Calibration | None = None,
         space: SearchSpace | None = None, layout: Layout | None = None,
         baseline: bool = True, progress: Callable[[str], None] | None = None,
         all_variants: bool = False, rank_by: str = "step",
         reliability: Reliability | None = None,
         prune_above: int = PRUNE_ABOVE) -> PlanResult:
    """Search every layout of `model` on `cluster` for `train` (within `space`, its
    `constraint` included), rank by step time, or with `rank_by="goodput"` by the effective
    step time, step ÷ goodput under `reliability` (`estimate.goodput`; default: the published
    fleet figures) — `rank.Ranking`: the exact figure, ties to the simpler layout. Every row
    carries its goodput.

    Returns the `top` fastest rows that fit (GPU memory × `headroom` on every stage) — one per
    family of layouts that differ only in second-order knobs (`rank.SECOND_ORDER`), or every
    layout with `all_variants` — the rejected regions with reasons and counts, the
    `choose_parallelism` baseline, the simplest layout within 1 % of the best, and, when
    `layout` is given, that layout's evaluation and its rank. Raises `ShardwiseError` when no
    layout fits, saying by how much the leanest misses and what would help.
    """
    if space is not None and space.offload:
        return _best_offload(model, cluster, train, top, space, headroom=headroom, calib=calib,
                             layout=layout, baseline=baseline, progress=progress,
                             all_variants=all_variants, prune_above=prune_above)
    started = time.perf_counter()
    say = progress or (lambda message: None)
    check_specs(model=model, layout=layout, cluster=cluster, train=train,
                optional=("layout",))
    validate.integer(top, "top", low=1, high=10**6)
    model.validate()
    cluster.validate()
    train = train.validate()
    if train.global_batch is None:
        raise ShardwiseError("planning needs a global batch (e.g. --global-batch 4M-tokens)")
    if not 0 < headroom <= 1:
        raise ShardwiseError(f"headroom must be in (0, 1], got {headroom}")
    if top < 1:
        raise ShardwiseError(f"top must be ≥ 1, got {top}")
    if rank_by not in RANK_BY:
        raise ShardwiseError(f"rank_by must be one of {', '.join(RANK_BY)}, got {rank_by!r}")
    rel = (reliability or Reliability()).validate()
    rel.check_stack(train)
    cal = calib or default_calibration(cluster.accelerator.calibration_name)
    budget = cluster.accelerator.memory_bytes * headroom
    rejections = _Rejections()
    say("enumerating layouts")
    cand, grid = _enumerate(model, cluster, train, space or SearchSpace(), rejections)
    given = (evaluate_layout(model, cluster, train, layout, cal, headroom, reliability=rel)
             if layout else None)
    if not cand or not cand["_valid"].any():
        # a structural example is already the full sentence of which `reason` is the summary
        reasons = "; ".join(r.example if r.example and _structure_reason(r.example) == r.reason
                            else f"{r.reason} ({r.example})" if r.example else r.reason
                            for r in rejections.result()[:3])
        raise ShardwiseError(
            f"no valid layout of {model.name} on {cluster.n_gpus} GPUs with a global batch of "
            f"{train.global_batch} sequence{'s' if train.global_batch != 1 else ''}: {reasons}"
        )
    n = int(np.count_nonzero(cand["_valid"]))
    say(f"evaluating {n:,} layouts")
    base_layout, base_error = None, None
    if baseline:
        try:
            base_layout = choose_parallelism(model, cluster, train, headroom=headroom)
        except ShardwiseError as exc:
            base_error = exc
    eval_start = time.perf_counter()
    pruned: Pruned | None = None
    if rank_by == "step" and n > prune_above:
        try:
            pruned = prune_evaluate(model, cluster, train, cand, cal, budget, top,
                                    not all_variants, SIMPLEST_WITHIN,
                                    (base_layout, given.layout if given else None))
        except BoundBroken:  # the step model no longer bounds so: evaluate every layout
            pruned = None
    if pruned is not None:
        cand, terms, fits, n_fit = pruned.cand, pruned.terms, pruned.fits, pruned.n_fit
    else:
        terms = evaluate_candidates(model, cluster, train, cand, cal, keys=(
            "total", "memory", "bubble", "t_forward", "t_backward", "t_wgrad"))
        cand, flat_terms = _flatten(cand, terms)
        assert flat_terms is not None
        terms = flat_terms
        fits = terms["memory"] <= budget
        n_fit = int(np.count_nonzero(fits))
    eval_seconds = time.perf_counter() - eval_start
    if n_fit < n:
        over = ~fits
        i = int(np.argmin(np.where(over, terms["total"], np.inf)))
        rejections.add("does not fit in GPU memory", n - n_fit,
                       f"fastest such, {_layout_of(cand, i).short()}, needs "
                       f"{terms['memory'][i] / 2**30:.1f} GiB, {(terms['memory'][i] - budget) / 2**30:.1f} "
                       f"GiB over the {budget / 2**30:.1f} GiB budget", "memory")
    if n_fit == 0:
        raise ShardwiseError(_no_fit_message(model, cluster, train, cand, terms, budget,
                                             headroom))
    say("ranking")
    scale: Any = 1.0
    if rank_by == "goodput":
        timing = candidate_goodput(model, cluster, train, cand, rel)
        usable = fits & (timing["goodput"] >= MIN_GOODPUT)
        if not usable.any():
            i = int(np.argmax(np.where(fits, timing["goodput"], -1.0)))
            raise ShardwiseError(no_progress(float(timing["job_mtbf_s"][i]), cluster.n_gpus,
                                             rel, float(timing["stall_s"][i])))
        scale = np.where(usable, 1 / timing["goodput"], np.inf)
    ranking = Ranking(model, cand, terms, fits, scale)
    rows = ranking.top(top, fold=not all_variants)
    if all_variants:
        variants = [0] * len(rows)
    elif pruned is not None:  # counted over the whole grid
        variants = [family_fits(pruned, _layout_of(cand, int(i))) - 1 for i in rows]
    else:
        variants = ranking.variants(rows)

    def entry(i: int, variants: int = 0) -> PlanEntry:
        found = evaluate_layout(model, cluster, train, _layout_of(cand, i), cal, headroom,
                                reliability=rel)
        return replace(found, budget=budget, variants=variants)

    # the rows in the order of the figures they show (the ranking's rule, `rank.rounded`)
    shown = [entry(int(i), variants=n) for i, n in zip(rows, variants)]
    shown_figures = [e.figure(rank_by) for e in shown]
    figure = rounded(shown_figures, min(shown_figures))
    order = sorted(range(len(shown)), key=lambda k: (figure[k], ranking.simple[rows[k]]))
    ranked = [replace(shown[k], rank=position + 1) for position, k in enumerate(order)]
    best = int(rows[order[0]])
    outside = ("outside the search space or its constraints" if space and space.constraint
               else "outside the search space")
    def position(layout: Layout) -> tuple[int | None, str | None]:
        """The rank of `layout` among the fitting layouts and how a note says it (the bounds
        it lies between when pruning left it open); (None, None) if the search lacks it."""
        pos = ranking.position(layout, model.n_layers)
        if pos is None:
            return None, None
        if pruned is not None:
            hit = _find(cand, layout, model.n_layers)
            assert hit is not None
            low, high = rank_bounds(pruned, pos, float(ranking.figure(hit)))
            if high > low:
                return None, (f"rank {low:,} to {high:,} of {n_fit:,} fitting layouts (bounds: "
                              f"{high - low:,} layouts that may be ahead were not timed)")
        return pos, f"rank {pos} of {n_fit:,} fitting layouts"

    base, note = None, ""
    if base_layout is not None:
        base = evaluate_layout(model, cluster, train, base_layout, cal, headroom,
                               reliability=rel)
        note = position(base_layout)[1] or outside
    elif base_error is not None:
        note = f"the §7 procedure finds no layout: {base_error}"
    given_note = ""
    if given is not None:
        pos, text = position(given.layout)
        given = replace(given, budget=budget, rank=pos)
        given_note = text or ("does not fit in GPU memory" if not given.fits else outside)
    alternatives = (_alternatives(ranking, best) if pruned is None else
                    _alternatives(ranking, best, pruned.values, pruned.least))
    simple = _simplest(ranking, best)
    simplest = ranked[0] if simple == best else entry(simple)
    seconds = time.perf_counter() - started
    return PlanResult(model, cluster, train, headroom, budget, cal, ranked, rejections.result(),
                      SearchStats(grid, n, n_fit, seconds, eval_seconds, ranking.simulations,
                                  pruned.evaluated if pruned is not None else n),
                      base, note, given, given_note, alternatives, simplest,
                      space.constraint.describe() if space and space.constraint else "",
                      all_variants, rank_by, rel)


def _best_offload(model: ModelSpec, cluster: Cluster, train: TrainSpec, top: int,
                  space: SearchSpace, **options: Any) -> PlanResult:
    """`plan` once per host offload in `space.offload` the stack runs (`stacks.Offload`), the
    fastest best layout kept (ties: the earlier kind, "none" first); when none fits, the
    first kind's error."""
    results, errors = [], []
    for kind in space.offload or ():
        if kind not in train.stack.offload_kinds():
            continue
        try:
            results.append(plan(model, cluster, replace(train, offload=kind), top,
                                space=replace(space, offload=None), **options))
        except ShardwiseError as exc:
            errors.append(exc)
    if not results:
        raise errors[0] if errors else ShardwiseError(
            f"{train.stack.name} has none of the offloads {', '.join(space.offload or ())}")
    return min(results, key=lambda r: r.best.estimate.total)
