"""Pipeline schedules as data: generate, validate, simulate and draw them (SPEC §6).

    >>> from shardwise.schedules import make_schedule, simulate
    >>> timeline = simulate(make_schedule("1f1b", p=4, m=8), t_f=1.0, t_b=1.0)
    >>> timeline.makespan, round(timeline.bubble_fraction, 4), timeline.peak_in_flight
    (22.0, 0.2727, (4, 3, 2, 1))
"""

from shardwise.schedules.actions import (
    Action,
    Schedule,
    check_dimensions,
    num_stages,
    parse_schedule,
    schedule_text,
)
from shardwise.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from shardwise.schedules.metrics import (
    bubble_fraction,
    bubble_over_ideal,
    microbatches_for_bubble,
    partition_layers,
)
from shardwise.schedules.registry import (
    SCHEDULE_REGISTRY,
    SCHEDULES,
    ScheduleInfo,
    get_schedule,
    make_schedule,
)
from shardwise.schedules.render import render_ascii, render_svg
from shardwise.schedules.simulate import Event, Timeline, peak_in_flight, simulate
from shardwise.schedules.validate import validate_schedule

__all__ = [
    "SCHEDULES",
    "SCHEDULE_REGISTRY",
    "Action",
    "Event",
    "Schedule",
    "ScheduleInfo",
    "Timeline",
    "bubble_fraction",
    "bubble_over_ideal",
    "check_dimensions",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "microbatches_for_bubble",
    "num_stages",
    "one_f_one_b",
    "parse_schedule",
    "partition_layers",
    "peak_in_flight",
    "render_ascii",
    "render_svg",
    "schedule_text",
    "simulate",
    "validate_schedule",
    "zb_h1",
]
