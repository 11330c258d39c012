"""`shardwise demo moe`: expert parallelism on real ranks. The expert-parallel MoE layer over
`ranks` gloo processes (or under torchrun) vs the single-device layer in fp64, outputs and
gradients, with balanced routing (bytes vs SPEC §5's `estimate.comm.ep_comm_bytes_per_layer`),
random routing (bytes vs the exact split counts) and random routing with a capacity limit.

Design notes: docs/concepts/runtime.md#demos-expert_parallel.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.emulate.moe import balanced_inputs
from shardwise.estimate.comm import ep_comm_bytes_per_layer
from shardwise.layout import Layout
from shardwise.ops.moe import MoEParams, imbalance, moe_layer
from shardwise.runtime import collectives as C
from shardwise.runtime.launch import launch

__all__ = ["run_moe_demo"]

TOL = 1e-12


def _moe_worker(ranks: int, tokens: int, hidden: int, ffn: int, experts: int,
                cases: list[tuple[str, int, float | None]]) -> list[dict[str, Any]]:
    from shardwise.runtime.expert_parallel import ExpertParallelMoE, global_expert_counts
    from shardwise.runtime.mesh import Mesh

    axis = Mesh.from_layout(Layout(dp=ranks, ep=ranks)).axis("ep")
    r, local = axis.rank, experts // ranks
    mine = slice(r * tokens, (r + 1) * tokens)
    out_rows = []
    for routing, top_k, cf in cases:
        params = MoEParams.random(hidden, ffn, experts, seed=1)
        if routing == "balanced":
            x_all, params.router = balanced_inputs(ranks * tokens, hidden, experts, top_k)
            params.router.requires_grad_()
        else:
            x_all = torch.randn(ranks * tokens, hidden, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(2))
        x_all.requires_grad_()
        # every rank draws the same upstream gradient: a seeded generator, never the global one
        # (ranks started by `spawn` do not share the parent's global RNG state)
        w_all = torch.randn(x_all.shape, dtype=x_all.dtype,
                            generator=torch.Generator().manual_seed(3))
        ref = moe_layer(x_all, params, top_k, capacity_factor=cf, groups=ranks)
        ref_grads = torch.autograd.grad((ref.out * w_all).sum() + ref.aux_loss,
                                        [x_all, *params.tensors()])
        # exact expected rows: each group's kept assignments per expert, by owner rank
        kept = [moe_layer(xg.detach(), params, top_k, capacity_factor=cf).kept
                for xg in x_all.chunk(ranks)]
        owned = torch.arange(experts) // local == r
        rows_moved = int(kept[r][~owned].sum()) + sum(
            int(kept[src][owned].sum()) for src in range(ranks) if src != r)
        layer = ExpertParallelMoE.from_full(params, top_k, axis, capacity_factor=cf)
        x = x_all.detach()[mine].clone().requires_grad_()
        with C.counting() as counter:
            y, aux = layer(x)
            ((y * w_all[mine]).sum() + aux / ranks).backward()
        router_grad = layer.router.grad.clone()
        C.all_reduce(router_grad, axis)
        sl = slice(r * local, (r + 1) * local)
        diffs = [y - ref.out[mine], x.grad - ref_grads[0][mine], router_grad - ref_grads[1],
                 layer.w_gate.grad - ref_grads[2][sl], layer.w_up.grad - ref_grads[3][sl],
                 layer.w_down.grad - ref_grads[4][sl]]
        assert layer.last_stats is not None
        out_rows.append({
            "diff": max(float(d.detach().abs().max()) for d in diffs),
            "bytes": counter.bytes(axis="ep", op="all-to-all"),
            "exact": 2 * rows_moved * hidden * 8,  # forward dispatch + combine, mirrored back
            "counts": global_expert_counts(layer.last_stats, axis),
        })
    return out_rows


def run_moe_demo(ranks: int = 4, *, tokens_per_rank: int | None = None,
                 hidden: int | None = None, ffn: int = 32, experts: int | None = None,
                 top_k: int = 2,
                 capacity_factor: float = 1.0, timeout_s: float = 120) -> list[dict[str, Any]]:
    """The expert-parallel MoE on `ranks` processes vs the single-device layer (fp64, outputs
    and gradients), with balanced routing (bytes vs `ep_comm_bytes_per_layer`), random routing
    (bytes vs the exact split counts) and random routing with a capacity limit."""
    experts = experts or 2 * ranks
    tokens_per_rank = tokens_per_rank or 2 * experts  # T·k divisible by E: balanced possible
    hidden = hidden or max(16, experts)  # balanced routing needs h ≥ E
    cases: list[tuple[str, int, float | None]] = [
        ("balanced", top_k, None), ("random", top_k, None), ("random", top_k, capacity_factor)]
    per_rank = launch(_moe_worker, ranks, ranks, tokens_per_rank, hidden, ffn, experts, cases,
                      timeout_s=timeout_s)
    formula = ep_comm_bytes_per_layer(tokens_per_rank, top_k, hidden, ranks, 8)
    rows = []
    for i, (routing, k, cf) in enumerate(cases):
        results = [rank_rows[i] for rank_rows in per_rank]
        counts = results[0]["counts"]
        diff = max(r["diff"] for r in results)
        predicted = [formula if routing == "balanced" else r["exact"] for r in results]
        rows.append({
            "check": "moe", "case": f"{routing} top-{k}" + (f" cf={cf:g}" if cf else ""),
            "ranks": ranks, "routing": routing, "top_k": k, "capacity_factor": cf,
            "max_diff": diff, "bytes_measured": max(r["bytes"] for r in results),
            "bytes_predicted": max(predicted),
            "bytes_source": "SPEC §5 formula" if routing == "balanced" else "split counts",
            "ok": diff <= TOL and all(r["bytes"] == p for r, p in zip(results, predicted)),
            "tokens_per_expert": counts["routed"], "kept_per_expert": counts["kept"],
            "dropped": counts["dropped"], "imbalance": imbalance(torch.tensor(counts["routed"])),
        })
    return rows
