"""Schedule generators: GPipe, 1F1B, interleaved 1F1B and ZB-H1 (SPEC §6).

Each returns a `Schedule` (`dict[stage, list[Action]]`) for `p` stages and `m` micro-batches.
With times per micro-batch per stage (per chunk for interleaved) and no p2p latency:

    schedule      makespan                   bubble fraction     peak in flight, stage i
    gpipe         (m+p-1)(t_f+t_b)           (p-1)/(m+p-1)       m
    1f1b          (m+p-1)(t_f+t_b)           (p-1)/(m+p-1)       min(p-i, m)
    interleaved   (v·m+p-1)(t_f+t_b)         (p-1)/(v·m+p-1)     stage 0: v·p+p-1 chunks [*]
    zb-h1         (3m+p-1)·t  [**]           (p-1)/(3m+p-1)      min(p-i, m)

[*] for `m ≥ 2p`. [**] with `t_f = t_b = t_w = t` (B and W split the backward) and
`m ≥ p`; 1F1B with the same work, a full backward of `2t`, takes `3(m+p-1)·t`.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise import validate
from shardwise.errors import ShardwiseError
from shardwise.layout import SCHEDULES
from shardwise.schedules.actions import Action, Kind, Schedule, check_dimensions


def _in_order(kind: Kind, m: int) -> list[Action]:
    return [Action(kind, j) for j in range(m)]


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action],
                       warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards[:steady]):
        order += [forward, backward]
    return order + backwards[steady:]


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every stage runs all `m` forwards, then all `m` backwards.

    Makespan `(m+p-1)(t_f+t_b)`, bubble `(p-1)/(m+p-1)`; every stage holds all `m` micro-batches'
    activations at the turn.
    """
    check_dimensions(p, m)
    return {i: _in_order("F", m) + _in_order("B", m) for i in range(p)}


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021): stage `i` runs `min(p-1-i, m)` warm-up
    forwards, then alternates one forward and one backward, then drains the backwards.

    Same makespan and bubble as GPipe, `(m+p-1)(t_f+t_b)` and `(p-1)/(m+p-1)`, but stage `i`
    holds at most `min(p-i, m)` micro-batches' activations instead of `m`.
    """
    check_dimensions(p, m)
    return {i: _one_f_one_b_order(_in_order("F", m), _in_order("B", m), min(p - 1 - i, m))
            for i in range(p)}


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2; Megatron-LM's schedule with `v` chunks).

    Each stage holds `v` chunks (virtual stage `c·p + i`), each `1/v` of the stage's layers.
    Forwards go in groups of `p` micro-batches through chunk 0, then chunk 1, …: the k-th forward
    on a stage is micro-batch `(k // pv)·p + k % p` through chunk `(k % pv) // p`; backwards run
    the same order with chunks reversed. Stage `i` warms up with
    `min(2(p-1-i) + (v-1)·p, m·v)` forwards, then 1F1B, then drains.

    Bubble `(p-1)/(v·m + p-1)`: fill and drain take `p-1` chunk-times each, `1/v` of 1F1B's.
    For `m ≥ 2p` stage 0 holds `v·p + p - 1` chunks' activations, i.e. `L(1 + (p-1)/(pv))`
    layers' worth when each chunk has `L/(pv)` layers (Korthikanti et al. 2022). Megatron groups
    micro-batches by `p`, so `m` must be a multiple of `p`; `v = 1` is plain 1F1B.
    """
    check_dimensions(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ShardwiseError(f"interleaved 1F1B needs m divisible by p (micro-batches go in groups of "
                         f"p through each chunk): m={m}, p={p}")
    total = m * v

    def unit(kind: Kind, k: int) -> Action:
        group, rank = divmod(k, p * v)
        chunk = rank // p
        return Action(kind, group * p + rank % p, chunk if kind == "F" else v - 1 - chunk)

    forwards = [unit("F", k) for k in range(total)]
    backwards = [unit("B", k) for k in range(total)]
    return {i: _one_f_one_b_order(forwards, backwards, min(2 * (p - 1 - i) + (v - 1) * p, total))
            for i in range(p)}


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2.1).

    The backward is split into B (input gradient, on the critical path) and W (weight gradient,
    needed by nobody downstream). Stage `i` runs 1F1B's F/B order and follows each backward with
    the oldest pending W, except its first `i` steady-state backwards: the `i` Ws deferred this
    way run after its last backward, filling the drain where stage `i` would otherwise wait for
    stage `i+1`. Stage `i` still holds at most `min(p-i, m)` micro-batches between F and B,
    1F1B's peak.

    No schedule holding at most `p` micro-batches on stage 0 does better than
    `max(m, p)·t_f + (p-1)·t_b + m(t_b+t_w)`: stage 0's first B cannot start before
    `p·t_f + (p-1)·t_b` (micro-batch 0 goes forward through p stages and back through p-1), and
    until then stage 0 can run only its first `min(m, p)` forwards. ZB-H1 reaches that bound when
    `t_f = t_b = t_w = t`: `(3m+p-1)·t` for `m ≥ p`, a bubble of `(p-1)·t` per stage, a third of
    1F1B's `3(p-1)·t`. For other times it stays above the bound and below 1F1B.
    """
    check_dimensions(p, m)
    order: Schedule = {}
    for i in range(p):
        warmup = min(p - 1 - i, m)
        steady = m - warmup
        actions, next_w = [], 0
        for action in _one_f_one_b_order(_in_order("F", m), _in_order("B", m), warmup):
            actions.append(action)
            if action.kind == "B" and (action.micro_batch >= i or action.micro_batch >= steady):
                actions.append(Action("W", next_w))
                next_w += 1
        order[i] = actions + [Action("W", j) for j in range(next_w, m)]
    return order


_SINGLE_CHUNK: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1,
}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` (one of `SCHEDULES`) for `p` stages, `m` micro-batches and `v`
    chunks per stage (`v > 1` only for "interleaved")."""
    check_dimensions(p, m, v)
    validate.schedule_shape(p, m, v)  # capped before allocating
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if name not in _SINGLE_CHUNK:
        raise ShardwiseError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if v != 1:
        raise ShardwiseError(f"{name} has one chunk per stage, got v={v}; use 'interleaved' for v > 1")
    return _SINGLE_CHUNK[name](p, m)
