"""DeepSpeed-Ulysses in one process: a list of shards plays the context-parallel ranks.

Ulysses (Jacobs et al. 2023) splits the sequence over `c` devices like ring attention, but
brings the tokens together by trading them for heads. Device `p` holds `n = s/c` tokens of all
`H` heads; an all-to-all sends device `j` the tokens of head group `j`:

    received_p = [shard_j[:, :, p·H/c : (p+1)·H/c] for j = 0..c-1]     (device order)

so device `p` holds every token of `H/c` heads and runs ordinary attention on them, after
putting the tokens in position order (they arrive in each device's layout). The output goes
back the same way. Each device keeps `1/c` of what it sends through (its own head group), so it
sends `(c-1)/c` of its Q, K, V and output blocks (`estimate.comm.ulysses_comm_bytes_per_layer`).
The runtime's version is `runtime.ulysses`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.errors import ShardwiseError
from shardwise.ops.attention import layout_positions

__all__ = ["ulysses_attention"]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _all_to_all(shards: list[torch.Tensor], split: int, join: int) -> tuple[list[torch.Tensor], int]:
    """Device p sends piece j of its shard (cut along `split`) to device j, which joins the
    pieces it receives along `join` in device order; (received shards, bytes one device sends)."""
    c = len(shards)
    pieces = [s.chunk(c, dim=split) for s in shards]  # pieces[j][p]: device j's piece for p
    out = [torch.cat([pieces[j][p] for j in range(c)], dim=join) for p in range(c)]
    sent = (c - 1) * pieces[0][0].numel() * pieces[0][0].element_size()
    return out, sent


def ulysses_attention(q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor],
                      attention: Attention, layout: str = "contiguous"
                      ) -> tuple[list[torch.Tensor], int]:
    """Each device's output block and the bytes one device sends (forward).

    q[p] (b, n, H_q, d), k[p] (b, n, H_kv, d), v[p] (b, n, H_kv, d_v; MLA: d_v < d): device
    p's tokens in `layout`; `attention(q, k, v)` on (b, s, H/c, ·) tensors in position order
    (e.g. causal softmax attention)."""
    c = len(q)
    if q[0].shape[2] % c or k[0].shape[2] % c:
        raise ShardwiseError(f"Ulysses over {c} devices splits the heads: {c} must divide "
                             f"n_heads={q[0].shape[2]} and n_kv_heads={k[0].shape[2]}")
    n = q[0].shape[1]
    order = layout_positions(n * c, c, layout).reshape(-1).argsort()  # device order -> positions
    sent = 0
    heads = []
    for shards in (q, k, v):  # (b, n, H, d) -> (b, c·n, H/c, d): every token, one head group
        gathered, nbytes = _all_to_all(shards, split=2, join=1)
        heads.append([t[:, order] for t in gathered])
        sent += nbytes
    out = [attention(*(h[p] for h in heads)) for p in range(c)]
    back = [torch.empty_like(o) for o in out]
    for p in range(c):
        back[p][:, order] = out[p]  # position order -> device order
    result, nbytes = _all_to_all(back, split=1, join=2)  # -> (b, n, H, d) again
    return result, sent + nbytes
