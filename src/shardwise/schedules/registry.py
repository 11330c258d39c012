"""The schedule registry: everything the project knows about each pipeline schedule, in one place.

Adding a schedule means: a generator in `schedules/generators.py` and one `ScheduleInfo` here.
Everything else — `Layout` validation, the CLI choices, the planner's grid, the bubble and
in-flight formulas of the step and memory models, the simulator's B/W split, the exports'
names — reads this table.

Each rule is written once and is array-generic: `p, m, v, stage` and the times may be Python
numbers or NumPy arrays (the planner evaluates millions of layouts at once), and
`select(codes, rule)` picks each layout's schedule's rule by its integer `code`.

Names in the frameworks (checked against their sources):

* Megatron-LM: interleaving is `--num-layers-per-virtual-pipeline-stage` (1F1B otherwise);
  it has no GPipe and no ZB-H1 in mainline (Qi et al.'s fork has it).
* torchtitan / torch.distributed.pipelining: `PipelineScheduleSingle` classes `GPipe`,
  `1F1B`; multi-stage `Interleaved1F1B`, `InterleavedZeroBubble` (the ZB-H1 family needs more
  than one stage per rank there).
* DeepSpeed's pipeline engine runs 1F1B only (`deepspeed.runtime.pipe.schedule.TrainSchedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import Schedule, check_dimensions
from shardwise.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b, zb_h1

__all__ = ["DEFAULT_SCHEDULE", "SCHEDULES", "SCHEDULE_CODES", "SCHEDULE_REGISTRY",
           "SEARCHED_SCHEDULES", "ScheduleInfo", "get_schedule", "make_schedule", "select"]


def _ideal_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """GPipe, 1F1B: `(p-1)·(t_f+t_b)` (Huang et al. 2019; Narayanan et al. 2021)."""
    return (p - 1) * (t_f + t_b)


def _interleaved_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """Interleaved 1F1B: `(p-1)·(t_f+t_b)/v` (Narayanan et al. 2021, §2.2)."""
    return (p - 1) * (t_f + t_b) / v


def _zb_h1_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """ZB-H1 (Qi et al. 2023), `t_b` the whole backward, `t_w` its weight-gradient part, so the
    input-gradient pass is `B = t_b - t_w`: `max((p-1)·(t_f + B - t_w), (p-1)·(t_f + B) -
    (m-1)·t_w)` — the paper's `(p-1)(T_F+T_B-T_W)` once `m ≥ p`; with fewer micro-batches there
    are too few deferred W to fill the drain."""
    back = t_b - t_w
    zb = np.maximum((p - 1) * (t_f + back - t_w), (p - 1) * (t_f + back) - (m - 1) * t_w)
    return np.maximum(zb, 0.0)


def _all_in_flight(p: Any, m: Any, v: Any, stage: Any) -> Any:
    """GPipe: every stage holds all `m` micro-batches at the turn."""
    return m + 0 * p


def _one_f_one_b_in_flight(p: Any, m: Any, v: Any, stage: Any) -> Any:
    """1F1B and ZB-H1: stage `i` holds `min(p - i, m)` (Narayanan et al. 2021; Qi et al. 2023
    keep 1F1B's memory)."""
    return np.minimum(p - stage, m)


def _interleaved_in_flight(p: Any, m: Any, v: Any, stage: Any) -> Any:
    """Interleaved 1F1B: Megatron's warm-up `(p-i-1)·2 + (v-1)·p` chunks plus one, at most
    `m·v`; stage 0 then holds `L·(1 + (p-1)/(p·v))` layers' worth (Korthikanti et al. 2022)."""
    return np.minimum((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)


@dataclass(frozen=True)
class ScheduleInfo:
    """One pipeline schedule and its traits.

    * `code`: the integer the vectorised planner and step model use for it;
    * `generator(p, m, v)`: its action lists (`schedules.generators`);
    * `chunked`: takes `v ≥ 2` virtual chunks per stage (else exactly one);
    * `splits_backward`: backward is split into B (input gradient) and W (weight gradient),
      so the simulator needs `t_w` (Qi et al. 2023);
    * `bubble(p, v, m, t_f, t_b, t_w)`: idle time of the critical stage per step;
    * `in_flight(p, m, v, stage)`: micro-batches (interleaved: micro-batch-chunks) whose
      activations stage `stage` holds at its peak;
    * `loss_waits`: the last stage keeps all `m` micro-batches' logits and final-norm inputs
      until backward starts (GPipe), instead of one;
    * `searched`: the planner's default grid includes it (GPipe does not: 1F1B has its bubble
      with less memory);
    * `trainable`: the runtime's training executor runs it (ZB-H1 needs the stages to split
      their backward, which the Transformer stages do not);
    * `megatron`, `torchtitan`, `deepspeed`: how each framework selects it (None: it has no
      such schedule).
    """

    name: str
    code: int
    generator: Callable[[int, int, int], Schedule]
    title: str
    source: str
    chunked: bool
    splits_backward: bool
    bubble: Callable[..., Any]
    in_flight: Callable[..., Any]
    loss_waits: bool = False
    trainable: bool = True
    searched: bool = True
    megatron: str | None = None
    torchtitan: str | None = None
    deepspeed: str | None = None


_REGISTRY: tuple[ScheduleInfo, ...] = (
    ScheduleInfo("gpipe", 0, lambda p, m, v: gpipe(p, m), "GPipe", "Huang et al. 2019",
                 chunked=False, splits_backward=False, bubble=_ideal_bubble,
                 in_flight=_all_in_flight, loss_waits=True, searched=False, torchtitan="GPipe"),
    ScheduleInfo("1f1b", 1, lambda p, m, v: one_f_one_b(p, m), "1F1B",
                 "Narayanan et al. 2021 (PipeDream-Flush)", chunked=False,
                 splits_backward=False, bubble=_ideal_bubble,
                 in_flight=_one_f_one_b_in_flight, megatron="default (no flag)",
                 torchtitan="1F1B",
                 deepspeed="TrainSchedule"),
    ScheduleInfo("interleaved", 2, interleaved_1f1b, "interleaved 1F1B",
                 "Narayanan et al. 2021, §2.2", chunked=True, splits_backward=False,
                 bubble=_interleaved_bubble, in_flight=_interleaved_in_flight,
                 megatron="--num-layers-per-virtual-pipeline-stage",
                 torchtitan="Interleaved1F1B"),
    ScheduleInfo("zb-h1", 3, lambda p, m, v: zb_h1(p, m), "ZB-H1",
                 "Qi et al. 2023, §2.1", chunked=False, splits_backward=True,
                 bubble=_zb_h1_bubble, in_flight=_one_f_one_b_in_flight, trainable=False,
                 torchtitan="InterleavedZeroBubble"),
)

SCHEDULE_REGISTRY: dict[str, ScheduleInfo] = {info.name: info for info in _REGISTRY}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_REGISTRY)
SCHEDULE_CODES: dict[str, int] = {info.name: info.code for info in _REGISTRY}
DEFAULT_SCHEDULE = "1f1b"  # `Layout`'s default, and what pp = 1 is said to run
SEARCHED_SCHEDULES: tuple[str, ...] = tuple(info.name for info in _REGISTRY if info.searched)
_BY_CODE: dict[int, ScheduleInfo] = {info.code: info for info in _REGISTRY}


def get_schedule(name: str | int) -> ScheduleInfo:
    """The registry entry for a schedule name (or planner code)."""
    info = (_BY_CODE.get(name) if isinstance(name, int) else
            SCHEDULE_REGISTRY.get(name) if isinstance(name, str) else None)
    if info is None:
        raise ShardwiseError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return info


def select(codes: Any, rule: Callable[[ScheduleInfo], Any],
           names: Sequence[str] = SCHEDULES) -> Any:
    """Each layout's value of `rule(its schedule)`, for an array (or scalar) of codes."""
    if np.ndim(codes) == 0:
        return rule(get_schedule(int(codes)))
    masks = [(codes == info.code, info) for info in map(SCHEDULE_REGISTRY.__getitem__, names)]
    present = [(mask, info) for mask, info in masks if mask.any()]  # evaluate only those used
    return np.select([mask for mask, _ in present], [rule(info) for _, info in present])


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` (one of `SCHEDULES`) for `p` stages, `m` micro-batches and `v`
    chunks per stage (`v > 1` only for chunked schedules: "interleaved")."""
    check_dimensions(p, m, v)
    validate.schedule_shape(p, m, v)  # capped before allocating
    info = get_schedule(name)
    if v != 1 and not info.chunked:
        chunked = ", ".join(s.name for s in _REGISTRY if s.chunked)
        raise ShardwiseError(f"{name} has one chunk per stage, got v={v}; use {chunked!r} for "
                             "v > 1")
    return info.generator(p, m, v)
