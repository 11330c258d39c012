"""Bad inputs to the schedule closed forms, the action parser and the simulator name what is
wrong (one line each, checked word for word where the words are the contract), and a
deadlock names each stuck action with the virtual stage it waits for — in the V placement
(ZBV, DualPipeV: stage i runs virtual stages i and 2p-1-i, torch.distributed.pipelining's
`generate_stage_to_rank_mapping(style="v")`) and inside overlapped pairs."""

from __future__ import annotations

import re

import pytest

import shardwise.validate as validate
from shardwise.schedules.actions import Action, parse_schedule
from shardwise.schedules.metrics import (
    bubble_fraction,
    bubble_over_ideal,
    microbatches_for_bubble,
    partition_layers,
)
from shardwise.schedules.simulate import simulate


@pytest.mark.parametrize("form", [bubble_fraction, bubble_over_ideal])
@pytest.mark.parametrize(("args", "names"), [((0, 8, 1), "p (stages)"),
                                             ((4, 0, 1), "m (micro-batches)"),
                                             ((4, 8, 0), "v (chunks)")])
def test_closed_forms_name_the_bad_dimension(form, args, names):
    with pytest.raises(ValueError, match=rf"^{re.escape(names)} must be an integer ≥ 1, got 0$"):
        form(*args)


@pytest.mark.parametrize(("args", "names"), [((0, 0.1), "p (stages)"),
                                             ((4, 0.1, 0), "v (chunks)")])
def test_microbatches_for_bubble_names_the_bad_dimension(args, names):
    with pytest.raises(ValueError, match=rf"^{re.escape(names)} must be an integer ≥ 1, got 0$"):
        microbatches_for_bubble(*args)


def test_partition_layers_names_each_bad_argument():
    top = validate.MAX_DEGREE
    cases = [((0, 1), {}, "n_layers"), ((top + 1, 1), {}, "n_layers"),
             ((8, 4), {"first_stage_extra": -1}, "first_stage_extra"),
             ((8, 4), {"last_stage_extra": float("nan")}, "last_stage_extra"),
             ((3, 4), {}, "need at least one layer per stage: n_layers=3, n_stages=4")]
    for args, kwargs, says in cases:
        with pytest.raises(ValueError) as info:
            partition_layers(*args, **kwargs)
        assert str(info.value).startswith(says), str(info.value)
    assert partition_layers(1, 1) == [[0]]  # the smallest valid input


def test_the_parser_explains_torchs_stage_first_form_and_overlaps():
    with pytest.raises(ValueError) as info:
        Action.parse("2F0")
    assert str(info.value) == (
        "cannot parse action '2F0' (that is torch.distributed.pipelining's "
        "<stage><kind><micro-batch> form; here the stage is the line, and an action is kind "
        "first): expected <F|B|W><micro-batch>[.<chunk>], e.g. 'F2' or 'B2.1'")
    with pytest.raises(ValueError) as info:
        Action.parse("X1")
    assert str(info.value) == ("cannot parse action 'X1': expected "
                               "<F|B|W><micro-batch>[.<chunk>], e.g. 'F2' or 'B2.1'")
    with pytest.raises(ValueError) as info:
        parse_schedule("0: F5&B2.1&W0")
    assert str(info.value) == "cannot parse 'F5&B2.1&W0': at most two actions overlap ('F5&B2.1')"
    # an overlapped pair keeps both actions' chunks
    assert parse_schedule("0: F5.1&B2 W2.1") == {0: [Action("F", 5, 1, with_next=True),
                                                      Action("B", 2, 0), Action("W", 2, 1)]}
    with pytest.raises(ValueError, match="^cannot parse action 'F0:'"):  # stage: the first ":"
        parse_schedule("0: F0: B0")


def test_a_v_deadlock_names_the_virtual_stages_it_waits_for():
    """p = 2 in the V: stage 0 runs virtual stages 0 and 3, stage 1 runs 1 and 2. Stage 0 opens
    with chunk 1's forward (virtual stage 3, needing virtual stage 2 = chunk 1 on stage 1),
    stage 1 with chunk 0's (virtual stage 1, needing virtual stage 0 on stage 0): each waits
    for the other. Looped, virtual stage 2 would be stage 0's."""
    schedule = parse_schedule("0: F0.1 F0 B0 B0.1\n1: F0 F0.1 B0.1 B0")
    with pytest.raises(ValueError) as info:
        simulate(schedule, 1.0, 1.0, placement="v")
    assert str(info.value) == ("schedule deadlocks: stage 0 at F0.1 waits for F0.1 on stage 1; "
                               "stage 1 at F0 waits for F0 on stage 0")


def test_a_deadlock_inside_an_overlapped_pair_names_its_stuck_half():
    """Stage 0's pair F1&B0: F1 could run, B0 waits for stage 1's B0; stage 1 waits for F1."""
    schedule = parse_schedule("0: F0 F1&B0 B1\n1: F1 F0 B0 B1")
    with pytest.raises(ValueError) as info:
        simulate(schedule, 1.0, 1.0)
    assert str(info.value) == ("schedule deadlocks: stage 0 at B0 waits for B0 on stage 1; "
                               "stage 1 at F1 waits for F1 on stage 0")


def test_a_deadlock_after_a_finished_stage_still_names_the_stuck_one():
    schedule = parse_schedule("0: F0\n1: F0 B0 B1")
    with pytest.raises(ValueError) as info:
        simulate(schedule, 1.0, 1.0)
    assert str(info.value) == "schedule deadlocks: stage 1 at B1 waits for F1 which no stage runs"


def test_simulator_and_stage_timeline_messages_name_what_is_wrong():
    """Each refusal as the one line users read (the same words a web 4xx carries)."""
    from shardwise.schedules.generators import zb_h1
    from shardwise.schedules.registry import stage_timeline

    cases = [
        (lambda: simulate({0: []}, 1.0, 1.0), "the schedule has no actions"),
        (lambda: simulate(zb_h1(2, 2), [1.0, 1.0, 1.0], 2.0, 1.0),
         "t_f: 3 times given, one per virtual stage (2) needed"),
        (lambda: simulate(zb_h1(2, 2), 1.0, 2.0, 1.0, p2p_latency=-1),
         "p2p_latency must be a finite number ≥ 0, got -1"),
        (lambda: stage_timeline("1f1b", 2, 4, t_f=1.0, t_b=-1.0),
         "t_b must be a finite number > 0, got -1.0"),
        (lambda: stage_timeline("zb-h1", 2, 4, t_f=1.0, t_b=2.0, t_w=3.0),
         "t_w (3) must be less than t_b (2): it is the weight-gradient part of the backward"),
        (lambda: stage_timeline("1f1b", 2, 4, shares=[1.0]),
         "1 shares given, one per virtual stage (2) needed"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


def test_stage_timeline_charges_the_p2p_latency_per_boundary():
    """1F1B, p = 2, m = 1, unit F and B: F0 on stage 0 (0–1), the hop (ℓ), F0 and B0 on stage
    1, the hop back, B0 on stage 0: makespan 4 + 2ℓ."""
    from shardwise.schedules.registry import stage_timeline

    for latency in (0.0, 0.25):
        timeline = stage_timeline("1f1b", 2, 1, t_f=1.0, t_b=1.0, p2p_latency=latency)
        assert timeline.makespan == pytest.approx(4 + 2 * latency)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (6, 12)])
def test_dualpipe_mirrors_its_overlapped_pairs(p, m):
    """DualPipe (DeepSeek-V3 report §3.2.1, Figure 5) is symmetric: rank i runs the other
    direction's stage p-1-i, so rank i and rank p-1-i overlap as many F&B pairs — the mirrored
    half keeps its pairs when the generator swaps the directions' chunks."""
    from shardwise.schedules.registry import make_schedule

    schedule = make_schedule("dualpipe", p, m)
    pairs = [sum(a.with_next for a in schedule[i]) for i in range(p)]
    assert all(pairs) and pairs == pairs[::-1]
