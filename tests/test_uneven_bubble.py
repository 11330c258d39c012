"""The pipeline bubble with uneven stages against the event simulator (SPEC §6): the planner's
closed form (the other stages' layers in place of `(p-1)` busiest stages) is exact for GPipe
and equal stages and never below the simulated bubble of the 1F1B family;
`estimate_step(simulate=True)` runs each uneven stage at its own times."""

import pytest

from shardwise.arch import get_model
from shardwise.estimate.memory import stage_params
from shardwise.estimate.step import busiest_stage_params, estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules import make_schedule, simulate
from shardwise.schedules.registry import get_schedule

CASES = [("gpipe", (1, 3), 1), ("1f1b", (3, 1), 1), ("1f1b", (2, 4, 4, 2), 1),
         ("1f1b", (7, 8, 8, 7), 1), ("1f1b", (2, 3, 4, 5), 1), ("gpipe", (5, 4, 3, 2), 1),
         ("zb-h1", (2, 4, 4, 2), 1), ("zb-h1", (4, 4, 4, 4), 1), ("1f1b", (4, 4, 4), 1),
         ("interleaved", (4, 2), 2), ("interleaved", (2, 4, 4, 2), 2),
         ("interleaved", (4, 4, 4, 4), 2)]


@pytest.mark.parametrize(("name", "partition", "v"), CASES)
@pytest.mark.parametrize("m", [4, 8])
def test_closed_form_bubble_bounds_the_simulated_one(name, partition, v, m):
    f, b, w = 1.0, 2.2, 0.9  # per layer and micro-batch; w: the weight-gradient part of b
    p, n_layers, most = len(partition), sum(partition), max(partition)
    sizes = [n // v for n in partition] * v  # virtual stage c·p + i
    schedule = make_schedule(name, p, m, v)
    split = get_schedule(name).splits_backward  # then B takes b - w and W takes w
    timeline = simulate(schedule, [f * n for n in sizes], [b * n for n in sizes],
                        [w * n for n in sizes] if split else None)
    simulated = timeline.makespan - m * most * (f + b)
    # the step model's closed form: the equal-stage bubble at the busiest stage's times,
    # scaled from (p-1) busiest stages to the others' layers
    equal = get_schedule(name).bubble(p, v, m, most * f, most * b, most * w)
    closed = equal * (n_layers - most) / ((p - 1) * most)
    assert closed >= simulated - 1e-9
    if name == "gpipe" or len(set(partition)) == 1:
        assert closed == pytest.approx(simulated, rel=1e-12)


def test_estimate_step_simulates_uneven_stages():
    model, cluster = get_model("llama3-8b"), Cluster.of(4, "h100")
    train = TrainSpec(seq_len=4096, global_batch=16)
    layout = Layout(pp=4, partition=(6, 10, 10, 6))
    closed = estimate_step(model, cluster, layout, train)
    uneven = estimate_step(model, cluster, layout, train, simulate=True)
    assert uneven.bubble_source == "simulator"
    assert uneven.bubble <= closed.bubble < 3 * closed.t_forward + 3 * closed.t_backward
    # the busiest stages (10 layers) wait for the first one's 6 layers on the way in and out
    per_layer = (uneven.t_forward + uneven.t_backward) / 10
    assert uneven.bubble < 3 * 10 * per_layer  # below the old (p-1)·busiest upper bound
    assert uneven.bubble >= 6 * per_layer


@pytest.mark.parametrize("partition", [(6, 10, 10, 6), (2, 10, 10, 10), (10, 10, 10, 2)])
def test_step_counts_the_busiest_stage_with_the_memory_model(partition):
    """The DP/optimizer terms use the stage with the most parameters, counted per stage."""
    model = get_model("mixtral-8x7b")
    layout = Layout(pp=4, tp=2, partition=partition)
    dense, expert = busiest_stage_params(model, 2, 4, 1, 1, partition)
    assert float(dense + expert) == max(sum(stage_params(model, layout, i)) for i in range(4))


@pytest.mark.parametrize("pp", [1, 2, 5, 6, 7])
def test_default_partition_busiest_stage_is_found_among_three(pp):
    model = get_model("mixtral-8x7b")  # 32 layers: pp 5, 6, 7 give the balanced uneven split
    dense, expert = busiest_stage_params(model, 2, pp, 1, 1)
    layout = Layout(pp=pp, tp=2)
    assert float(dense + expert) == max(sum(stage_params(model, layout, i)) for i in range(pp))


def test_planner_memory_finds_the_second_stage_of_the_default_partition():
    """Llama 3 405B TP8 PP16 (7, 8 × 14, 7), 1F1B: stage 1 holds 8 layers × 15 micro-batches'
    activations, more than stage 0's 7 × 16; the arrays' peak is the per-stage maximum."""
    from shardwise.estimate.memory import peak_stage_memory, training_memory_per_gpu

    model, train = get_model("llama3-405b"), TrainSpec(seq_len=8192, global_batch=2048)
    layout = Layout(dp=64, tp=8, pp=16, sp=True, zero=1, recompute="full")
    stages = training_memory_per_gpu(model, layout, train)
    assert max(stages, key=lambda st: st.total).stage == 1
    peak = peak_stage_memory(model, train, **layout.codes(), m=layout.microbatches(train))
    assert float(peak["total"]) == pytest.approx(stages[1].total, rel=1e-12)
