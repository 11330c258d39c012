"""Simulated timelines against SPEC §6's figures and the papers' closed forms."""

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.schedules import (
    Action,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    parse_schedule,
    peak_in_flight,
    simulate,
    stage_timeline,
    zb_h1,
)

times = st.floats(0.01, 100.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_p4_m8_unit_slots_bubble_3_over_11_makespan_22(name):
    timeline = simulate(make_schedule(name, 4, 8), t_f=1.0, t_b=1.0)
    assert timeline.bubble_fraction == pytest.approx(3 / 11)
    assert round(timeline.bubble_fraction, 4) == 0.2727
    assert timeline.makespan == 22
    assert len(timeline.events) == 64


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("m", "expected"), [(8, 7 / 15), (16, 7 / 23), (32, 7 / 39), (64, 7 / 71)])
@pytest.mark.parametrize("t_b", [1.0, 3.0])
def test_p8_bubble_unchanged_by_backward_cost(name, m, expected, t_b):
    assert simulate(make_schedule(name, 8, m), 1.0, t_b).bubble_fraction == pytest.approx(expected)


@given(name=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(1, 16), m=st.integers(1, 64),
       t_f=times, t_b=times)
def test_gpipe_1f1b_makespan_and_bubble_closed_form(name, p, m, t_f, t_b):
    timeline = simulate(make_schedule(name, p, m), t_f, t_b)
    assert timeline.makespan == pytest.approx((m + p - 1) * (t_f + t_b), rel=1e-9)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-9, abs=1e-12)


def test_peak_in_flight_p4_m8():
    assert simulate(gpipe(4, 8), 1, 1).peak_in_flight == (8, 8, 8, 8)
    assert simulate(one_f_one_b(4, 8), 1, 1).peak_in_flight == (4, 3, 2, 1)


def test_peak_in_flight_p4_m16_stage0():
    assert peak_in_flight(gpipe(4, 16))[0] == 16
    assert peak_in_flight(one_f_one_b(4, 16))[0] == 4


@given(p=st.integers(1, 16), m=st.integers(1, 64))
def test_1f1b_peak_in_flight_is_min_p_minus_i_m(p, m):
    assert peak_in_flight(one_f_one_b(p, m)) == tuple(min(p - i, m) for i in range(p))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3),
                                           (8, 16, 2), (8, 8, 2), (3, 9, 3)])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    # Unit time per chunk; a stage's forward is v units, so the ideal time is 2·v·m and the
    # pipeline fills and drains in p-1 chunk-times each way.
    timeline = simulate(interleaved_1f1b(p, m, v), t_f=1.0, t_b=1.0)
    assert timeline.makespan == 2 * (v * m + p - 1)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@given(p=st.integers(1, 8), groups=st.integers(1, 6), v=st.integers(2, 4), t_f=times, t_b=times)
def test_interleaved_makespan_closed_form_for_any_times(p, groups, v, t_f, t_b):
    m = groups * p
    timeline = simulate(interleaved_1f1b(p, m, v), t_f, t_b)
    assert timeline.makespan == pytest.approx((v * m + p - 1) * (t_f + t_b), rel=1e-9)


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 16, 4), (8, 16, 2), (2, 6, 3)])
def test_interleaved_stage0_peak_is_vp_plus_p_minus_1_chunks(p, m, v):
    peak = peak_in_flight(interleaved_1f1b(p, m, v))[0]
    assert peak == v * p + p - 1
    # Korthikanti et al. 2022: with L/(pv) layers per chunk, stage 0 holds L(1 + (p-1)/(pv)).
    layers = 96
    assert peak * layers / (p * v) == pytest.approx(layers * (1 + (p - 1) / (p * v)))


def test_zb_h1_p4_m8_bubble_is_a_third_of_1f1b():
    # Unit F, B, W: 1F1B's backward is B+W = 2, makespan 3(m+p-1) = 33, idle 3(p-1) per stage;
    # ZB-H1 idles only (p-1)·t_b: makespan 3m + p - 1 = 27, bubble 3/27.
    zb = simulate(zb_h1(4, 8), t_f=1.0, t_b=2.0, t_w=1.0)
    baseline = simulate(one_f_one_b(4, 8), t_f=1.0, t_b=2.0)
    assert baseline.makespan == 33
    assert zb.makespan == 27
    assert zb.bubble_fraction == pytest.approx(1 / 9)
    assert zb.bubble_fraction < baseline.bubble_fraction == pytest.approx(3 / 11)
    assert zb.makespan - 24 == (baseline.makespan - 24) / 3
    assert zb.peak_in_flight == baseline.peak_in_flight == (4, 3, 2, 1)


@given(p=st.integers(1, 12), m=st.integers(1, 48), t=times)
def test_zb_h1_reaches_the_lower_bound_at_equal_times(p, m, t):
    # Stage 0 may start at most p forwards before its first B, which cannot start before
    # p·t_f + (p-1)·t_b: the makespan is at least max(m, p)·t_f + (p-1)·t_b + m(t_b + t_w).
    timeline = simulate(zb_h1(p, m), t, 2 * t, t)
    assert timeline.makespan == pytest.approx((max(m, p) + p - 1 + 2 * m) * t, rel=1e-9)
    assert timeline.peak_in_flight == tuple(min(p - i, m) for i in range(p))


@given(p=st.integers(2, 12), m=st.integers(1, 48), t_f=st.floats(0.1, 10.0),
       t_b=st.floats(0.1, 10.0), t_w=st.floats(0.1, 10.0))
def test_zb_h1_beats_1f1b_and_respects_the_bound_for_any_times(p, m, t_f, t_b, t_w):
    # t_b the input-gradient pass B here; the whole backward is t_b + t_w
    makespan = simulate(zb_h1(p, m), t_f, t_b + t_w, t_w).makespan
    assert makespan >= (max(m, p) * t_f + (p - 1) * t_b + m * (t_b + t_w)) * (1 - 1e-12)
    assert makespan < (m + p - 1) * (t_f + t_b + t_w)  # 1F1B with a full backward t_b + t_w


def test_events_follow_each_stage_order_and_dependencies():
    timeline = simulate(one_f_one_b(3, 4), t_f=1.0, t_b=2.0)
    by_stage = {s: [e for e in timeline.events if e.stage == s] for s in range(3)}
    assert [e.action for e in by_stage[1]] == one_f_one_b(3, 4)[1]
    assert all(a.end <= b.start for row in by_stage.values() for a, b in pairwise(row))
    first = {(e.stage, e.action): e for e in timeline.events}
    assert first[(1, Action("F", 0))].start == 1.0
    assert first[(2, Action("B", 0))].start == 3.0
    assert first[(0, Action("B", 0))].end == 3.0 + 3 * 2.0


def test_p2p_latency_delays_cross_stage_dependencies_only():
    # GPipe p=2, m=1: F on 0, F on 1 (+latency), B on 1, B on 0 (+latency).
    timeline = simulate(gpipe(2, 1), t_f=1.0, t_b=2.0, p2p_latency=0.5)
    assert timeline.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    # Interleaved with one stage: every dependency stays on stage 0.
    assert simulate(interleaved_1f1b(1, 2, 2), 1.0, 1.0, p2p_latency=5.0).makespan == 8


def test_split_backward_needs_t_w_below_t_b():
    with pytest.raises(ValueError, match="pass t_w"):
        simulate(zb_h1(2, 2), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"t_w \(1\) must be less than t_b \(1\)"):
        simulate(zb_h1(2, 2), 1.0, 1.0, 1.0)


def test_t_w_is_ignored_without_w_actions():
    assert simulate(one_f_one_b(4, 8), 1.0, 1.0, t_w=5.0).makespan == 22


@pytest.mark.parametrize(("t_f", "t_b", "t_w", "latency"),
                         [(0, 2, 1, 0), (1, -1, 1, 0), (1, 2, 0, 0), (1, 2, 1, -1)])
def test_times_must_be_positive(t_f, t_b, t_w, latency):
    with pytest.raises(ValueError, match="must be"):
        simulate(zb_h1(2, 2), t_f, t_b, t_w, p2p_latency=latency)


def test_deadlock_names_the_stuck_actions():
    schedule = parse_schedule("0: F0 B0 F1 B1\n1: F1 B1 F0 B0")
    with pytest.raises(ValueError, match="deadlocks: stage 0 at B0 waits for B0 on stage 1; "
                                         "stage 1 at F1 waits for F1 on stage 0"):
        simulate(schedule, 1.0, 1.0)


def test_missing_dependency_is_named():
    schedule = parse_schedule("0: F0 B0\n1: B0")
    with pytest.raises(ValueError, match="stage 1 at B0 waits for F0 which no stage runs"):
        simulate(schedule, 1.0, 1.0)


def test_peak_counted_until_w():
    # Holding (X, dY) until W, ZB-H1 keeps p micro-batches on every stage (when m ≥ p);
    # schedules without W are unchanged.
    assert peak_in_flight(zb_h1(4, 8), until="W") == (4, 4, 4, 4)
    assert peak_in_flight(zb_h1(4, 2), until="W") == (2, 2, 2, 2)
    assert peak_in_flight(one_f_one_b(4, 8), until="W") == (4, 3, 2, 1)


# ------------------------------------------------------------ per-stage times (issue 31)
def test_per_stage_times_p4_m8_every_schedule_does_1f1bs_work():
    # t_f = t_b = 1 per stage: the work is m·(t_f + t_b) = 16 on every stage; 1F1B adds
    # (p-1)(t_f+t_b) = 6 (makespan 22); interleaved chunks take 1/2, so its fill and drain are
    # (p-1)(t_f+t_b)/v = 3: 19; ZB-H1 splits t_b into B = W = 1/2 and idles
    # (p-1)·max(t_f + B - W, B, t_f) = 3: 19.
    makespans = {name: stage_timeline(name, 4, 8, t_f=1.0, t_b=1.0).makespan
                 for name in ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev")}
    assert makespans["1f1b"] == makespans["gpipe"] == 22
    assert makespans["interleaved"] == 19
    assert makespans["zb-h1"] == 19
    assert makespans["zbv"] < 22 and makespans["dualpipev"] < 22
    interleaved = stage_timeline("interleaved", 4, 8, 2, t_f=1.0, t_b=1.0)
    assert {e.end - e.start for e in interleaved.events} == {0.5}
    assert interleaved.peak_in_flight[0] == 4 + 3 / 2  # p + (p-1)/v micro-batches


def test_zbv_unit_chunk_times_idle_only_the_fill():
    # F = B = W = 1 per chunk (t_f = 2, t_b = 4, t_w = 2 per stage): the last stage's first
    # action waits for micro-batch 0's chunk-0 forward through p-1 stages, (p-1)·1, and at
    # equal times ZBV then never idles (Qi et al. 2023, §6): makespan 6m + p - 1.
    for p, m in [(2, 3), (4, 8), (5, 12)]:
        timeline = stage_timeline("zbv", p, m, t_f=2.0, t_b=4.0, t_w=2.0)
        assert timeline.makespan == 6 * m + p - 1
        assert timeline.peak_in_flight == (p,) * p  # 2p chunks of half a stage


def test_dualpipev_p2_m4_unit_chunk_times_by_hand():
    # Chunk F = B = W = 1, a whole B 2, a pair F&B 3 (stage 1's list in
    # test_dualpipev_p2_m4_last_stage_by_hand). Stage 1 waits [0, 1] for F0 and [21, 22] for
    # stage 0's whole B3.1; stage 0 waits [10, 11] for stage 1's F2.1&B0 pair (both inputs of
    # its own pair F2.1&B0 arrive when that pair ends) and [16, 17] for stage 1's F3.1&B1.
    # Each stage works 6m = 24: makespan 26, a bubble of 2(p-1) chunk-forwards.
    timeline = stage_timeline("dualpipev", 2, 4, t_f=2.0, t_b=4.0, t_w=2.0)
    assert timeline.makespan == 26
    idle = {stage: [(a.end, b.start) for a, b in pairwise(
        [e for e in timeline.events if e.stage == stage]) if b.start > a.end]
        for stage in (0, 1)}
    assert idle == {0: [(10, 11), (16, 17)], 1: [(21, 22)]}
    assert min(e.start for e in timeline.events if e.stage == 1) == 1


def test_an_overlapped_pair_sends_both_outputs_when_both_are_done():
    # Stage 0 runs F1&B0: B0 waits for stage 1's B0 (ends at 3), so the pair runs 3–5 and F1's
    # activation leaves at 5, not at 4 — stage 1's F1 starts at 5.
    schedule = parse_schedule("0: F0 F1&B0 B1\n1: F0 B0 F1 B1")
    timeline = simulate(schedule, 1.0, 1.0)
    start = {(e.stage, str(e.action)): e.start for e in timeline.events}
    assert start[(0, "F1")] == 3 and start[(0, "B0")] == 4
    assert start[(1, "F1")] == 5


def test_stage_timeline_rejects_a_weight_part_not_below_the_backward():
    with pytest.raises(ValueError, match=r"t_w \(2\) must be less than t_b \(1\)"):
        stage_timeline("zb-h1", 2, 2, t_f=1.0, t_b=1.0, t_w=2.0)
    # schedules without W ignore it
    assert stage_timeline("1f1b", 2, 2, t_f=1.0, t_b=1.0, t_w=2.0).makespan == 6
