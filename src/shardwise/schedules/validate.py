"""Check a schedule once before it drives the simulator or the pipeline executor (SPEC §6)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import Action, Kind, Placement, check_dimensions, num_stages
from shardwise.schedules.simulate import simulate, split_backwards

_BEFORE: dict[Kind, Kind] = {"B": "F", "W": "B"}
"""Each kind and the kind that must precede it on the same stage."""


def validate_schedule(schedule: Mapping[int, Sequence[Action]], p: int, m: int,
                      v: int = 1, placement: Placement = "loop",
                      bidirectional: bool = False) -> None:
    """Raise `ShardwiseError` naming the offending action unless `schedule` is a complete,
    deadlock-free schedule of `p` stages, `m` micro-batches and `v` chunks per stage:

    * its stages are `0 … p-1`; every action has micro-batch `< m` and chunk `< v`;
    * every stage runs one F and one B of each (micro-batch, chunk), in that order, and at most
      one W after the B (a B with no W is the whole backward);
    * an overlapped pair (`with_next`) is two actions, not the stage's last;
    * under the dependencies of `simulate` (with `placement`), no stage waits forever.

    `bidirectional` (DualPipe): `m/2` micro-batches per direction, numbered `0 … m/2-1` within
    each chunk (`simulate`), so the checks above run with `m/2`; `m` must be even.
    """
    check_dimensions(p, m, v)
    if (stages := num_stages(schedule)) != p:
        raise ShardwiseError(f"schedule has {stages} stages, expected p={p}")
    if bidirectional and (m % 2 or v != 2):
        raise ShardwiseError(f"a bidirectional schedule needs an even m and v=2, got m={m}, "
                             f"v={v}")
    for stage in range(p):
        _check_stage(stage, schedule[stage], m // 2 if bidirectional else m, v)
    simulate(schedule, 1.0, 2.0, 1.0, placement=placement, bidirectional=bidirectional)


def _check_stage(stage: int, actions: Sequence[Action], m: int, v: int) -> None:
    position: dict[Action, int] = {}
    for index, action in enumerate(actions):
        if action.micro_batch >= m or action.chunk >= v:
            raise ShardwiseError(f"stage {stage}: action {action} is out of range "
                             f"(m={m} micro-batches, v={v} chunks)")
        if action in position:
            raise ShardwiseError(f"stage {stage}: action {action} appears twice "
                             f"(positions {position[action]} and {index})")
        position[action] = index
        if action.with_next and (index + 1 == len(actions) or actions[index + 1].with_next):
            raise ShardwiseError(f"stage {stage}: action {action} overlaps with the next, which "
                                 "must be a single action")
    split = split_backwards(actions)
    for kind in ("F", "B", "W"):
        for j in range(m):
            for chunk in range(v):
                action = Action(kind, j, chunk)
                if kind == "W" and (j, chunk) not in split:
                    continue
                if action not in position:
                    raise ShardwiseError(f"stage {stage} is missing action {action}")
                if kind in _BEFORE:
                    before = Action(_BEFORE[kind], j, chunk)
                    if position[before] > position[action]:
                        raise ShardwiseError(f"stage {stage}: action {action} comes before {before}")
