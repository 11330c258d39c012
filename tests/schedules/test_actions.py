"""Action and schedule text forms."""

import pytest

from shardwise.schedules import Action, make_schedule, num_stages, parse_schedule, schedule_text


def test_action_text_is_kind_micro_batch_dot_chunk():
    assert str(Action("F", 2)) == "F2"
    assert str(Action("B", 13, 3)) == "B13.3"
    assert Action.parse("F2") == Action("F", 2, 0)
    assert Action.parse(" W7.1 ") == Action("W", 7, 1)
    assert Action.parse("B3.0") == Action("B", 3, 0)


def test_pipelining_form_is_refused_with_the_reason():
    # torch.distributed.pipelining's "2F0" is stage 2, forward, micro-batch 0
    with pytest.raises(ValueError, match="pipelining's <stage><kind><micro-batch> form"):
        Action.parse("2F0")


@pytest.mark.parametrize("text", ["2F0", "X2", "F", "F2.", "F-1", "F 2", "f2", ""])
def test_action_parse_rejects_malformed_text(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


@pytest.mark.parametrize(("kind", "micro_batch", "chunk"), [("X", 0, 0), ("F", -1, 0), ("B", 0, -2)])
def test_action_rejects_bad_fields(kind, micro_batch, chunk):
    with pytest.raises(ValueError):
        Action(kind, micro_batch, chunk)


def test_schedule_text_round_trips():
    schedule = make_schedule("interleaved", 2, 4, 2)
    text = schedule_text(schedule)
    assert text.splitlines()[0].startswith("0: F0 F1 F0.1 F1.1")
    assert parse_schedule(text) == schedule


def test_schedule_text_of_1f1b_p2_m2():
    assert schedule_text(make_schedule("1f1b", 2, 2)) == "0: F0 F1 B0 B1\n1: F0 B0 F1 B1"


@pytest.mark.parametrize("text", ["0 F0", "x: F0", "0: F0\n0: B0"])
def test_parse_schedule_rejects_bad_lines(text):
    with pytest.raises(ValueError, match="schedule"):
        parse_schedule(text)


@pytest.mark.parametrize("schedule", [{}, {1: []}, {0: [], 2: []}])
def test_num_stages_needs_stages_0_to_p_minus_1(schedule):
    with pytest.raises(ValueError, match="0 … p-1"):
        num_stages(schedule)
