"""Ring attention in one process: a list of shards plays the context-parallel ranks (SPEC §8).

The per-block results merge exactly with the online softmax; the block kernels, the merge and
FlashAttention-2's backward live in `shardwise.ops.attention` (shared with the runtime's context
parallelism), which states the formulas.

`dQ` accumulates on the query's device; `dK, dV` accumulate in a buffer that travels around the
ring and arrives at the block's owner after `c - 1` hops (see `_ring_backward`).

Design notes: docs/concepts/runtime.md#emulate-ring_attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.errors import ShardwiseError
from shardwise.ops.attention import (
    LAYOUTS,
    SoftmaxState,
    absorb_block,
    block_grads,
    from_layout,
    group_heads,
    layout_positions,
    plan_block,
    seq_rows,
    to_layout,
)

__all__ = ["LAYOUTS", "RingStats", "causal_block_work", "ring_attention"]


# ------------------------------------------------------------------------- causal work
def causal_block_work(num_devices: int, block_size: int, layout: str = "contiguous") -> list[int]:
    """Causal (query, key) pairs each device computes: `#{(i, j): i on p, j ≤ i}` per device p.

    The sequence has `num_devices · block_size` tokens. SPEC §8: 8 devices × 16 tokens give
    contiguous [136, 392, 648, 904, 1160, 1416, 1672, 1928] (max/min 14.18×) and striped
    [976, 992, …, 1088] (1.11×); every layout sums to s(s+1)/2.
    """
    if block_size < 1:
        raise ShardwiseError(f"block_size must be ≥ 1, got {block_size}")
    positions = layout_positions(num_devices * block_size, num_devices, layout)  # (c, n)
    # A query at position i sees the i + 1 keys 0..i.
    return [int(row.sum()) + block_size for row in positions]


# ---------------------------------------------------------------------- the emulated ring
@dataclass
class RingStats:
    """What an emulated ring run did: per device blocks computed/skipped, allowed and scored
    (query, key) pairs, and bytes sent forward and backward (K,V and dK,dV)."""

    blocks_computed: list[int] = field(default_factory=list)
    blocks_skipped: list[int] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)
    pairs_computed: list[int] = field(default_factory=list)
    bytes_forward: list[int] = field(default_factory=list)
    bytes_backward: list[int] = field(default_factory=list)

    def reset(self, c: int) -> None:
        for name in ("blocks_computed", "blocks_skipped", "pairs", "pairs_computed",
                     "bytes_forward", "bytes_backward"):
            setattr(self, name, [0] * c)


def _rotate(held: list[torch.Tensor], sent: list[int]) -> list[torch.Tensor]:
    """One ring step: device p sends to p+1. Sends are snapshotted before receives land."""
    c = len(held)
    snapshot = list(held)
    for p in range(c):
        sent[p] += snapshot[p].numel() * snapshot[p].element_size()
    return [snapshot[(p - 1) % c] for p in range(c)]


class _EmulatedRing(torch.autograd.Function):
    """Ring attention over stacked shards q (c, b, n, h_q, d), k/v (c, b, n, h_kv, d)."""

    @staticmethod
    def forward(ctx: Any, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                positions: torch.Tensor, causal: bool, scale: float,
                stats: RingStats) -> torch.Tensor:
        c = qs.shape[0]
        held = [torch.stack((ks[p], vs[p])) for p in range(c)]  # each (2, b, n, h_kv, d)
        states = [SoftmaxState.empty(qs[p], vs.shape[-1]) for p in range(c)]
        for t in range(c):
            for p in range(c):
                src = (p - t) % c
                plan = plan_block(positions[p], positions[src], causal)
                if plan is None:
                    stats.blocks_skipped[p] += 1
                    continue
                stats.blocks_computed[p] += 1
                stats.pairs[p] += plan.pairs
                stats.pairs_computed[p] += plan.computed
                k, v = seq_rows(held[p][0], plan.cols), seq_rows(held[p][1], plan.cols)
                if plan.rows is None:
                    states[p] = absorb_block(states[p], qs[p], k, v, scale, plan.mask)
                else:  # absorb into the selected rows only
                    r = plan.rows
                    sub = SoftmaxState(states[p].m[:, :, r], states[p].l[:, :, r],
                                       states[p].o[:, r])
                    sub = absorb_block(sub, qs[p][:, r], k, v, scale, plan.mask)
                    states[p].m[:, :, r], states[p].l[:, :, r] = sub.m, sub.l
                    states[p].o[:, r] = sub.o
            if t < c - 1:
                held = _rotate(held, stats.bytes_forward)
        finished = [state.finish() for state in states]
        out = torch.stack([o for o, _ in finished])  # (c, b, n, h_q, d)
        lse = torch.stack([lse for _, lse in finished])  # (c, b, h_q, n)
        ctx.save_for_backward(qs, ks, vs, out, lse, positions)
        ctx.causal, ctx.scale, ctx.stats = causal, scale, stats
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        qs, ks, vs, out, lse, positions = ctx.saved_tensors
        dq, dkv = _ring_backward(dout, qs, ks, vs, out, lse, positions, ctx.causal, ctx.scale,
                                 ctx.stats)
        return dq, dkv[:, 0], dkv[:, 1], None, None, None, None


def _ring_backward(dout: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, positions: torch.Tensor, causal: bool,
                   scale: float, stats: RingStats) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward ring. K,V rotate again (c-1 hops); device p first meets the blocks of
    p-1, p-2, …, p+1 and its own block last, so the dK,dV buffer of block j is created on j+1,
    picks up each device's contribution, and reaches its owner j after c-1 hops:

        step t = 0..c-2: receive (K,V) of block p-1-t; add this device's dK,dV to the buffer
                         received from p-1 (which holds block p-1-t); send the buffer to p+1.
        finally:         the buffer received is block p's; add the own-block dK,dV.
    """
    c = qs.shape[0]
    dq = torch.zeros_like(qs)

    def grads(p: int, src: int, kv: torch.Tensor) -> torch.Tensor:
        plan = plan_block(positions[p], positions[src], causal)
        return block_grads(dout[p], qs[p], kv, out[p], lse[p], plan, scale, dq[p])

    held = [torch.stack((ks[p], vs[p])) for p in range(c)]  # (2, b, n, h_kv, d)
    buffers: list[torch.Tensor] | None = None
    for t in range(c - 1):
        held = _rotate(held, stats.bytes_backward)
        mine = [grads(p, (p - 1 - t) % c, held[p]) for p in range(c)]
        if buffers is not None:
            mine = [buffers[p] + mine[p] for p in range(c)]
        buffers = _rotate(mine, stats.bytes_backward)
    own = [grads(p, p, torch.stack((ks[p], vs[p]))) for p in range(c)]
    dkv = torch.stack(own if buffers is None else [buffers[p] + own[p] for p in range(c)])
    return dq, dkv  # dkv (c, 2, b, n, h_kv, d)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_devices: int,
                   causal: bool = False, layout: str = "contiguous", *,
                   scale: float | None = None, stats: RingStats | None = None) -> torch.Tensor:
    """Softmax attention computed as `num_devices` ring-attention devices would (one process).

    q (b, s, h_q, d), k/v (b, s, h_kv, d) in natural token order -> (b, s, h_q, d); equal to
    `softmax(scale·QKᵀ + causal mask)·V` (scale defaults to 1/√d). The sequence is permuted to
    `layout`, cut into one block per device, run around the ring (forward with `absorb_block`,
    backward with the rotating dK,dV buffer), and permuted back. Pass `stats` to see the block
    skipping and the bytes each device sent.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ShardwiseError("ring_attention wants q (b, s, h_q, d) and k, v (b, s, h_kv, d)")
    b, s, h_q, d = q.shape
    group_heads(q, k.shape[2])  # validates h_kv | h_q
    c = num_devices
    positions = layout_positions(s, c, layout)
    stats = stats if stats is not None else RingStats()
    stats.reset(c)

    def blocks(x: torch.Tensor) -> torch.Tensor:
        # (b, s, h, d) -> layout order -> (b, c, n, h, d) -> (c, b, n, h, d)
        x = to_layout(x, c, layout)
        return x.reshape(b, c, s // c, *x.shape[2:]).transpose(0, 1)

    out = _EmulatedRing.apply(blocks(q), blocks(k), blocks(v), positions, causal,
                              scale if scale is not None else 1.0 / math.sqrt(d), stats)
    # (c, b, n, h_q, d) -> (b, c·n, h_q, d) in layout order -> natural order
    return from_layout(out.transpose(0, 1).reshape(b, s, h_q, -1), c, layout)
