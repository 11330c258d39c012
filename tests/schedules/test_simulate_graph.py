"""The simulator's two halves, `schedule_graph` (compiled once per schedule) and `simulate_graph`
(per set of times), against closed forms and a timeline worked out by hand."""

import pytest

from shardwise.errors import ShardwiseError
from shardwise.schedules import (
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_schedule,
    stage_timeline,
    zb_h1,
)
from shardwise.schedules.simulate import schedule_graph, simulate_graph


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    (gpipe(4, 8), 4, 8, 1), (one_f_one_b(5, 7), 5, 7, 1), (one_f_one_b(8, 60), 8, 60, 1),
    (interleaved_1f1b(4, 8, 2), 4, 8, 2), (interleaved_1f1b(3, 9, 3), 3, 9, 3)])
def test_one_compiled_schedule_gives_the_closed_form_for_every_set_of_times(schedule, p, m, v):
    # Stage times t_f, t_b, a chunk taking 1/v of them: makespan m(t_f + t_b) plus the fill and
    # drain (p-1)(t_f + t_b)/v (Huang et al. 2019; Narayanan et al. 2021, §2.2), evaluated
    # over and over on one graph, as stage_timeline does with the graphs it keeps.
    graph = schedule_graph(schedule)
    for t_f, t_b in [(1.0, 2.0), (0.3, 0.7), (5.0, 1.25), (1.0, 2.0)]:
        timeline = simulate_graph(graph, t_f / v, t_b / v)
        assert timeline.makespan == pytest.approx((v * m + p - 1) * (t_f + t_b) / v, rel=1e-12)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)
        assert len(timeline.events) == 2 * m * v * p


@pytest.mark.parametrize(("p", "m", "latency"), [(4, 8, 0.25), (5, 3, 0.5), (2, 6, 0.125)])
def test_gpipe_pays_the_p2p_latency_once_per_boundary_each_way(p, m, latency):
    # The first forward reaches the last stage after (p-1)(t_f + ℓ), which then never waits;
    # the last backward reaches stage 0 after (p-1)(t_b + ℓ) more.
    timeline = simulate_graph(schedule_graph(gpipe(p, m)), 1.0, 2.0, p2p_latency=latency)
    assert timeline.makespan == (m + p - 1) * 3.0 + 2 * (p - 1) * latency


def test_zb_h1_p3_m4_uneven_stages_with_latency_by_hand():
    # Stage orders (zb_h1): 0: F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3;
    # 1: F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3; 2: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3.
    # F = 1, 2, 1.5; the split B = t_b - t_w = 2, 2.5, 1.5; W = 1, 1.5, 0.5; a hop ℓ = 0.25.
    # E.g. stage 1's B0 waits for stage 2's B0 (ends 6.5) + ℓ = 6.75, and stage 0's B0 for it
    # (ends 9.25) + ℓ = 9.5; stage 2's F2 waits for stage 1's F2 (ends 11.25) + ℓ.
    timeline = simulate_graph(schedule_graph(zb_h1(3, 4)), [1.0, 2.0, 1.5], [3.0, 4.0, 2.0],
                              [1.0, 1.5, 0.5], p2p_latency=0.25)
    expected = {
        0: [("F0", 0, 1), ("F1", 1, 2), ("F2", 2, 3), ("B0", 9.5, 11.5), ("W0", 11.5, 12.5),
            ("F3", 12.5, 13.5), ("B1", 14, 16), ("W1", 16, 17), ("B2", 20, 22), ("W2", 22, 23),
            ("B3", 24, 26), ("W3", 26, 27)],
        1: [("F0", 1.25, 3.25), ("F1", 3.25, 5.25), ("B0", 6.75, 9.25), ("F2", 9.25, 11.25),
            ("B1", 11.25, 13.75), ("W0", 13.75, 15.25), ("F3", 15.25, 17.25),
            ("B2", 17.25, 19.75), ("W1", 19.75, 21.25), ("B3", 21.25, 23.75),
            ("W2", 23.75, 25.25), ("W3", 25.25, 26.75)],
        2: [("F0", 3.5, 5), ("B0", 5, 6.5), ("F1", 6.5, 8), ("B1", 8, 9.5), ("F2", 11.5, 13),
            ("B2", 13, 14.5), ("W0", 14.5, 15), ("F3", 17.5, 19), ("B3", 19, 20.5),
            ("W1", 20.5, 21), ("W2", 21, 21.5), ("W3", 21.5, 22)]}
    assert {stage: [(str(e.action), e.start, e.end) for e in timeline.events
                    if e.stage == stage] for stage in range(3)} == expected
    assert timeline.makespan == 27
    # busy 16 + 24 + 14 = 54 of 3 · 27
    assert timeline.bubble_fraction == pytest.approx(1 / 3)


def test_a_deadlock_is_refused_once_the_times_are_checked():
    graph = schedule_graph(parse_schedule("0: F0 B0 F1 B1\n1: F1 B1 F0 B0"))  # compiles
    with pytest.raises(ShardwiseError, match="t_b must be a finite number > 0"):
        simulate_graph(graph, 1.0, -1.0)
    with pytest.raises(ShardwiseError) as info:
        simulate_graph(graph, 1.0, 1.0)
    assert str(info.value) == ("schedule deadlocks: stage 0 at B0 waits for B0 on stage 1; "
                               "stage 1 at F1 waits for F1 on stage 0")


def test_an_overlapped_pair_waiting_on_itself_deadlocks():
    # B0 needs F0 of its own pair: the pair can never start.
    with pytest.raises(ShardwiseError, match="stage 0 at B0 waits for F0 on stage 0"):
        simulate_graph(schedule_graph(parse_schedule("0: F0&B0")), 1.0, 1.0)


def test_the_kept_schedules_refuse_what_make_schedule_refuses():
    # stage_timeline keeps compiled schedules by (name, p, m, v); True hashes as 1
    stage_timeline("1f1b", 1, 4)
    with pytest.raises(ShardwiseError, match="p \\(stages\\) must be an integer ≥ 1, got True"):
        stage_timeline("1f1b", True, 4)


HAIR = 2.0 ** -51  # the spacing of floats just below 4.0


@pytest.mark.parametrize(("text", "t_f", "t_b", "t_w", "expected"), [
    # B0 waits for B0.1 (ended at 4) on its own stage, not only for its predecessor B1
    ("0: F0 F1 F0.1 F1.1 B1.1 B0.1 B1 B0 W1", [1.0, 0.5], [0.9 * HAIR, 0.5], [0.6 * HAIR, 0.25],
     [("F0", 0, 1), ("F1", 1, 2), ("F0.1", 2, 2.5), ("F1.1", 2.5, 3), ("B1.1", 3, 3.5),
      ("B0.1", 3.5, 4), ("B1", 4, 4 - HAIR), ("B0", 4, 4), ("W1", 4, 4)]),
    # W0.1 waits for its B0.1 (ended at 4), not only for its predecessor B1
    ("0: F0 F1 F0.1 F1.1 B1.1 B0.1 B1 W0.1 B0 W1", [1.0, 0.375], [0.9 * HAIR, 0.75],
     [0.6 * HAIR, 0.25],
     [("F0", 0, 1), ("F1", 1, 2), ("F0.1", 2, 2.375), ("F1.1", 2.375, 2.75),
      ("B1.1", 2.75, 3.5), ("B0.1", 3.5, 4), ("B1", 4, 4 - HAIR), ("W0.1", 4, 4.25),
      ("B0", 4.25, 4.25), ("W1", 4.25, 4.25)]),
])
def test_an_action_waits_for_each_dependency_on_its_stage_too(text, t_f, t_b, t_w, expected):
    # One stage, two chunks (virtual stages 0 and 1). Virtual stage 0's backward is far below
    # the clock's resolution at 4: its split B1 starts at 4, 4 + t_b rounds to 4 and 4 - t_w
    # to 4 - HAIR, so it ends a hair before it starts; whatever waits on an action its stage
    # ran earlier still starts at that action's end, as in the list-scheduling rule.
    timeline = simulate_graph(schedule_graph(parse_schedule(text)), t_f, t_b, t_w)
    assert [(str(e.action), e.start, e.end) for e in timeline.events] == expected
