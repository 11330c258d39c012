"""Expert parallelism in one process: a list of token shards plays the ranks (SPEC §8).

The layer itself (routing, capacity, load-balancing loss, the dispatch plan and the expert
MLPs) lives in `shardwise.ops.moe`, shared with the runtime; this module emulates its
distribution.

Expert parallelism (GShard): `e` ranks each hold `E/e` experts (rank r: experts
[r·E/e, (r+1)·E/e)). A rank routes its tokens, drops over-capacity assignments locally, sorts
the kept ones by expert, exchanges per-expert counts (so every receiver knows its uneven
splits), then dispatches the token rows with one all-to-all, runs its experts, and returns the
results with a second all-to-all (combine), where they are weighted by the gates. Backward runs
the two all-to-alls in reverse. Each all-to-all moves `(e-1)/e · T·k·h·bytes` per rank when
routing is balanced (SPEC §5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.errors import ShardwiseError
from shardwise.ops.moe import (
    DispatchPlan,
    MoEParams,
    dispatch_plan,
    load_balancing_loss,
    route,
    run_local_experts,
)

__all__ = ["EPEmulation", "balanced_inputs", "combine", "emulated_all_to_all", "ep_moe_emulated"]


def balanced_inputs(tokens: int, hidden: int, num_experts: int, top_k: int, *, seed: int = 0,
                    dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x (T, h) and a router (h, E) whose top-k routing is exactly balanced.

    Token t prefers experts (t·k + j) mod E, j < k (a large logit on coordinate i of x selects
    expert i through the identity block of the router), so any `tokens` with `T·k` divisible by
    `E` — and every rank's slice of them when the slice is — sends `T·k/E` assignments to each
    expert. Small noise keeps the logits distinct. Needs `hidden ≥ E`.
    """
    if hidden < num_experts or (tokens * top_k) % num_experts:
        raise ShardwiseError("balanced routing needs hidden ≥ n_experts and E | tokens·top_k")
    gen = torch.Generator().manual_seed(seed)
    x = 0.1 * torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    for t in range(tokens):
        for j in range(top_k):
            x[t, (t * top_k + j) % num_experts] += 6.0 - 0.5 * j
    router = torch.zeros(hidden, num_experts, dtype=dtype)
    router[:num_experts] = torch.eye(num_experts, dtype=dtype)
    router += 0.01 * torch.randn(hidden, num_experts, generator=gen, dtype=dtype)
    return x, router


def combine(expert_out: torch.Tensor, plan: DispatchPlan, tokens: int) -> torch.Tensor:
    """Gate-weighted sum of the returned expert rows into (T, h); dropped tokens stay zero."""
    y = expert_out.new_zeros(tokens, expert_out.shape[1])
    return y.index_add(0, plan.token, plan.gate.to(expert_out.dtype)[:, None] * expert_out)


# ------------------------------------------------------------------------ emulated EP
@dataclass
class EPEmulation:
    """Per-rank outputs and aux losses, per-expert routed/kept counts (all ranks), and per rank
    the bytes each all-to-all sent to other ranks (dispatch, combine; backward mirrors them)."""

    outputs: list[torch.Tensor]
    aux_losses: list[torch.Tensor]
    routed: torch.Tensor
    kept: torch.Tensor
    dispatch_bytes: list[int]
    combine_bytes: list[int]


def emulated_all_to_all(chunks: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """`chunks[src][dst]` -> `received[dst][src]` (differentiable: it only moves references)."""
    n = len(chunks)
    return [[chunks[src][dst] for src in range(n)] for dst in range(n)]


def _offrank_bytes(chunks: list[list[torch.Tensor]]) -> list[int]:
    return [sum(t.numel() * t.element_size() for dst, t in enumerate(row) if dst != src)
            for src, row in enumerate(chunks)]


def ep_moe_emulated(x_shards: list[torch.Tensor], params: MoEParams, top_k: int, *,
                    capacity_factor: float | None = None,
                    normalize: bool = True) -> EPEmulation:
    """Expert parallelism over `len(x_shards)` emulated ranks, each with its own tokens."""
    e = len(x_shards)
    num_experts = params.num_experts
    local = num_experts // e
    routings = [route(x, params.router, top_k, normalize) for x in x_shards]
    plans = [dispatch_plan(r, e, capacity_factor) for r in routings]
    # Count exchange: rank dst learns, from each src, the rows for each of its experts.
    counts = emulated_all_to_all([list(p.per_expert.reshape(e, local)) for p in plans])
    # Dispatch: rows sorted by expert are already grouped by destination rank.
    send = [list(x[p.token].split(p.send.tolist())) for x, p in zip(x_shards, plans)]
    received = emulated_all_to_all(send)
    results = []
    for dst in range(e):
        sl = slice(dst * local, (dst + 1) * local)
        rows = torch.cat(received[dst])  # (N_recv, h): src-major, then expert, then token
        out = run_local_experts(rows, torch.stack(counts[dst]), params.w_gate[sl],
                                params.w_up[sl], params.w_down[sl])
        results.append(list(out.split([int(c.sum()) for c in counts[dst]])))
    returned = emulated_all_to_all(results)  # combine
    outputs = [combine(torch.cat(returned[r]), plans[r], x_shards[r].shape[0]) for r in range(e)]
    return EPEmulation(
        outputs, [load_balancing_loss(r.probs, r.experts) for r in routings],
        torch.stack([p.routed for p in plans]).sum(0),
        torch.stack([p.per_expert for p in plans]).sum(0),
        _offrank_bytes(send), _offrank_bytes(results))
