"""Planner details the sampled mutation run of `plan` left unchecked (mut-plan2), each against
a rule written here: `--fix` values added to the grid and nothing else allowed (ZeRO's implied
stage 1 with a group, stage 0 without), the rejected-regions text (a tuple shown as `a:b:c`,
the region of a `Layout.problems` sentence, the first etp-without-ep point's numbers, the
memory region's `needs X, X − B over the B budget` arithmetic in GiB = 2**30 bytes), and the
cluster block of `PlanResult.to_dict`. Non-degenerate: an MoE with a shared expert and a dense
first layer (tiny-deepseek), tp·cp·ep > 1 in the searched grid, nodes of 4."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.estimate.compute import RC_CODES
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.partition import partition_problems
from shardwise.plan import SearchSpace, _enumerate, _flatten, _Rejections, plan
from shardwise.plan.grid import _structure_reason
from shardwise.plan.lines import _Groups, _Runs
from shardwise.plan.rank import _ordinal, simplicity
from shardwise.plan.space import Constraint
from shardwise.schedules.registry import SCHEDULE_CODES

MODEL = get_model("tiny-deepseek").with_(n_layers=6, vocab=2048)
CLUSTER = Cluster.of(8, "h100", gpus_per_node=4)
AXES = {"tp": [1, 2, 4], "pp": [1, 2], "cp": [1, 2], "ep": [1, 2, 4], "etp": [0, 1],
        "micro_batch": [1, 2], "schedule": [(1, 1)], "zero": [(3, 8)], "sp": [0, 1],
        "recompute": [0, 2]}


def test_a_fixed_ep_outside_the_grid_is_added_and_is_the_only_one_allowed():
    grid, allowed = SearchSpace(constraint=Constraint.parse("ep=3,tp=4")).constrained(AXES)
    assert grid["ep"] == [1, 2, 3, 4] and allowed["ep"] == [3]
    assert grid["tp"] == [1, 2, 4] and allowed["tp"] == [4]
    assert allowed["cp"] == [1, 2]  # unconstrained axes keep every value


@pytest.mark.parametrize("fix, pair", [
    ("zero_group=0", (0, 0)),  # no group, no stage: plain data parallelism
    ("zero_group=4", (1, 4)),  # a group alone implies ZeRO-1 (stage 1 within the group)
    ("zero=2", (2, 0)),
    ("zero=3,zero_group=2", (3, 2)),
])
def test_a_fixed_zero_form_is_added_to_the_grid_and_is_the_only_one_allowed(fix, pair):
    # the axes' only ZeRO form (3, 8) differs from every fixed one: the added pair is visible
    rule = Constraint(tuple(Constraint.parse(fix).fixed))
    grid, allowed = SearchSpace(constraint=rule).constrained(AXES)
    assert grid["zero"] == [(3, 8), pair]
    assert allowed["zero"] == ([pair] if "zero=" in fix.replace("zero_group=", "") else
                               [(z, g) for z, g in grid["zero"]
                                if g == dict(rule.fixed)["zero_group"]])


def test_a_fixed_partition_is_described_colon_separated():
    rule = Constraint.parse("partition=1:2:3,tp=2", "cp=2")
    assert rule.describe() == "fix partition=1:2:3,tp=2; max cp=2"


def test_a_partition_that_does_not_sum_to_the_layers_is_the_pp_region():
    problems = partition_problems(MODEL.n_layers, 2, 1, (2, MODEL.n_layers))
    assert problems and f"n_layers={MODEL.n_layers}" in problems[0]
    assert _structure_reason(problems[0]) == "pp does not split the layers"


def test_the_etp_without_ep_region_names_the_first_such_point():
    space = SearchSpace(tp=(1, 2, 4), pp=(1,), cp=(1,), ep=(1, 2, 4), etp=(0, 1),
                        micro_batch=(1,), zero=(0,), sp=(False,), recompute=("none",),
                        schedules=("1f1b",))
    rejections = _Rejections()
    _enumerate(MODEL, CLUSTER, TrainSpec(seq_len=64, global_batch=8, impl="shardwise"), space,
               rejections)
    # the search's order: tp, pp, cp, ep, etp; etp = tp is its own region (a duplicate of 0)
    t, _e, et = next((t, e, et) for t, e, et in itertools.product((1, 2, 4), (1, 2, 4), (0, 1))
                    if et and et != t and e == 1)
    by = {r.reason: r for r in rejections.result()}
    region = by["etp without ep (routed experts replicated over tp; not searched)"]
    assert region.example == f"tp={t} etp={et} ep=1"


def test_the_memory_region_shows_need_minus_budget_in_gib_and_the_cluster_block():
    headroom = 0.01  # a budget of 0.8 GiB of the H100's 80 GiB: some layouts do not fit
    train = TrainSpec(seq_len=32768, global_batch=16, impl="shardwise")
    result = plan(MODEL, CLUSTER, train, top=3, headroom=headroom,
                  space=SearchSpace(tp=(1, 2), pp=(1, 2), cp=(1, 2), ep=(1, 2)))
    budget = headroom * CLUSTER.accelerator.memory_bytes / 2**30
    memory = [r for r in result.rejected if r.category == "memory"]
    assert memory
    need, over, shown = map(float, re.search(
        r"needs ([\d.]+) GiB, ([\d.]+) GiB over the ([\d.]+) GiB budget",
        memory[0].example).groups())
    assert shown == pytest.approx(budget, abs=0.051)
    assert need - over == pytest.approx(budget, abs=0.11)  # each rounded to 0.1 GiB
    assert over > 0.2 and need > budget + 0.2
    cluster = result.to_dict()["cluster"]
    assert (cluster["gpus"], cluster["gpus_per_node"]) == (CLUSTER.n_gpus,
                                                          CLUSTER.gpus_per_node)
    assert (cluster["intra"], cluster["inter"]) == (CLUSTER.intra.name, CLUSTER.inter.name)
    assert cluster["intra"] != cluster["inter"]


def _rows(**columns):
    """A candidate table of len(pp) layouts: the given columns, every other axis at 1 / 0 and
    the default schedule (1F1B) and recompute (none)."""
    n = len(columns["pp"])
    cand = {k: np.full(n, v) for k, v in (("cp", 1), ("tp", 1), ("ep", 1), ("cp_kind", 0),
                                           ("etp", 0), ("zero", 0), ("zero_group", 0),
                                           ("recompute", RC_CODES["none"]), ("sp", 0),
                                           ("schedule", SCHEDULE_CODES["1f1b"]), ("chunks", 1),
                                           ("micro_batch", 1))}
    return cand | {k: np.asarray(v) for k, v in columns.items()}


def test_the_default_stage_split_is_simpler_than_a_searched_one():
    # 6 layers on pp 4: the default is Balanced(1, 1) (embedding and head one layer each), so
    # (0, 1) is searched although its last_less equals the default's; on pp 2 (0, 0) is the
    # default and (1, 0) is searched
    cand = _rows(pp=[4, 4, 2, 2], first_less=[1, 0, 0, 1], last_less=[1, 1, 0, 0],
                 _n_layers=6)
    order = simplicity(cand)
    assert order[0] < order[1] and order[2] < order[3]
    assert order[2] < order[0]  # fewer stages first (SIMPLER: cp, then pp)


def test_distinct_searched_splits_never_tie_in_simplicity():
    # 10 layers on pp 4: the default is Balanced(1, 1); (0, 2), (2, 0) and (2, 2) are searched
    # splits that differ in one end or both — a tie of their step times must still have one
    # order (SIMPLER's last key before the micro-batch is the split), never the grid's
    cand = _rows(pp=[4, 4, 4, 4], first_less=[1, 0, 2, 2], last_less=[1, 2, 0, 2],
                 _n_layers=10)
    order = simplicity(cand)
    assert len(set(order.tolist())) == 4 and order[0] == order.min()

def test_simplicity_without_searched_partitions_orders_by_cp_then_pp_then_tp():
    cand = _rows(pp=[2, 1, 1, 1], cp=[1, 2, 1, 1], tp=[1, 1, 4, 1], _n_layers=6)
    assert list(np.argsort(simplicity(cand))) == [3, 2, 0, 1]


def test_ordinal_sorts_like_tuples_beyond_64_bits():
    # 8 columns of radix 1024 (2**80 combinations): the mixed-radix code must renumber
    rng = np.random.default_rng(7)
    columns = [rng.integers(0, 1024, 60) for _ in range(8)]
    columns[3][:2] = 0  # a column whose minimum is not its first value's
    code = _ordinal(columns)
    rows = list(zip(*(c.tolist() for c in columns), strict=True))
    assert sorted(range(60), key=lambda i: rows[i]) == sorted(range(60), key=lambda i: code[i])
    assert len(set(code.tolist())) == len(set(rows))


def test_a_written_out_default_partition_searches_the_default_split():
    # 6 layers on pp 2: the default split is 3,3 (pp divides the layers); fixing it written out
    # keeps exactly the layouts of `--fix pp=2` with the default partition
    space = dict(tp=(1, 2), pp=(1, 2), cp=(1,), ep=(1, 2), etp=(0,), micro_batch=(1,),
                 zero=(0,), sp=(False,), recompute=("none",), schedules=("1f1b",))
    train = TrainSpec(seq_len=64, global_batch=8, impl="shardwise")
    written = SearchSpace(**space, constraint=Constraint.parse("pp=2,partition=3:3"))
    cand, _ = _enumerate(MODEL, CLUSTER, train, written, _Rejections())
    flat, _ = _flatten(cand)
    assert len(flat["pp"]) and set(flat["pp"].tolist()) == {2}
    assert set(flat["tp"].tolist()) == {1, 2} and set(flat["ep"].tolist()) == {1, 2}
    # without pp fixed the written-out split is the default of its own pp: its pp = 2 layouts
    # are the same, with the default partition's codes (not a fixed partition's)
    alone, _ = _flatten(_enumerate(MODEL, CLUSTER, train, SearchSpace(
        **space, constraint=Constraint.parse("partition=3:3")), _Rejections())[0])
    two = alone["pp"] == 2
    assert alone.keys() == flat.keys() and two.sum() == len(flat["pp"])
    for key, value in flat.items():
        if not key.startswith("_") and key != "pair":  # (the grid's own pair ids)
            np.testing.assert_array_equal(alone[key][two], value, err_msg=key)


def test_comparing_offloads_still_reports_the_baseline_unless_asked_not_to():
    # plan(offload=[...]) is one plan per offload, the fastest kept (docs/concepts/planner.md);
    # the recipe baseline (baseline=True, the default) comes with it, as with one offload
    space = SearchSpace(tp=(1, 2), pp=(1, 2), cp=(1, 2), ep=(1, 2), micro_batch=(1, 2))
    train = TrainSpec(seq_len=512, global_batch=16, impl="shardwise")
    compared = plan(MODEL, CLUSTER, train, top=3,
                    space=replace(space, offload=("none", "optimizer")))
    single = plan(MODEL, CLUSTER, replace(train, offload=compared.train.offload), top=3,
                  space=space)
    assert single.baseline is not None and compared.baseline is not None
    assert compared.baseline.layout == single.baseline.layout
    assert plan(MODEL, CLUSTER, train, top=3, baseline=False,
                space=replace(space, offload=("none", "optimizer"))).baseline is None


def test_line_groups_give_each_codes_least_value_and_its_first_position():
    # a column of codes (one per row) and a row of codes (one per column), unsorted, with a
    # missing code (3): positions per code in their own order, inf where no position
    for code in (np.array([[2], [0], [2], [4], [0], [1]], dtype=np.int16),
                 np.array([[2, 0, 2, 4, 0, 1]], dtype=np.int16)):
        groups = _Groups(code)
        line = code.ravel()
        value = np.array([5.0, 7.0, 1.0, 2.0, 3.0, 9.0])
        want = [min((value[i] for i in range(6) if line[i] == c), default=np.inf)
                for c in range(5)]
        assert groups.min(value).tolist() == want
        # the first position of each code's least value; a code whose target is inf is left out
        target = np.array([3.0, 9.0, 1.0, np.inf, 2.0])
        assert groups.firsts(value, target) == {0: 4, 1: 5, 2: 2, 4: 3}
        tied = np.array([5.0, 7.0, 5.0, 2.0, 3.0, 9.0])  # code 2's least (5) at 0 and 2
        assert groups.firsts(tied, np.array([3.0, 9.0, 5.0, np.inf, np.inf]))[2] == 0


def test_line_groups_over_runs_give_the_positions_least_and_first():
    # rows in runs that share their code (starts 0, 2, 3, 6): per run, then per code, the
    # same as over the rows one by one — the least, its first row, and the codes present
    code = np.array([[1], [1], [0], [1], [1], [1], [0], [0]], dtype=np.int16)
    starts = np.array([0, 2, 3, 6])
    groups = _Groups(code, _Runs(starts))
    value = np.array([4.0, 2.0, 6.0, 5.0, 2.0, 3.0, 8.0, 6.0], dtype=np.float32)
    # code 0: rows 2, 6, 7 (least 6 at row 2); code 1: rows 0, 1, 3, 4, 5 (least 2, first row 1)
    assert groups.min(value).tolist() == [6.0, 2.0]
    assert groups.firsts(value, np.array([6.0, 2.0])) == {0: 2, 1: 1}
    valid = np.array([False, False, False, True, False, False, False, True])
    assert groups.present(valid) == [0, 1]
    assert groups.present(valid & (np.arange(8) < 5)) == [1]


def test_a_fixed_partition_the_grid_does_not_enumerate_is_searched_as_given():
    """`--fix pp=2,partition=1,3` (layer counts, comma-separated as the error message shows):
    tiny's 4 layers split 1 + 3, a split the grid does not search, is used as given."""
    result = plan(get_model("tiny"), Cluster.of(8, "h100"),
                  TrainSpec(seq_len=256, global_batch=16),
                  space=SearchSpace(constraint=Constraint.parse("pp=2,partition=1,3")))
    assert result.best.layout.partition == (1, 3) and result.best.layout.pp == 2


def test_goodput_that_makes_no_progress_names_the_gpus_and_the_way_out():
    """Ranked by goodput with one failure every few seconds across 64 GPUs: one line naming
    the GPU count, the failure interval and the options that help."""
    from shardwise.errors import ShardwiseError
    from shardwise.estimate.goodput import Reliability

    with pytest.raises(ShardwiseError, match=r"^with 0\.0001 GPU-hours between failures per "
                                             r"GPU, 64 GPUs fail every .* give a larger "
                                             r"--mtbf-gpu-hours or fewer GPUs$"):
        plan(get_model("llama3-8b"), Cluster.of(64, "h100"),
             TrainSpec(seq_len=4096, global_batch=256), rank_by="goodput",
             reliability=Reliability(mtbf_gpu_hours=1e-4))


def test_row_argmin_and_ordinal_agree_with_numpy_where_the_first_column_is_least():
    from shardwise.plan.lines import _row_argmin

    grid = np.array([[1.0, 3.0, 2.0], [5.0, 4.0, 4.0], [0.5, 0.5, 9.0]])
    low, arg = _row_argmin(grid)
    assert list(low) == list(grid.min(axis=1)) and list(arg) == list(grid.argmin(axis=1))
    assert _ordinal([np.zeros(0, dtype=np.int64)]).shape == (0,)  # no rows: no codes
    # negative values (a fixed partition's -1 ends): the codes sort as the rows' tuples do
    first, second = np.array([-1, 0, -1, 2, 0, -1]), np.array([3, -5, 1, 0, -5, 1])
    code = _ordinal([first, second])
    rows = list(zip(first.tolist(), second.tolist(), strict=True))
    assert sorted(range(6), key=lambda i: (code[i], i)) == \
        sorted(range(6), key=lambda i: (rows[i], i))
    assert [code[i] == code[j] for i, j in ((1, 4), (2, 5), (0, 2))] == [True, True, False]


def test_the_recommendation_is_named_in_words_for_each_choice():
    """The JSON's tiers say which row is recommended: the simplest rule's sentence, or the
    fastest row."""
    from shardwise.plan.tiers import SIMPLEST_RULE, tiering

    result = plan(get_model("tiny"), Cluster.of(8, "h100"), TrainSpec(seq_len=256,
                                                                       global_batch=16))
    said = {choose: tiering(replace(result, choose=choose)).to_dict()["recommendation"]
            for choose in ("simplest", "fastest")}
    assert said == {"simplest": SIMPLEST_RULE, "fastest": "the fastest row"}


def test_a_schedule_refused_at_one_micro_batch_says_one_micro_batch():
    """Interleaving 2 chunks over pp = 2 needs micro-batches in groups of pp; 8 GPUs, dp 4
    and a batch of 4 give one micro-batch per step: the example says "1 micro-batch"."""
    space = SearchSpace(tp=(1,), pp=(2,), cp=(1,), ep=(1,), micro_batch=(1,),
                        schedules=("interleaved",), chunks=(2,), zero=(0,))
    rejections = _Rejections()
    _enumerate(get_model("tiny"), Cluster.of(8, "h100"), TrainSpec(seq_len=256, global_batch=4),
               space, rejections)
    examples = {r.reason: r.example for r in rejections.result()}
    refused = [example for reason, example in examples.items() if "micro-batches" in reason]
    assert refused == ["pp=2, 1 micro-batch"], examples


def test_an_unknown_choice_of_recommendation_names_the_valid_ones():
    from shardwise.errors import ShardwiseError
    from shardwise.plan.tiers import CHOOSE, tiering

    result = plan(get_model("tiny"), Cluster.of(8, "h100"), TrainSpec(seq_len=256,
                                                                       global_batch=16))
    with pytest.raises(ShardwiseError) as info:
        tiering(replace(result, choose="cheapest"))
    assert str(info.value) == f"choose must be one of {', '.join(CHOOSE)}, got 'cheapest'"


def test_the_baseline_skips_a_layout_the_batch_refuses_and_takes_the_next():
    """SPEC §7's procedure on 8 GPUs with a global batch of 4: tp·pp = 1 leaves dp = 8, which
    does not divide the batch, so the next smallest tp·pp (tp = 2, dp = 4) is the baseline,
    not a context-parallel one."""
    from shardwise.plan.baseline import choose_parallelism

    layout = choose_parallelism(get_model("tiny"), Cluster.of(8, "h100"),
                                TrainSpec(seq_len=256, global_batch=4))
    assert (layout.tp, layout.pp, layout.cp, layout.dp) == (2, 1, 1, 4)


def test_the_first_live_cells_are_every_cell_under_its_threshold():
    """`prune._Live`: the unevaluated valid cells whose floor is under their threshold — a
    fitting cell's the largest of the search's, its row axes' and its column axes' values'
    bests, a cell that does not fit the fastest such — against that definition cell by cell
    on a random grid of runs (ZeRO variants share every row axis but zero). Cells admitted
    only by a column value's best, only by a ZeRO option's and only as the fastest that does
    not fit are present."""
    from types import SimpleNamespace

    from shardwise.plan.prune import _COL_AXES, _ROW_AXES, _Live

    rng = np.random.default_rng(7)
    n_runs, per_run, n_cols = 30, 4, 6
    n_rows = n_runs * per_run
    first, run = np.arange(0, n_rows, per_run), np.repeat(np.arange(n_runs), per_run)
    codes = {axis: rng.integers(0, 3, n_runs)[run][:, None].astype(np.int16)
             for axis in _ROW_AXES if axis != "zero"}
    codes["zero"] = np.tile(np.arange(per_run), n_runs)[:, None].astype(np.int16)
    codes |= {axis: rng.integers(0, 2, n_cols)[None, :].astype(np.int16) for axis in _COL_AXES}
    state = SimpleNamespace(valid=rng.random((n_rows, n_cols)) < 0.9,
                            done=rng.random((n_rows, n_cols)) < 0.1,
                            fits=rng.random((n_rows, n_cols)) < 0.7,
                            floor=rng.uniform(1.0, 3.0, (n_rows, n_cols)).astype(np.float32))
    per_axis = {axis: rng.uniform(1.0, 1.6, int(code.max()) + 1) for axis, code in codes.items()}
    per_axis["recompute"][1] = 2.6  # a column value whose best is far above the rest
    per_axis["zero"][3] = 2.0  # and a row's ZeRO option
    fit_threshold, fastest_over = 1.2, 2.2
    live = _Live(state, codes, (fit_threshold, per_axis, fastest_over),
                 SimpleNamespace(first=first, run=run))

    def threshold(i: int, j: int) -> float:
        if not state.fits[i, j]:
            return fastest_over
        return max([fit_threshold] + [per_axis[a][codes[a][i, 0]] for a in _ROW_AXES]
                   + [per_axis[a][codes[a][0, j]] for a in _COL_AXES])

    want = [i * n_cols + j for i in range(n_rows) for j in range(n_cols)
            if state.valid[i, j] and not state.done[i, j]
            and state.floor[i, j] <= np.float32(threshold(i, j) * (1 + 1e-6))]
    assert live.index.tolist() == want
    by_column = [k for k in want if state.fits.flat[k] and codes["recompute"][0, k % n_cols] == 1
                 and state.floor.flat[k] > 1.6 * (1 + 1e-6)]
    over = [k for k in want if not state.fits.flat[k] and state.floor.flat[k] > 1.6 * (1 + 1e-6)]
    by_zero = [k for k in want if state.fits.flat[k] and codes["zero"][k // n_cols, 0] == 3
               and codes["recompute"][0, k % n_cols] != 1 and state.floor.flat[k] > 1.6 * (1 + 1e-6)]
    assert by_column and over and by_zero


# ------------------------------------------------- the sampled run at a49e8a0 (mut-plan3)
def test_the_kth_best_step_time_is_the_kth_of_the_sorted_times_or_family_bests():
    """`_kth_best` against numpy's sort: the `top`-th smallest step time, or when folding the
    `top`-th smallest of the families' bests (a family: every field but the ZeRO group and
    the partition); inf with fewer than `top`."""
    from shardwise.plan.lines import _kth_best
    from shardwise.plan.rank import _FIRST_ORDER

    cand, _ = _enumerate(MODEL, CLUSTER, TrainSpec(seq_len=64, global_batch=16),
                         SearchSpace(), _Rejections())
    rows, cols = np.nonzero(cand["_valid"])
    total = np.random.default_rng(3).uniform(1.0, 2.0, len(rows))
    flat, _ = _flatten(cand)
    family = np.unique(np.stack([flat[k] for k in _FIRST_ORDER], axis=1), axis=0,
                       return_inverse=True)[1].ravel()
    best = np.full(family.max() + 1, np.inf)
    np.minimum.at(best, family, total)
    assert len(best) < len(total)  # families hold several layouts
    for top in (1, 2, 7):
        assert _kth_best(cand, rows, cols, total, top, False) == np.sort(total)[top - 1]
        assert _kth_best(cand, rows, cols, total, top, True) == np.sort(best)[top - 1]
    assert _kth_best(cand, rows, cols, total, len(best) + 1, True) == np.inf


def test_the_fewest_parallel_axes_counts_the_axes_above_one():
    from shardwise.layout import Layout
    from shardwise.plan.tiers import parallel_axes

    assert parallel_axes(Layout(dp=8)) == 1
    assert parallel_axes(Layout(dp=1)) == 0
    assert parallel_axes(Layout(dp=4, tp=2, pp=1, cp=2, ep=4)) == 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top": 10**6 + 1}, "top must be an integer in [1, 1,000,000], got 1000001"),
    ({"headroom": 0.0}, "headroom must be in (0, 1], got 0.0"),
])
def test_plan_refuses_top_and_headroom_past_their_ranges(kwargs, message):
    from shardwise.errors import ShardwiseError

    with pytest.raises(ShardwiseError, match=re.escape(message)):
        plan(MODEL, CLUSTER, TrainSpec(seq_len=64, global_batch=16), **kwargs)


def test_the_size_of_a_search_needs_a_global_batch():
    from shardwise.errors import ShardwiseError
    from shardwise.plan.prune import search_size

    with pytest.raises(ShardwiseError, match=re.escape(
            "planning needs a global batch (e.g. --global-batch 4M-tokens)")):
        search_size(MODEL, CLUSTER, TrainSpec(seq_len=64))


def test_ordinal_keeps_the_last_column_past_float_precision():
    """Six columns of radix 1024 (2**60 codes, under the renumbering bound of 2**62) whose
    rows differ only in the last, least significant column: an int64 code keeps them apart
    and in order, where float64's 53-bit mantissa would not."""
    columns = [np.full(10, 1023) for _ in range(5)] + [np.arange(10)[::-1].copy()]
    columns[0][0] = 0  # the first column's radix is 1024 too
    code = _ordinal(columns)
    rows = list(zip(*(c.tolist() for c in columns), strict=True))
    assert sorted(range(10), key=lambda i: rows[i]) == list(np.argsort(code, kind="stable"))
    assert len(set(code.tolist())) == 10


def test_the_head_split_takes_the_most_head_layers_that_leave_the_last_stage_one():
    """16 layers on pp = 4 with a head costing round(V·h / N_layer) = 15 layers (V = 240,000,
    h = 1,024, N_layer = 16,779,264 parameters): (0, z) gives each stage (16 + z)/4 units and
    the last z fewer layers, so z = 4 is the most that leaves it one layer: 5, 5, 5, 1."""
    from shardwise.arch import ModelSpec
    from shardwise.plan.grid import _partitions

    model = ModelSpec("big-vocab", 16, 1024, 16, 16, 4096, 240_000)
    assert round(model.vocab * model.d_model / 16_779_264) == 15
    searched = _partitions(model, 4)
    assert searched[(0, 4)] == (5, 5, 5, 1)
    assert [z for a, z in searched if a == 0 and z > 1] == [4]


@pytest.mark.parametrize(("heads", "kv_heads", "d_ff", "reason", "example"), [
    # 24 query heads and 6 key/value heads: tp = 4 and 8 divide the query heads but neither
    # divide nor are multiples of the key/value heads
    (24, 6, 8192, "tp does not fit the key/value heads", "n_kv_heads=6"),
    # an FFN width of 4·2049: tp = 8 divides every head count but not the width
    (24, 24, 8196, "tp does not divide the FFN width", "d_ff=8196"),
])
def test_a_tp_the_model_refuses_is_its_own_region_in_words(heads, kv_heads, d_ff, reason,
                                                          example):
    """On nodes of 8, each tp the model's widths refuse is a rejected region named in words,
    its example the numbers."""
    from shardwise.arch import ModelSpec

    model = ModelSpec("refuses", 4, 3072, heads, kv_heads, d_ff, 32000)
    result = plan(model, Cluster.of(8, "h100"), TrainSpec(seq_len=1024, global_batch=8),
                  top=1, baseline=False)
    (region,) = [r for r in result.rejected if r.reason == reason]
    assert example in region.example and region.count > 0


def test_the_grid_keeps_its_per_row_fields_in_int32_where_they_fit():
    """`_expand` stores the per-row fields in int32 where every value fits (half the bytes of
    the grid's largest arrays); the models widen what they compute with."""
    cand, _ = _enumerate(get_model("mixtral-8x7b"), Cluster.of(64, "h100"),
                         TrainSpec(seq_len=4096, global_batch=256), SearchSpace(), _Rejections())
    for key in ("tp", "pp", "dp", "ep", "micro_batch", "m", "zero", "zero_group", "pair"):
        assert cand[key].dtype == np.int32, key


def test_find_cell_finds_each_valid_layout_of_the_grid_at_its_own_cell():
    """`prune.find_cell` (the pruned search's rank of the baseline and of a given layout):
    every valid cell's layout is found at that cell — in a grid of ZeRO stages and groups,
    schedules with chunks, searched partitions and both sp and recompute columns, where a
    pair's rows differ in each of those."""
    from shardwise.plan.evaluate import _layout_of, flat_cells
    from shardwise.plan.prune import find_cell

    cand, _ = _enumerate(MODEL, CLUSTER, TrainSpec(seq_len=64, global_batch=16),
                         SearchSpace(), _Rejections())
    n_cols = cand["_valid"].shape[1]
    flat = np.flatnonzero(cand["_valid"].ravel())
    pick = flat[np.random.default_rng(4).permutation(len(flat))[:300]]
    cells = flat_cells(cand, *np.divmod(pick, n_cols))
    for i, at in enumerate(pick):
        assert find_cell(cand, _layout_of(cells, i), MODEL.n_layers) == at
    # not degenerate: the rows of a pair differ in the ZeRO stage, its group, the schedule
    rows = np.divmod(pick, n_cols)[0]
    for key in ("zero", "zero_group", "schedule", "first_less"):
        assert len(set(np.asarray(cand[key])[rows, 0].tolist())) > 1, key


def test_tiers_of_a_goodput_ranking_are_of_the_effective_step():
    """Ranked by goodput, the tiers are of what is ranked, step ÷ goodput: three rows one
    step-time tier apart in goodput (0.9, 0.6, 0.4) are three tiers; by step time alone they
    would be one."""
    from shardwise.estimate.goodput import Reliability
    from shardwise.estimate.uncertainty import resolution
    from shardwise.plan.tiers import tiering, tiers

    result = plan(get_model("tiny"), Cluster.of(8, "h100"),
                  TrainSpec(seq_len=256, global_batch=16), top=3, rank_by="goodput",
                  reliability=Reliability(mtbf_gpu_hours=1.0))
    ranked = [replace(entry, goodput=replace(entry.goodput, goodput=g))
              for entry, g in zip(result.ranked, (0.9, 0.6, 0.4), strict=True)]
    spread = replace(result, ranked=ranked)
    value = resolution(result.cluster.accelerator.name, result.train.impl)[0]
    assert tiers([e.figure() for e in ranked], value) == [1, 1, 1]  # one step-time tier
    assert list(tiering(spread).tier) == [1, 2, 3]


@pytest.mark.parametrize(("key", "value"), [("tp", 8), ("pp", 3), ("cp", 4), ("ep", 8),
                                            ("etp", 2), ("micro_batch", 3)])
def test_each_fixed_degree_outside_the_grid_is_added_and_is_the_only_one_allowed(key, value):
    grid, allowed = SearchSpace(constraint=Constraint.parse(f"{key}={value}")).constrained(AXES)
    assert grid[key] == sorted([*AXES[key], value]) and allowed[key] == [value]


def test_a_deepspeed_stack_searches_its_own_split_of_an_odd_layer_count():
    """Megatron-DeepSpeed over pp = 2 splits 7 layers 4, 3 (the first `L mod pp` stages one
    more): the grid holds that split, which no other stack's searched partitions include."""
    from shardwise.layout import Layout
    from shardwise.plan.grid import partition_ends

    model = MODEL.with_(n_layers=7)
    train = TrainSpec(seq_len=64, global_batch=16, impl="megatron-deepspeed")
    cand, _ = _enumerate(model, CLUSTER, train, SearchSpace(), _Rejections())
    layout = Layout(pp=2, dp=4, partition=(4, 3))
    ((a, z),) = partition_ends(cand, layout, 7)
    at_pp2 = np.asarray(cand["pp"])[:, 0] == 2
    assert at_pp2.any()
    assert set(zip(np.asarray(cand["first_less"])[at_pp2, 0],
                   np.asarray(cand["last_less"])[at_pp2, 0], strict=True)) == {(a, z)}


def test_the_grid_widens_its_fields_where_a_value_passes_int32():
    """A global batch of 3·2**30 sequences on one GPU: micro-batch 1 runs 3·2**30 of them,
    past int32 (2**31 - 1), so the grid keeps int64 and the count exact."""
    cand, _ = _enumerate(get_model("tiny"), Cluster.of(1, "h100"),
                         TrainSpec(seq_len=64, global_batch=3 * 2**30), SearchSpace(),
                         _Rejections())
    assert int(np.max(cand["m"])) == 3 * 2**30


def test_the_baseline_says_when_no_layout_satisfies_the_divisibility_rules():
    """One sequence per step on 8 GPUs: dp = 1, so tp·pp = 8 — but 4 heads allow tp ≤ 4 and
    3 layers pp ∈ {1, 3}, and a sequence of 66 no context parallelism (2·cp must divide
    it): no layout."""
    from shardwise.errors import ShardwiseError
    from shardwise.plan import choose_parallelism

    with pytest.raises(ShardwiseError) as err:
        choose_parallelism(get_model("tiny").with_(n_layers=3), Cluster.of(8, "h100"),
                           TrainSpec(seq_len=66, global_batch=1))
    assert str(err.value) == "no layout satisfies the divisibility rules"


def test_a_fixed_recompute_the_stack_does_not_search_is_refused_with_its_options():
    train = TrainSpec(seq_len=64, global_batch=16, impl="megatron-deepspeed")
    space = SearchSpace(constraint=Constraint.parse("recompute=op-sac"))
    with pytest.raises(Exception) as err:
        space.resolve(MODEL, CLUSTER, train)
    assert str(err.value) == ("--fix recompute=op-sac: the megatron-deepspeed search has no "
                              "op-sac recompute; valid: none, selective, full")
