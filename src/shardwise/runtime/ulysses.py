"""Context parallelism by all-to-all over heads: DeepSpeed-Ulysses (Jacobs et al. 2023), and its
hybrid with ring attention (USP, Fang & Zhao 2024; Transformer Engine's cp_comm_type
"a2a+p2p", Megatron's `--hierarchical-context-parallel-sizes`).

Before the attention an all-to-all trades tokens for heads, `(b, n, H, d) → (b, u·n, H/u, d)`
for Q, K and V, so each rank attends `1/u` of the heads over the group's `u·n` tokens (the
whole sequence when `u = c`); a fourth all-to-all returns the output to the sequence blocks,
and backward runs the conjugate all-to-alls. Bytes a rank sends per layer forward, and the
same backward (`estimate.comm.ulysses_comm_bytes_per_layer`): `(u-1)/u · n·b·(2q + 2kv)·bytes`
(V and the output at K's and Q's widths here; MLA's narrower V, d_v < d, is refused).

Design notes: docs/concepts/runtime.md#runtime-ulysses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.errors import ShardwiseError
from shardwise.runtime import collectives as C
from shardwise.runtime.mesh import AxisGroup

__all__ = ["ulysses_attention"]

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _to_heads(x: torch.Tensor, g: AxisGroup, order: torch.Tensor) -> torch.Tensor:
    """(b, n, H, d) this rank's tokens -> (b, u·n, H/u, d) the group's tokens of its head group,
    in position order (`order`: the member-order index of each position-ordered token)."""
    b, n, heads, d = x.shape
    u = g.size
    send = x.reshape(b, n, u, heads // u, d).permute(2, 0, 1, 3, 4).contiguous()  # (u, b, n, H/u, d)
    received = torch.empty_like(send)  # [i]: member i's tokens of this rank's head group
    C.all_to_all_single(received, send, group=g)
    tokens = received.permute(1, 0, 2, 3, 4).reshape(b, u * n, heads // u, d)  # member order
    return tokens.index_select(1, order)


def _to_tokens(y: torch.Tensor, g: AxisGroup, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `_to_heads`: (b, u·n, H/u, d) in position order -> (b, n, H, d)."""
    b, m, head_group, d = y.shape
    u = g.size
    by_member = torch.empty_like(y)
    by_member[:, order] = y  # position order -> member order
    send = by_member.reshape(b, u, m // u, head_group, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)  # [j]: this rank's tokens of head group j
    C.all_to_all_single(received, send, group=g)
    return received.permute(1, 2, 0, 3, 4).reshape(b, m // u, u * head_group, d)


class _ToHeads(torch.autograd.Function):
    """Sequence blocks -> head groups forward, the inverse all-to-all backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup, order: torch.Tensor) -> torch.Tensor:
        ctx.g, ctx.order = g, order
        return _to_heads(x, g, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _to_tokens(grad.contiguous(), ctx.g, ctx.order), None, None


class _ToTokens(torch.autograd.Function):
    """Head groups -> sequence blocks forward, the inverse all-to-all backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, g: AxisGroup, order: torch.Tensor) -> torch.Tensor:
        ctx.g, ctx.order = g, order
        return _to_tokens(y, g, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _to_heads(grad.contiguous(), ctx.g, ctx.order), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core: AttentionCore,
                      group: C.GroupLike = "cp", *, positions: torch.Tensor) -> torch.Tensor:
    """Attention of this rank's tokens with the heads spread over `group` by all-to-all.

    q (b, n, H_q, d), k/v (b, n, H_kv, d): this rank's tokens; `positions` (u, n): the global
    position of every token each member of `group` holds, in group order. `core(q, k, v)`
    attends the group's `u·n` tokens, position order, of `1/u` of the heads: the single-device
    kernel for Ulysses (then the positions are the whole sequence), ring attention across the
    groups for the hybrid. Returns this rank's (b, n, H_q, d). Differentiable.
    """
    g = C.resolve(group)
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2]:
        raise ShardwiseError("ulysses_attention wants local q (b, n, h_q, d) and k, v "
                             "(b, n, h_kv, d)")
    if q.shape[2] % g.size or k.shape[2] % g.size:
        raise ShardwiseError(f"Ulysses over {g.size} ranks splits the heads: {g.size} must "
                             f"divide n_heads={q.shape[2]} and n_kv_heads={k.shape[2]}")
    if positions.shape != (g.size, q.shape[1]):
        raise ShardwiseError(f"ulysses_attention: positions {tuple(positions.shape)} must be "
                             f"(group ranks, tokens per rank) = ({g.size}, {q.shape[1]})")
    if g.size == 1:
        return core(q, k, v)
    order = positions.reshape(-1).argsort().to(q.device)
    heads = [_ToHeads.apply(t, g, order) for t in (q, k, v)]
    return _ToTokens.apply(core(*heads), g, order)
