"""Context parallelism: ring attention over the `cp` axis (Liu, Zaharia & Abbeel 2023).

Causal blocks entirely in the future are skipped (their K,V still pass along the ring).
Bytes each rank sends per layer (SPEC §5, `estimate.comm.cp_comm_bytes_per_layer`): forward
`(c-1)·2·(s/c)·b·kv·bytes`, backward twice that, `kv = h_kv·d` (GQA ships only the kv heads).

Sends and receives are paired in a fixed order (even ranks send first) with CPU tensors on
gloo; every transfer goes through the counted `collectives` layer under the group's axis name.
Transfers are blocking: this file shows the algorithm and measures its bytes; it does not
overlap communication with the block computation as a production kernel would.

Design notes: docs/concepts/runtime.md#runtime-context_parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.errors import ShardwiseError
from shardwise.ops.attention import (
    LAYOUTS,
    attend_block,
    block_grads,
    layout_positions,
    plan_block,
    shard_sequence,
)
from shardwise.runtime import collectives as C
from shardwise.runtime.mesh import AxisGroup

__all__ = ["LAYOUTS", "RingRankStats", "local_positions", "ring_attention", "shard_for_rank"]


@dataclass
class RingRankStats:
    """One rank's work in one ring-attention call (forward), and its backward block count."""

    blocks_computed: int = 0
    blocks_skipped: int = 0
    pairs: int = 0  # allowed (query, key) pairs
    pairs_computed: int = 0  # pairs the block kernels scored (after trimming)
    backward_blocks_computed: int = 0


def local_positions(seq_len: int, group_size: int, group_rank: int,
                    layout: str = "contiguous") -> torch.Tensor:
    """Global token positions (n,) held by rank `group_rank` of a cp group of `group_size`."""
    return layout_positions(seq_len, group_size, layout)[group_rank]


def shard_for_rank(x: torch.Tensor, group_size: int, group_rank: int,
                   layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's sequence block of a full tensor (natural token order along `dim`)."""
    return shard_sequence(x, group_size, layout, dim)[group_rank].contiguous()


def _shift(t: torch.Tensor, g: AxisGroup, counter: C.CommCounter | None) -> torch.Tensor:
    """Send `t` to the right neighbour, return what the left neighbour sent (one ring hop).
    Even ranks send first, odd ranks receive first: no cycle of blocking sends."""
    t = t.contiguous()
    received = torch.empty_like(t)
    right, left = g.global_rank(g.rank + 1), g.global_rank(g.rank - 1)
    if g.rank % 2 == 0:
        C.send(t, right, g, counter=counter)
        C.recv(received, left, g)
    else:
        C.recv(received, left, g)
        C.send(t, right, g, counter=counter)
    return received


class _RingAttention(torch.autograd.Function):
    """Local q (b, n, h_q, d), k/v (b, n, h_kv, d) -> local output (b, n, h_q, d)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AxisGroup,
                positions: torch.Tensor, causal: bool, scale: float, stats: RingRankStats,
                counter: C.CommCounter | None) -> torch.Tensor:
        c, r = g.size, g.rank
        b, n, h_q, _ = q.shape
        # the merge accumulates in at least fp32, as the fused kernel keeps its lse
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(b, n, h_q, v.shape[-1], dtype=acc)
        lse = torch.full((b, h_q, n), float("-inf"), dtype=acc, device=q.device)
        held = torch.stack((k, v))  # (2, b, n, h_kv, d): one message per hop
        for t in range(c):
            plan = plan_block(positions[r], positions[(r - t) % c], causal)
            if plan is None:
                stats.blocks_skipped += 1
            else:
                stats.blocks_computed += 1
                stats.pairs += plan.pairs
                stats.pairs_computed += plan.computed
                out, lse = attend_block(out, lse, q, held, plan, scale)
            if t < c - 1:
                held = _shift(held, g, counter)
        # Contiguous, so the caller's (b, n, h_q·d) view for the out-projection is this very
        # tensor: one copy of the output is kept for backward, not two.
        out = out.to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.g, ctx.causal, ctx.scale, ctx.stats, ctx.counter = g, causal, scale, stats, counter
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, positions = ctx.saved_tensors
        g, causal, scale = ctx.g, ctx.causal, ctx.scale
        c, r = g.size, g.rank
        dout = dout.contiguous()
        dq = torch.zeros_like(q)

        def grads(src: int, kv: torch.Tensor) -> torch.Tensor:
            plan = plan_block(positions[r], positions[src], causal)
            ctx.stats.backward_blocks_computed += plan is not None
            return block_grads(dout, q, kv, out, lse, plan, scale, dq)

        own = torch.stack((k, v))  # (2, b, n, h_kv, d)
        held, buffer = own, None
        for t in range(c - 1):
            held = _shift(held, g, ctx.counter)  # now the block of rank r-1-t
            mine = grads((r - 1 - t) % c, held)
            buffer = _shift(mine if buffer is None else buffer + mine, g, ctx.counter)
        dkv = grads(r, own)
        if buffer is not None:  # the buffer that arrived last is this rank's own block's
            dkv = buffer + dkv
        return dq, dkv[0], dkv[1], None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: C.GroupLike = "cp", causal: bool = False,
                   layout: str = "contiguous", *, scale: float | None = None,
                   stats: RingRankStats | None = None,
                   counter: C.CommCounter | None = None,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """Ring attention of this rank's block over the whole sequence of its cp group.

    q (b, n, h_q, d), k/v (b, n, h_kv, d): this rank's block (`shard_for_rank`) of a sequence
    of `s = n·c` tokens laid out as `layout`; returns this rank's block of
    `softmax(scale·QKᵀ + causal mask)·V`, (b, n, h_q, d). Differentiable (the backward is the
    ring above, not autograd through the communication). `group`: an axis name of the current
    mesh, an `AxisGroup`, a process group or None (world); a group of one is plain attention.
    `positions` (c, n): the global token positions each ring rank holds, in its local order,
    in place of `layout`'s (the hybrid's rings, `runtime.ulysses`).
    """
    g = C.resolve(group)
    if q.dim() != 4 or k.dim() != 4 or v.shape[:3] != k.shape[:3] or k.shape[:2] != q.shape[:2]:
        raise ShardwiseError("ring_attention wants local q (b, n, h_q, d) and k, v (b, n, h_kv, d)")
    if q.shape[2] % k.shape[2]:
        raise ShardwiseError(f"n_kv_heads={k.shape[2]} does not divide n_heads={q.shape[2]}")
    if positions is None:
        positions = layout_positions(q.shape[1] * g.size, g.size, layout)  # (c, n)
    elif positions.shape != (g.size, q.shape[1]):
        raise ShardwiseError(f"ring_attention: positions {tuple(positions.shape)} must be "
                             f"(ring ranks, tokens per rank) = ({g.size}, {q.shape[1]})")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, g, positions, causal, scale,
                                stats if stats is not None else RingRankStats(), counter)
