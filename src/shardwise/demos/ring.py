"""`shardwise demo ring`: the p2p ring all-reduce (send/recv, `runtime.collectives`) vs the
backend's all-reduce, and its bytes vs the ring formula `2(N-1)/N·S` (SPEC §5). Rows as
`demos.common.check_row`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.demos.common import TOL, check_row, max_rel_diff
from shardwise.estimate.comm import ring_bytes_on_wire
from shardwise.runtime import collectives as C
from shardwise.runtime.launch import launch

__all__ = ["run_ring_demo"]


def _ring_rank(sizes: list[int]) -> list[dict[str, float]]:
    """p2p ring all-reduce vs the backend's, per size (float64)."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in sizes:
        gen = torch.Generator().manual_seed(numel + 7919 * r)
        x = torch.randn(numel, dtype=torch.float64, generator=gen)
        ref = x.clone()
        dist.all_reduce(ref)
        with C.counting() as c:
            C.ring_all_reduce_p2p(x)
        out.append({"numel": numel, "diff": max_rel_diff(x, ref), "bytes": c.bytes(),
                    "predicted": ring_bytes_on_wire("all-reduce", numel * 8, n)})
    return out


def run_ring_demo(ranks: int = 4, sizes: tuple[int, ...] = (1000, 4099, 2**16 + 1),
                  timeout_s: float = 120) -> list[dict[str, Any]]:
    """Ring all-reduce from send/recv vs gloo's all_reduce; bytes sent vs `2(N-1)/N·S`."""
    results = launch(_ring_rank, ranks, list(sizes), timeout_s=timeout_s, backend="gloo")
    rows = []
    for i, numel in enumerate(sizes):
        worst = max(res[i]["diff"] for res in results)
        rows.append(check_row(f"p2p ring vs backend all-reduce, {numel} float64 on {ranks} ranks "
                              "(max rel. diff)", worst, f"≤ {TOL['float64']:g}"))
        sent = results[0][i]["bytes"]
        predicted = results[0][i]["predicted"]
        # N ∤ numel: chunks differ by one element, so bytes differ from the formula by < 1 chunk
        rows.append(check_row(f"bytes sent by rank 0 for {numel * 8} bytes", sent, predicted,
                              abs(sent - predicted) <= 2 * 8 * (ranks - 1)))
    return rows
