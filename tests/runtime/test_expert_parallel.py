"""Expert-parallel MoE on real gloo process groups against the single-device per-token loop."""

import pytest
import torch
from tests.emulate.test_moe import reference_moe

from shardwise.emulate.moe import balanced_inputs
from shardwise.estimate.comm import ep_comm_bytes_per_layer
from shardwise.ops.moe import MoEParams
from shardwise.runtime.launch import spawn

TOL = 1e-12
T, H, F, E = 8, 8, 10, 8  # tokens per rank, hidden, expert ffn, experts
CONFIGS = [  # (top_k, capacity_factor, normalize)
    (1, None, True), (2, None, True), (2, None, False), (2, 1.0, True), (2, 0.5, True),
]


def _check_moe(mesh, top_k, capacity_factor, normalize, balanced):
    """This rank's EP layer vs the reference on the ep group's tokens: outputs, aux loss,
    gradients, per-expert counts and the all-to-all bytes."""
    from shardwise.runtime import collectives as C
    from shardwise.runtime.expert_parallel import (
        COUNTS_OP,
        ExpertParallelMoE,
        global_expert_counts,
    )

    axis = mesh.axis("ep")
    e, r = axis.size, axis.rank
    group_id = axis.ranks[0] // e  # ep groups are consecutive ranks here (tp = pp = 1)
    params = MoEParams.random(H, F, E, seed=1)
    if balanced:
        x_all, router = balanced_inputs(e * T, H, E, top_k, seed=group_id)
        params.router = router.requires_grad_()
    else:
        gen = torch.Generator().manual_seed(100 + group_id)
        x_all = torch.randn(e * T, H, generator=gen, dtype=torch.float64)
    x_all.requires_grad_()
    w_all = torch.randn(e * T, H, generator=torch.Generator().manual_seed(7),
                        dtype=torch.float64)
    y_ref, aux_ref, kept_ref = reference_moe(x_all, params, top_k, capacity_factor, normalize,
                                             groups=e)
    ref_grads = torch.autograd.grad((y_ref * w_all).sum() + 0.3 * aux_ref,
                                    [x_all, *params.tensors()])

    mine = slice(r * T, (r + 1) * T)
    local = E // e
    experts = slice(r * local, (r + 1) * local)
    layer = ExpertParallelMoE.from_full(params, top_k, axis, capacity_factor=capacity_factor,
                                        normalize=normalize)
    x = x_all.detach()[mine].clone().requires_grad_()
    with C.counting() as fwd:
        y, aux = layer(x)
    with C.counting() as bwd:
        ((y * w_all[mine]).sum() + 0.3 * aux / e).backward()
    router_grad = layer.router.grad.clone()
    C.all_reduce(router_grad, axis)  # what the data-parallel all-reduce does next
    diffs = {
        "y": (y - y_ref[mine]).abs().max(),
        "x": (x.grad - ref_grads[0][mine]).abs().max(),
        "router": (router_grad - ref_grads[1]).abs().max(),
        "w_gate": (layer.w_gate.grad - ref_grads[2][experts]).abs().max(),
        "w_up": (layer.w_up.grad - ref_grads[3][experts]).abs().max(),
        "w_down": (layer.w_down.grad - ref_grads[4][experts]).abs().max(),
    }
    aux_mean = aux.detach().clone()
    C.all_reduce(aux_mean, axis)  # the layer's loss: the mean of the ranks' Switch losses
    diffs["aux"] = (aux_mean / e - aux_ref).abs()
    # Exact rows this rank sends to / receives from the others, from the reference's routing.
    owner = [i // local for i in range(E)]
    sent = sum(kept_ref[r][i] for i in range(E) if owner[i] != r)
    received = sum(kept_ref[src][i] for src in range(e) if src != r
                   for i in range(E) if owner[i] == r)
    return {
        "e": e, "rank": r, "top_k": top_k, "cf": capacity_factor, "balanced": balanced,
        "diffs": {name: float(value.detach()) for name, value in diffs.items()},
        "fwd": fwd.bytes(axis="ep", op="all-to-all"), "bwd": bwd.bytes(axis="ep", op="all-to-all"),
        "counts_bytes": fwd.bytes(axis="ep", op=COUNTS_OP), "bwd_other": bwd.as_dict(),
        "expected_dispatch": sent * H * 8, "expected_combine": received * H * 8,
        "counts": global_expert_counts(layer.last_stats, axis),
        "kept_ref": [sum(col) for col in zip(*kept_ref)],
        "routed_rows": int(layer.last_stats.routed.sum()),
    }


def _worker(dp, ep, configs, balanced):
    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh

    mesh = Mesh.from_layout(Layout(dp=dp, ep=ep))
    return [_check_moe(mesh, *cfg, balanced) for cfg in configs]


def _assert_rows(results, e):
    for rows in results:
        for row in rows:
            assert row["e"] == e
            assert max(row["diffs"].values()) < TOL, row
            # measured all-to-all bytes: dispatch + combine forward, mirrored backward
            expected = row["expected_dispatch"] + row["expected_combine"]
            assert row["fwd"] == expected and row["bwd"] == expected, row
            assert row["counts_bytes"] == (e - 1) * (E // e) * 8  # int64 counts, off-rank
            assert set(row["bwd_other"]) == {"ep/all-to-all"}  # no count exchange backward
            assert row["counts"]["kept"] == row["kept_ref"]
            assert row["counts"]["dropped"] == sum(row["counts"]["routed"]) - sum(
                row["kept_ref"])
            assert row["routed_rows"] == T * row["top_k"]


@pytest.mark.slow
@pytest.mark.parametrize("dp,ep", [(4, 4), (4, 2)])
def test_expert_parallel_equals_single_device(dp, ep):
    results = spawn(_worker, dp, dp, ep, CONFIGS, False, timeout_s=90)
    _assert_rows(results, ep)
    dropped = [row["counts"]["dropped"] for row in results[0]]
    assert dropped[:3] == [0, 0, 0] and dropped[4] > dropped[3] > 0  # cf 1.0, then 0.5


@pytest.mark.slow
@pytest.mark.parametrize("dp,ep", [(4, 4), (4, 2), (8, 8)])
def test_balanced_routing_bytes_equal_spec_ep_formula(dp, ep):
    results = spawn(_worker, dp, dp, ep, [(1, None, True), (2, None, True)], True,
                    timeout_s=120)
    _assert_rows(results, ep)
    for rows in results:
        for row in rows:
            k = row["top_k"]
            assert row["counts"]["routed"] == [ep * T * k // E] * E
            assert row["counts"]["imbalance"] == 1.0
            assert row["fwd"] == ep_comm_bytes_per_layer(T, k, H, ep, 8, backward=False)
            assert row["fwd"] + row["bwd"] == ep_comm_bytes_per_layer(T, k, H, ep, 8)


def test_group_of_one_runs_all_experts_locally():
    from shardwise.ops.moe import moe_layer
    from shardwise.runtime import collectives as C
    from shardwise.runtime.expert_parallel import ExpertParallelMoE
    from shardwise.runtime.mesh import AxisGroup

    single = AxisGroup("ep", None, 1, 0, (0,))
    params = MoEParams.random(H, F, E, seed=2)
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    layer = ExpertParallelMoE.from_full(params, 2, single, capacity_factor=1.0)
    with C.counting() as counter:
        y, aux = layer(x)
    y_ref, aux_ref, _ = reference_moe(x, params, 2, 1.0)
    assert (y - y_ref).abs().max() < TOL and abs(float((aux - aux_ref).detach())) < TOL
    assert counter.bytes() == 0
    assert layer.last_stats.dropped == moe_layer(x, params, 2, capacity_factor=1.0).dropped
