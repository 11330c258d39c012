"""The pruned search's floor (`evaluate.step_floor`) against the scalar step model, layout by
layout: the terms that depend on neither the ZeRO stage nor its group — compute, the TP,
CP, EP and PP traffic — of `estimate_step` at ZeRO 0 (so the floor is exactly what every
ZeRO variant adds its DP traffic and optimizer step to), plus the closed-form bubble, and on
the uneven pipelines the ranking simulates a part of the simulator's bubble
(docs/concepts/planner.md#pruning). The grid: an MoE with a shared expert, tp·ep > 1, a
searched uneven split (5+1 layers) and even ones, interleaving and ZB-H1."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.calibration import default_calibration
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, _enumerate, _flatten, _layout_of, _Rejections
from shardwise.plan.evaluate import shared_costs, step_floor

MODEL = get_model("tiny-deepseek").with_(n_layers=6, vocab=2048)  # pp 2 also splits 5+1
CLUSTER = Cluster.of(16, "h100")
TRAIN = TrainSpec(seq_len=64, global_batch=32, impl="shardwise")
SPACE = SearchSpace(tp=(1, 2), pp=(1, 2, 4), cp=(1, 2), cp_kinds=("ring",), ep=(1, 4),
                    etp=(0,), micro_batch=(1, 2), zero=(0, 1, 3), zero_groups=(2,),
                    recompute=("none", "full"), schedules=("1f1b", "interleaved", "zb-h1"),
                    chunks=(3,))
TERMS = ("compute", "tp_comm", "cp_comm_exposed", "ep_comm", "pp_comm")


def test_the_floor_is_the_scalar_zero_independent_terms_and_bubble():
    cand, _ = _enumerate(MODEL, CLUSTER, TRAIN, SPACE, _Rejections())
    cal = default_calibration(CLUSTER.accelerator.calibration_name)
    shared = shared_costs(MODEL, CLUSTER, TRAIN, cand, cal)
    floor = step_floor(MODEL, CLUSTER, TRAIN, cand, shared, np.arange(cand["_valid"].shape[0]))
    flat, terms = _flatten(cand, {"floor": floor})
    assert terms is not None
    n = len(flat["tp"])
    # every uneven or interleaved layout, and a spread of the rest
    special = np.flatnonzero((flat["last_less"] != flat["first_less"]) | (flat["chunks"] > 1)
                             | (flat["pp"] == 4))
    picked = np.union1d(special[:: max(len(special) // 40, 1)], np.arange(0, n, max(n // 40, 1)))
    kinds = set()
    for i in picked:
        layout = _layout_of(flat, int(i))
        at_zero = layout.with_(zero=0, zero_group=0)
        est = estimate_step(MODEL, CLUSTER, at_zero, TRAIN, cal)
        # uneven stages (pp 4 of 6 layers, the 5+1 split): the ranking simulates the
        # bubble of 1F1B and ZB-H1, so the floor holds a part of the simulator's
        uneven = max(layout.stage_partition(MODEL.n_layers)) * layout.pp != MODEL.n_layers
        want = sum(getattr(est, k) for k in TERMS)
        if uneven and layout.schedule in ("1f1b", "zb-h1"):
            simulated = estimate_step(MODEL, CLUSTER, at_zero, TRAIN, cal, simulate=True)
            assert want * (1 - 1e-9) <= terms["floor"][i] <= (want + simulated.bubble) * (
                1 + 1e-9), layout.short()
            held = (terms["floor"][i] - want) / simulated.bubble if simulated.bubble else None
        else:
            assert layout.pp == 1 or est.bubble > 0
            assert terms["floor"][i] == pytest.approx(want + est.bubble, rel=1e-9), \
                layout.short()
            held = None
        kinds.add((layout.pp, layout.schedule, bool(layout.partition), uneven,
                   layout.tp * layout.ep > 1, layout.zero > 0, held))
    # not degenerate: an even pipeline with its bubble, uneven ones with most of the
    # simulated bubble, the searched split
    assert any(pp > 1 and not uneven for pp, _, _, uneven, *_ in kinds)
    assert any(uneven and partition for _, _, partition, uneven, *_ in kinds)
    assert max(held for *_, held in kinds if held is not None) > 0.5
    assert any(s == "interleaved" for _, s, *_ in kinds)
    assert any(tpep and zero for *_, tpep, zero, _ in kinds)


def test_the_pruned_searchs_cell_memory_is_the_scalar_model_on_blackwell():
    """`cell_terms(("memory",))` (the peak the pruned search reports for layouts that do not
    fit) and `cell_terms` with the step time against `training_memory_per_gpu` cell by cell, on a B200 (Blackwell: TE keeps one
    cached FP8 copy of a weight with the tensorwise recipe, Hopper two) — the generation must
    reach the memory model."""
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.plan.evaluate import cell_terms, flat_cells

    cluster = Cluster.of(16, "b200")
    train = TrainSpec(seq_len=64, global_batch=32, fp8="tensorwise").validate()
    space = SearchSpace(tp=(1, 2), pp=(1, 2), cp=(1,), ep=(1, 4), etp=(0,),
                        micro_batch=(1,), zero=(0, 3), recompute=("none",),
                        schedules=("1f1b",))
    cand, _ = _enumerate(MODEL, cluster, train, space, _Rejections())
    cal = default_calibration(cluster.accelerator.calibration_name)
    shared = shared_costs(MODEL, cluster, train, cand, cal)
    rows, cols = np.nonzero(cand["_valid"])
    cells = flat_cells(cand, rows, cols)
    memory = cell_terms(MODEL, cluster, train, cells, shared, ("memory",))["memory"]
    # and with the step time (the exhaustive search's path, `evaluate_candidates`)
    timed = cell_terms(MODEL, cluster, train, cells, shared, ("total", "memory"))["memory"]
    assert np.array_equal(timed, memory)
    assert len(memory) > 4
    for i in range(len(memory)):
        layout = _layout_of(cells, i)
        blackwell = max(s.total for s in training_memory_per_gpu(MODEL, layout, train,
                                                                 generation="blackwell"))
        hopper = max(s.total for s in training_memory_per_gpu(MODEL, layout, train,
                                                              generation="hopper"))
        assert memory[i] == pytest.approx(blackwell, rel=1e-12), layout.short()
        assert layout.zero == 3 or hopper > blackwell  # FSDP holds no cached copy
