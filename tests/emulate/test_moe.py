"""Mixture of experts and emulated expert parallelism against a plain per-token loop."""

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.emulate.moe import balanced_inputs, ep_moe_emulated
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ep_comm_bytes_per_layer
from shardwise.ops.moe import (
    MoEParams,
    capacity_keep,
    expert_capacity,
    imbalance,
    load_balancing_loss,
    moe_layer,
    route,
)

TOL = 1e-12


def reference_moe(x, params, top_k, capacity_factor=None, normalize=True, groups=1):
    """Token by token: softmax router, k best experts, first-come capacity per group,
    SwiGLU experts; Switch aux loss averaged over groups.

    Returns (y, aux, kept) with kept[g][i] the assignments expert i kept from group g."""
    num_experts = params.num_experts
    rows, losses, kept = [], [], []
    for xg in x.chunk(groups):
        tokens = xg.shape[0]
        cap = math.inf if capacity_factor is None else math.ceil(
            capacity_factor * tokens * top_k / num_experts)
        used = [0] * num_experts
        kept.append(used)
        probs = torch.softmax(xg @ params.router, dim=-1)
        counts = [0] * num_experts
        for t in range(tokens):
            best = torch.argsort(probs[t], descending=True, stable=True)[:top_k].tolist()
            total = sum(probs[t, i] for i in best)
            y = torch.zeros_like(xg[t])
            for i in best:
                counts[i] += 1
                if used[i] >= cap:
                    continue
                used[i] += 1
                gate = probs[t, i] / total if normalize else probs[t, i]
                hidden = F.silu(xg[t] @ params.w_gate[i]) * (xg[t] @ params.w_up[i])
                y = y + gate * (hidden @ params.w_down[i])
            rows.append(y)
        f = torch.tensor(counts, dtype=x.dtype) / (tokens * top_k)
        losses.append(num_experts * sum(f[i] * probs[:, i].mean() for i in range(num_experts)))
    return torch.stack(rows), sum(losses) / groups, kept


def grads(outputs, aux, tensors, weight):
    loss = (outputs * weight).sum() + 0.3 * aux
    return torch.autograd.grad(loss, tensors)


def setup(tokens=24, hidden=6, ffn=10, experts=8, seed=0):
    params = MoEParams.random(hidden, ffn, experts, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    return params, x, weight


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("groups", [1, 4])
def test_moe_layer_equals_token_loop(top_k, capacity_factor, normalize, groups):
    params, x, weight = setup()
    got = moe_layer(x, params, top_k, capacity_factor=capacity_factor, normalize=normalize,
                    groups=groups)
    y, aux, kept = reference_moe(x, params, top_k, capacity_factor, normalize, groups)
    assert (got.out - y).abs().max() < TOL
    assert abs(float((got.aux_loss - aux).detach())) < TOL
    assert got.kept.tolist() == [sum(col) for col in zip(*kept)]
    assert int(got.routed.sum()) == x.shape[0] * top_k
    assert got.dropped == x.shape[0] * top_k - sum(map(sum, kept))
    tensors = [x, *params.tensors()]
    for a, b in zip(grads(got.out, got.aux_loss, tensors, weight),
                    grads(y, aux, tensors, weight)):
        assert (a - b).abs().max() < TOL


@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (2, 1.0), (2, 0.5)])
def test_emulated_expert_parallel_equals_single_device(e, top_k, capacity_factor):
    params, x, weight = setup(tokens=32)
    ep = ep_moe_emulated(list(x.chunk(e)), params, top_k, capacity_factor=capacity_factor)
    out, aux = torch.cat(ep.outputs), torch.stack(ep.aux_losses).mean()
    y, ref_aux, kept = reference_moe(x, params, top_k, capacity_factor, groups=e)
    assert (out - y).abs().max() < TOL
    assert abs(float((aux - ref_aux).detach())) < TOL
    assert ep.kept.tolist() == [sum(col) for col in zip(*kept)]
    tensors = [x, *params.tensors()]
    for a, b in zip(grads(out, aux, tensors, weight), grads(y, ref_aux, tensors, weight)):
        assert (a - b).abs().max() < TOL


def test_capacity_drops_in_token_order_and_dropped_tokens_pass_as_zero():
    experts = torch.tensor([[0], [0], [1], [0], [0]])
    assert capacity_keep(experts, 2, 2).flatten().tolist() == [True, True, True, False, False]
    assert capacity_keep(experts, 2, None).all()
    assert expert_capacity(tokens=5, top_k=1, num_experts=2, capacity_factor=1.0) == 3
    # top-1 with a tiny capacity: tokens whose only expert is full come out exactly zero
    params, x, _ = setup(tokens=16)
    result = moe_layer(x, params, 1, capacity_factor=0.25)
    cap = expert_capacity(16, 1, 8, 0.25)
    assert (result.kept <= cap).all()
    assert result.dropped == 16 - int(result.kept.sum()) > 0
    zero_rows = int((result.out.abs().sum(dim=1) == 0).sum())
    assert zero_rows == result.dropped


def test_gates_normalised_or_raw():
    params, x, _ = setup()
    mixtral = route(x, params.router, 2, normalize=True)
    assert (mixtral.gates.sum(dim=1) - 1).abs().max() < TOL
    raw = route(x, params.router, 2, normalize=False)
    assert torch.equal(raw.gates, raw.probs.gather(1, raw.experts))
    with pytest.raises(ShardwiseError, match="top_k"):
        route(x, params.router, 9)


def test_load_balancing_loss_bounds():
    num_experts, tokens = 4, 8
    uniform = torch.full((tokens, num_experts), 1 / num_experts, dtype=torch.float64)
    balanced = torch.arange(tokens).remainder(num_experts)[:, None]
    assert float(load_balancing_loss(uniform, balanced)) == pytest.approx(1.0, abs=TOL)
    collapsed = F.one_hot(torch.zeros(tokens, dtype=torch.long), num_experts).double()
    assert float(load_balancing_loss(collapsed, torch.zeros(tokens, 1, dtype=torch.long))
                 ) == pytest.approx(num_experts, abs=TOL)


@pytest.mark.parametrize("e,top_k", [(2, 1), (2, 2), (4, 2)])
def test_balanced_routing_bytes_equal_spec_ep_formula(e, top_k):
    tokens_per_rank, hidden, experts = 16, 8, 8
    x, router = balanced_inputs(e * tokens_per_rank, hidden, experts, top_k, seed=e)
    params = MoEParams.random(hidden, 12, experts, seed=3)
    params.router = router
    ep = ep_moe_emulated(list(x.chunk(e)), params, top_k)
    assert ep.routed.tolist() == [e * tokens_per_rank * top_k // experts] * experts
    assert imbalance(ep.routed) == 1.0
    one = ep_comm_bytes_per_layer(tokens_per_rank, top_k, hidden, e, 8, backward=False) / 2
    assert ep.dispatch_bytes == [one] * e
    assert ep.combine_bytes == [one] * e


def test_unbalanced_bytes_follow_the_split_counts():
    params, x, _ = setup(tokens=32, hidden=6)
    e, top_k = 4, 2
    ep = ep_moe_emulated(list(x.chunk(e)), params, top_k)
    local = params.num_experts // e
    for rank, xr in enumerate(x.chunk(e)):
        experts = route(xr, params.router, top_k).experts.flatten()
        off_rank = int(((experts // local) != rank).sum())
        assert ep.dispatch_bytes[rank] == off_rank * 6 * 8
    assert imbalance(ep.routed) > 1.0


def test_groups_must_divide_tokens():
    params, x, _ = setup(tokens=10)
    with pytest.raises(ShardwiseError, match="groups"):
        moe_layer(x, params, 1, groups=4)
