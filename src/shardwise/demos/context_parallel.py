"""`shardwise demo ring-attention`: context parallelism on real ranks. Ring attention over
`ranks` gloo processes (or under torchrun) vs single-device attention in fp64, forward and
backward, for each sequence layout × causal; bytes per rank vs SPEC §5
(`estimate.comm.cp_comm_bytes_per_layer`).

Design notes: docs/concepts/runtime.md#demos-context_parallel.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardwise.estimate.comm import cp_comm_bytes_per_layer
from shardwise.layout import Layout
from shardwise.ops.attention import LAYOUTS
from shardwise.runtime import collectives as C
from shardwise.runtime.launch import launch

__all__ = ["reference_attention", "run_ring_attention_demo"]

TOL = 1e-12


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool) -> torch.Tensor:
    """Single-device `softmax(QKᵀ/√d + mask)·V`, q (b, s, h_q, d), k/v (b, s, h_kv, d)."""
    _, s, h_q, d = q.shape
    k = k.repeat_interleave(h_q // k.shape[2], dim=2)  # (b, s, h_kv, d) -> (b, s, h_q, d)
    v = v.repeat_interleave(h_q // v.shape[2], dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(dim=-1), v)


def _ring_worker(ranks: int, seq_len: int, batch: int, heads: int, kv_heads: int,
                 head_dim: int, cases: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    from shardwise.runtime.context_parallel import RingRankStats, ring_attention, shard_for_rank
    from shardwise.runtime.mesh import Mesh

    axis = Mesh.from_layout(Layout(cp=ranks)).axis("cp")
    out_rows = []
    for layout, causal in cases:
        gen = torch.Generator().manual_seed(0)
        shapes = [(heads,), (kv_heads,), (kv_heads,), (heads,)]
        q, k, v, w = (torch.randn(batch, seq_len, h, head_dim, generator=gen,
                                  dtype=torch.float64) for (h,) in shapes)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = reference_attention(q, k, v, causal)
        ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))

        def mine(t: torch.Tensor, layout: str = layout) -> torch.Tensor:
            return shard_for_rank(t.detach(), axis.size, axis.rank, layout)

        ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
        stats = RingRankStats()
        with C.counting() as counter:
            out = ring_attention(ql, kl, vl, axis, causal, layout, stats=stats)
            (out * mine(w)).sum().backward()
        diff = max([float((out.detach() - mine(ref)).abs().max())]
                   + [float((a.grad - mine(b)).abs().max())
                      for a, b in zip((ql, kl, vl), ref_grads)])
        out_rows.append({"diff": diff, "bytes": counter.bytes(axis="cp"),
                         "skipped": stats.blocks_skipped, "pairs": stats.pairs})
    return out_rows


def run_ring_attention_demo(ranks: int = 4, *, seq_len: int | None = None, batch: int = 2,
                            heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                            layouts: tuple[str, ...] = LAYOUTS,
                            causal: tuple[bool, ...] = (True, False),
                            timeout_s: float = 120) -> list[dict[str, Any]]:
    """Ring attention on `ranks` processes vs single-device attention, fp64, forward and
    backward, for each layout × causal; bytes per rank vs `cp_comm_bytes_per_layer`.
    With 8 ranks the causal pairs per rank are SPEC §8's [136, 392, …, 1928] (contiguous)."""
    seq_len = seq_len or 16 * ranks  # 16 tokens per rank: SPEC §8's causal-work example
    cases = [(layout, c) for layout in layouts for c in causal]
    per_rank = launch(_ring_worker, ranks, ranks, seq_len, batch, heads, kv_heads, head_dim,
                      cases, timeout_s=timeout_s)
    predicted = cp_comm_bytes_per_layer(seq_len, batch, kv_heads * head_dim, ranks, 8)
    rows = []
    for i, (layout, is_causal) in enumerate(cases):
        results = [rank_rows[i] for rank_rows in per_rank]
        pairs = [r["pairs"] for r in results]
        measured = [r["bytes"] for r in results]
        diff = max(r["diff"] for r in results)
        rows.append({
            "check": "ring attention", "case": f"{layout}{' causal' if is_causal else ''}",
            "ranks": ranks, "layout": layout, "causal": is_causal, "seq_len": seq_len,
            "max_diff": diff, "bytes_measured": max(measured), "bytes_predicted": predicted,
            "ok": diff <= TOL and all(m == predicted for m in measured),
            "blocks_skipped": [r["skipped"] for r in results], "causal_pairs": pairs,
            "work_imbalance": max(pairs) / min(pairs) if min(pairs) else math.inf,
        })
    return rows
