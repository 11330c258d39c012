"""Contracts of the search's outputs against references outside the planner: the web API's
response schema (`web.tools.PlanResponse`, what FastAPI validates `/api/plan` against) for
`plan --json`'s payload; the best over host offloads as the fastest of one search per kind;
a `--fix` of an unknown schedule named with the registry's list; and the id of distinct
rows (`prune._dense_ids`) as numpy's own row-unique where the mixed-radix code would
overflow int64."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, plan
from shardwise.plan.prune import _dense_ids
from shardwise.plan.space import Constraint
from shardwise.schedules.registry import SCHEDULES

MODEL = get_model("tiny-deepseek")  # MLA, a shared expert, a dense first layer


def test_plan_payload_validates_against_the_web_apis_response_schema():
    from shardwise.report.builders import plan_payload, run_plan
    from shardwise.web.tools import PlanEntryOut, PlanResponse

    result = run_plan(MODEL, gpus=16, seq=64, global_batch="64", top=3,
                      layout_text="tp=2,pp=1,ep=4,zero=1", max_text="pp=2")
    payload = plan_payload(result)
    response = PlanResponse.model_validate(payload)  # every required key, of its type
    assert response.constraint == "max pp=2" and payload["all_variants"] is False
    for row in (*payload["ranked"], payload["baseline"], payload["given"]):
        entry = PlanEntryOut.model_validate(row)
        assert entry.fits == (entry.memory["total"] <= entry.budget_bytes)
        assert entry.budget_bytes == pytest.approx(result.budget)


def test_the_best_over_offloads_is_the_fastest_search_per_kind():
    """torchtitan runs no offload and FSDP's parameter offload: `space.offload` searches
    both and keeps the faster best; a kind the stack lacks is skipped."""
    cluster = Cluster.of(8, "h100")
    train = TrainSpec(seq_len=64, global_batch=16, impl="torchtitan")
    space = SearchSpace(tp=(1, 2), pp=(1,), micro_batch=(1, 2), recompute=("none",))
    each = {kind: plan(MODEL, cluster, TrainSpec(seq_len=64, global_batch=16,
                                                 impl="torchtitan", offload=kind),
                       top=1, space=space, baseline=False)
            for kind in ("none", "params")}
    totals = {kind: r.best.estimate.total for kind, r in each.items()}
    assert totals["none"] != totals["params"]
    from dataclasses import replace

    best = plan(MODEL, cluster, train, top=1, baseline=False,
                space=replace(space, offload=("params", "optimizer", "none")))
    fastest = min(totals, key=totals.get)
    assert best.best.estimate.total == pytest.approx(totals[fastest], rel=1e-12)
    assert best.train.offload == fastest
    with pytest.raises(ShardwiseError, match="torchtitan has none of the offloads optimizer"):
        plan(MODEL, cluster, train, top=1, space=replace(space, offload=("optimizer",)))


def test_fixing_an_unknown_schedule_names_the_registry():
    with pytest.raises(ShardwiseError) as info:
        Constraint.parse("schedule=zigzag")
    assert str(info.value) == ("--fix schedule='zigzag' unknown; valid: "
                               + ", ".join(SCHEDULES))
    assert "gpipe" in SCHEDULES and "dualpipev" in SCHEDULES


def test_dense_ids_number_distinct_rows_in_order_past_int64():
    """Eight columns of ~3000 distinct values each: the product of their counts (~6e27) is
    far past int64, so the code must renumber on the way; the ids are numpy's row-unique
    inverse (rows sorted lexicographically, first column most significant)."""
    rng = np.random.default_rng(7)
    n = 4000
    columns = [rng.integers(0, 10**9, size=n) for _ in range(8)]
    columns[0][: n // 2] = columns[0][n // 2:]  # some rows share a prefix...
    for c in columns[1:]:
        c[n - 50:] = c[:50]
    columns[0][n - 50:] = columns[0][:50]  # ...and 50 rows are repeated whole
    expected = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)[1].ravel()
    got = _dense_ids(columns)
    assert int(got.max()) + 1 == n - 50
    assert (got == expected).all()


@pytest.mark.parametrize("prune_above", [0, 10**12])  # pruned (`prune.find_cell`), every one
def test_a_given_layout_with_its_default_partition_written_out_is_found(prune_above):
    """`--layout …,partition=3:3` for 6 layers over pp 2 is the default split: the search
    holds it (the same rank as without the partition), and a split it does not search is
    outside the search space."""
    from shardwise.layout import Layout

    model = MODEL.with_(n_layers=6)
    cluster, train = Cluster.of(8, "h100"), TrainSpec(seq_len=64, global_batch=16)
    space = SearchSpace(tp=(1, 2), pp=(1, 2), ep=(1, 2), micro_batch=(1, 2),
                        recompute=("none",))
    bare = Layout.parse("dp=2,tp=2,pp=2,ep=2,zero=1")
    found = {}
    for text in ("", ",partition=3:3", ",partition=4:2"):
        layout = Layout.parse(f"dp=2,tp=2,pp=2,ep=2,zero=1{text}")
        result = plan(model, cluster, train, top=2, space=space, layout=layout,
                      baseline=False, prune_above=prune_above)
        found[text] = (result.given.rank, result.given_note)
    assert found[""][0] is not None and found[""][1].startswith(f"rank {found[''][0]} of ")
    assert found[",partition=3:3"] == found[""]
    assert found[",partition=4:2"] == (None, "outside the search space")
    assert bare.stage_partition(6) == (3, 3)


def test_fit_hint_and_search_size_dicts_carry_their_bytes():
    """A fit hint's dict: the largest stage of its layout (the scalar memory model) and what
    it leaves of the budget; a search size's dict: the grid, the cells and the bytes that
    `budget` compares (`BASE_BYTES + BYTES_PER_CELL · cells`)."""
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.layout import Layout
    from shardwise.plan import search_size
    from shardwise.plan.fit import fit_hints
    from shardwise.plan.prune import BASE_BYTES, BYTES_PER_CELL

    cluster, train = Cluster.of(8, "h100"), TrainSpec(seq_len=64, global_batch=16)
    layout = Layout(dp=2, tp=2, pp=2, ep=2, recompute="none")
    peak = max(s.total for s in training_memory_per_gpu(MODEL, layout, train))
    budget = peak * 0.97
    hints = fit_hints(MODEL, cluster, train, layout, budget)
    assert hints
    for hint in hints:
        out = hint.to_dict()
        total = max(s.total for s in training_memory_per_gpu(MODEL, hint.layout, train))
        assert out["total_bytes"] == pytest.approx(total, rel=1e-12)
        assert out["margin_bytes"] == pytest.approx(budget - total, rel=1e-12) and total <= budget
        assert out["change"] == f"{hint.knob}={out['value']}"
    size = search_size(MODEL, cluster, train)
    assert size.to_dict() == {"grid": size.grid, "cells": size.cells,
                              "bytes": pytest.approx(BASE_BYTES + BYTES_PER_CELL * size.cells)}
    assert size.grid > size.cells > 0


def test_default_rows_and_the_baseline():
    """`plan` shows 10 rows by default (as the CLI's `--top`, cli/planner.py) when more families
    fit, and carries the §7 baseline: `choose_parallelism`'s layout, as `evaluate_layout`
    times it, with its rank among the fitting layouts."""
    from shardwise.plan import choose_parallelism
    from shardwise.plan.evaluate import evaluate_layout

    cluster = Cluster.of(16, "h100")
    train = TrainSpec(seq_len=64, global_batch=64, impl="shardwise")
    result = plan(MODEL, cluster, train)
    assert len(result.ranked) == 10 < result.stats.fits
    chosen = choose_parallelism(MODEL, cluster, train)
    assert result.baseline is not None and result.baseline.layout == chosen
    scalar = evaluate_layout(MODEL, cluster, train, chosen, result.calibration, 0.85)
    assert result.baseline.estimate.total == pytest.approx(scalar.estimate.total, rel=1e-12)
    assert result.baseline_note.startswith("rank ") and result.baseline_note.endswith(
        f" of {result.stats.fits:,} fitting layouts")


def test_the_text_report_states_the_searchs_own_counts_and_times(capsys):
    """`shardwise plan`'s closing line gives the counts and times of the search it ran, as
    `--json` does: the evaluation is part of the whole search, so it takes no longer."""
    import re

    from tests.cli_helpers import run_in_process

    args = ("plan", "tiny-deepseek", "--gpus", "16", "--seq", "64", "--global-batch", "64")
    code, out, _ = run_in_process(capsys, *args)
    assert code == 0
    found = re.search(r"Searched ([\d,]+) grid points; evaluated ([\d,]+) valid layouts in "
                      r"(\d+) ms \(([\d.]+)M layouts/s\), (\d+) ms in all", " ".join(out.split()))
    assert found, out
    grid, evaluated, evaluation_ms, _, total_ms = found.groups()
    stats = plan(MODEL, Cluster.of(16, "h100"), TrainSpec(seq_len=64, global_batch=64)).stats
    assert (int(grid.replace(",", "")), int(evaluated.replace(",", ""))) == (
        stats.grid, stats.evaluated)
    assert 0 < stats.evaluation_seconds <= stats.seconds
    assert int(evaluation_ms) <= int(total_ms)


def test_the_best_over_offloads_shows_every_variant_when_asked():
    """`all_variants` reaches the search of each offload kind: the rows are the winning
    kind's own search with every ZeRO-group variant shown (several rows of one family)."""
    from dataclasses import replace

    cluster = Cluster.of(8, "h100")
    space = SearchSpace(tp=(1, 2), pp=(1,), micro_batch=(1, 2), recompute=("none",))
    best = plan(MODEL, cluster, TrainSpec(seq_len=64, global_batch=16, impl="torchtitan"),
                top=6, baseline=False, all_variants=True,
                space=replace(space, offload=("params", "none")))
    alone = plan(MODEL, cluster, TrainSpec(seq_len=64, global_batch=16, impl="torchtitan",
                                           offload=best.train.offload),
                 top=6, space=space, baseline=False, all_variants=True)
    rows = [e.layout.short() for e in best.ranked]
    assert rows == [e.layout.short() for e in alone.ranked]
    families = {e.layout.with_(zero_group=0).short() for e in best.ranked}
    assert len(families) < len(rows)  # not degenerate: variants of one family shown


def test_a_given_layout_over_memory_is_said_not_to_fit():
    """llama3-8b at dp = 8, ZeRO-1 on 8 H100 holds 117 GiB at 16,384 tokens, over the 68 GiB
    budget (the memory model): the given layout has no rank, and the note says why."""
    from shardwise.arch import get_model
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.layout import Layout

    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=16384, global_batch=64)
    layout = Layout(dp=8, zero=1)
    peak = max(s.total for s in training_memory_per_gpu(model, layout, train))
    assert peak > 0.85 * cluster.accelerator.memory_bytes
    result = plan(model, cluster, train, top=2, layout=layout, baseline=False)
    assert not result.given.fits and result.given.rank is None
    assert result.given_note == "does not fit in GPU memory"
