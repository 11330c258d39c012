"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV, DualPipeV, DualPipe (SPEC §6).

Each returns a `Schedule` (`dict[stage, list[Action]]`) for `p` stages and `m` micro-batches.
With `t_f`, `t_b` a stage's forward and whole backward of one micro-batch (all its chunks:
a chunk's action takes `1/v` of it; a split backward is B = `t_b - t_w` and W = `t_w`) and no
p2p latency, makespan = `m·(t_f + t_b)` + the bubble:

    schedule      bubble                        peak in flight, stage i (micro-batches)
    gpipe         (p-1)(t_f+t_b)                m
    1f1b          (p-1)(t_f+t_b)                min(p-i, m)
    interleaved   (p-1)(t_f+t_b)/v              stage 0: p + (p-1)/v [*]
    zb-h1         (p-1)(t_f+t_b-2t_w) [**]      min(p-i, m)
    zbv           (p-1)(t_f+t_b-2t_w)/2 [**]    stage 0: p (2p chunks of half a stage)
    dualpipev     see `registry`                stage 0: p + 1/2
    dualpipe      see `registry`                p + 1 on every rank (two model copies)

[*] for `m ≥ 2p`. [**] for `m ≥ p` (zbv: `m ≥ 2p`) and `t_w ≤` B, F (the registry's
closed forms give the general case). `docs/concepts/schedules.md` derives them.
"""

from __future__ import annotations

from collections import deque

from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import KINDS, Action, Kind, Schedule, check_dimensions


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
    order = _in_order("F", m) + _in_order("B", m)  # actions are immutable: shared by stages
    return {i: list(order) for i in range(p)}


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021): stage `i` runs `min(p-1-i, m)` warm-up
    forwards, then alternates one forward and one backward, then drains the backwards.

    Same makespan and bubble as GPipe, `(m+p-1)(t_f+t_b)` and `(p-1)/(m+p-1)`, but stage `i`
    holds at most `min(p-i, m)` micro-batches' activations instead of `m`.
    """
    check_dimensions(p, m)
    forwards, backwards = _in_order("F", m), _in_order("B", m)  # shared by the stages' lists
    return {i: _one_f_one_b_order(forwards, backwards, min(p - 1 - i, m)) for i in range(p)}


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
    forwards, backwards = _in_order("F", m), _in_order("B", m)  # shared by the stages' lists
    order: Schedule = {}
    for i in range(p):
        warmup = min(p - 1 - i, m)
        steady = m - warmup
        actions, next_w = [], 0
        for action in _one_f_one_b_order(forwards, backwards, warmup):
            actions.append(action)
            if action.kind == "B" and (action.micro_batch >= i or action.micro_batch >= steady):
                actions.append(Action("W", next_w))
                next_w += 1
        order[i] = actions + [Action("W", j) for j in range(next_w, m)]
    return order


class _Stage:
    """One stage's action list being written: the next micro-batch of each (kind, chunk), and
    the weight gradients a split backward has deferred, oldest first."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next_mb: dict[tuple[Kind, int], int] = {(k, c): 0 for k in KINDS for c in (0, 1)}
        self.pending_w: deque[Action] = deque()

    def run(self, kind: Kind, chunk: int, with_next: bool = False) -> Action:
        action = Action(kind, self.next_mb[kind, chunk], chunk, with_next)
        self.next_mb[kind, chunk] += 1
        self.actions.append(action)
        return action

    def backward(self, chunk: int, split: bool) -> None:
        """A B of `chunk`; split: its W waits in `pending_w`."""
        action = self.run("B", chunk)
        if split:
            self.pending_w.append(Action("W", action.micro_batch, chunk))

    def oldest_w(self) -> None:
        if self.pending_w:
            self.actions.append(self.pending_w.popleft())


def zbv(p: int, m: int) -> Schedule:
    """ZBV, the zero-bubble V schedule (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
    arXiv:2401.10241, §6 "ZB-V"; torch.distributed.pipelining's `ScheduleZBVZeroBubble`,
    whose order this is).

    Two chunks per stage in a V (placement "v"): chunk 0 runs virtual stage `i`, chunk 1
    virtual stage `2p-1-i`, so a micro-batch goes down the stages through chunk 0 and back up
    through chunk 1, and stage 0 both starts and ends it. Stage `i` runs `2(p-i)-1` forwards of
    chunk 0, then `i` pairs (F chunk 1, F chunk 0), then `p-i` rounds of chunk 1's F, B, W;
    in the steady state (F0) B0 W0 F1 B1 W1; in the cool-down `i` rounds of B0 B1 and `p-i`
    of B0 W0, the deferred Ws of chunk 1 and then of chunk 0 last. The pattern is that of
    `max(m, 2p-1)` micro-batches with the ones beyond `m` left out. Peak activations: `2p`
    chunks on every stage, i.e. `p` micro-batches' worth, 1F1B's stage-0 peak.
    """
    check_dimensions(p, m)
    n = max(m, 2 * p - 1)
    order: Schedule = {}
    for i in range(p):
        stage = _Stage()
        for _ in range(2 * (p - i) - 1):
            stage.run("F", 0)
        for _ in range(i):
            stage.run("F", 1)
            stage.run("F", 0)
        for _ in range(p - i):
            for kind in KINDS:
                stage.run(kind, 1)
        while stage.next_mb["F", 1] < stage.next_mb["F", 0] or stage.next_mb["F", 0] < n:
            if stage.next_mb["F", 0] < n:
                stage.run("F", 0)
            stage.run("B", 0)
            stage.run("W", 0)
            for kind in KINDS:
                stage.run(kind, 1)
        for _ in range(i):
            stage.run("B", 0)
            stage.run("B", 1)
        for _ in range(p - i):
            stage.run("B", 0)
            stage.run("W", 0)
        for c in (1, 0):
            while stage.next_mb["W", c] < n:
                stage.run("W", c)
        order[i] = [a for a in stage.actions if a.micro_batch < m]
    return order


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV: DeepSeek-AI's DualPipe (DeepSeek-V3 report, 2024, §3.2.1) cut in half into a
    single-direction V (Sea AI Lab's "cut-in-half"; github.com/deepseek-ai/DualPipe
    `dualpipev.py`); torch.distributed.pipelining's `ScheduleDualPipeV`, whose order this is.
    Needs `m ≥ 2p`.

    Two chunks per stage in a V, as `zbv`. Stage `i`: `2(p-i-1)` forwards of chunk 0; `i+1`
    pairs F0 F1; `p-i-1` rounds of B1 (split) W F1; then the main phase of `m-2p+i+1` rounds
    of two overlapped pairs, F0&B1 and F1&B0 (whole backwards; the last stage runs its first
    F0 and B1 one after the other); `p-i-1` rounds of B1, F1&B0; `i+1` rounds of B1 B0, whose
    backwards are split from the middle round on (odd stages from its B1, even ones from its
    B0); `p-i-1` rounds of a deferred W then a split B0; and the remaining Ws, oldest first.
    A B is split exactly when its W appears on the stage (`actions`).
    """
    check_dimensions(p, m)
    if m < 2 * p:
        raise ShardwiseError(f"DualPipeV needs at least 2p = {2 * p} micro-batches (two "
                             f"chunks per stage), got m={m}")
    return {i: _dual_stage(p, i, m) for i in range(p)}


def dualpipe(p: int, m: int) -> Schedule:
    """DualPipe, the bidirectional schedule (DeepSeek-V3 report, 2024, §3.2.1, Fig. 5;
    github.com/deepseek-ai/DualPipe `dualpipe.py` @3da1bbe, `DualPipe.step`, whose order this
    is). Needs an even `p` and an even `m ≥ 2p`.

    Two pipelines in opposite directions on the same `p` ranks: `m/2` micro-batches enter at
    rank 0 and run chunk 0 (rank `i` holds stage `i` of that direction), `m/2` enter at rank
    `p-1` and run chunk 1 (rank `i` holds stage `p-1-i`); micro-batches are numbered
    `0 … m/2-1` within each direction (chunk). Rank `i` runs DualPipeV's order (`_dual_stage`)
    for `p/2` stages and `m/2` micro-batches at half-rank `min(i, p-1-i)` — DualPipeV is this
    schedule cut in half — with the two directions swapped on the second half of the ranks
    (`phase ^= is_in_second_half` in the reference).
    """
    check_dimensions(p, m)
    if p % 2 or m % 2 or m < 2 * p:
        raise ShardwiseError(f"DualPipe needs an even pp and an even number of micro-batches "
                             f"m ≥ 2·pp (m/2 from each end), got p={p}, m={m}")
    half = p // 2
    swap = {0: 1, 1: 0}
    order: Schedule = {}
    for i in range(p):
        actions = _dual_stage(half, min(i, p - 1 - i), m // 2)
        order[i] = actions if i < half else [
            Action(a.kind, a.micro_batch, swap[a.chunk], a.with_next) for a in actions]
    return order


def _dual_stage(p: int, i: int, m: int) -> list[Action]:
    """Stage `i` of DualPipeV's order for `p` stages and `m` micro-batches (`dualpipev`)."""
    stage = _Stage()
    for _ in range(2 * (p - i - 1)):
        stage.run("F", 0)
    for _ in range(i + 1):
        stage.run("F", 0)
        stage.run("F", 1)
    for _ in range(p - i - 1):
        stage.backward(1, split=True)
        stage.oldest_w()
        stage.run("F", 1)
    for k in range(m - 2 * p + i + 1):
        stage.run("F", 0, with_next=not (k == 0 and i == p - 1))
        stage.backward(1, split=False)
        stage.run("F", 1, with_next=True)
        stage.backward(0, split=False)
    for _ in range(p - i - 1):
        stage.backward(1, split=False)
        stage.run("F", 1, with_next=True)
        stage.backward(0, split=False)
    split = False
    for k in range(i + 1):
        split = split or (k == (i + 1) // 2 and i % 2 == 1)
        stage.backward(1, split)
        split = split or k == (i + 1) // 2
        stage.backward(0, split)
    for _ in range(p - i - 1):
        stage.oldest_w()
        stage.backward(0, split=True)
    while stage.pending_w:
        stage.oldest_w()
    return stage.actions
