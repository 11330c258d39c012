"""The schedule registry: one entry per schedule, its rules equal to what its generator does."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.schedules import (
    SCHEDULE_REGISTRY,
    SCHEDULES,
    get_schedule,
    make_schedule,
    peak_in_flight,
    stage_timeline,
)
from shardwise.schedules.registry import SCHEDULE_CODES, select


def test_names_codes_and_lookup():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev",
                         "dualpipe")
    assert len(set(SCHEDULE_CODES.values())) == len(SCHEDULES)
    for name, info in SCHEDULE_REGISTRY.items():
        assert get_schedule(name) is info and get_schedule(info.code) is info
    with pytest.raises(ShardwiseError, match="unknown schedule 'x'; valid: gpipe, 1f1b"):
        get_schedule("x")


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 1), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_traits_match_the_generated_actions(name, p, m):
    info = get_schedule(name)
    v = info.default_chunks if info.chunked else 1
    if info.microbatch_problem(p, m) or (info.chunked and p < 2):
        return
    schedule = make_schedule(name, p, m, v)
    has_w = any(a.kind == "W" for actions in schedule.values() for a in actions)
    assert has_w == info.splits_backward
    # the memory rule equals the peak counted from the action order (F … B)
    assert tuple(int(info.in_flight(p, m, v, i)) for i in range(p)) == peak_in_flight(schedule)
    # the bubble rule equals the simulator's idle time on equal stages (per-stage times)
    t_f, t_b, t_w = 1.0, 2.0, 0.75
    timeline = stage_timeline(name, p, m, v, t_f=t_f, t_b=t_b, t_w=t_w)
    assert timeline.makespan - m * (t_f + t_b) == pytest.approx(
        float(info.bubble(p, v, m, t_f, t_b, t_w)), abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(SCHEDULES), p=st.integers(1, 8), m=st.integers(1, 34),
       v=st.integers(2, 4), t_f=st.floats(0.05, 5.0), t_b=st.floats(0.05, 5.0),
       w_share=st.floats(0.02, 0.98))
def test_bubble_closed_forms_equal_the_simulator_for_any_times(name, p, m, v, t_f, t_b,
                                                               w_share):
    """Every registry bubble, for every time ratio the step model can produce, equals the
    simulator's makespan minus the busy time `m·(t_f + t_b)` (per-stage times)."""
    info = get_schedule(name)
    v = v if info.chunks is None else info.chunks
    m = -(-m // p) * p if info.chunks is None else m
    if info.microbatch_problem(p, m) or (info.chunked and p < 2):
        return
    t_w = w_share * t_b
    timeline = stage_timeline(name, p, m, v, t_f=t_f, t_b=t_b, t_w=t_w)
    assert timeline.makespan - m * (t_f + t_b) == pytest.approx(
        float(info.bubble(p, v, m, t_f, t_b, t_w)), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("p, m", [(3, 5), (4, 8), (5, 9)])
def test_zbv_bubble_when_the_forwards_outweigh_the_backward_parts(p, m):
    """Chunk times f = 1.5, b = w = 1 (w ≥ b/2, (b + w)/2 ≤ f ≤ b + w): of ZBV's eight
    critical paths (2p-3)f - (p-2)b is the longest, by hand (p = 4: 5.5, the next
    2(p-1)f - (p-1)b - w = 5); the simulator idles as long."""
    f, b, w = 1.5, 1.0, 1.0
    t_f, t_b, t_w = 2 * f, 2 * (b + w), 2 * w  # a stage runs both chunks
    bubble = (2 * p - 3) * f - (p - 2) * b
    timeline = stage_timeline("zbv", p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    assert timeline.makespan - m * (t_f + t_b) == pytest.approx(bubble, abs=1e-12)
    assert float(get_schedule("zbv").bubble(p, 2, m, t_f, t_b, t_w)) == pytest.approx(
        bubble, abs=1e-12)


@pytest.mark.parametrize("p, m", [(3, 5), (4, 8), (5, 9)])
def test_zbv_bubble_when_the_input_gradient_and_weight_outweigh_the_forward(p, m):
    """Chunk times f = 1.2, b = 1, w = 0.3 (f > b, b + w > f, p·b > f + (2p-3)w): of ZBV's
    eight critical paths (2p-3)f + b - 2(p-1)w is the longest, by hand (p = 4: 5.2, the next
    2(p-1)f - (2p-1)w = 5.1); the simulator idles as long."""
    f, b, w = 1.2, 1.0, 0.3
    t_f, t_b, t_w = 2 * f, 2 * (b + w), 2 * w  # a stage runs both chunks
    bubble = (2 * p - 3) * f + b - 2 * (p - 1) * w
    timeline = stage_timeline("zbv", p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    assert timeline.makespan - m * (t_f + t_b) == pytest.approx(bubble, abs=1e-12)
    assert float(get_schedule("zbv").bubble(p, 2, m, t_f, t_b, t_w)) == pytest.approx(
        bubble, abs=1e-12)


@given(p=st.integers(2, 12), m=st.integers(1, 40))
def test_v_schedules_in_flight_rules_equal_their_action_order(p, m):
    for name in ("zbv", "dualpipev"):
        info = get_schedule(name)
        if info.microbatch_problem(p, m) is None or name == "zbv":
            peaks = peak_in_flight(make_schedule(name, p, m))
            assert peaks == tuple(int(info.in_flight(p, m, 2, i)) for i in range(p))


def test_chunk_and_micro_batch_rules():
    assert get_schedule("interleaved").chunk_options([1, 2, 3]) == [2, 3]
    assert get_schedule("zbv").chunk_options([1, 2, 3]) == [2]
    assert get_schedule("1f1b").chunk_options([1, 2, 3]) == [1]
    assert [get_schedule(n).default_chunks for n in SCHEDULES] == [1, 1, 2, 1, 2, 2, 2]
    assert get_schedule("zbv").chunk_problem(3) == "the zbv schedule runs 2 chunks per stage, " \
                                                   "got chunks=3"
    assert "at least 2·pp micro-batches" in get_schedule("dualpipev").microbatch_problem(4, 7)
    assert get_schedule("dualpipev").microbatch_problem(4, 8) is None
    assert get_schedule("interleaved").microbatch_problem(4, 6) is not None


def test_select_picks_each_layouts_rule_for_arrays_and_scalars():
    codes = np.array([SCHEDULE_CODES[name] for name in SCHEDULES])
    got = select(codes, lambda info: info.in_flight(4, 8, 2, 0))
    # p=4, m=8, v=2, stage 0: GPipe m; 1F1B, ZB-H1 min(p, m); interleaved 2(p-1) + (v-1)p + 1
    # chunks; ZBV 2p-1 forwards of chunk 0 and 1 of chunk 1; DualPipeV 2p+1; DualPipe p+1
    assert got.tolist() == [8, 4, 11, 4, 8, 9, 5]
    assert select(SCHEDULE_CODES["gpipe"], lambda info: info.loss_waits) is True


def test_layout_rules_come_from_the_registry():
    assert "needs schedule=interleaved" in " ".join(
        Layout(pp=2, chunks=2).problems(_tiny()))
    assert "the interleaved schedule needs chunks ≥ 2" in Layout(
        pp=2, schedule="interleaved").problems(_tiny())


def _tiny():
    from shardwise.arch import get_model
    return get_model("tiny")


def test_torchtitan_names_are_pipelinings_own():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for info in SCHEDULE_REGISTRY.values():
        if info.torchtitan is not None:
            assert schedules.get_schedule_class(info.torchtitan) is not None
