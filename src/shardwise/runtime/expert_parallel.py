"""Expert parallelism: an MoE layer whose experts are sharded over the `ep` axis (GShard,
Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021).

Design notes: docs/concepts/runtime.md#runtime-expert_parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from shardwise.errors import ShardwiseError
from shardwise.estimate.check import COUNTS_OP
from shardwise.ops.moe import (
    MoEParams,
    RoutingRule,
    SequenceShards,
    gather_rows,
    imbalance,
    load_balancing_loss,
    run_local_experts,
    weighted_combine,
)
from shardwise.runtime import collectives as C
from shardwise.runtime.mesh import AxisGroup

__all__ = ["COUNTS_OP", "EPStats", "ExpertParallelMoE", "all_to_all", "expert_parallel_moe",
           "global_expert_counts"]


class _AllToAll(torch.autograd.Function):
    """Rows (N_in, …) split `in_splits` to the ranks -> rows (N_out, …) split `out_splits`
    from them; backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                g: AxisGroup, counter: C.CommCounter | None) -> torch.Tensor:
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        C.all_to_all_single(out, x.contiguous(), out_splits, in_splits, g, counter=counter)
        ctx.splits, ctx.g, ctx.counter = (out_splits, in_splits), g, counter
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        C.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, ctx.g,
                            counter=ctx.counter)
        return grad_in, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: C.GroupLike = "ep", *, counter: C.CommCounter | None = None
               ) -> torch.Tensor:
    """Differentiable `all_to_all_single` along dim 0 with uneven splits (counted)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), C.resolve(group), counter)


@dataclass
class EPStats:
    """One rank's view of one MoE forward.

    routed (E,): this rank's assignments per expert before the capacity limit; kept (E,):
    after it; local_expert_rows (E/e,): rows this rank's experts processed (from all ranks);
    sent_rows / received_rows: row splits of the dispatch (per rank of the group).
    """

    routed: torch.Tensor
    kept: torch.Tensor
    local_expert_rows: torch.Tensor
    sent_rows: list[int]
    received_rows: list[int]

    @property
    def dropped(self) -> int:
        return int((self.routed - self.kept).sum())


def expert_parallel_moe(x: torch.Tensor, router: torch.Tensor, w_gate: torch.Tensor,
                        w_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
                        group: C.GroupLike = "ep", *, capacity_factor: float | None = None,
                        normalize: bool = True, counter: C.CommCounter | None = None,
                        shards: SequenceShards | None = None,
                        routing: RoutingRule | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, EPStats]:
    """The expert-parallel MoE forward on this rank's tokens x (T, h).

    router (h, E) is replicated; w_gate, w_up (E/e, h, f) and w_down (E/e, f, h) are this
    rank's experts. Returns (y (T, h), this rank's aux loss, stats). `shards`: this rank's
    tokens are part of sequences split over other ranks too (cp, SP): the aux loss is this
    rank's share of their group's (`ops.moe.load_balancing_loss`). `routing`: the router's
    rule (`ops.moe.RoutingRule`: DeepSeek's scores, groups, bias, scale; its top_k and
    normalize replace those given)."""
    g = C.resolve(group)
    e, local = g.size, w_gate.shape[0]
    num_experts = router.shape[1]
    if local * e != num_experts:
        raise ShardwiseError(f"{local} local experts × ep={e} ranks ≠ n_experts={num_experts}")
    rule = replace(routing or RoutingRule(top_k, normalize), num_ranks=e,
                   capacity_factor=capacity_factor)
    probs = rule.probs(x, router)  # saved: x and probs; the plan is recomputed in backward
    rule = rule.for_group(probs, shards)  # capacity over sequences split over ranks too
    routing, plan = rule.plan(probs)
    # Count exchange: (E,) = (e, E/e) per destination -> (e, E/e) per source, for my experts.
    counts = torch.empty_like(plan.per_expert)
    with C.labelled(COUNTS_OP):
        C.all_to_all_single(counts, plan.per_expert.contiguous(), None, None, g,
                            counter=counter)
    counts = counts.reshape(e, local)  # rows from source s for local expert j
    send, recv = plan.send.tolist(), counts.sum(dim=1).tolist()
    received = all_to_all(gather_rows(x, probs, plan, rule), recv, send, g, counter=counter)  # (N_recv, h)
    expert_out = run_local_experts(received, counts, w_gate, w_up, w_down)  # (N_recv, h)
    if not int(counts.sum()) and torch.is_grad_enabled():
        # No rows reached my experts. Keep both all-to-alls in the graph (a zero-size term) so
        # this rank still joins them in backward, where its peers wait for it, and give every
        # local expert weight a zero gradient (a zero-valued term): its gradient reduction over
        # the expert-data-parallel group (ZeRO-2's hook, ZeRO-3's reduce-scatter) then runs
        # on every rank, in the same order, with a missing gradient counted as zeros.
        expert_out = expert_out + 0 * received + 0 * (w_gate.sum() + w_up.sum() + w_down.sum())
    returned = all_to_all(expert_out, send, recv, g, counter=counter)  # (N_send, h)
    y = weighted_combine(returned, probs, plan, rule)
    stats = EPStats(plan.routed, plan.per_expert, counts.sum(dim=0), send, recv)
    return y, load_balancing_loss(probs, routing.experts, shards), stats


def global_expert_counts(stats: EPStats, group: C.GroupLike = "ep", *,
                         counter: C.CommCounter | None = None) -> dict[str, Any]:
    """Per-expert assignments over the whole ep group (an all-reduce of the local counts):
    {"routed": [...], "kept": [...], "dropped": int, "imbalance": max/mean of routed}."""
    both = torch.stack((stats.routed, stats.kept)).to(torch.float64)  # (2, E)
    C.all_reduce(both, group, counter=counter)
    routed, kept = both[0].round().long(), both[1].round().long()
    return {"routed": routed.tolist(), "kept": kept.tolist(),
            "dropped": int((routed - kept).sum()), "imbalance": imbalance(routed)}


class ExpertParallelMoE(torch.nn.Module):
    """An MoE layer holding the replicated router and this rank's slice of the experts."""

    def __init__(self, router: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, top_k: int, group: C.GroupLike = "ep", *,
                 capacity_factor: float | None = None, normalize: bool = True):
        super().__init__()
        self.router = torch.nn.Parameter(router.detach().clone())
        self.w_gate = torch.nn.Parameter(w_gate.detach().clone())
        self.w_up = torch.nn.Parameter(w_up.detach().clone())
        self.w_down = torch.nn.Parameter(w_down.detach().clone())
        self.top_k, self.group = top_k, group
        self.capacity_factor, self.normalize = capacity_factor, normalize
        self.last_stats: EPStats | None = None

    @classmethod
    def from_full(cls, params: MoEParams, top_k: int, group: C.GroupLike = "ep",
                  **kw: Any) -> ExpertParallelMoE:
        """Take this rank's experts [r·E/e, (r+1)·E/e) from the full parameters."""
        g = C.resolve(group)
        if params.num_experts % g.size:
            raise ShardwiseError(f"ep={g.size} does not divide n_experts={params.num_experts}")
        local = params.num_experts // g.size
        sl = slice(g.rank * local, (g.rank + 1) * local)
        return cls(params.router, params.w_gate[sl], params.w_up[sl], params.w_down[sl], top_k,
                   g, **kw)

    def forward(self, x: torch.Tensor, counter: C.CommCounter | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, h) -> (y (T, h), this rank's load-balancing loss)."""
        y, aux, self.last_stats = expert_parallel_moe(
            x, self.router, self.w_gate, self.w_up, self.w_down, self.top_k, self.group,
            capacity_factor=self.capacity_factor, normalize=self.normalize, counter=counter)
        return y, aux
