"""Pipeline schedules as data: generate, validate, simulate and draw them (SPEC §6).

    >>> from shardwise.schedules import make_schedule, simulate
    >>> timeline = simulate(make_schedule("1f1b", p=4, m=8), t_f=1.0, t_b=1.0)
    >>> timeline.makespan, round(timeline.bubble_fraction, 4), timeline.peak_in_flight
    (22.0, 0.2727, (4.0, 3.0, 2.0, 1.0))

With per-stage times (a chunk takes `1/v`; a split backward is B = `t_b - t_w` plus W):

    >>> from shardwise.schedules import stage_timeline
    >>> stage_timeline("interleaved", 4, 8, 2, t_f=1.0, t_b=1.0).makespan
    19.0
"""

from shardwise.schedules.actions import (
    Action,
    Placement,
    Schedule,
    check_dimensions,
    num_stages,
    parse_schedule,
    schedule_text,
    stage_of,
    virtual_stage,
)
from shardwise.schedules.generators import (
    dualpipe,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zbv,
)
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
    stage_timeline,
)
from shardwise.schedules.render import render_ascii, render_svg
from shardwise.schedules.simulate import (
    Event,
    Timeline,
    peak_in_flight,
    simulate,
    split_backwards,
)
from shardwise.schedules.validate import validate_schedule

__all__ = [
    "SCHEDULES",
    "SCHEDULE_REGISTRY",
    "Action",
    "Event",
    "Placement",
    "Schedule",
    "ScheduleInfo",
    "Timeline",
    "bubble_fraction",
    "bubble_over_ideal",
    "check_dimensions",
    "dualpipe",
    "dualpipev",
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
    "split_backwards",
    "stage_of",
    "stage_timeline",
    "validate_schedule",
    "virtual_stage",
    "zb_h1",
    "zbv",
]
