"""The pruned search (`plan.prune`) against the exhaustive one, through `run_plan` (what the
CLI and the web app call): the same rows, counts, notes, alternatives, simplest layout and
ranks on MoE grids small enough to enumerate; its floor under every step time; the size
estimate against the grid it predicts."""

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.calibration import default_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Balanced, Layout, TrainSpec, stage_extremes
from shardwise.plan import (
    SearchSpace,
    _enumerate,
    _flatten,
    _Rejections,
    evaluate_candidates,
    plan,
    prune,
)
from shardwise.plan.evaluate import (
    RunGeometries,
    _layout_of,
    dp_floor,
    flat_cells,
    run_shapes,
    shared_costs,
    simulated,
    step_floor,
)
from shardwise.plan.prune import _floor, rank_bounds, search_size
from shardwise.report.builders import run_plan

EXHAUSTIVE = 10**12  # `prune_above` above any grid: every step time evaluated


def _comparable(result):
    """The result as the user sees it, without the timings and the counts of step times and
    pipeline simulations (the work done, not the answer)."""
    out = result.to_dict()
    out["stats"] = {k: v for k, v in out["stats"].items()
                    if k not in ("seconds", "evaluation_seconds", "layouts_per_s", "timed",
                                 "simulated")}
    return out


# MoE models with shared experts (tiny-deepseek: MLA, a dense first layer; mixtral: GQA),
# grids with tp·ep > 1 layouts, 1F1B, zero-bubble and interleaved schedules, ZeRO groups
CASES = [
    ("tiny-deepseek", dict(gpus=32, seq=64, global_batch="256")),
    ("tiny-deepseek", dict(gpus=16, seq=64, global_batch="64", top=3,
                           layout_text="tp=2,pp=1,ep=4,zero=1")),
    ("tiny-moe", dict(gpus=32, seq=64, global_batch="128", all_variants=True, top=5)),
    ("mixtral-8x7b", dict(gpus=16, seq=4096, global_batch="64", max_text="pp=4",
                          layout_text="tp=2,pp=4,ep=2,zero=1,sp=1")),
    # axis values no layout of which fits (pp=16, recompute none and selective): the
    # alternatives name the least memory each needs, from the whole grid
    ("mixtral-8x22b", dict(gpus=32, seq=4096, global_batch="64")),
]


@pytest.mark.parametrize(("name", "options"), CASES)
def test_pruned_search_equals_the_exhaustive_one(name, options):
    spec = get_model(name)
    exhaustive = run_plan(spec, **options, prune_above=EXHAUSTIVE)
    pruned = run_plan(spec, **options, prune_above=0)
    assert pruned.stats.timed < exhaustive.stats.timed == exhaustive.stats.evaluated
    assert _comparable(pruned) == _comparable(exhaustive)
    assert pruned.stats.fits == exhaustive.stats.fits > len(exhaustive.ranked)
    # not degenerate: fitting layouts with tp·ep > 1, three ZeRO stages, several schedules
    # (where pipelines can interleave), layouts that do not fit (mixtral)
    fitting = {(a.axis, a.value) for a in exhaustive.alternatives if a.best_total is not None}
    best = exhaustive.best.layout
    fitting |= {("tp", best.tp), ("ep", best.ep), ("schedule", best.schedule),
                ("zero", best.zero)}
    assert any(axis in ("tp", "ep") and value > 1 for axis, value in fitting)
    assert len({value for axis, value in fitting if axis == "zero"}) >= 3
    assert len({value for axis, value in fitting if axis == "schedule"}) >= (
        2 if spec.n_layers >= 4 else 1)
    assert spec.n_moe_layers and (spec.n_shared_experts or name != "tiny-deepseek")
    if name.startswith("mixtral"):
        assert exhaustive.stats.fits < exhaustive.stats.evaluated
    if name == "mixtral-8x22b":  # not degenerate: axis values of which nothing fits
        assert any(a.best_total is None for a in exhaustive.alternatives)


def test_pruned_search_takes_an_axis_value_past_int16():
    """The pruned search keeps an axis' codes in int16 where they fit: micro-batch 2¹⁵ does
    not (int16 ends at 2¹⁵ − 1), and the search must answer as the exhaustive one does."""
    options = dict(gpus=8, seq=64, global_batch=str(2**15 * 8), fix_text="micro_batch=32768")
    exhaustive = run_plan(get_model("tiny-deepseek"), **options, prune_above=EXHAUSTIVE)
    pruned = run_plan(get_model("tiny-deepseek"), **options, prune_above=0)
    assert exhaustive.best.layout.micro_batch == 2**15 and exhaustive.stats.fits > 1
    assert _comparable(pruned) == _comparable(exhaustive)

def test_the_threshold_of_layouts_over_memory_keeps_the_fastest_timed(monkeypatch):
    """The threshold for layouts that do not fit, watched on each round of the real search,
    is at least the fastest such layout timed: an untimed one whose floor ties it is still
    timed (mixtral-8x22b on 32 GPUs: most layouts do not fit)."""
    from shardwise.plan import prune as pruning

    seen = []
    real = pruning._State.thresholds

    def watched(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        over = ~self.fits.ravel()[self.index]  # the timed layouts that do not fit
        if over.any():
            seen.append(out[2] >= self.terms["total"][over].min())
        return out

    monkeypatch.setattr(pruning._State, "thresholds", watched)
    run_plan(get_model("mixtral-8x22b"), gpus=32, seq=4096, global_batch="64", prune_above=0)
    assert seen and all(seen)

def _exact_figures(spec, cluster, train, cal, flat, cells):
    """The ranking's figure of layouts `cells` of the flat grid, on the scalar path: the step
    time with the simulated bubble where the ranking simulates it."""
    out = []
    for i in cells:
        layout = _layout_of(flat, int(i))
        out.append(estimate_step(spec, cluster, layout, train, cal, simulate=bool(
            simulated({"pp": layout.pp, "chunks": layout.chunks,
                       "m": layout.microbatches(train)}))).total)
    return np.array(out)


@pytest.mark.parametrize(("name", "gpus", "seq", "batch"),
                         [("tiny-deepseek", 32, 64, 256), ("mixtral-8x7b", 16, 4096, 64)])
def test_the_floor_is_under_every_step_time(name, gpus, seq, batch):
    """`step_floor` (the ZeRO-independent terms at ZeRO 0, the closed-form bubble, and where
    the ranking simulates the bubble a bound on the simulator's) is at most every layout's
    step time, each ZeRO variant included, and at most the simulated figure (the scalar path)
    on the uneven pipelines: those the floor is closest to, and a spread."""
    spec, cluster = get_model(name), Cluster.of(gpus, "h100")
    train = TrainSpec(seq_len=seq, global_batch=batch)
    cand, _ = _enumerate(spec, cluster, train, SearchSpace(), _Rejections())
    cal = default_calibration(cluster.accelerator.calibration_name)
    terms = evaluate_candidates(spec, cluster, train, cand, cal, keys=("total", "bubble"))
    shared = shared_costs(spec, cluster, train, cand, cal)
    floor = step_floor(spec, cluster, train, cand, shared, np.arange(cand["_valid"].shape[0]))
    valid = cand["_valid"]
    flat, _ = _flatten(cand)
    total, bubble, floor = terms["total"][valid], terms["bubble"][valid], floor[valid]
    assert np.all(floor <= total * (1 + 1e-12))
    assert np.median(floor / total) > 0.8  # a bound that prunes
    most = stage_extremes(spec.n_layers, flat["pp"], flat["chunks"],
                          Balanced(flat["first_less"], flat["last_less"]))[0]
    pending = np.flatnonzero(simulated(flat) & (most * flat["pp"] != spec.n_layers))
    assert len(pending)  # uneven pipelines (tiny-deepseek: 3 layers) and even ones
    assert name == "tiny-deepseek" or ((flat["pp"] > 1) & (most * flat["pp"] == spec.n_layers)
                                       ).any()
    # the uneven pipelines: the simulated bubble's bound is most of the closed form's
    without = total[pending] - bubble[pending]
    share = (floor[pending] - without) / bubble[pending]
    assert np.median(share) > 0.3
    closest = pending[np.argsort(total[pending] - floor[pending])[:60]]
    spread = pending[:: max(len(pending) // 60, 1)]
    picked = np.union1d(closest, spread)
    exact = _exact_figures(spec, cluster, train, cal, flat, picked)
    assert np.all(floor[picked] <= exact * (1 + 1e-9))
    assert np.any(floor[picked] > (total - bubble)[picked] + 0.5 * (exact - (total - bubble)[
        picked]))  # not degenerate: the bound holds more than half the simulated bubble


def test_search_size_bounds_the_cells_the_search_holds():
    spec, cluster = get_model("mixtral-8x7b"), Cluster.of(64, "h100")
    train = TrainSpec(seq_len=4096, global_batch=256)
    size = search_size(spec, cluster, train)
    cand, grid = _enumerate(spec, cluster, train, SearchSpace(), _Rejections())
    assert size.grid == grid
    assert cand["_valid"].size <= size.cells <= 20 * cand["_valid"].size
    assert size.bytes > size.cells


def test_pruned_search_says_what_the_exhaustive_one_says_when_nothing_fits():
    """Nothing fits: the same one-line error (the leanest layout, by how much it misses)."""
    spec = get_model("mixtral-8x7b")
    options = dict(gpus=4, seq=4096, global_batch="16")
    messages = []
    for prune_above in (EXHAUSTIVE, 0):
        with pytest.raises(ShardwiseError) as caught:
            run_plan(spec, **options, prune_above=prune_above)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "GiB" in messages[0]


# DeepSeek-V2-Lite: 27 layers with a dense first one (every pp > 1 splits unevenly, searched
# partitions beside the default), MLA, shared experts; expert tensor parallelism fixed to 1
# under tp = 2 (etp ≠ tp), every variant shown (ZeRO groups, partitions)
MOE_CASES = [
    dict(gpus=16, seq=4096, global_batch="64", top=16),
    dict(gpus=32, seq=4096, global_batch="128", top=6, fix_text="etp=1", all_variants=True),
]


@pytest.mark.parametrize("options", MOE_CASES)
def test_pruned_search_equals_the_exhaustive_one_on_uneven_moe_pipelines(options):
    spec = get_model("deepseek-v2-lite")
    exhaustive = run_plan(spec, **options, prune_above=EXHAUSTIVE)
    pruned = run_plan(spec, **options, prune_above=0)
    assert pruned.stats.timed < exhaustive.stats.timed == exhaustive.stats.evaluated
    assert _comparable(pruned) == _comparable(exhaustive)
    # not degenerate: the rows shown hold what the case is about
    rows = [entry.layout for entry in exhaustive.ranked]
    assert spec.first_dense_layers and spec.n_shared_experts and spec.n_layers % 2
    assert any(row.ep > 1 for row in rows) and len({row.zero_group for row in rows}) > 1
    if "fix_text" in options:
        assert all(row.etp == 1 and row.tp > 1 and row.ep > 1 for row in rows)
    else:
        assert any(row.pp > 1 for row in rows)  # an uneven split of 27 layers
        assert {a.axis for a in exhaustive.alternatives if a.best_total} >= {"pp", "zero", "ep"}


@pytest.mark.parametrize(("block", "per_thread"), [(96, 8), (1 << 17, 512)])
def test_pruned_search_is_the_same_in_small_blocks_on_threads(monkeypatch, block, per_thread):
    """The memory grid, the floors and the step times evaluated in many small blocks (96
    cells), or each round's cells of one (pp, chunks) halved between two threads (their
    1,244 to 8,990 cells over 512), several on threads at once (`prune.BLOCK_CELLS`,
    `prune._THREAD_CELLS`), give the exhaustive search's answer: every layout's numbers are
    its own, whatever block it is in."""
    spec, options = get_model(CASES[0][0]), CASES[0][1]
    exhaustive = run_plan(spec, **options, prune_above=EXHAUSTIVE)
    monkeypatch.setattr(prune, "BLOCK_CELLS", block)
    monkeypatch.setattr(prune, "_THREAD_CELLS", per_thread)
    pruned = run_plan(spec, **options, prune_above=0)
    assert _comparable(pruned) == _comparable(exhaustive)
    assert pruned.stats.timed > 2 * max(96, 2 * per_thread)  # in several blocks


# The DP/ZeRO term decides: DeepSeek-V2-Lite (MoE with shared experts: a dense and an expert
# parameter group, the experts' data-parallel group dp·cp/ep) on 16 H100 (2 nodes: dp·cp
# across them), s=1024, where the DP/ZeRO traffic is ~6 % of the step; ZeRO 0-3 with hybrid
# groups. Megatron-LM does not overlap DP traffic by default (the floor holds all of it),
# --overlap-grad-reduce (dp_overlap) hides it (the floor holds none), Megatron-DeepSpeed
# overlaps ZeRO-3 only (`dp_overlap_zero=(3,)`) and adds its pipeline engine's DP time.
DP_CASES = [
    ("megatron-te", {}),
    ("megatron-te", {"dp_overlap": True}),
    ("megatron-deepspeed", {}),
]


@pytest.mark.parametrize(("impl", "stack_kw"), DP_CASES)
def test_the_dp_floor_is_the_exposed_dp_traffic_where_it_is_not_overlapped(impl, stack_kw):
    """The floor `prune` searches with (`step_floor` + `dp_floor`) is at most the ranking's
    lower bound on every layout (`evaluate_candidates`) and at most `estimate_step` (the
    scalar path) on layouts of every ZeRO stage and group; its DP part is `estimate_step`'s
    `dp_comm_total` where the stack does not overlap the stage and 0 where it does; and the
    pruned search gives the exhaustive one's answer with fewer step times than without it."""
    spec, cluster = get_model("deepseek-v2-lite"), Cluster.of(16, "h100")
    train = TrainSpec(seq_len=1024, global_batch=64, impl=impl, **stack_kw)
    cand, _ = _enumerate(spec, cluster, train, SearchSpace(), _Rejections())
    cal = default_calibration(cluster.accelerator.calibration_name)
    shared = shared_costs(spec, cluster, train, cand, cal)
    with ThreadPoolExecutor(2) as pool:
        floor = prune._floor(spec, cluster, train, cand, shared, pool,
                             RunGeometries(spec, cand).first)()
    valid = cand["_valid"]
    rows = np.arange(valid.shape[0])
    dp = dp_floor(train, cand, shared, run_shapes(spec, cand, shared, rows), rows, rows)
    terms = evaluate_candidates(spec, cluster, train, cand, cal,
                                keys=("total", "bubble", "dp_comm_total"))
    assert np.all(floor[valid] <= terms["total"][valid])  # the closed-form bubble's bound
    zero, group = (np.asarray(cand[k])[:, 0] for k in ("zero", "zero_group"))
    overlapped = np.asarray(train.settings().dp_overlapped(zero), dtype=bool)
    exposed = np.where(overlapped[:, None], 0.0, terms["dp_comm_total"])
    np.testing.assert_allclose(np.broadcast_to(dp[:, None], valid.shape)[valid],
                               np.broadcast_to(exposed, valid.shape)[valid], rtol=1e-12)
    # layout by layout on the scalar path: every ZeRO stage and group, 1F1B and interleaved
    cells = np.argwhere(valid)
    combos = np.stack([zero[cells[:, 0]], group[cells[:, 0]],
                       np.asarray(cand["chunks"])[cells[:, 0], 0]])
    _, firsts = np.unique(combos, axis=1, return_index=True)
    pick = cells[np.concatenate([firsts, np.minimum(firsts + 1, len(cells) - 1)])]
    one = flat_cells(cand, pick[:, 0], pick[:, 1])
    for i, (row, col) in enumerate(pick):
        layout = _layout_of(one, i)
        step = estimate_step(spec, cluster, layout, train, cal,
                             simulate=bool(simulated({"pp": layout.pp, "chunks": layout.chunks,
                                                      "m": layout.microbatches(train)})))
        assert floor[row, col] <= step.total
        assert dp[row] == pytest.approx(0.0 if overlapped[row] else step.dp_comm_total,
                                        rel=1e-12, abs=0.0)
        assert dp[row] <= step.dp_comm_exposed
    # not degenerate: the DP part is a share of the floor at every non-overlapped ZeRO stage,
    # with hybrid shard groups, replicas across nodes, and expert parallelism (the experts'
    # data-parallel group apart from the dense one)
    bare = ~overlapped
    assert set(zero[bare & (dp > 0)]) == {0, 1, 2, 3} - set(zero[overlapped])
    dp_cp = np.asarray(cand["dp"])[:, 0] * np.asarray(cand["cp"])[:, 0]
    ep = np.asarray(cand["ep"])[:, 0]
    if bare.any():
        assert ((dp_cp > cluster.gpus_per_node) & (ep > 1) & (dp > 0)).any()
        share = dp[bare] / np.min(np.where(valid, floor, np.inf), axis=1)[bare]
        assert np.median(share) > 0.02
    if impl == "megatron-te":
        assert (bare & (group > 0) & (group < dp_cp) & (dp > 0)).any() or not bare.any()
    # the search: the exhaustive answer, and fewer step times than without the DP part
    options = dict(gpus=16, seq=1024, global_batch="64", impl=impl, stack_kw=stack_kw,
                   top=6)
    exhaustive = run_plan(spec, **options, prune_above=EXHAUSTIVE)
    pruned = run_plan(spec, **options, prune_above=0)
    assert pruned.stats.timed < exhaustive.stats.timed  # no `BoundBroken` fallback
    assert _comparable(pruned) == _comparable(exhaustive)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prune, "dp_floor", lambda *args: np.zeros(len(args[4])))
        without = run_plan(spec, **options, prune_above=0)
    assert _comparable(without) == _comparable(exhaustive)
    if overlapped.all():
        assert pruned.stats.timed == without.stats.timed
    else:
        assert pruned.stats.timed < without.stats.timed


def test_the_grid_floor_is_float32_rounded_down_from_the_float64_bound():
    """`prune._floor` keeps the floor in float32 (half the bytes of the grid's largest array)
    and stays under the float64 `step_floor` it rounds (the DP floor only adds): within
    float32's rounding after the 1e-6 it takes off; inf where the cell is not valid."""
    spec, cluster = get_model("tiny-deepseek"), Cluster.of(32, "h100")
    train = TrainSpec(seq_len=64, global_batch=256)
    cand, _ = _enumerate(spec, cluster, train, SearchSpace(), _Rejections())
    cal = default_calibration(cluster.accelerator.calibration_name)
    shared = shared_costs(spec, cluster, train, cand, cal)
    with ThreadPoolExecutor(2) as pool:
        floor = _floor(spec, cluster, train, cand, shared, pool,
                       RunGeometries(spec, cand).first)()
    valid = cand["_valid"]
    assert floor.dtype == np.float32 and floor.shape == valid.shape
    assert np.all(np.isinf(floor[~valid])) and np.all(np.isfinite(floor[valid]))
    bound = step_floor(spec, cluster, train, cand, shared, np.arange(valid.shape[0]))
    total = evaluate_candidates(spec, cluster, train, cand, cal, keys=("total",))["total"]
    assert np.all(floor[valid] >= bound[valid] * (1 - 2e-6))
    assert np.all(floor[valid] <= total[valid])


def test_rank_bounds_count_the_untimed_fitting_layouts_that_may_tie_or_beat_it():
    """`rank_bounds`: a layout ranked `position` among the timed ones, of figure f, may have
    behind it each fitting layout not timed whose floor is at most f (a floor equal to f
    may still tie, and ties go to the simpler layout); timed layouts, layouts that do not
    fit and floors above f do not count."""
    from types import SimpleNamespace

    floor = np.array([[1.0, 2.0, 0.5], [0.9, 1.0 + 1e-3, 0.25]], dtype=np.float32)
    fits = np.array([[True, True, False], [True, True, True]])
    evaluated = np.array([[False, False, False], [True, False, True]])
    pruned = SimpleNamespace(grid={"fits": fits, "evaluated": evaluated, "floor": floor})
    assert rank_bounds(pruned, 3, 1.0) == (3, 4)  # the floor of exactly 1.0 only
    assert rank_bounds(pruned, None, 2.0) == (1, 4)  # 1.0, 1.001 and 2.0
    assert rank_bounds(pruned, 2, 0.1) == (2, 2)


def test_the_pruned_search_at_deepseek_v3s_published_scale_beats_its_scalar_baseline():
    """DeepSeek-V3 on 2,048 H800 (9.9 M valid layouts; its grid fields int32, widened where
    the models multiply them): the best row is no slower than the §7 baseline evaluated by
    the scalar model, whose rank lies within the fitting layouts, and the published layout
    without DeepSeek's memory techniques is refused as the scalar memory model refuses it."""
    result = plan(get_model("deepseek-v3"), Cluster.of(2048, "h800"),
                  TrainSpec(seq_len=4096, global_batch=15360), top=3,
                  layout=Layout(dp=128, pp=16, ep=64, zero=1))
    base, given = result.baseline, result.given
    assert base is not None and base.fits and given is not None
    assert result.best.estimate.total <= base.estimate.total
    ranks = re.match(r"rank ([\d,]+)(?: to ([\d,]+))? of ([\d,]+) fitting", result.baseline_note)
    assert ranks, result.baseline_note
    low, high, fitting = (int((x or ranks[1]).replace(",", "")) for x in ranks.groups())
    assert 1 <= low <= high <= fitting == result.stats.fits
    assert not given.fits and given.memory.total > given.budget
    assert result.given_note == "does not fit in GPU memory"
