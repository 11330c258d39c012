"""The schedule registry: everything the project knows about each pipeline schedule, in one place.

Adding a schedule: a generator in `schedules/generators.py` and one `ScheduleInfo` here; layout
validation, the CLI, the planner's grid, the bubble and in-flight rules of the step and memory
models, the simulator's placement and B/W split and the exports' names read this table. Times
are per stage (`t_f`, `t_b`, `t_w` over all its chunks; a chunk's action takes `1/v`). Rules
are array-generic; `select(codes, rule)` picks each layout's. Which framework runs which
schedule, with the files and versions read: docs/concepts/schedules.md#the-registry-in-full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import Placement, Schedule, check_dimensions
from shardwise.schedules.generators import (
    dualpipe,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zbv,
)
from shardwise.schedules.simulate import (
    ScheduleGraph,
    Timeline,
    schedule_graph,
    simulate_graph,
)

__all__ = ["DEFAULT_SCHEDULE", "SCHEDULES", "SCHEDULE_CODES", "SCHEDULE_REGISTRY",
           "SEARCHED_SCHEDULES", "ScheduleInfo", "get_schedule", "make_schedule", "select",
           "stage_timeline"]


def _ideal_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """GPipe, 1F1B: `(p-1)·(t_f+t_b)` (Huang et al. 2019; Narayanan et al. 2021)."""
    return (p - 1) * (t_f + t_b)


def _interleaved_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """Interleaved 1F1B: `(p-1)·(t_f+t_b)/v` (Narayanan et al. 2021, §2.2)."""
    return (p - 1) * (t_f + t_b) / v


def _zb_h1_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """ZB-H1 (Qi et al. 2023), `t_b` the whole backward and `t_w` its weight-gradient part, so
    B = `t_b - t_w` is the input gradient: the longest of three critical paths,

        max((p-1)(t_f + B) - min(m-1, p-1)·t_w,  max(p-m, 0)·t_f + (p-1)·B,
            (p-1)·t_f + [m < p]·B)

    — for `m ≥ p`, `(p-1)·max(t_f + B - t_w, B, t_f)`: the paper's `(p-1)(T_F + T_B - T_W)`
    when W is no longer than F and B; with fewer micro-batches there are too few deferred Ws
    to fill the drain (`docs/concepts/schedules.md`)."""
    back = t_b - t_w
    drain = (p - 1) * (t_f + back) - np.minimum(m - 1, p - 1) * t_w
    return np.maximum(drain, np.maximum(np.maximum(p - m, 0) * t_f + (p - 1) * back,
                                        (p - 1) * t_f + (m < p) * back))


def _chunk_times(t_f: Any, t_b: Any, t_w: Any) -> tuple[Any, Any, Any]:
    """A V schedule's chunk times (half a stage each): F, the input-gradient B, W."""
    return t_f / 2, (t_b - t_w) / 2, t_w / 2


def _zbv_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """ZBV for `m ≥ 2p-1` (`accepts`), in chunk times `f, b, w` (`_chunk_times`): the longest
    of its eight critical paths (`docs/concepts/schedules.md`),

        max(b + (p-2)w, (p-1)b, 2(p-1)(b-w), f + (p-2)w, (2p-3)f - (p-2)b,
            (2p-3)f + b - 2(p-1)w, 2(p-1)f - (p-1)b - w, 2(p-1)f - (2p-1)w);

    `(p-1)·f` when `f = b = w`: the last stage waits for the first forward and, at equal
    times, nothing else idles (Qi et al. 2023, §6)."""
    f, b, w = _chunk_times(t_f, t_b, t_w)
    paths = [b + (p - 2) * w, (p - 1) * b, 2 * (p - 1) * (b - w), f + (p - 2) * w,
             (2 * p - 3) * f - (p - 2) * b, (2 * p - 3) * f + b - 2 * (p - 1) * w,
             2 * (p - 1) * f - (p - 1) * b - w, 2 * (p - 1) * f - (2 * p - 1) * w]
    return np.where(p > 1, np.max(np.broadcast_arrays(*paths), axis=0), 0.0)  # p = 1: none


def _dualpipev_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """DualPipeV (`m ≥ 2p`), in chunk times `f, b, w` (`_chunk_times`), an overlapped F&B
    taking `f + b + w`: `(p-1)·max(b-w, 0) + max((p-2)f + (p-1)b, 2(p-1)f)`, the longest of
    its four critical paths (`docs/concepts/schedules.md`); `2(p-1)·f` when `f = b = w`."""
    return _dual_bubble(p, *_chunk_times(t_f, t_b, t_w))


def _dual_bubble(h: Any, f: Any, b: Any, w: Any) -> Any:
    """DualPipe's order on `h` half-ranks with chunk times `f`, input-gradient `b`, `w`."""
    return (h - 1) * np.maximum(b - w, 0.0) + np.maximum((h - 2) * f + (h - 1) * b,
                                                         2 * (h - 1) * f)


def _dualpipe_bubble(p: Any, v: Any, m: Any, t_f: Any, t_b: Any, t_w: Any) -> Any:
    """DualPipe (even `p`, even `m ≥ 2p`): DualPipeV's critical paths on `p/2` ranks, each
    chunk a whole stage (`f = t_f`, `b = t_b - t_w`, `w = t_w`). It equals the DeepSeek-V3
    report's `(p/2-1)(F&B + B - 3W)` (Table 2; F&B = `t_f + t_b` here, nothing hidden) when
    the forward takes as long as the input gradient, `t_f = t_b - t_w`; it is `t_f` shorter
    when the input gradient dominates (`docs/concepts/schedules.md`)."""
    return _dual_bubble(p / 2, t_f, t_b - t_w, t_w)


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


def _zbv_in_flight(p: Any, m: Any, v: Any, stage: Any) -> Any:
    """ZBV: before its first backward stage `i` has run `2p-i-1` forwards of chunk 0 and `i+1`
    of chunk 1 (each at most `m`), and holds that many from then on: `2p` chunks, `p`
    micro-batches' worth, on every stage once `m ≥ 2p-1` — 1F1B's stage-0 peak (Qi et al.
    2023, §6)."""
    return np.minimum(2 * p - stage - 1, m) + np.minimum(stage + 1, m)


def _dualpipev_in_flight(p: Any, m: Any, v: Any, stage: Any) -> Any:
    """DualPipeV (`m ≥ 2p`): `2p + 1` chunks on every stage — the "PP+1" activation per
    device of github.com/deepseek-ai/DualPipe's README (@3da1bbe), PP = 2p stages."""
    return 2 * p + 1 + 0 * stage


def _dualpipe_in_flight(p: Any, m: Any, v: Any, stage: Any) -> Any:
    """DualPipe (even `m ≥ 2p`): `p + 1` chunks on every rank, each a whole stage's layers of
    one direction — the report's "PP+1" activation per device (DeepSeek-V3 report, Table 2)."""
    return p + 1 + 0 * stage


def _any_microbatches(p: Any, m: Any) -> Any:
    return m >= 1


@dataclass(frozen=True)
class ScheduleInfo:
    """One pipeline schedule and its traits.

    * `code`: the integer the vectorised planner and step model use for it;
    * `generator(p, m, v)`: its action lists (`schedules.generators`);
    * `chunks`: chunks (virtual stages) per stage: 1, a fixed count (the V schedules: 2), or
      None for any `v ≥ 2` (interleaved); `default_chunks`, `chunked` and `chunk_problem`
      follow from it;
    * `placement`: which virtual stage each chunk runs ("loop" or "v", `actions.virtual_stage`);
    * `splits_backward`: some backwards are split into B (input gradient) and W (weight
      gradient), so the simulator needs `t_w` (Qi et al. 2023);
    * `bubble(p, v, m, t_f, t_b, t_w)`: idle time of the critical stage per step (per-stage
      times, `t_w` the weight-gradient part of `t_b`), for the `m` that `accepts` allows;
    * `in_flight(p, m, v, stage)`: micro-batch-chunks (a chunk is `1/v` of the stage's layers)
      whose activations stage `stage` holds at its peak;
    * `accepts(p, m)`: the micro-batch counts a layout may use with it, `microbatch_rule` in
      words: the generator's requirement, or where the bubble's closed form holds (ZBV);
    * `loss_waits`: the last stage keeps all `m` micro-batches' logits and final-norm inputs
      until backward starts (GPipe), instead of one;
    * `bidirectional`: two pipelines in opposite directions on the same ranks (DualPipe):
      chunk `d` runs direction `d`'s `m/2` micro-batches (numbered within it) in the "v"
      placement, each chunk a whole stage's layers, so a rank holds two stages' parameters
      and a chunk's action takes the stage's time, not `1/v` of it (`simulate`);
    * `searched`: the planner's default grid includes it (GPipe does not: 1F1B has its bubble
      with less memory);
    * `trainable`: the Transformer training runtime (`runtime.parallelize`) runs it — the V
      placement puts embedding and head on one rank, which its stage split does not do; the
      pipeline executor (`runtime.pipeline`) runs every schedule;
    * `megatron`, `torchtitan`, `deepspeed`, `neox`: how each framework selects it (None: it
      has no such schedule; `neox`: GPT-NeoX, whose DeeperSpeed has no ZB-H1);
    * `no_stack`: why no stack runs it, when none does (shown where a layout asks for it).
    """

    name: str
    code: int
    generator: Callable[[int, int, int], Schedule]
    title: str
    source: str
    splits_backward: bool
    bubble: Callable[..., Any]
    in_flight: Callable[..., Any]
    chunks: int | None = 1
    placement: Placement = "loop"
    accepts: Callable[[Any, Any], Any] = _any_microbatches
    microbatch_rule: str = ""
    loss_waits: bool = False
    bidirectional: bool = False
    trainable: bool = True
    searched: bool = True
    megatron: str | None = None
    torchtitan: str | None = None
    deepspeed: str | None = None
    neox: str | None = None
    no_stack: str = ""

    @property
    def chunked(self) -> bool:
        """More than one chunk per stage."""
        return self.chunks != 1

    @property
    def default_chunks(self) -> int:
        """The chunks per stage when none are asked for: its fixed count (1 for the one-chunk
        schedules), else 2."""
        return self.chunks or 2

    def chunk_options(self, candidates: Sequence[int]) -> list[int]:
        """The chunk counts the planner's grid tries: its own count, or those of `candidates`
        it runs with (interleaved: `v ≥ 2`)."""
        return [self.chunks] if self.chunks else [v for v in candidates if v >= 2]

    def chunk_problem(self, v: int) -> str | None:
        """Why `v` chunks per stage cannot run this schedule (None: they can)."""
        if self.chunks is None:
            return None if v >= 2 else f"the {self.name} schedule needs chunks ≥ 2"
        if v != self.chunks:
            count = "one chunk" if self.chunks == 1 else f"{self.chunks} chunks"
            return f"the {self.name} schedule runs {count} per stage, got chunks={v}"
        return None

    def last_stage(self, p: Any) -> Any:
        """The stage running the last virtual stage (head and loss): `p-1`, or 0 in the V
        of two chunks (`actions.stage_of`). Array-generic."""
        return 0 * p if self.placement == "v" else p - 1

    def microbatch_problem(self, p: int, m: int) -> str | None:
        """Why `m` micro-batches over `p` stages cannot run this schedule (None: they can)."""
        if not bool(self.accepts(p, m)):
            return f"{self.title} needs {self.microbatch_rule}: p={p}, m={m}"
        return None


_REGISTRY: tuple[ScheduleInfo, ...] = (
    ScheduleInfo("gpipe", 0, lambda p, m, v: gpipe(p, m), "GPipe", "Huang et al. 2019",
                 splits_backward=False, bubble=_ideal_bubble, in_flight=_all_in_flight,
                 loss_waits=True, searched=False, torchtitan="GPipe"),
    ScheduleInfo("1f1b", 1, lambda p, m, v: one_f_one_b(p, m), "1F1B",
                 "Narayanan et al. 2021 (PipeDream-Flush)", splits_backward=False,
                 bubble=_ideal_bubble, in_flight=_one_f_one_b_in_flight,
                 megatron="default (no flag)", torchtitan="1F1B", deepspeed="TrainSchedule",
                 neox="TrainSchedule (pipe_parallel_size ≥ 1)"),
    ScheduleInfo("interleaved", 2, interleaved_1f1b, "interleaved 1F1B",
                 "Narayanan et al. 2021, §2.2", splits_backward=False,
                 bubble=_interleaved_bubble, in_flight=_interleaved_in_flight, chunks=None,
                 accepts=lambda p, m: m % p == 0,
                 microbatch_rule="micro-batches divisible by pp (groups of p per chunk)",
                 megatron="--num-virtual-stages-per-pipeline-rank",
                 torchtitan="Interleaved1F1B"),
    ScheduleInfo("zb-h1", 3, lambda p, m, v: zb_h1(p, m), "ZB-H1",
                 "Qi et al. 2023, §2.1", splits_backward=True,
                 bubble=_zb_h1_bubble, in_flight=_one_f_one_b_in_flight,
                 deepspeed="--enable-zbh1-pipeline"),
    ScheduleInfo("zbv", 4, lambda p, m, v: zbv(p, m), "ZBV",
                 "Qi et al. 2023, §6 (ZB-V)", splits_backward=True,
                 bubble=_zbv_bubble, in_flight=_zbv_in_flight, chunks=2, placement="v",
                 accepts=lambda p, m: m >= 2 * p - 1,
                 microbatch_rule="at least 2·pp-1 micro-batches (fewer leave the V idle; its "
                                 "closed-form bubble holds from there)",
                 trainable=False, torchtitan="ZBVZeroBubble"),
    ScheduleInfo("dualpipev", 5, lambda p, m, v: dualpipev(p, m), "DualPipeV",
                 "DeepSeek-AI 2024 (DualPipe, DeepSeek-V3 §3.2.1), cut into a V by Sea AI Lab",
                 splits_backward=True,
                 bubble=_dualpipev_bubble, in_flight=_dualpipev_in_flight, chunks=2,
                 placement="v", accepts=lambda p, m: m >= 2 * p,
                 microbatch_rule="at least 2·pp micro-batches (two chunks per stage)",
                 trainable=False, torchtitan="DualPipeV"),
    ScheduleInfo("dualpipe", 6, lambda p, m, v: dualpipe(p, m), "DualPipe",
                 "DeepSeek-AI 2024 (DeepSeek-V3 §3.2.1, Fig. 5; github.com/deepseek-ai/DualPipe)",
                 splits_backward=True, bubble=_dualpipe_bubble, in_flight=_dualpipe_in_flight,
                 chunks=2, placement="v", bidirectional=True,
                 accepts=lambda p, m: (p % 2 == 0) & (m % 2 == 0) & (m >= 2 * p),
                 microbatch_rule="an even pp and an even number of micro-batches ≥ 2·pp "
                                 "(half from each end)",
                 trainable=False, searched=False,
                 no_stack="DualPipe is not run by any stack: torchtitan 0.3.0 (torch.distributed."
                          "pipelining 2.13) and DeepSpeed 0.19.8 ship only DualPipeV, megatron-core "
                          "0.16.1 neither, and shardwise's pipeline executor runs one direction; "
                          "simulate and draw it with `shardwise schedule --schedule dualpipe`"),
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


def make_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The schedule called `name` (one of `SCHEDULES`) for `p` stages, `m` micro-batches and `v`
    chunks per stage (default: the schedule's `default_chunks`)."""
    info = get_schedule(name)
    v = info.default_chunks if v is None else v
    check_dimensions(p, m, v)
    validate.schedule_shape(p, m, v)  # capped before allocating
    if (problem := info.chunk_problem(v)) is not None:
        chunked = ", ".join(s.name for s in _REGISTRY if s.chunks is None)
        raise ShardwiseError(problem + (f"; use {chunked!r} for v > 1" if v > 1 else ""))
    return info.generator(p, m, v)


_CACHED_CELLS = 4096  # the largest p·m·v whose compiled schedule is kept (≲ 3.5 MB each)


@lru_cache(maxsize=64, typed=True)  # typed: True is not 1 (`make_schedule` refuses a bool)
def _graph(name: str, p: int, m: int, v: int) -> ScheduleGraph:
    """`make_schedule(name, p, m, v)` compiled: the same for the same arguments, immutable,
    and holding no reference to the generated lists, so callers share it."""
    info = get_schedule(name)
    return schedule_graph(make_schedule(name, p, m, v), info.placement, info.bidirectional)


def stage_timeline(name: str, p: int, m: int, v: int | None = None, *, t_f: float = 1.0,
                   t_b: float = 1.0, t_w: float | None = None, p2p_latency: float = 0.0,
                   shares: Sequence[float] = ()) -> Timeline:
    """Generate schedule `name` and simulate it with per-stage times: `t_f`, `t_b` a stage's
    forward and whole backward of one micro-batch over all its `v` chunks, `t_w` the weight-
    gradient part of `t_b` where the schedule splits it (default `t_b/2`; ignored otherwise).

    Each of the `p·v` virtual stages takes its share of its stage's time: `shares[vs]`
    (uneven stages), else `1/v` — so interleaved chunks take `t/v` and every schedule does
    `m·(t_f + t_b)` of work per stage. The one function behind `shardwise schedule`,
    `/api/schedule`, the Learn grid and the step model's simulated bubble. The schedules of the
    last 64 `(name, p, m, v)` with `p·m·v ≤ 4096` are kept compiled (`schedule_graph`)."""
    info = get_schedule(name)
    v = info.default_chunks if v is None else v
    check_dimensions(p, m, v)  # integers, so the cache can hash them
    graph = (_graph if p * m * v <= _CACHED_CELLS else _graph.__wrapped__)(info.name, p, m, v)
    chunks = graph.virtual_stages // p
    for value, label in ((t_f, "t_f"), (t_b, "t_b")):
        validate.positive(value, label)
    if info.splits_backward:
        t_w = t_b / 2 if t_w is None else t_w
        validate.positive(t_w, "t_w")
        if t_w >= t_b:
            raise ShardwiseError(f"t_w ({t_w:g}) must be less than t_b ({t_b:g}): it is the "
                                 "weight-gradient part of the backward")
    share = list(shares) or [1.0 if info.bidirectional else 1 / chunks] * (p * chunks)
    if len(share) != p * chunks:
        raise ShardwiseError(f"{len(share)} shares given, one per virtual stage "
                             f"({p * chunks}) needed")
    return simulate_graph(graph, [t_f * s for s in share], [t_b * s for s in share],
                          [t_w * s for s in share] if info.splits_backward and t_w else None,
                          p2p_latency)
