"""List-scheduling simulation of a pipeline schedule (SPEC §6).

An action starts at `max(stage free, each dependency's end + p2p latency across stages)`;
with `vs` an action's virtual stage: `F(j, vs)` needs `F(j, vs-1)`; `B(j, vs)` needs
`F(j, vs)` and `B(j, vs+1)`; `W(j, vs)` needs `B(j, vs)`. Bidirectional schedules (DualPipe)
run two chains of `p`; an overlapped pair starts when both inputs are in and ends after both.
F costs `t_f`, an unsplit B `t_b`, a split one `t_b - t_w` and its W `t_w` (per virtual
stage). Bubble `1 - busy / (p · makespan)`; peak in flight counts each micro-batch-chunk from
its F to its B (Qi et al. 2023, Table 1). docs/concepts/schedules.md#the-simulator-in-full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import shardwise.validate as validate
from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import (
    Action,
    Kind,
    Placement,
    check_placement,
    num_stages,
    stage_of,
    virtual_stage,
)

_Key = tuple[Kind, int, int]
"""(kind, micro-batch, virtual stage): an action's identity across the whole pipeline."""


class Event(NamedTuple):
    """One action as simulated: `stage` runs `action` from `start` to `end` (seconds).

    A named tuple rather than a frozen dataclass: the simulator makes one per action, and tuples
    are built several times faster.
    """

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated schedule: its events (stage by stage, in execution order) and figures.

    `peak_in_flight`: per stage, the most micro-batches' activations held at once — chunks
    alive (`peak_in_flight()`) over the chunks per stage `v`, so interleaved 1F1B's stage 0
    holds `p + (p-1)/v`, not `v·p + p - 1`."""

    stages: int
    events: tuple[Event, ...]
    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple[float, ...]


def peak_in_flight(schedule: Mapping[int, Sequence[Action]], until: str = "B"
                   ) -> tuple[int, ...]:
    """Per stage, the most micro-batch-chunks alive at once (from F until B), from the action
    order alone: GPipe `m` everywhere, 1F1B `min(p-i, m)` on stage `i`.

    `until="W"` counts a micro-batch-chunk until its weight gradient instead, what a split
    backward holds while (X, dY) pairs wait for W (one with no W releases at B either way)."""
    peaks = []
    for stage in range(num_stages(schedule)):
        later = split_backwards(schedule[stage]) if until == "W" else set()
        alive = peak = 0
        for action in schedule[stage]:
            if action.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif action.kind == ("W" if (action.micro_batch, action.chunk) in later else "B"):
                alive -= 1
        peaks.append(peak)
    return tuple(peaks)


def split_backwards(actions: Sequence[Action]) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs whose backward this stage splits: those it runs a W of."""
    return {(a.micro_batch, a.chunk) for a in actions if a.kind == "W"}


Times = float | Sequence[float]  # one for every virtual stage, or one per virtual stage


def _per_vs(value: Times, name: str, count: int) -> list[float]:
    """`value` for each of the `count` virtual stages, each checked > 0."""
    if not isinstance(value, (int, float)) and len(value) != count:
        raise ShardwiseError(f"{name}: {len(value)} times given, one per virtual stage "
                             f"({count}) needed")
    times = [float(value)] * count if isinstance(value, (int, float)) else list(value)
    for one in times:
        validate.positive(one, name)
    return times


def _weight_times(t_w: Times | None, backward: list[float], count: int) -> list[float]:
    if t_w is None:
        raise ShardwiseError("the schedule splits backward into B and W: pass t_w, the weight-"
                             "gradient part of the backward t_b")
    weight = _per_vs(t_w, "t_w", count)
    for vs, (back, part) in enumerate(zip(backward, weight)):
        if part >= back:
            raise ShardwiseError(f"t_w ({part:g}) must be less than t_b ({back:g}), the "
                                 f"whole backward it is part of (virtual stage {vs})")
    return weight


def _dependencies(kind: Kind, micro_batch: int, vs: int, last: int,
                  span: int = 0) -> tuple[_Key, ...]:
    """`span`: the virtual stages of one pipeline (`p` when bidirectional; 0: all of them)."""
    first = span and vs % span == 0
    final = vs == last or (span and vs % span == span - 1)
    if kind == "F":
        return (("F", micro_batch, vs - 1),) if vs > 0 and not first else ()
    if kind == "B":
        upstream = (("B", micro_batch, vs + 1),) if not final else ()
        return ("F", micro_batch, vs), *upstream
    return (("B", micro_batch, vs),)


def simulate(schedule: Mapping[int, Sequence[Action]], t_f: Times, t_b: Times,
             t_w: Times | None = None, p2p_latency: float = 0.0,
             placement: Placement = "loop", bidirectional: bool = False) -> Timeline:
    """Simulate `schedule` with per-action times: `t_f` a forward, `t_b` a whole backward and
    `t_w` its weight-gradient part (needed when the schedule has Ws), of one virtual stage —
    one number for all, or a sequence indexed by virtual stage (uneven stages). `placement`
    maps chunks to virtual stages ("loop" or "v", `actions.virtual_stage`); `bidirectional`:
    two chunks, one pipeline of `p` virtual stages each (DualPipe, see above).

    Runs in O(actions): a stage waiting on a dependency sleeps until that action ends. Raises
    `ShardwiseError` naming the stuck actions if the schedule deadlocks; other defects (a
    duplicate action, a W before its B) are `validate_schedule`'s to find, once per schedule.
    """
    p = num_stages(schedule)
    check_placement(placement)
    if not any(schedule.values()):
        raise ShardwiseError("the schedule has no actions")
    split = [split_backwards(schedule[stage]) for stage in range(p)]
    count = p * (1 + max(action.chunk for actions in schedule.values() for action in actions))
    forward, backward = _per_vs(t_f, "t_f", count), _per_vs(t_b, "t_b", count)
    weight = _weight_times(t_w, backward, count) if any(split) else [0.0] * count
    validate.finite(p2p_latency, "p2p_latency", low=0)

    last, span = count - 1, (p if bidirectional else 0)
    if bidirectional and (count != 2 * p or placement != "v"):
        raise ShardwiseError("a bidirectional schedule runs two chunks per stage, one per "
                             "direction, in the \"v\" placement")
    owner = [stage_of(vs, p, placement) for vs in range(count)]  # the stage of each vs
    chunk_vs = [[virtual_stage(stage, c, p, placement) for c in range(count // p)]
                for stage in range(p)]
    done: dict[_Key, float] = {}
    sleeping: dict[_Key, list[int]] = {}
    events: list[list[Event]] = [[] for _ in range(p)]
    ready = list(range(p))
    while ready:
        stage = ready.pop()
        actions, row, where = schedule[stage], events[stage], chunk_vs[stage]
        free = row[-1].end if row else 0.0
        while len(row) < len(actions):
            first = len(row)
            group = actions[first:first + 1 + actions[first].with_next]  # a pair: two
            start, blocked = free, None
            for action in group:  # a pair starts once both inputs are in
                for dep in _dependencies(action.kind, action.micro_batch, where[action.chunk],
                                         last, span):
                    end = done.get(dep)
                    if end is None:
                        blocked = dep
                        break
                    if owner[dep[2]] != stage:
                        end += p2p_latency
                    if end > start:
                        start = end
                if blocked is not None:
                    break
            if blocked is not None:
                sleeping.setdefault(blocked, []).append(stage)
                break
            for action in group:
                vs = where[action.chunk]
                if action.kind == "F":
                    free = start + forward[vs]
                elif action.kind == "W":
                    free = start + weight[vs]
                elif (action.micro_batch, action.chunk) in split[stage]:  # B, then its W
                    free = start + backward[vs] - weight[vs]
                else:  # the whole backward
                    free = start + backward[vs]
                row.append(Event(stage, action, start, free))
                start = free
            for action in group:  # a pair's outputs leave when both are done
                key = (action.kind, action.micro_batch, where[action.chunk])
                done[key] = free
                if key in sleeping:
                    ready.extend(sleeping.pop(key))
    if any(len(events[s]) < len(schedule[s]) for s in range(p)):
        raise ShardwiseError(_deadlock_message(schedule, events, p, last, placement, span))
    makespan = max(row[-1].end for row in events if row)
    busy = sum(e.end - e.start for row in events for e in row)
    chunks = 1 if bidirectional else count // p  # chunks per micro-batch on a stage
    return Timeline(p, tuple(e for row in events for e in row), makespan,
                    1 - busy / (p * makespan),
                    tuple(n / chunks for n in peak_in_flight(schedule)))


def _group(actions: Sequence[Action], index: int) -> list[Action]:
    """The action at `index` and, if it runs overlapped with the next, that one too."""
    if actions[index].with_next and index + 1 < len(actions):
        return [actions[index], actions[index + 1]]
    return [actions[index]]


def _deadlock_message(schedule: Mapping[int, Sequence[Action]], events: list[list[Event]],
                      p: int, last: int, placement: Placement, span: int = 0) -> str:
    def key(stage: int, a: Action) -> _Key:
        return a.kind, a.micro_batch, virtual_stage(stage, a.chunk, p, placement)

    scheduled = {key(s, a) for s, actions in schedule.items() for a in actions}
    done = {key(e.stage, e.action) for row in events for e in row}
    stuck = []
    for stage in range(p):
        if len(events[stage]) == len(schedule[stage]):
            continue
        for action in _group(schedule[stage], len(events[stage])):
            vs = virtual_stage(stage, action.chunk, p, placement)
            missing = [dep for dep in _dependencies(action.kind, action.micro_batch, vs, last,
                                                    span) if dep not in done]
            if missing:
                kind, j, dep_vs = missing[0]  # chunk c runs virtual stages c·p … c·p + p-1
                where = (f"on stage {stage_of(dep_vs, p, placement)}"
                         if missing[0] in scheduled else "which no stage runs")
                stuck.append(f"stage {stage} at {action} waits for "
                             f"{Action(kind, j, dep_vs // p)} {where}")
                break
    return "schedule deadlocks: " + "; ".join(stuck)
