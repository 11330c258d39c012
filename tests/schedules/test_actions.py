"""Action and schedule text forms."""

import pytest

from shardwise.schedules import Action, make_schedule, num_stages, parse_schedule, schedule_text


def test_action_text_is_micro_batch_kind_chunk():
    assert str(Action("F", 2)) == "2F0"
    assert str(Action("B", 13, 3)) == "13B3"
    assert Action.parse("2F0") == Action("F", 2, 0)
    assert Action.parse(" 7W1 ") == Action("W", 7, 1)


@pytest.mark.parametrize("text", ["F2", "2X0", "2F", "-1F0", "2 F0", ""])
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
    assert text.splitlines()[0].startswith("0: 0F0 1F0 0F1 1F1")
    assert parse_schedule(text) == schedule


def test_schedule_text_of_1f1b_p2_m2():
    assert schedule_text(make_schedule("1f1b", 2, 2)) == "0: 0F0 1F0 0B0 1B0\n1: 0F0 0B0 1F0 1B0"


@pytest.mark.parametrize("text", ["0 0F0", "x: 0F0", "0: 0F0\n0: 0B0"])
def test_parse_schedule_rejects_bad_lines(text):
    with pytest.raises(ValueError, match="schedule"):
        parse_schedule(text)


@pytest.mark.parametrize("schedule", [{}, {1: []}, {0: [], 2: []}])
def test_num_stages_needs_stages_0_to_p_minus_1(schedule):
    with pytest.raises(ValueError, match="0 … p-1"):
        num_stages(schedule)
