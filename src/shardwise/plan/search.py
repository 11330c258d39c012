"""The search: enumerate, evaluate, reject what does not fit, rank, re-evaluate the top
layouts with the scalar models, and gather the baseline and the alternatives."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec, check_specs
from shardwise.plan.baseline import choose_parallelism
from shardwise.plan.evaluate import _layout_of, evaluate_candidates, evaluate_layout
from shardwise.plan.explain import _alternatives, _no_fit_message
from shardwise.plan.grid import _enumerate, _flatten, _Rejections, _structure_reason
from shardwise.plan.rank import _position, _rank
from shardwise.plan.results import PlanEntry, PlanResult, SearchStats
from shardwise.plan.space import DEFAULT_HEADROOM, SearchSpace


def plan(model: ModelSpec, cluster: Cluster, train: TrainSpec, top: int = 10, *,
         headroom: float = DEFAULT_HEADROOM, calib: Calibration | None = None,
         space: SearchSpace | None = None, layout: Layout | None = None,
         baseline: bool = True, progress: Callable[[str], None] | None = None) -> PlanResult:
    """Search every layout of `model` on `cluster` for `train`, rank by step time.

    Returns the `top` fastest layouts that fit (GPU memory × `headroom` on every stage), the
    rejected regions with reasons and counts, the `choose_parallelism` baseline, and, when
    `layout` is given, that layout's evaluation and its rank. Raises `ShardwiseError` when no
    layout fits, saying by how much the leanest misses and what would help.
    """
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
    cal = calib or default_calibration(cluster.accelerator.name)
    budget = cluster.accelerator.memory_bytes * headroom
    rejections = _Rejections()
    say("enumerating layouts")
    cand, grid = _enumerate(model, cluster, train, space or SearchSpace(), rejections)
    given = evaluate_layout(model, cluster, train, layout, cal, headroom) if layout else None
    if not cand or not cand["_valid"].any():
        # a structural example is already the full sentence of which `reason` is the summary
        reasons = "; ".join(r.example if r.example and _structure_reason(r.example) == r.reason
                            else f"{r.reason} ({r.example})" if r.example else r.reason
                            for r in rejections.result()[:3])
        raise ShardwiseError(
            f"no valid layout of {model.name} on {cluster.n_gpus} GPUs with a global batch of "
            f"{train.global_batch} sequence{'s' if train.global_batch != 1 else ''}: {reasons}"
        )
    n = int(cand["_valid"].sum())
    say(f"evaluating {n:,} layouts")
    eval_start = time.perf_counter()
    terms = evaluate_candidates(model, cluster, train, cand, cal)
    cand, flat_terms = _flatten(cand, terms, keys=("total", "memory"))
    assert flat_terms is not None
    terms = flat_terms
    eval_seconds = time.perf_counter() - eval_start
    fits = terms["memory"] <= budget
    n_fit = int(fits.sum())
    if n_fit < n:
        over = ~fits
        i = int(np.argmin(np.where(over, terms["total"], np.inf)))
        rejections.add("does not fit in GPU memory", int(over.sum()),
                       f"fastest such, {_layout_of(cand, i).short()}, needs "
                       f"{terms['memory'][i] / 2**30:.1f} GiB, {(terms['memory'][i] - budget) / 2**30:.1f} "
                       f"GiB over the {budget / 2**30:.1f} GiB budget", "memory")
    if n_fit == 0:
        raise ShardwiseError(_no_fit_message(model, cluster, train, cand, terms, budget,
                                             headroom))
    say("ranking")
    order = _rank(cand, terms, fits)
    ranked = []
    for position, i in enumerate(order[:top]):
        entry = evaluate_layout(model, cluster, train, _layout_of(cand, int(i)), cal, headroom)
        ranked.append(PlanEntry(entry.layout, entry.estimate, entry.memory, budget,
                                rank=position + 1))
    base, note = None, ""
    if baseline:
        try:
            base_layout = choose_parallelism(model, cluster, train, headroom=headroom)
            base = evaluate_layout(model, cluster, train, base_layout, cal, headroom)
            pos = _position(cand, terms, fits, order, base_layout)
            note = (f"rank {pos} of {n_fit:,} fitting layouts" if pos else
                    "outside the search space")
        except ShardwiseError as exc:
            note = f"the §7 procedure finds no layout: {exc}"
    given_note = ""
    if given is not None:
        pos = _position(cand, terms, fits, order, given.layout)
        given = PlanEntry(given.layout, given.estimate, given.memory, budget, rank=pos)
        given_note = (f"rank {pos} of {n_fit:,} fitting layouts" if pos else
                      "does not fit in GPU memory" if not given.fits else
                      "outside the search space")
    alternatives = _alternatives(cand, terms, fits, int(order[0]))
    seconds = time.perf_counter() - started
    return PlanResult(model, cluster, train, headroom, budget, cal, ranked, rejections.result(),
                      SearchStats(grid, n, n_fit, seconds, eval_seconds), base, note, given,
                      given_note, alternatives)
