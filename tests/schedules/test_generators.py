"""Generators against SPEC §6's definitions and Megatron-LM's / Qi et al.'s schedules."""

from itertools import pairwise
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.schedules import (
    SCHEDULES,
    Action,
    dualpipev,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    parse_schedule,
    schedule_text,
    validate_schedule,
    zb_h1,
    zbv,
)


def _forwards_before_first_backward(actions):
    return next(k for k, action in enumerate(actions) if action.kind == "B")


def test_gpipe_runs_all_forwards_then_all_backwards():
    schedule = gpipe(4, 8)
    assert sum(len(actions) for actions in schedule.values()) == 64
    expected = [Action("F", j) for j in range(8)] + [Action("B", j) for j in range(8)]
    assert all(schedule[i] == expected for i in range(4))


def test_1f1b_warms_up_p_minus_1_minus_i_forwards_then_alternates():
    schedule = one_f_one_b(4, 8)
    assert schedule == parse_schedule("""
        0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
        1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7
        2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7
        3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7
    """)


def test_1f1b_with_fewer_micro_batches_than_stages_warms_up_m():
    assert one_f_one_b(4, 2)[0] == parse_schedule("0: F0 F1 B0 B1")[0]


def test_interleaved_follows_megatron_order_and_warmup():
    p, m, v = 4, 8, 2
    schedule = interleaved_1f1b(p, m, v)
    forwards = [a for a in schedule[0] if a.kind == "F"]
    backwards = [a for a in schedule[0] if a.kind == "B"]
    # Groups of p micro-batches through chunk 0, then chunk 1; backwards start at the last chunk.
    assert [str(a) for a in forwards[:10]] == \
        ["F0", "F1", "F2", "F3", "F0.1", "F1.1", "F2.1", "F3.1", "F4", "F5"]
    assert [str(a) for a in backwards[:5]] == ["B0.1", "B1.1", "B2.1", "B3.1", "B0"]
    # Megatron: warm-up min(2(p-1-i) + (v-1)p, m·v), then one more forward before the first B.
    warmups = [min(2 * (p - 1 - i) + (v - 1) * p, m * v) for i in range(p)]
    assert warmups == [10, 8, 6, 4]
    assert [_forwards_before_first_backward(schedule[i]) for i in range(p)] == \
        [w + 1 for w in warmups]


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved_1f1b(4, 6, 1) == one_f_one_b(4, 6)


def test_interleaved_needs_m_divisible_by_p():
    with pytest.raises(ValueError, match="m divisible by p.*m=6, p=4"):
        interleaved_1f1b(4, 6, 2)


def test_zb_h1_defers_i_weight_gradients_on_stage_i():
    schedule = zb_h1(4, 8)
    assert schedule[3] == parse_schedule(
        "3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 "
        "W5 W6 W7")[3]
    assert [str(a) for a in schedule[0][:8]] == \
        ["F0", "F1", "F2", "F3", "B0", "W0", "F4", "B1"]
    for i in range(4):
        after_last_b = len(schedule[i]) - 1 - max(
            k for k, a in enumerate(schedule[i]) if a.kind == "B")
        assert after_last_b == i + 1  # the i deferred Ws and one more


def test_make_schedule_dispatches_by_name():
    assert make_schedule("gpipe", 2, 3) == gpipe(2, 3)
    assert make_schedule("1f1b", 2, 3) == one_f_one_b(2, 3)
    assert make_schedule("interleaved", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    assert make_schedule("zb-h1", 2, 3) == zb_h1(2, 3)


def test_make_schedule_lists_valid_names():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*gpipe, 1f1b, interleaved, "
                                         "zb-h1, zbv, dualpipev, dualpipe"):
        make_schedule("pipedream", 4, 8)


def test_make_schedule_rejects_chunks_for_single_chunk_schedules():
    with pytest.raises(ValueError, match="one chunk per stage.*'interleaved'"):
        make_schedule("1f1b", 4, 8, v=2)


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b, zb_h1])
@pytest.mark.parametrize(("p", "m"), [(0, 4), (4, 0), (-1, 4), (2.5, 4), (4, "8")])
def test_generators_validate_arguments(generator, p, m):
    with pytest.raises(ValueError, match="must be an integer ≥ 1"):
        generator(p, m)


def test_interleaved_validates_chunks():
    with pytest.raises(ValueError, match=r"v \(chunks\) must be an integer ≥ 1, got 0"):
        interleaved_1f1b(4, 8, 0)


@given(name=st.sampled_from(SCHEDULES), p=st.integers(1, 8), m=st.integers(1, 24),
       v=st.integers(2, 4))
def test_every_generated_schedule_validates(name, p, m, v):
    info = get_schedule(name)
    if info.bidirectional:  # DualPipe: even p, even m
        p, m = p + p % 2, m + m % 2
    v = v if info.chunks is None else info.chunks
    m = -(-m // p) * p if info.chunks is None else max(m, 2 * p)
    validate_schedule(make_schedule(name, p, m, v), p, m, v, info.placement, info.bidirectional)


# ------------------------------------------------------------------ ZBV and DualPipeV
def _pipelining_order(name, p, m):
    """torch.distributed.pipelining's own compute order (2.13) for schedule class `name` on
    every rank, in our actions: its stage index `rank` is chunk 0 and `2p-1-rank` chunk 1 (the
    V); `I` is a split B, `B` a whole one; `OVERLAP_F_B` is our overlapped pair."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = schedules.get_schedule_class(name)
    # the order is computed from these three attributes alone; no process group is needed
    shape = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    kinds = {"F": "F", "I": "B", "B": "B", "W": "W"}
    order = {}
    for rank in range(p):
        actions = []
        for action in cls._calculate_single_rank_operations(shape, rank):
            parts = (action.sub_actions or (action,)) if action is not None else ()
            for k, part in enumerate(parts):
                actions.append(Action(kinds[part.computation_type.value], part.microbatch_index,
                                      int(part.stage_index != rank), with_next=k < len(parts) - 1))
        order[rank] = actions
    return order


@pytest.mark.parametrize(("name", "generator", "cases"), [
    ("ZBVZeroBubble", zbv, [(1, 1), (2, 1), (2, 3), (3, 4), (4, 8), (4, 13), (5, 9), (6, 20)]),
    ("DualPipeV", dualpipev, [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 11), (5, 16)]),
])
def test_v_schedules_are_pipelinings_own_order(name, generator, cases):
    for p, m in cases:
        ours, theirs = generator(p, m), _pipelining_order(name, p, m)
        assert ours == theirs, (name, p, m)
        for rank in range(p):  # equality ignores `with_next`: compare the pairs too
            assert [a.with_next for a in ours[rank]] == [a.with_next for a in theirs[rank]]


def test_zbv_p2_m3_by_hand():
    # Stage 0: 2p-1 = 3 forwards of chunk 0; p = 2 rounds F1 B1 W1 (chunk 1 of stage 0 is the
    # last virtual stage, so its backward follows at once); one steady round without a new F0:
    # B0 W0 F2.1 B2.1 W2.1; cool-down p rounds B0 W0.
    # Stage 1: 2(p-1)-1 = 1 forward F0, one pair F0.1 F1, one round F1.1 B0.1 W0.1, one steady
    # round F2 B0 W0 F2.1 B1.1 W1.1, cool-down B1 B2.1 (i = 1 round) and B2 W1 (p-i = 1 round),
    # then the deferred Ws: chunk 1's W2.1, chunk 0's W2.
    assert schedule_text(zbv(2, 3)) == (
        "0: F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 F2.1 B2.1 W2.1 B1 W1 B2 W2\n"
        "1: F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 B1 B2.1 B2 W1 W2.1 W2")


def test_dualpipev_p2_m4_last_stage_by_hand():
    # Stage 1 (i = p-1): no lone F0; i+1 = 2 pairs F0 F1; no B1 W F1 round; m-2p+i+1 = 2 main
    # rounds — the first F0 and B0.1 apart (whole B), then F2.1&B0, then F3&B1.1, F3.1&B1;
    # i+1 = 2 rounds B1 B0, split from round (i+1)//2 = 1 on (odd stage: from its B1); the
    # deferred Ws last.
    schedule = dualpipev(2, 4)
    assert schedule_text(schedule).splitlines()[1] == (
        "1: F0 F0.1 F1 F1.1 F2 B0.1 F2.1&B0 F3&B1.1 F3.1&B1 B2.1 B2 B3.1 B3 W3.1 W3")
    for actions in schedule.values():  # every pair is a forward overlapped with a backward
        assert all(a.kind == "F" and b.kind == "B"
                   for a, b in pairwise(actions) if a.with_next)


def test_dualpipev_needs_2p_micro_batches():
    with pytest.raises(ValueError, match="at least 2p = 8 micro-batches"):
        dualpipev(4, 7)
