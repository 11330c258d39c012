"""validate_schedule rejects corrupted schedules with a message naming the offending action."""

import pytest

from shardwise.schedules import (
    Action,
    make_schedule,
    one_f_one_b,
    parse_schedule,
    simulate,
    validate_schedule,
    zb_h1,
)


def _replace(schedule, stage, actions):
    return {**schedule, stage: [Action.parse(a) for a in actions.split()]}


def test_valid_schedules_pass():
    validate_schedule(one_f_one_b(4, 8), 4, 8)
    validate_schedule(make_schedule("interleaved", 4, 8, 2), 4, 8, 2)
    validate_schedule(zb_h1(4, 8), 4, 8)


def test_backward_before_forward_is_rejected():
    schedule = _replace(one_f_one_b(2, 2), 1, "B0 F0 F1 B1")
    with pytest.raises(ValueError, match="stage 1: action B0 comes before F0"):
        validate_schedule(schedule, 2, 2)


def test_weight_gradient_before_its_backward_is_rejected():
    schedule = _replace(zb_h1(2, 2), 0, "F0 F1 W0 B0 B1 W1")
    with pytest.raises(ValueError, match="stage 0: action W0 comes before B0"):
        validate_schedule(schedule, 2, 2)


def test_missing_action_is_rejected():
    schedule = one_f_one_b(4, 8)
    schedule[2] = [a for a in schedule[2] if a != Action("B", 3)]
    with pytest.raises(ValueError, match="stage 2 is missing action B3"):
        validate_schedule(schedule, 4, 8)


def test_a_backward_without_its_w_is_whole():
    # DualPipeV mixes whole and split backwards: a B with no W on its stage is the whole
    # backward, so dropping stage 1's Ws leaves a valid schedule whose Bs there take t_b
    schedule = zb_h1(2, 2)
    schedule[1] = [a for a in schedule[1] if a.kind != "W"]
    validate_schedule(schedule, 2, 2)
    timeline = simulate(schedule, 1.0, 3.0, 1.0)
    assert {e.end - e.start for e in timeline.events if e.stage == 1 and e.action.kind == "B"} \
        == {3.0}
    assert {e.end - e.start for e in timeline.events if e.stage == 0 and e.action.kind == "B"} \
        == {2.0}


def test_overlapped_pair_must_be_two_single_actions():
    schedule = parse_schedule("0: F0 F1&B0 B1\n1: F0 B0 F1 B1")
    validate_schedule(schedule, 2, 2)
    with pytest.raises(ValueError, match="^stage 0: action B1 overlaps with the next, which "
                                         "must be a single action$"):
        validate_schedule({**schedule, 0: [*schedule[0][:-1], Action("B", 1, with_next=True)]},
                          2, 2)


def test_v_placement_deadlock_names_the_stage_of_the_chunk():
    # p = 2 in a V: stage 1 holds virtual stages 1 and 2; its chunk 1 (vs 2) forward needs
    # its own chunk 0 (vs 1) first
    schedule = parse_schedule("0: F0 F0.1 B0.1 B0\n1: F0.1 F0 B0 B0.1")
    with pytest.raises(ValueError, match="stage 1 at F0.1 waits for F0 on stage 1"):
        validate_schedule(schedule, 2, 1, 2, placement="v")


def test_duplicate_action_is_rejected():
    schedule = _replace(one_f_one_b(2, 2), 0, "F0 F1 B0 B1 B1")
    with pytest.raises(ValueError, match="stage 0: action B1 appears twice"):
        validate_schedule(schedule, 2, 2)


@pytest.mark.parametrize("bad", ["F2", "F0.1"])
def test_out_of_range_action_is_rejected(bad):
    schedule = _replace(one_f_one_b(2, 2), 0, f"F0 F1 B0 B1 {bad}")
    with pytest.raises(ValueError, match=f"stage 0: action {bad} is out of range"):
        validate_schedule(schedule, 2, 2)


def test_cross_stage_deadlock_is_rejected():
    schedule = parse_schedule("0: F0 B0 F1 B1\n1: F1 B1 F0 B0")
    with pytest.raises(ValueError, match="deadlocks: stage 0 at B0 waits for B0 on stage 1"):
        validate_schedule(schedule, 2, 2)


def test_interleaved_chunk_order_deadlock_is_rejected():
    # Stage 0 runs chunk 1's forward of micro-batch 0 before chunk 0's: chunk 1 (virtual stage 2)
    # needs stage 1's chunk 0, which needs stage 0's chunk 0.
    schedule = make_schedule("interleaved", 2, 2, 2)
    schedule[0] = [Action("F", 0, 1), *[a for a in schedule[0] if a != Action("F", 0, 1)]]
    with pytest.raises(ValueError, match="stage 0 at F0.1 waits for F0 on stage 1"):
        validate_schedule(schedule, 2, 2, 2)


def test_wrong_number_of_stages_is_rejected():
    with pytest.raises(ValueError, match="2 stages, expected p=3"):
        validate_schedule(one_f_one_b(2, 2), 3, 2)
