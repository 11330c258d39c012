"""Pipeline actions and schedules as plain data (SPEC §6).

A schedule is `dict[stage, list[Action]]`: what each pipeline stage computes, in order. The
simulator and the pipeline executor consume the same lists.

An action is `(kind, micro_batch, chunk)`: `F` forward, `B` backward (input gradient; the whole
backward when the schedule has no `W`), `W` weight gradient (Qi et al. 2023). Chunk `c` of stage
`i` holds the model's virtual stage `c·p + i` (Megatron-LM's interleaving, Narayanan et al.
2021), so a forward pass visits stage 0 chunk 0, stage 1 chunk 0, …, stage p-1 chunk 0, stage 0
chunk 1, …

Text form: `<micro-batch><kind><chunk>`, e.g. `2F0`; one stage per line in `schedule_text`:

    0: 0F0 1F0 0B0 1B0
    1: 0F0 0B0 1F0 1B0
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shardwise.errors import ShardwiseError

Kind = Literal["F", "B", "W"]
KINDS: tuple[Kind, ...] = ("F", "B", "W")
_ACTION = re.compile(r"(\d+)([FBW])(\d+)")


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work on one stage: `kind` of `micro_batch` through `chunk`."""

    kind: Kind
    micro_batch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ShardwiseError(f"action kind must be one of F, B, W, got {self.kind!r}")
        if self.micro_batch < 0 or self.chunk < 0:
            raise ShardwiseError(f"micro-batch and chunk must be ≥ 0, got {self.micro_batch}, "
                             f"{self.chunk}")

    def __str__(self) -> str:
        return f"{self.micro_batch}{self.kind}{self.chunk}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str`: `"2F0"` -> `Action("F", 2, 0)`."""
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            raise ShardwiseError(f"cannot parse action {text!r}: expected <micro-batch><F|B|W><chunk>, "
                             "e.g. '2F0'")
        micro_batch, kind, chunk = match.groups()
        return cls(kind, int(micro_batch), int(chunk))  # type: ignore[arg-type]


Schedule = dict[int, list[Action]]
"""Stage -> the actions it runs, in order."""


def check_dimensions(p: int, m: int, v: int = 1) -> None:
    """Raise `ValueError` unless `p` stages, `m` micro-batches and `v` chunks are integers ≥ 1."""
    for name, value in (("p (stages)", p), ("m (micro-batches)", m), ("v (chunks)", v)):
        if not isinstance(value, int) or value < 1:
            raise ShardwiseError(f"{name} must be an integer ≥ 1, got {value!r}")


def num_stages(schedule: Mapping[int, Sequence[Action]]) -> int:
    """`p`, checking that the schedule's stages are exactly `0 … p-1`."""
    if not schedule or sorted(schedule) != list(range(len(schedule))):
        raise ShardwiseError(f"a schedule's stages must be 0 … p-1, got {sorted(schedule)}")
    return len(schedule)


def schedule_text(schedule: Mapping[int, Sequence[Action]]) -> str:
    """One line per stage, `"<stage>: <action> <action> …"`, stages in ascending order."""
    return "\n".join(f"{stage}: {' '.join(map(str, schedule[stage]))}"
                     for stage in sorted(schedule))


def parse_schedule(text: str) -> Schedule:
    """Inverse of `schedule_text`."""
    schedule: Schedule = {}
    for line in filter(str.strip, text.splitlines()):
        stage, sep, actions = line.partition(":")
        if not sep or not stage.strip().isdigit():
            raise ShardwiseError(f"cannot parse schedule line {line!r}: expected '<stage>: <actions>'")
        if int(stage) in schedule:
            raise ShardwiseError(f"stage {int(stage)} appears twice in the schedule text")
        schedule[int(stage)] = [Action.parse(word) for word in actions.split()]
    return schedule
