"""The schedule registry: one entry per schedule, its rules equal to what its generator does."""

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.schedules import (
    SCHEDULE_REGISTRY,
    SCHEDULES,
    get_schedule,
    make_schedule,
    peak_in_flight,
    simulate,
)
from shardwise.schedules.registry import SCHEDULE_CODES, select


def test_names_codes_and_lookup():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1")
    assert len(set(SCHEDULE_CODES.values())) == len(SCHEDULES)
    for name, info in SCHEDULE_REGISTRY.items():
        assert get_schedule(name) is info and get_schedule(info.code) is info
    with pytest.raises(ShardwiseError, match="unknown schedule 'x'; valid: gpipe, 1f1b"):
        get_schedule("x")


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 1), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_traits_match_the_generated_actions(name, p, m):
    info = get_schedule(name)
    v = 2 if info.chunked else 1
    if info.chunked and (p < 2 or m % p):
        return
    schedule = make_schedule(name, p, m, v)
    has_w = any(a.kind == "W" for actions in schedule.values() for a in actions)
    assert has_w == info.splits_backward
    # the memory rule equals the peak counted from the action order (F … B)
    assert tuple(int(info.in_flight(p, m, v, i)) for i in range(p)) == peak_in_flight(schedule)
    # the bubble rule equals the simulator's idle time on equal stages
    t_f, t_b, t_w = 1.0, 2.0, 0.75
    if info.splits_backward:
        timeline = simulate(schedule, t_f, t_b - t_w, t_w)
    else:
        timeline = simulate(schedule, t_f / v, t_b / v)
    assert timeline.makespan - m * (t_f + t_b) == pytest.approx(
        float(info.bubble(p, v, m, t_f, t_b, t_w)), abs=1e-9)


def test_select_picks_each_layouts_rule_for_arrays_and_scalars():
    codes = np.array([SCHEDULE_CODES[name] for name in SCHEDULES])
    got = select(codes, lambda info: info.in_flight(4, 8, 2, 0))
    # p=4, m=8, v=2, stage 0: GPipe m; 1F1B, ZB-H1 min(p, m); interleaved 2(p-1) + (v-1)p + 1
    assert got.tolist() == [8, 4, 11, 4]
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
