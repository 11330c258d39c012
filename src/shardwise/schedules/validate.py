"""Check a schedule once before it drives the simulator or the pipeline executor (SPEC §6)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import KINDS, Action, Kind, check_dimensions, num_stages
from shardwise.schedules.simulate import simulate

_BEFORE: dict[Kind, Kind] = {"B": "F", "W": "B"}
"""Each kind and the kind that must precede it on the same stage."""


def validate_schedule(schedule: Mapping[int, Sequence[Action]], p: int, m: int,
                      v: int = 1) -> None:
    """Raise `ValueError` naming the offending action unless `schedule` is a complete,
    deadlock-free schedule of `p` stages, `m` micro-batches and `v` chunks per stage:

    * its stages are `0 … p-1`; every action has micro-batch `< m` and chunk `< v`;
    * every stage runs one F and one B of each (micro-batch, chunk), and one W of each too if the
      schedule has any W (zero-bubble), in the order F, B, W;
    * under the dependencies of `simulate`, no stage waits forever.
    """
    check_dimensions(p, m, v)
    if (stages := num_stages(schedule)) != p:
        raise ShardwiseError(f"schedule has {stages} stages, expected p={p}")
    split = any(a.kind == "W" for actions in schedule.values() for a in actions)
    kinds = KINDS if split else KINDS[:2]
    for stage in range(p):
        _check_stage(stage, schedule[stage], m, v, kinds)
    simulate(schedule, 1.0, 1.0, 1.0 if split else None)


def _check_stage(stage: int, actions: Sequence[Action], m: int, v: int,
                 kinds: tuple[Kind, ...]) -> None:
    position: dict[Action, int] = {}
    for index, action in enumerate(actions):
        if action.micro_batch >= m or action.chunk >= v:
            raise ShardwiseError(f"stage {stage}: action {action} is out of range "
                             f"(m={m} micro-batches, v={v} chunks)")
        if action in position:
            raise ShardwiseError(f"stage {stage}: action {action} appears twice "
                             f"(positions {position[action]} and {index})")
        position[action] = index
    for kind in kinds:
        for j in range(m):
            for chunk in range(v):
                action = Action(kind, j, chunk)
                if action not in position:
                    hint = " (the schedule has Ws, so every backward needs one)" * (kind == "W")
                    raise ShardwiseError(f"stage {stage} is missing action {action}{hint}")
                if kind in _BEFORE:
                    before = Action(_BEFORE[kind], j, chunk)
                    if position[before] > position[action]:
                        raise ShardwiseError(f"stage {stage}: action {action} comes before {before}")
