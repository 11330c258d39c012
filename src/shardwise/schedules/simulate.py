"""List-scheduling simulation of a pipeline schedule (SPEC §6).

Every stage runs its actions in order, one at a time; an action starts at
`max(stage free, each dependency's end + p2p latency if that dependency ran on another stage)`.
With `V = v·p` virtual stages and `vs = chunk·p + stage`, the dependencies of micro-batch `j` are

    F(j, vs)  needs  F(j, vs-1)                        (none for vs = 0)
    B(j, vs)  needs  F(j, vs) and B(j, vs+1)           (only F(j, vs) for vs = V-1)
    W(j, vs)  needs  B(j, vs)

Costs per action: F costs `t_f`. When the schedule has no W, B is the whole backward and costs
`t_b` (input and weight gradients). When it has Ws (zero-bubble schedules, Qi et al. 2023), B is
the input gradient only and costs `t_b`, W the weight gradient and costs `t_w`: split a full
backward `t_full` as `t_b + t_w = t_full` (about half each for a Transformer layer). For
interleaved schedules the times are per chunk (`1/v` of a stage's layers).

Bubble fraction `1 - busy / (p · makespan)`.

Peak in flight: per stage, the most micro-batch-chunks whose activations are alive at once, each
counted from its F until its B. In split schedules B frees most activations and a pending W keeps
only the linear layers' inputs (Qi et al. 2023, Table 1), so pending Ws are not counted; by this
count ZB-H1 has 1F1B's `[p, p-1, …, 1]`. (Counted until W, ZB-H1 holds `p` on every stage; the
largest, stage 0's, is the same either way.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import shardwise.validate as validate
from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import Action, Kind, num_stages

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
    """A simulated schedule: its events (stage by stage, in execution order) and figures."""

    stages: int
    events: tuple[Event, ...]
    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]


def peak_in_flight(schedule: Mapping[int, Sequence[Action]], until: str = "B"
                   ) -> tuple[int, ...]:
    """Per stage, the most micro-batch-chunks alive at once (from F until B), from the action
    order alone: GPipe `m` everywhere, 1F1B `min(p-i, m)` on stage `i`.

    `until="W"` counts a micro-batch until its weight gradient instead, what a split backward
    holds while (X, dY) pairs wait for W (schedules without W release at B either way)."""
    split = any(a.kind == "W" for actions in schedule.values() for a in actions)
    release = "W" if until == "W" and split else "B"
    peaks = []
    for stage in range(num_stages(schedule)):
        alive = peak = 0
        for action in schedule[stage]:
            if action.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif action.kind == release:
                alive -= 1
        peaks.append(peak)
    return tuple(peaks)


Times = float | Sequence[float]  # one per action kind, or one per virtual stage


def _costs(t_f: Times, t_b: Times, t_w: Times | None, split: bool,
           p2p_latency: float) -> dict[str, Times]:
    if split and t_w is None:
        raise ShardwiseError("the schedule splits backward into B and W: pass t_w (then t_b is the "
                         "input-gradient time alone)")
    w = t_w if split and t_w is not None else 0.0
    times = {"t_f": t_f, "t_b": t_b, **({"t_w": w} if split else {})}
    for name, value in times.items():
        for one in ([value] if isinstance(value, (int, float)) else value):
            validate.positive(one, name)
    validate.finite(p2p_latency, "p2p_latency", low=0)
    return {"F": t_f, "B": t_b, "W": w}


def _cost(value: Times, vs: int) -> float:
    """An action's time: one for every virtual stage, or virtual stage `vs`'s own."""
    return value if isinstance(value, (int, float)) else value[vs]


def _dependencies(kind: Kind, micro_batch: int, vs: int, last: int) -> tuple[_Key, ...]:
    if kind == "F":
        return (("F", micro_batch, vs - 1),) if vs > 0 else ()
    if kind == "B":
        upstream = (("B", micro_batch, vs + 1),) if vs < last else ()
        return ("F", micro_batch, vs), *upstream
    return (("B", micro_batch, vs),)


def simulate(schedule: Mapping[int, Sequence[Action]], t_f: Times, t_b: Times,
             t_w: Times | None = None, p2p_latency: float = 0.0) -> Timeline:
    """Simulate `schedule` with per-action times `t_f`, `t_b` (and `t_w` when it has Ws): one
    number for every virtual stage, or a sequence indexed by virtual stage `c·p + i`
    (uneven stages).

    Runs in O(actions): a stage waiting on a dependency sleeps until that action ends. Raises
    `ValueError` naming the stuck actions if the schedule deadlocks; other defects (a duplicate
    action, a missing W) are `validate_schedule`'s to find, once per schedule.
    """
    p = num_stages(schedule)
    if not any(schedule.values()):
        raise ShardwiseError("the schedule has no actions")
    split = any(action.kind == "W" for actions in schedule.values() for action in actions)
    cost = _costs(t_f, t_b, t_w, split, p2p_latency)
    last = p * (1 + max(action.chunk for actions in schedule.values() for action in actions)) - 1
    for kind, value in cost.items():
        if not isinstance(value, (int, float)) and len(value) != last + 1:
            raise ShardwiseError(f"{kind} times: {len(value)} given, one per virtual stage "
                                 f"({last + 1}) needed")
    done: dict[_Key, float] = {}
    sleeping: dict[_Key, list[int]] = {}
    events: list[list[Event]] = [[] for _ in range(p)]
    ready = list(range(p))
    while ready:
        stage = ready.pop()
        actions, row = schedule[stage], events[stage]
        free = row[-1].end if row else 0.0
        while len(row) < len(actions):
            action = actions[len(row)]
            vs = action.chunk * p + stage
            start, blocked = free, None
            for dep in _dependencies(action.kind, action.micro_batch, vs, last):
                end = done.get(dep)
                if end is None:
                    blocked = dep
                    break
                if dep[2] % p != stage:
                    end += p2p_latency
                if end > start:
                    start = end
            if blocked is not None:
                sleeping.setdefault(blocked, []).append(stage)
                break
            free = start + _cost(cost[action.kind], vs)
            row.append(Event(stage, action, start, free))
            key = (action.kind, action.micro_batch, vs)
            done[key] = free
            ready.extend(sleeping.pop(key, ()))
    if any(len(events[s]) < len(schedule[s]) for s in range(p)):
        raise ShardwiseError(_deadlock_message(schedule, events, p, last))
    makespan = max(row[-1].end for row in events if row)
    busy = sum(_cost(cost[action.kind], action.chunk * p + stage)
               for stage, actions in schedule.items() for action in actions)
    return Timeline(p, tuple(e for row in events for e in row), makespan,
                    1 - busy / (p * makespan), peak_in_flight(schedule))


def _deadlock_message(schedule: Mapping[int, Sequence[Action]], events: list[list[Event]],
                      p: int, last: int) -> str:
    scheduled: set[_Key] = {(a.kind, a.micro_batch, a.chunk * p + s)
                            for s, actions in schedule.items() for a in actions}
    done: set[_Key] = {(e.action.kind, e.action.micro_batch, e.action.chunk * p + e.stage)
                       for row in events for e in row}
    stuck = []
    for stage in range(p):
        if len(events[stage]) == len(schedule[stage]):
            continue
        action = schedule[stage][len(events[stage])]
        vs = action.chunk * p + stage
        for dep in _dependencies(action.kind, action.micro_batch, vs, last):
            if dep not in done:
                kind, j, dep_vs = dep
                where = f"on stage {dep_vs % p}" if dep in scheduled else "which no stage runs"
                stuck.append(f"stage {stage} at {action} waits for "
                             f"{Action(kind, j, dep_vs // p)} {where}")
                break
    return "schedule deadlocks: " + "; ".join(stuck)
