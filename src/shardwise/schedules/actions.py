"""Pipeline actions and schedules as plain data (SPEC §6).

A schedule is `dict[stage, list[Action]]`; the simulator and the pipeline executor consume the
same lists. An action is `(kind, micro_batch, chunk)`: `F`, `B` (input gradient when its `W`
runs apart, else the whole backward), `W` (Qi et al. 2023); `with_next` overlaps it with the
next (DualPipe's F&B). A chunk's virtual stage is the schedule's placement (`virtual_stage`):
"loop" (Megatron's interleaving: `c·p + i`) or "v" (ZBV, DualPipeV: stage `i` holds `i` and
`2p-1-i`). Text form: kind first, `F2`, `B2.1`, `F5&B2.1`; torch's `2F0` (stage first) is
refused with that explanation. docs/concepts/schedules.md#actions-in-full.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from shardwise.errors import ShardwiseError

Kind = Literal["F", "B", "W"]
KINDS: tuple[Kind, ...] = ("F", "B", "W")
Placement = Literal["loop", "v"]
PLACEMENTS: tuple[Placement, ...] = ("loop", "v")
_ACTION = re.compile(r"([FBW])(\d+)(?:\.(\d+))?")
_PIPELINING_ACTION = re.compile(r"\d+[FBW]\d+")  # torch.distributed.pipelining: stage, kind, mb


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work on one stage: `kind` of `micro_batch` through `chunk`.

    `with_next`: it runs overlapped with the stage's next action. How an action runs, not which
    action it is: equality and hashing ignore it."""

    kind: Kind
    micro_batch: int
    chunk: int = 0
    with_next: bool = field(default=False, compare=False)

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


def virtual_stage(stage: int, chunk: int, p: int, placement: Placement = "loop") -> int:
    """The virtual stage that `chunk` of `stage` runs: "loop" `c·p + i`; "v" `c·p + i` for even
    chunks and `(c+1)·p - 1 - i` for odd ones (`2p-1-i` for chunk 1)."""
    if placement == "v" and chunk % 2:
        return (chunk + 1) * p - 1 - stage
    return chunk * p + stage


def stage_of(vs: int, p: int, placement: Placement = "loop") -> int:
    """The stage that runs virtual stage `vs` (inverse of `virtual_stage`, for the stage)."""
    chunk, offset = divmod(vs, p)
    return p - 1 - offset if placement == "v" and chunk % 2 else offset


def check_placement(placement: str) -> None:
    """Refuse a stage placement that is not one of `PLACEMENTS`."""
    if placement not in PLACEMENTS:
        raise ShardwiseError(f"placement must be one of {', '.join(PLACEMENTS)}, got "
                             f"{placement!r}")


def num_stages(schedule: Mapping[int, Sequence[Action]]) -> int:
    """`p`, checking that the schedule's stages are exactly `0 … p-1`."""
    if not schedule or sorted(schedule) != list(range(len(schedule))):
        raise ShardwiseError(f"a schedule's stages must be 0 … p-1, got {sorted(schedule)}")
    return len(schedule)


def schedule_text(schedule: Mapping[int, Sequence[Action]]) -> str:
    """One line per stage, `"<stage>: <action> <action> …"`, stages in ascending order; an
    overlapped pair is one word, `F5&B2.1`."""
    return "\n".join(f"{stage}: " + "".join(f"{a}{'&' if a.with_next else ' '}"
                                            for a in schedule[stage]).rstrip()
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
        schedule[int(stage)] = [action for word in actions.split() for action in _parse_word(word)]
    return schedule


def _parse_word(word: str) -> list[Action]:
    """`F2` -> [F2]; an overlapped pair `F5&B2.1` -> [F5 (with_next), B2.1]."""
    first, sep, second = word.partition("&")
    if not sep:
        return [Action.parse(word)]
    if "&" in second:
        raise ShardwiseError(f"cannot parse {word!r}: at most two actions overlap ('F5&B2.1')")
    head = Action.parse(first)
    return [Action(head.kind, head.micro_batch, head.chunk, with_next=True), Action.parse(second)]
