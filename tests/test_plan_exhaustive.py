"""The planner's contract against an enumeration written here: every layout of a small grid
(itertools over the axes, dp = GPUs / (tp·pp·cp), kept when `Layout.problems` finds nothing),
each timed by the scalar `estimate_step` (equal stages: its closed form is the
simulator's) and sized by `training_memory_per_gpu` — not the
planner's grid, arrays or pruning. `plan(..., all_variants=True)` must list exactly the
fitting layouts, fastest first, with the scalar figures; its winner is the enumeration's
fastest; the budget's edge (GPU memory × headroom) admits a layout whose peak equals it and
refuses the run one byte below, saying by how much. Model: tiny-deepseek (MLA with
d_k ≠ d_v, a shared expert, a dense first layer, 8 routed experts) with tp·cp·ep > 1.
"""

from __future__ import annotations

import itertools
import math

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import training_memory_per_gpu
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.plan import SearchSpace, plan

MODEL = get_model("tiny-deepseek").with_(n_layers=4)  # pp 2: two stages of 2
CLUSTER = Cluster.of(8, "h100")
TRAIN = TrainSpec(seq_len=64, global_batch=16, impl="shardwise")
AXES = {"tp": (1, 2), "pp": (1, 2), "cp": (1, 2), "ep": (1, 2, 4), "micro_batch": (1, 2),
        "zero": (0, 1, 3), "sp": (False, True), "recompute": ("none", "full")}
SPACE = SearchSpace(tp=AXES["tp"], pp=AXES["pp"], cp=AXES["cp"], ep=AXES["ep"], etp=(0,),
                    micro_batch=AXES["micro_batch"], zero=AXES["zero"], zero_groups=(2,),
                    sp=AXES["sp"], recompute=AXES["recompute"], schedules=("1f1b",),
                    chunks=(1,), cp_kinds=("ring",))


def _enumerated() -> list[tuple[float, float, Layout]]:
    """(step seconds, peak stage bytes, layout) of every valid layout of `SPACE`'s values:
    ZeRO flat, or ZeRO ≥ 1 sharded over groups of 2 of the dp·cp ranks; SP only with tp > 1
    (the same layout as without)."""
    rows = []
    for tp, pp, cp, ep, mb, zero, sp, rc in itertools.product(*AXES.values()):
        if CLUSTER.n_gpus % (tp * pp * cp) or (sp and tp == 1):
            continue
        dp = CLUSTER.n_gpus // (tp * pp * cp)
        for group in (0, 2) if zero else (0,):
            if group and group >= dp * cp:  # a group of all dp·cp ranks is plain ZeRO
                continue
            layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=mb, zero=zero,
                            zero_group=group, sp=sp, recompute=rc)
            if layout.problems(MODEL, CLUSTER, TRAIN):
                continue
            peak = max(m.total for m in training_memory_per_gpu(MODEL, layout, TRAIN))
            step = estimate_step(MODEL, CLUSTER, layout, TRAIN).total
            rows.append((step, peak, layout))
    return rows


@pytest.fixture(scope="module")
def enumerated():
    rows = _enumerated()
    # the grid is not degenerate: every axis takes both of its kinds of value among the valid
    for axis in ("tp", "pp", "cp", "ep", "zero", "zero_group", "sp", "recompute"):
        assert len({getattr(layout, axis) for _, _, layout in rows}) > 1, axis
    return rows


def _key(layout: Layout) -> tuple:
    return (layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.micro_batch,
            layout.zero, layout.zero_group, layout.sp, layout.recompute)


def _at(peak: float) -> float:
    """The headroom whose budget (GPU memory × headroom) is `peak`, rounded up by an ulp or
    two so that the float product is not below it."""
    capacity = CLUSTER.accelerator.memory_bytes
    headroom = peak / capacity
    while capacity * headroom < peak:
        headroom = math.nextafter(headroom, 1.0)
    return headroom


def _budget_plan(headroom: float):
    return plan(MODEL, CLUSTER, TRAIN, top=10_000, space=SPACE, all_variants=True,
                baseline=False, headroom=headroom)


def test_the_rows_are_every_fitting_layout_fastest_first(enumerated):
    """Headroom at the median peak: about half the layouts fit. The rows are exactly those
    whose peak is within the budget, each with the scalar step time and memory, sorted."""
    peaks = sorted(p for _, p, _ in enumerated)
    headroom = _at(peaks[len(peaks) // 2])
    budget = CLUSTER.accelerator.memory_bytes * headroom
    fitting = {_key(layout): (step, peak) for step, peak, layout in enumerated
               if peak <= budget}
    assert 0 < len(fitting) < len(enumerated)
    result = _budget_plan(headroom)
    shown = {_key(e.layout): e for e in result.ranked}
    assert set(shown) == set(fitting)
    for key, entry in shown.items():
        step, peak = fitting[key]
        assert entry.estimate.total == pytest.approx(step, rel=1e-9)
        assert entry.memory.total == pytest.approx(peak, rel=1e-9)
        assert entry.fits and entry.budget == pytest.approx(budget)
    totals = [e.estimate.total for e in result.ranked]
    assert all(a <= b * (1 + 1e-9) for a, b in itertools.pairwise(totals))
    fastest = min(step for step, _ in fitting.values())
    assert result.best.estimate.total == pytest.approx(fastest, rel=1e-9)
    assert result.ranked[0].rank == 1
    # every layout the search evaluated and found too big is counted under memory
    memory = sum(r.count for r in result.rejected if r.category == "memory")
    assert memory == len(enumerated) - len(fitting) == result.stats.evaluated - result.stats.fits
    assert result.stats.fits == len(fitting)


def test_the_budget_edge_admits_equal_and_refuses_one_byte_more(enumerated):
    """The leanest layout's peak as the budget: it (and any layout as lean) is the only row;
    a budget a hair below it fits nothing: one `ShardwiseError` line naming the leanest
    layout, its GiB and the GiB over the budget."""
    capacity = CLUSTER.accelerator.memory_bytes
    lean_peak = min(p for _, p, _ in enumerated)
    leanest = {_key(layout) for _, p, layout in enumerated if p == lean_peak}
    result = _budget_plan(_at(lean_peak))
    assert {_key(e.layout) for e in result.ranked} == leanest
    below = lean_peak * (1 - 1e-6)
    with pytest.raises(ShardwiseError) as info:
        _budget_plan(below / capacity)
    message = str(info.value)
    assert "\n" not in message and "no layout of tiny-deepseek fits 8×" in message
    assert f"needs {lean_peak / 2**30:.1f} GiB per GPU" in message
    assert f"{(lean_peak - below) / 2**30:.1f} GiB over the {below / 2**30:.1f} GiB" in message
    # what would help: the state of a few hundred thousand parameters needs no more GPUs
    assert message.endswith("would help: more GPUs (more ways to shard); a shorter sequence "
                            "or a smaller global batch per replica; an 8-bit optimizer")
    assert f"GiB budget ({below / capacity:.0%} of {capacity / 2**30:.0f} GiB)" in message


def test_the_winner_is_the_enumerations_fastest_at_full_headroom(enumerated):
    """Default headroom: the winner's step time is the fastest fitting layout's (the
    enumeration's, scalar), and top=3 shows the first three of the full order."""
    budget = CLUSTER.accelerator.memory_bytes * 0.85
    order = sorted(step for step, peak, _ in enumerated if peak <= budget)
    result = plan(MODEL, CLUSTER, TRAIN, top=3, space=SPACE, all_variants=True,
                  baseline=False, headroom=0.85)
    assert [e.estimate.total for e in result.ranked] == pytest.approx(order[:3], rel=1e-9)
    assert result.stats.grid >= len(enumerated)


def _spec_candidates():
    """SPEC §7's order, written out: for cp = 1, 2, 4, … (while 2·cp divides the sequence),
    ZeRO-1 then ZeRO-3, (tp, pp) by tp·pp then the larger tp, tp | heads (and kv heads) and
    d_ff within the node, pp | layers; ep the most experts dividing dp·cp; selective
    recompute, SP with tp > 1, micro-batch 1, 1F1B. (peak bytes, layout) of the valid ones."""
    tps = [t for t in (1, 2, 4, 8) if MODEL.n_heads % t == 0 and MODEL.d_ff % t == 0
           and (MODEL.n_kv_heads % t == 0 or t % MODEL.n_kv_heads == 0)]
    pps = [p for p in range(1, MODEL.n_layers + 1) if MODEL.n_layers % p == 0]
    out, c, n = [], 1, CLUSTER.n_gpus
    while c <= n and (c == 1 or TRAIN.seq_len % (2 * c) == 0):
        pairs = sorted(((t, p) for t in tps for p in pps if n % (t * p * c) == 0),
                       key=lambda tp: (tp[0] * tp[1], -tp[0]))
        for zero, (t, p) in itertools.product((1, 3), pairs):
            dp = n // (t * p * c)
            ep = max(e for e in range(1, MODEL.n_experts + 1)
                     if MODEL.n_experts % e == 0 and dp * c % e == 0)
            layout = Layout(dp=dp, tp=t, pp=p, cp=c, ep=ep, zero=zero if dp * c > 1 else 0,
                            sp=t > 1, recompute="selective", micro_batch=1)
            if not layout.problems(MODEL, CLUSTER, TRAIN):
                peak = max(m.total for m in training_memory_per_gpu(MODEL, layout, TRAIN))
                out.append((peak, layout))
        c *= 2
    return out


def test_the_baseline_is_the_first_in_spec_order_that_fits_at_each_threshold():
    """A budget equal to a candidate's peak that undercuts every earlier one: the baseline is
    that candidate; a hair below, the next in order that fits; below the leanest, one line
    naming it."""
    from shardwise.plan import choose_parallelism

    capacity = CLUSTER.accelerator.memory_bytes
    candidates = _spec_candidates()
    assert len({layout.tp for _, layout in candidates}) > 1
    picked = 0
    for k, (peak, layout) in enumerate(candidates):
        if k and peak < min(p for p, _ in candidates[:k]):
            assert choose_parallelism(MODEL, CLUSTER, TRAIN, headroom=_at(peak)) == layout
            budget = peak * (1 - 1e-9)
            later = [lay for p, lay in candidates[k + 1:] if p <= budget]
            if later:
                assert choose_parallelism(MODEL, CLUSTER, TRAIN,
                                          headroom=budget / capacity) == later[0]
            picked += 1
    assert picked >= 2
    assert choose_parallelism(MODEL, CLUSTER, TRAIN) == candidates[0][1]
    lean_peak, leanest = min(candidates, key=lambda x: x[0])
    with pytest.raises(ShardwiseError) as info:
        choose_parallelism(MODEL, CLUSTER, TRAIN, headroom=lean_peak * 0.999 / capacity)
    assert str(info.value) == (f"nothing fits: the leanest ({leanest.short()}) needs "
                               f"{lean_peak / 2**30:.1f} GiB of "
                               f"{lean_peak * 0.999 / 2**30:.1f} GiB")
