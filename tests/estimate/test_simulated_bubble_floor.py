"""`simulated_bubble_floor` (the planner's bound on the simulated bubble of uneven pipelines)
against the schedule simulator (`simulated_bubble`, an event simulation of each schedule's
action order): never above it, for every one-direction schedule of the registry, uneven
explicit partitions (stages of 0 layers included: embedding- or loss-only) and split
backwards; equal to it where the whole step is one chain (one micro-batch, no split)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from shardwise.estimate.step import simulated_bubble, simulated_bubble_floor
from shardwise.layout import Layout
from shardwise.schedules.registry import SCHEDULE_REGISTRY

ONE_DIRECTION = [name for name, info in SCHEDULE_REGISTRY.items() if not info.bidirectional]


def _layout(schedule: str, p: int, counts: list[int]) -> Layout:
    """`counts` layers per stage (the chunks of a stage share its count)."""
    info = SCHEDULE_REGISTRY[schedule]
    return Layout(pp=p, chunks=info.default_chunks if info.chunked else 1, schedule=schedule,
                  partition=tuple(counts))


@settings(max_examples=150, deadline=None)
@given(schedule=st.sampled_from(ONE_DIRECTION), p=st.integers(2, 6), m=st.integers(1, 14),
       data=st.data(), t_f=st.floats(0.2, 3.0), t_b=st.floats(0.5, 6.0),
       w_share=st.floats(0.05, 0.9))
def test_the_bound_is_never_above_the_simulator(schedule, p, m, data, t_f, t_b, w_share):
    info = SCHEDULE_REGISTRY[schedule]
    chunks = info.default_chunks if info.chunked else 1
    counts = data.draw(st.lists(st.integers(0, 5), min_size=p, max_size=p)
                       .filter(lambda c: max(c) > 0))
    counts = [n * chunks for n in counts]  # each chunk of a stage holds a whole number
    layout = _layout(schedule, p, counts)
    assume(info.microbatch_problem(p, m) is None)
    t_w = w_share * t_b
    try:
        exact = simulated_bubble(layout, m, t_f, t_b, t_w, sum(counts))
    except ShardwiseError:
        assume(False)
    bound = simulated_bubble_floor(layout, np.float64(m), np.float64(t_f), np.float64(t_b),
                                   np.float64(t_w), sum(counts))
    assert 0.0 <= bound <= exact * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_micro_batch_is_one_chain_so_the_bound_is_exact(schedule):
    """m = 1 without a split backward: the step is the forward down every stage and the
    backward back up, `Σ_k (F_k + B_k)` — the stage before the last bound holds all of it.
    By hand for 4+4+4+2 layers (the busiest: 4), t_f = 1, t_b = 2: (3.5 + 7) - 3 = 7.5."""
    layout = _layout(schedule, 4, [4, 4, 4, 2])
    exact = simulated_bubble(layout, 1, 1.0, 2.0, 0.5, 14)
    bound = simulated_bubble_floor(layout, np.float64(1), np.float64(1.0), np.float64(2.0),
                                   np.float64(0.5), 14)
    assert exact == pytest.approx(7.5, rel=1e-12)
    assert bound == pytest.approx(7.5, rel=1e-12)


def test_arrays_of_times_bound_each_layout_and_a_lighter_last_stage_holds_most():
    """One geometry (1F1B, 6+6+6+3 layers), arrays of m and times: each entry under its own
    simulation, and most of it (the light last stage waits for the others' chain)."""
    layout = _layout("1f1b", 4, [6, 6, 6, 3])
    m = np.array([1.0, 2.0, 4.0, 8.0])
    t_f, t_b = np.array([1.0, 0.7, 2.0, 1.5]), np.array([2.0, 2.1, 3.0, 4.0])
    bound = simulated_bubble_floor(layout, m, t_f, t_b, 0.3 * t_b, 21)
    exact = np.array([simulated_bubble(layout, int(m[i]), t_f[i], t_b[i], 0.3 * t_b[i], 21)
                      for i in range(4)])
    assert np.all(bound <= exact * (1 + 1e-12))
    assert np.all(bound >= 0.6 * exact)


def test_a_bidirectional_schedule_gets_no_bound():
    """DualPipe runs two pipelines in opposite directions: the one-direction chains do not
    hold, so the bound is 0 (the planner never searches it)."""
    layout = Layout(pp=4, chunks=2, schedule="dualpipe")
    assert simulated_bubble_floor(layout, np.float64(8), np.float64(1.0), np.float64(2.0),
                                  np.float64(0.5), 16) == 0.0
