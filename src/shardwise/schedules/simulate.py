"""List-scheduling simulation of a pipeline schedule (SPEC §6).

An action starts at `max(stage free, each dependency's end + p2p latency across stages)`;
with `vs` an action's virtual stage: `F(j, vs)` needs `F(j, vs-1)`; `B(j, vs)` needs
`F(j, vs)` and `B(j, vs+1)`; `W(j, vs)` needs `B(j, vs)`. Bidirectional schedules (DualPipe)
run two chains of `p`; an overlapped pair starts when both inputs are in and ends after both.
F costs `t_f`, an unsplit B `t_b`, a split one `t_b - t_w` and its W `t_w` (per virtual
stage). Bubble `1 - busy / (p · makespan)`; peak in flight counts each micro-batch-chunk from
its F to its B (Qi et al. 2023, Table 1). docs/concepts/schedules.md#the-simulator-in-full.

`simulate` compiles the schedule (`schedule_graph`: which action each one waits for, in an order
that runs them after those; the action order's part, kept by callers that simulate a schedule
often) and evaluates that for the times (`simulate_graph`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from itertools import accumulate, chain
from operator import attrgetter, sub
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

_KIND, _MICRO_BATCH, _CHUNK = attrgetter("kind"), attrgetter("micro_batch"), attrgetter("chunk")
_KIND_CODES: dict[Kind, int] = {"F": 0, "B": 1, "W": 2}
_HOLD: dict[Kind, int] = {"F": 1, "B": -1, "W": 0}  # micro-batch-chunks alive, F until B

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


_new_event = partial(tuple.__new__, Event)  # `Event(*fields)`, built in C: twice as fast


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
        actions = schedule[stage]
        if until == "W":
            later = split_backwards(actions)
            change: Iterable[int] = (
                1 if a.kind == "F" else
                -(a.kind == ("W" if (a.micro_batch, a.chunk) in later else "B")) for a in actions)
        else:
            change = map(_HOLD.__getitem__, map(_KIND, actions))
        peaks.append(max(accumulate(change, initial=0)))  # highest after some F
    return tuple(peaks)


def split_backwards(actions: Sequence[Action]) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs whose backward this stage splits: those it runs a W of."""
    return {(a.micro_batch, a.chunk) for a in actions if a.kind == "W"}


Times = float | Sequence[float]  # one for every virtual stage, or one per virtual stage


def _per_vs(value: Times, name: str, count: int) -> list[float]:
    """`value` for each of the `count` virtual stages, each checked > 0."""
    if isinstance(value, (int, float)):
        times = [validate.positive(float(value), name)] * count
    elif len(value) != count:
        raise ShardwiseError(f"{name}: {len(value)} times given, one per virtual stage "
                             f"({count}) needed")
    else:
        times = list(value)
        for one in times:
            if not (type(one) is float and 0.0 < one < math.inf):  # else the full check
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


Step = tuple[int, int, int, int, int, int, int]
"""One step of `simulate_graph`, as slots: the event it writes; its cost and the cost it
subtracts (a split B's W, else 0.0); the ends it waits for: its predecessor's on its stage, two
more on its stage and one on another (plus p2p latency), or the slot of 0.0 (-inf for the one on
another stage) where there are fewer."""


@dataclass(frozen=True)
class ScheduleGraph:
    """A schedule compiled by `schedule_graph`; it depends on the action order only. `steps`
    come after those they wait for; `slots`: the events, two per overlapped pair, 0.0 and -inf.
    `refusal`: why the schedule cannot run (a deadlock, a bidirectional one not in two "v"
    chunks), raised by `simulate_graph` once the times are checked."""

    stages: int
    virtual_stages: int
    splits_backward: bool
    actions: tuple[Action, ...]  # stage by stage, each in its order: the events' order
    action_stages: tuple[int, ...]
    last_actions: tuple[int, ...]  # each stage's last action, stages with none left out
    steps: tuple[Step, ...]
    slots: int
    peak_in_flight: tuple[float, ...]
    refusal: str = ""


def schedule_graph(schedule: Mapping[int, Sequence[Action]], placement: Placement = "loop",
                   bidirectional: bool = False) -> ScheduleGraph:
    """Compile `schedule` for `simulate_graph` (arguments as `simulate`): the action each
    dependency waits for (the last of its group: an overlapped pair's outputs leave at its end;
    an action repeated on a stage, its first run), and the groups in the order list scheduling
    runs them, each stage in its order as far as its dependencies allow — those that never run
    are a deadlock (`refusal`). An overlapped pair `x&y` is four steps: one collecting y's
    waits, one those and x's, x after that and its predecessor, y after x."""
    p = num_stages(schedule)
    check_placement(placement)
    if not any(schedule.values()):
        raise ShardwiseError("the schedule has no actions")
    rows = [schedule[stage] for stage in range(p)]
    actions = tuple(chain.from_iterable(rows))
    n = len(actions)
    count = p * (1 + max(map(_CHUNK, actions)))
    offsets = [0, *accumulate(map(len, rows))]  # each stage's first action's index
    stages = tuple(stage for stage, row in enumerate(rows) for _ in row)
    graph = ScheduleGraph(p, count, any(a.kind == "W" for a in actions), actions, stages,
                          tuple(offsets[s + 1] - 1 for s in range(p) if rows[s]), (), 0, ())
    if bidirectional and (count != 2 * p or placement != "v"):
        return replace(graph, refusal="a bidirectional schedule runs two chunks per stage, "
                                      "one per direction, in the \"v\" placement")
    last, span = count - 1, (p if bidirectional else 0)
    # an action's rule, kind code × count + vs, and key, 3·count·micro_batch + rule: the key of
    # F(j, vs-1) is key - 1, of B(j, vs+1) key + 1, of F(j, vs) for B(j, vs) key - count
    rules = [_KIND_CODES[a.kind] * count + where[a.chunk]
             for stage, row in enumerate(rows)
             for where in ([virtual_stage(stage, c, p, placement) for c in range(count // p)],)
             for a in row]
    keys = [3 * count * a.micro_batch + rule for a, rule in zip(actions, rules)]
    pairs = _overlapped_pairs(actions, stages, offsets)
    closes = list(range(n))  # the last action of each action's group
    head_of = list(range(n))  # the first
    for head in pairs:
        closes[head], head_of[head + 1] = head + 1, head
    producer = dict(zip(reversed(keys), reversed(closes)))  # the first group, if repeated
    none, never = n + 2 * len(pairs), n + 2 * len(pairs) + 1  # the slots of 0.0 and -inf
    zero = 3 * count  # the cost slot of 0.0
    waits_of = _dependency_columns(placement, p, count, span)
    # per action its step, and what it waits for that its stage may not have run before it
    # (`needs`, by group: its first action; n: an action no stage runs)
    by_id: list[Step] = []  # then the pairs' extra steps
    needs: list[tuple[int, ...]] = []
    for index, (key, rule, stage) in enumerate(zip(keys, rules, stages)):
        waits = [none, none, never]
        need: tuple[int, ...] = ()
        for offset, column in waits_of[rule]:
            source = producer.get(key + offset)
            if source is None:
                need += (n,)
            else:
                waits[column] = source
                if column == 2 or source >= index:
                    need += (head_of[source],)
        less = (count + rule if count <= rule < 2 * count and key + count in producer
                else zero)  # a B whose W its stage runs subtracts the W's cost
        by_id.append((index, rule, less, index - 1 if index > offsets[stage] else none,
                      *waits))
        needs.append(need)
    runs: dict[int, tuple[int, ...]] = {}  # each pair's steps, by its first action
    for extra, head in zip(range(n, none, 2), pairs):
        x, y = by_id[head], by_id[head + 1]
        by_id += [(extra, zero, zero, none, *y[4:]), (extra + 1, zero, zero, extra, *x[4:])]
        by_id[head] = (head, x[1], x[2], x[3], extra + 1, none, never)
        by_id[head + 1] = (head + 1, y[1], y[2], head, none, none, never)
        needs[head] += needs[head + 1]
        runs[head] = (extra, extra + 1, head, head + 1)
    seconds = {head + 1 for head in pairs}
    stage_heads = [[i for i in range(offsets[s], offsets[s + 1]) if i not in seconds]
                   for s in range(p)]
    order, ran = _list_order(stage_heads, needs)
    if len(order) < n - len(pairs):
        progress = [(mine[g] if g < len(mine) else offsets[s + 1]) - offsets[s]
                    for s, (mine, g) in enumerate(zip(stage_heads, ran))]  # actions run
        return replace(graph, refusal=_deadlock_message(schedule, progress, p, last,
                                                        placement, span))
    if runs:
        order = [k for head in order for k in runs.get(head, (head,))]
    chunks = 1 if bidirectional else count // p  # chunks per micro-batch on a stage
    return replace(graph, steps=tuple(map(by_id.__getitem__, order)), slots=never + 1,
                   peak_in_flight=tuple(x / chunks for x in peak_in_flight(schedule)))


def _overlapped_pairs(actions: Sequence[Action], stages: Sequence[int],
                      offsets: Sequence[int]) -> list[int]:
    """The first actions of the overlapped pairs: one `with_next`, not itself the second of
    a pair, with a next one on its stage."""
    pairs: list[int] = []
    for index in (i for i, action in enumerate(actions) if action.with_next):
        if (not pairs or index != pairs[-1] + 1) and index + 1 < offsets[stages[index] + 1]:
            pairs.append(index)
    return pairs


@lru_cache(maxsize=64)
def _dependency_columns(placement: Placement, p: int, count: int, span: int
                        ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rule (kind code × `count` + virtual stage), its dependencies (`_dependencies`) as
    (key offset, `Step` wait column: 0 and 1 on the action's stage, 2 on another)."""
    rules = []
    for kind, code in _KIND_CODES.items():
        for vs in range(count):
            columns: list[tuple[int, int]] = []
            for dep_kind, _, dep_vs in _dependencies(kind, 0, vs, count - 1, span):
                far = stage_of(dep_vs, p, placement) != stage_of(vs, p, placement)
                columns.append(((_KIND_CODES[dep_kind] - code) * count + dep_vs - vs,
                                2 if far else sum(c < 2 for _, c in columns)))
            rules.append(tuple(columns))
    return tuple(rules)


def _list_order(stage_heads: list[list[int]], needs: Sequence[tuple[int, ...]]
                ) -> tuple[list[int], list[int]]:
    """List scheduling's order of the groups, each named by its first action: each stage runs
    its groups (`stage_heads`) in turn until one `needs` a group not run yet (`len(needs)`:
    one no stage runs), and resumes once that one has run. Also the groups each stage ran."""
    order: list[int] = []
    finished = [False] * (len(needs) + 1)
    ran = [0] * len(stage_heads)
    sleeping: dict[int, list[int]] = {}  # a group -> the stages waiting for it
    ready = list(range(len(stage_heads)))
    while ready:
        stage = ready.pop()
        heads, g = stage_heads[stage], ran[stage]
        while g < len(heads):
            head = heads[g]
            for wait in needs[head]:
                if not finished[wait]:
                    sleeping.setdefault(wait, []).append(stage)
                    break
            else:
                order.append(head)
                finished[head] = True
                if head in sleeping:
                    ready += sleeping.pop(head)
                g += 1
                continue
            break
        ran[stage] = g
    return order, ran


def simulate_graph(graph: ScheduleGraph, t_f: Times, t_b: Times, t_w: Times | None = None,
                   p2p_latency: float = 0.0) -> Timeline:
    """`simulate` a compiled schedule: each step starts at the latest end of those it waits
    for (+ `p2p_latency` from another stage)."""
    count = graph.virtual_stages
    forward, backward = _per_vs(t_f, "t_f", count), _per_vs(t_b, "t_b", count)
    weight = _weight_times(t_w, backward, count) if graph.splits_backward else [0.0] * count
    validate.finite(p2p_latency, "p2p_latency", low=0)
    if graph.refusal:
        raise ShardwiseError(graph.refusal)
    costs = [*forward, *backward, *weight, 0.0]  # the slots of `Step`
    starts, ends = [0.0] * graph.slots, [0.0] * graph.slots
    ends[-1] = -math.inf
    for index, slot, less, previous, near, also, far in graph.steps:
        start = ends[previous]
        if ends[near] > start:
            start = ends[near]
        if ends[also] > start:
            start = ends[also]
        arrival = ends[far] + p2p_latency
        if arrival > start:
            start = arrival
        starts[index] = start
        ends[index] = start + costs[slot] - costs[less]
    makespan = max(ends[index] for index in graph.last_actions)
    busy = sum(map(sub, ends[:len(graph.actions)], starts))
    events = map(_new_event, zip(graph.action_stages, graph.actions, starts, ends))
    return Timeline(graph.stages, tuple(events), makespan, 1 - busy / (graph.stages * makespan),
                    graph.peak_in_flight)


def simulate(schedule: Mapping[int, Sequence[Action]], t_f: Times, t_b: Times,
             t_w: Times | None = None, p2p_latency: float = 0.0,
             placement: Placement = "loop", bidirectional: bool = False) -> Timeline:
    """Simulate `schedule` with per-action times: `t_f` a forward, `t_b` a whole backward and
    `t_w` its weight-gradient part (needed when the schedule has Ws), of one virtual stage —
    one number for all, or a sequence indexed by virtual stage (uneven stages). `placement`
    maps chunks to virtual stages ("loop" or "v", `actions.virtual_stage`); `bidirectional`:
    two chunks, one pipeline of `p` virtual stages each (DualPipe, see above).

    `schedule_graph` then `simulate_graph`, O(actions) each; the graph depends on the action
    order only, so a caller simulating one schedule often keeps it (`registry.stage_timeline`).
    Raises `ShardwiseError` naming the stuck actions if the schedule deadlocks; other defects (a
    duplicate action, a W before its B) are `validate_schedule`'s to find, once per schedule.
    """
    return simulate_graph(schedule_graph(schedule, placement, bidirectional), t_f, t_b, t_w,
                          p2p_latency)


def _group(actions: Sequence[Action], index: int) -> list[Action]:
    """The action at `index` and, if it runs overlapped with the next, that one too."""
    if actions[index].with_next and index + 1 < len(actions):
        return [actions[index], actions[index + 1]]
    return [actions[index]]


def _deadlock_message(schedule: Mapping[int, Sequence[Action]], progress: Sequence[int],
                      p: int, last: int, placement: Placement, span: int = 0) -> str:
    """`progress`: the actions each stage ran before it got stuck."""
    def key(stage: int, a: Action) -> _Key:
        return a.kind, a.micro_batch, virtual_stage(stage, a.chunk, p, placement)

    scheduled = {key(s, a) for s, actions in schedule.items() for a in actions}
    done = {key(s, a) for s in range(p) for a in schedule[s][:progress[s]]}
    stuck = []
    for stage in range(p):
        if progress[stage] == len(schedule[stage]):
            continue
        for action in _group(schedule[stage], progress[stage]):
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
