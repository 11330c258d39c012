"""Ring all-reduce emulated step by step on a list of shards (rank i = index i).

Patarasuk & Yuan (2009): split each rank's buffer into N chunks. Reduce-scatter — at step
s = 0..N-2 rank r sends chunk (r-s-1) mod N to rank r+1, which adds it into its own copy;
after N-1 steps rank r holds the complete sum of chunk r. All-gather — at step s rank r
forwards chunk (r-s) mod N, and after N-1 more steps every rank holds every reduced chunk.
Each step moves S/N bytes per rank, so a rank sends `2(N-1)/N · S` in all (SPEC §5).

All the sends of a step are *snapshotted* before any receive is applied, as on real hardware
where the step's messages are in flight simultaneously. (In this schedule no rank receives
into the chunk it is sending in the same step, so the step is race-free; the snapshot makes
that independence explicit instead of relying on the order of a Python loop.)

Design notes: docs/concepts/runtime.md#emulate-collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ring_bytes_on_wire

__all__ = [
    "ring_all_gather",
    "ring_all_reduce",
    "ring_all_reduce_bytes",
    "ring_all_reduce_steps",
    "ring_all_reduce_traced",
    "ring_reduce_scatter",
]


def _check(tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ShardwiseError("a ring needs at least one rank")
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != shape:
            raise ShardwiseError(f"rank {i} holds shape {tuple(t.shape)}, rank 0 "
                                 f"{tuple(shape)}: an all-reduce needs equal shapes")


_OnStep = Callable[[str, list[tuple[int, int]], list[list[torch.Tensor]], list[int]], None]
"""Called after each step's receives land: (phase, the step's (sender, chunk) pairs, every rank's
chunks, bytes each rank has sent so far)."""


def _reduce_scatter_chunks(chunks: list[list[torch.Tensor]], sent: list[int],
                           on_step: _OnStep | None = None) -> None:
    """In place on `chunks[rank][chunk]`; afterwards chunks[r][r] is the full sum."""
    n = len(chunks)
    for s in range(n - 1):
        # Snapshot: every message of this step is taken before any is applied.
        messages = [(r, (r - s - 1) % n, chunks[r][(r - s - 1) % n].clone()) for r in range(n)]
        for r, c, payload in messages:
            chunks[(r + 1) % n][c] += payload
            sent[r] += payload.numel() * payload.element_size()
        if on_step:
            on_step("reduce-scatter", [(r, c) for r, c, _ in messages], chunks, sent)


def _all_gather_chunks(chunks: list[list[torch.Tensor]], sent: list[int],
                       on_step: _OnStep | None = None) -> None:
    """In place; on entry chunks[r][r] is rank r's; afterwards every rank has every chunk."""
    n = len(chunks)
    for s in range(n - 1):
        messages = [(r, (r - s) % n, chunks[r][(r - s) % n].clone()) for r in range(n)]
        for r, c, payload in messages:
            chunks[(r + 1) % n][c].copy_(payload)
            sent[r] += payload.numel() * payload.element_size()
        if on_step:
            on_step("all-gather", [(r, c) for r, c, _ in messages], chunks, sent)


def ring_all_reduce_traced(tensors: Sequence[torch.Tensor], on_step: _OnStep | None = None
                           ) -> tuple[list[torch.Tensor], list[int]]:
    """(every rank's all-reduced tensor, bytes each rank sent). Any length: with N ∤ numel
    the chunks are `torch.tensor_split`'s (sizes differ by at most one element). `on_step`
    sees the ring after each of the 2(N-1) steps."""
    _check(tensors)
    n = len(tensors)
    flats = [t.detach().reshape(-1).clone() for t in tensors]  # (numel,) per rank
    chunks = [list(torch.tensor_split(f, n)) for f in flats]  # views into flats
    sent = [0] * n
    _reduce_scatter_chunks(chunks, sent, on_step)
    _all_gather_chunks(chunks, sent, on_step)
    return [f.view(tensors[0].shape) for f in flats], sent


@dataclass(frozen=True)
class RingStep:
    """The ring after one step: `phase`, the (sender, chunk) pairs sent (each to sender + 1),
    every rank's flat buffer and the bytes each rank has sent so far."""

    phase: str  # "reduce-scatter" or "all-gather"
    sends: tuple[tuple[int, int], ...]
    buffers: tuple[torch.Tensor, ...]
    sent: tuple[int, ...]


def ring_all_reduce_steps(tensors: Sequence[torch.Tensor]) -> list[RingStep]:
    """Snapshots of `ring_all_reduce_traced`'s run, one after each of its 2(N-1) steps, for
    stepping through the algorithm (the last one holds the all-reduced buffers)."""
    steps: list[RingStep] = []

    def record(phase: str, sends: list[tuple[int, int]], chunks: list[list[torch.Tensor]],
               sent: list[int]) -> None:
        steps.append(RingStep(phase, tuple(sends), tuple(torch.cat(row) for row in chunks),
                              tuple(sent)))

    ring_all_reduce_traced(tensors, record)
    return steps


def ring_all_reduce(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's copy of `sum(tensors)`, computed by the chunked ring."""
    return ring_all_reduce_traced(tensors)[0]


def ring_reduce_scatter(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Rank r's result: chunk r (`tensor_split` of the flat tensor) of the sum."""
    _check(tensors)
    n = len(tensors)
    chunks = [list(torch.tensor_split(t.detach().reshape(-1).clone(), n)) for t in tensors]
    _reduce_scatter_chunks(chunks, [0] * n)
    return [chunks[r][r] for r in range(n)]


def ring_all_gather(chunks_in: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's concatenation of all ranks' (flat) chunks, forwarded around the ring."""
    n = len(chunks_in)
    total = sum(c.numel() for c in chunks_in)
    flats = [torch.zeros(total, dtype=chunks_in[0].dtype) for _ in range(n)]
    bounds = [0]
    for c in chunks_in:
        bounds.append(bounds[-1] + c.numel())
    chunks = [[f[bounds[i]:bounds[i + 1]] for i in range(n)] for f in flats]
    for r in range(n):
        chunks[r][r].copy_(chunks_in[r].reshape(-1))
    _all_gather_chunks(chunks, [0] * n)
    return flats


def ring_all_reduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `size` bytes: `2(N-1)/N · size`."""
    return ring_bytes_on_wire("all-reduce", size, n)
