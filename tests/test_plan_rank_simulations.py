"""The ranking runs the schedule simulator only where the closed form is not the figure
(`plan.rank`: uneven pipelines small enough to simulate; equal stages have the closed form's
bubble exactly): none for a grid of even pipelines, at most the uneven fitting layouts
otherwise, and every shown row's figure is the scalar `evaluate_layout`'s (simulated
bubble included)."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, plan
from shardwise.plan.evaluate import evaluate_layout

CLUSTER = Cluster.of(16, "h100")
TRAIN = TrainSpec(seq_len=64, global_batch=32, impl="shardwise")
SPACE = SearchSpace(tp=(1, 2), pp=(1, 2, 4), cp=(1,), ep=(1, 4), etp=(0,), micro_batch=(1, 2),
                    zero=(0, 1), recompute=("none", "full"), schedules=("1f1b", "zb-h1"))


@pytest.mark.parametrize("layers", [4, 6])  # pp 2 and 4 even; pp 4 of 6 uneven
def test_only_uneven_pipelines_are_simulated(layers):
    model = get_model("tiny-deepseek").with_(n_layers=layers)
    result = plan(model, CLUSTER, TRAIN, top=6, space=SPACE, baseline=False,
                  all_variants=True)
    uneven = [e for e in result.ranked
              if max(e.layout.stage_partition(layers)) * e.layout.pp != layers]
    if layers == 4:
        assert result.stats.simulated == 0 and not uneven
    else:
        assert 0 < result.stats.simulated <= result.stats.fits
    for entry in result.ranked:
        scalar = evaluate_layout(model, CLUSTER, TRAIN, entry.layout, result.calibration,
                                 result.headroom)
        assert entry.estimate.total == pytest.approx(scalar.estimate.total, rel=1e-9)


def test_the_top_rows_are_the_fastest_by_the_scalar_figure_with_searched_splits():
    """A model whose head costs about four layers (so pp 2 and 4 search shortened last
    stages, whose bubble the simulator gives): the rows `plan` shows are the fastest of
    every valid layout by `evaluate_layout`'s figure (the simulated bubble where the stages
    are uneven), enumerated here over the axes."""
    import itertools

    from shardwise.arch import ModelSpec
    from shardwise.layout import Layout

    model = ModelSpec("big-vocab", 16, 1024, 16, 16, 4096, 64000)
    cluster = Cluster.of(8, "h100")
    train = TrainSpec(seq_len=512, global_batch=16, impl="shardwise")
    space = SearchSpace(tp=(1,), pp=(2, 4), cp=(1,), micro_batch=(1, 2), zero=(1,),
                        sp=(False,), recompute=("none",), schedules=("1f1b", "zb-h1"))
    cal = None
    figures = []
    for pp, mb, schedule in itertools.product((2, 4), (1, 2), ("1f1b", "zb-h1")):
        splits = {(8, 8): [(), (10, 6)],  # (L + a + z)/pp units, less a first and z last
                  (4,) * 4: [(), (3, 5, 5, 3), (5, 5, 5, 1)]}[(16 // pp,) * pp]
        # ZeRO-1 flat, or over groups of 2 or 4 of the dp ranks (fewer than all of them)
        for split, group in itertools.product(splits, (0, 2, 4)):
            if group >= 8 // pp:
                continue
            layout = Layout(dp=8 // pp, pp=pp, micro_batch=mb, zero=1, zero_group=group,
                            schedule=schedule, partition=split)
            entry = evaluate_layout(model, cluster, train, layout, cal, 0.85)
            if entry.fits:
                figures.append((entry.estimate.total, layout))
    figures.sort(key=lambda x: x[0])
    result = plan(model, cluster, train, top=4, space=space, baseline=False,
                  all_variants=True)
    assert [e.estimate.total for e in result.ranked] == pytest.approx(
        [f for f, _ in figures[:4]], rel=1e-9)
    assert result.stats.fits == len(figures)
    assert any(layout.partition for _, layout in figures[:4])


def test_the_ring_alternative_has_context_parallelism():
    """Llama-3-8B at 32k tokens, 4 sequences on 8 GPUs: the winner runs Ulysses over cp 2;
    the explanation's alternative `cp_kind=ring` is the fastest fitting layout with cp > 1
    and ring attention (only layouts with context parallelism have a kind), timed here by
    `evaluate_layout` over the grid written out."""
    import itertools

    from shardwise.arch import get_model
    from shardwise.layout import Layout

    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=32768, global_batch=4, impl="shardwise")
    space = SearchSpace(tp=(1, 2), pp=(1,), cp=(1, 2), micro_batch=(1,), zero=(1, 3),
                        recompute=("none", "full"), cp_kinds=("ring", "ulysses"))
    result = plan(model, cluster, train, top=1, space=space, baseline=False)
    assert (result.best.layout.cp, result.best.layout.cp_kind) == (2, "ulysses")
    ring = []
    for tp, zero, rc, sp in itertools.product((1, 2), (1, 3), ("none", "full"), (False, True)):
        if sp and tp == 1:
            continue
        layout = Layout(dp=4 // tp, tp=tp, cp=2, zero=zero, recompute=rc, sp=sp)
        entry = evaluate_layout(model, cluster, train, layout, result.calibration, 0.85)
        if entry.fits:
            ring.append((entry.estimate.total, layout.short()))
    (alt,) = [a for a in result.alternatives if a.axis == "cp_kind" and a.value == "ring"]
    assert (alt.best_total, alt.best_layout) == (pytest.approx(min(ring)[0], rel=1e-9),
                                                 min(ring)[1])


def test_zero_bubble_rows_simulate_the_input_and_weight_gradients_apart():
    """Only ZB-H1 in the space, 6 layers on pp = 4 (uneven): the simulated rows split each
    backward into its input gradient (B − W) and weight gradient (W) as the scalar
    `evaluate_layout` does; every shown row's figure is its figure."""
    model = get_model("tiny-deepseek").with_(n_layers=6)
    space = SearchSpace(tp=(1,), pp=(4,), cp=(1,), ep=(1, 4), etp=(0,), micro_batch=(1, 2),
                        zero=(0, 1), recompute=("none",), schedules=("zb-h1",))
    result = plan(model, CLUSTER, TRAIN, top=4, space=space, baseline=False)
    assert result.stats.simulated > 0
    totals = [entry.estimate.total for entry in result.ranked]
    assert totals == sorted(totals)  # ranked by the figure the scalar path gives
    for entry in result.ranked:
        assert entry.layout.schedule == "zb-h1"
        scalar = evaluate_layout(model, CLUSTER, TRAIN, entry.layout, result.calibration,
                                 result.headroom)
        assert entry.estimate.total == pytest.approx(scalar.estimate.total, rel=1e-9)


def test_a_simulation_settles_its_group_only_where_every_lane_scales_alike():
    """`Ranking._simulate` marks another layout of the same simulated group exact when its
    forward, input-gradient and weight-gradient times are all the same multiple of the
    simulated one's (the whole timeline scales). Here the second layout's forward and whole
    backward scale by 1 but its weight gradient by 0.2 (zero-bubble splits it off): its
    figure, once known, is the event simulator's for its own times, and its bound never
    exceeds that."""
    import numpy as np

    from shardwise.calibration import default_calibration
    from shardwise.estimate.step import simulated_bubble
    from shardwise.plan import _enumerate, _flatten, _Rejections, evaluate_candidates
    from shardwise.plan.evaluate import _layout_of
    from shardwise.plan.rank import Ranking

    model = get_model("tiny-deepseek").with_(n_layers=6)
    space = SearchSpace(tp=(1,), pp=(4,), cp=(1,), ep=(1, 4), etp=(0,), micro_batch=(1,),
                        zero=(0, 1), recompute=("none",), schedules=("zb-h1",))
    cand, _ = _enumerate(model, CLUSTER, TRAIN, space, _Rejections())
    cal = default_calibration(CLUSTER.accelerator.calibration_name)
    terms = evaluate_candidates(model, CLUSTER, TRAIN, cand, cal, keys=(
        "total", "memory", "bubble", "t_forward", "t_backward", "t_wgrad"))
    flat, terms = _flatten(cand, terms)
    one, two = 0, 1  # two layouts of one group (schedule, pp, chunks, m, stage ends)
    for key in ("pp", "chunks", "m", "schedule", "first_less", "last_less"):
        assert flat[key][one] == flat[key][two]
    terms = {k: np.array(v, dtype=float) for k, v in terms.items()}
    times = {"t_forward": (1e-3, 1e-3), "t_backward": (2e-3, 2e-3), "t_wgrad": (1e-3, 2e-4)}
    for key, (a, b) in times.items():
        terms[key][[one, two]] = a, b
    fits = np.zeros(len(terms["total"]), dtype=bool)
    fits[[one, two]] = True
    ranking = Ranking(model, flat, terms, fits)
    assert ranking.pending[one] and ranking.pending[two]  # uneven: 6 layers on 4 stages

    def exact(i):
        layout = _layout_of(flat, i)
        return terms["total"][i] - terms["bubble"][i] + simulated_bubble(
            layout, int(flat["m"][i]), *(float(terms[k][i]) for k in times), model.n_layers)

    ranking._simulate(one)
    assert ranking.figure(one) == pytest.approx(exact(one), rel=1e-12)
    assert ranking.lower[two] <= exact(two) * (1 + 1e-12)
    if not ranking.pending[two]:  # settled by the group: it must be its own figure
        assert ranking.figure(two) == pytest.approx(exact(two), rel=1e-12)
    ranking.top(2)
    assert ranking.figure(two) == pytest.approx(exact(two), rel=1e-12)
