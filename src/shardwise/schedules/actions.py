"""Pipeline actions and schedules as plain data (SPEC §6).

A schedule is `dict[stage, list[Action]]`: what each pipeline stage computes, in order. The
simulator and the pipeline executor consume the same lists.

An action is `(kind, micro_batch, chunk)`: `F` forward, `B` backward (input gradient; the whole
backward when the schedule has no `W`), `W` weight gradient (Qi et al. 2023). Chunk `c` of stage
`i` holds the model's virtual stage `c·p + i` (Megatron-LM's interleaving, Narayanan et al.
2021), so a forward pass visits stage 0 chunk 0, stage 1 chunk 0, …, stage p-1 chunk 0, stage 0
chunk 1, …

Text form: `<kind><micro-batch>[.<chunk>]` — `F2` is the forward of micro-batch 2 (through
chunk 0), `B2.1` the backward of micro-batch 2 through chunk 1 (`.0` may be written, and is
left out when printing). The kind comes first on purpose: torch.distributed.pipelining writes
`<stage><kind><micro-batch>`, so its `2F0` is stage 2's forward of micro-batch 0; a text
starting with a digit is refused with that explanation rather than read either way. One stage
per line in `schedule_text` (the labels of the `render_ascii` grid, which also writes `.0` when a
schedule has several chunks):

    0: F0 F1 B0 B1
    1: F0 B0 F1 B1
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shardwise.errors import ShardwiseError

Kind = Literal["F", "B", "W"]
KINDS: tuple[Kind, ...] = ("F", "B", "W")
_ACTION = re.compile(r"([FBW])(\d+)(?:\.(\d+))?")
_PIPELINING_ACTION = re.compile(r"\d+[FBW]\d+")  # torch.distributed.pipelining: stage, kind, mb


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
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str`: `"F2"` -> `Action("F", 2, 0)`, `"B2.1"` -> `Action("B", 2, 1)`."""
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            hint = (" (that is torch.distributed.pipelining's <stage><kind><micro-batch> form; "
                    "here the stage is the line, and an action is kind first)"
                    if _PIPELINING_ACTION.fullmatch(text.strip()) else "")
            raise ShardwiseError(f"cannot parse action {text!r}{hint}: expected "
                                 "<F|B|W><micro-batch>[.<chunk>], e.g. 'F2' or 'B2.1'")
        kind, micro_batch, chunk = match.groups()
        return cls(kind, int(micro_batch), int(chunk or 0))  # type: ignore[arg-type]


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
