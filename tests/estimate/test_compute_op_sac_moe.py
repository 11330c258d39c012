"""torchtitan's per-op SAC on an MoE layer, against its own policy (torchtitan 0.3.0
`distributed/activation_checkpoint.py`, `SelectiveAC`): run on its MoE module with shared
experts on CPU, it recomputes every routed-expert GEMM (`aten._grouped_mm` is in neither its
save list nor torch 2.13's compute-intensive ops), the router gate (forced by
`force_recompute_mm_shapes_by_fqns`) and the shared experts' w3 (every second counted matmul of
the block; w1, w2 kept) — what `ModelSpec.op_sac_recomputed_flops` counts and
`compute.layer_cost` times."""

from __future__ import annotations

from functools import partial

import pytest

from shardwise.arch import ModelSpec
from shardwise.estimate.compute import RC_CODES, ComputeContext, layer_cost, linear
from shardwise.estimate.host import dispatch_sync
from shardwise.hardware import get_accelerator
from shardwise.layout import TrainSpec

H, F, E, K, SHARED, B, S = 64, 32, 8, 2, 2, 2, 16  # h, expert f, experts, top-k, shared, b, s


def _moe_spec() -> ModelSpec:
    """One MoE layer: 2 shared experts of f (torchtitan: one FeedForward of 2·f), d_ff ≠ f."""
    return ModelSpec(name="sac-moe", n_layers=1, d_model=H, n_heads=4, n_kv_heads=2, d_ff=96,
                     vocab=64, max_seq=64, n_experts=E, top_k=K, d_ff_expert=F,
                     n_shared_experts=SHARED).validate()


def _recomputed_by_torchtitan(monkeypatch) -> tuple[list[tuple[str, str]], float]:
    """(op, decision) of every matmul in the forward and the FLOPs of those recomputed."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchtitan")
    import torch.nn as nn
    import torchtitan.distributed.activation_checkpoint as titan_ac
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    experts_init = {"w1_EFD": init["weight"], "w2_EDF": init["weight"],
                    "w3_EFD": init["weight"]}
    config = make_moe_config(
        num_experts=E,
        router=make_router_config(dim=H, num_experts=E, gate_param_init=init, top_k=K,
                                  score_func="softmax"),
        routed_experts=make_routed_experts_config(dim=H, hidden_dim=F, num_experts=E, top_k=K,
                                                  param_init=experts_init,
                                                  comm_backend="standard"),
        shared_experts=make_ffn_config(dim=H, hidden_dim=SHARED * F, w1_param_init=init,
                                       w2w3_param_init=init))
    moe = config.build().train()
    for module in moe.modules():
        if hasattr(module, "_init_self_buffers"):
            module._init_self_buffers(buffer_device=torch.device("cpu"))
        for p in module.parameters(recurse=False):
            with torch.no_grad():
                p.normal_(0.0, 0.02)
    moe = moe.to(torch.bfloat16)
    mms = (torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default)
    seen: list[tuple[str, str]] = []
    flops = [0.0]
    original = titan_ac.create_selective_checkpoint_contexts

    def spy(policy, *args, **kwargs):
        def recording(ctx, func, *fargs, **fkwargs):
            decision = policy(ctx, func, *fargs, **fkwargs)
            if not ctx.is_recompute and func in mms:
                a, w = fargs[0], fargs[1]  # mm: (M×K)·(K×N); grouped: (R×K)·(E×K×N)
                seen.append((func.__name__.split(".")[0], decision.name))
                if decision.name != "MUST_SAVE":
                    flops[0] += 2.0 * a.shape[0] * a.shape[1] * w.shape[-1]
            return decision
        return original(recording, *args, **kwargs)

    monkeypatch.setattr(titan_ac, "create_selective_checkpoint_contexts", spy)
    wrapped = titan_ac.SelectiveAC(titan_ac.SelectiveAC.Config())._wrap_block(
        moe, base_fqn="layers.0.moe")
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    wrapped(x).float().sum().backward()
    return seen, flops[0]


def test_op_sac_recomputes_routed_experts_and_gate(monkeypatch):
    """The policy's decisions in forward order (gate, w1, w3, w2 routed, then the shared
    FeedForward's w1, w3, w2) and the recomputed FLOPs per token equal the MoE share of
    `op_sac_recomputed_flops` (its wo term taken out): `2·(3·k·h·f + n_s·h·f + h·E)`."""
    seen, flops = _recomputed_by_torchtitan(monkeypatch)
    recompute, save = "PREFER_RECOMPUTE", "MUST_SAVE"
    assert seen == [("mm", recompute)] + [("_grouped_mm", recompute)] * 3 + [
        ("mm", save), ("mm", recompute), ("mm", save)]
    model = _moe_spec()
    wo = 2.0 * model.o_dim * model.d_model
    assert model.op_sac_recomputed_flops() - wo == pytest.approx(flops / (B * S), rel=1e-12)
    assert flops / (B * S) == 2.0 * (3 * K * H * F + SHARED * H * F + H * E)


def test_op_sac_hardware_flops_add_the_recomputed_matmuls():
    """Hardware FLOPs per token under op-sac: 3 × forward plus the forward matmuls torchtitan
    recomputes on the one-layer MoE (above): the routed experts, the shared experts' w3, the
    gate, and the attention's output projection wo (2·h·h: o = heads·head_dim = h)."""
    model = _moe_spec()
    recomputed = 2.0 * (3 * K * H * F + SHARED * H * F + H * E) + 2.0 * H * H
    assert model.training_flops_per_token(S, recompute="op-sac") == pytest.approx(
        3 * model.forward_flops_per_token(S) + recomputed, rel=1e-12)


def test_op_sac_layer_time_reruns_the_routed_forward():
    """`layer_cost` on an MoE layer with shared experts under tp = 2 (SP) and ep = 4 on H100:
    forward − op-sac recompute − attention core = what op-sac keeps — QKV and the shared
    experts' w1 and w2 (their fused fc1 at 2·f/t less the recomputed w3 at f/t, and w2); the
    routed experts' GEMMs, the gate and the memory-bound ops cancel (run in both); the
    dispatcher's host round trip (`host.dispatch_sync`) is the forward's alone (op-sac keeps
    the device→host copy: torchtitan saves `_to_copy` to the CPU)."""
    model = ModelSpec(name="moe-sac", n_layers=4, d_model=2048, n_heads=16, n_kv_heads=4,
                      d_ff=5632, vocab=32000, max_seq=4096, n_experts=64, top_k=6,
                      d_ff_expert=1408, n_shared_experts=2, first_dense_layers=1).validate()
    train = TrainSpec(seq_len=4096, impl="torchtitan").validate()
    ctx = ComputeContext.of(model, get_accelerator("h100-sxm"), train)
    t, ep, b = 2, 4, 1
    cost = layer_cost(ctx, t, 1, b, 1, RC_CODES["op-sac"], moe=True, ep=ep)
    tokens = 4096 * b
    q, kv = 2048 / t, (4 // t) * 128
    f_s = 1408 / t
    kept = (linear(ctx, tokens, 2048, q + 2 * kv).fwd
            + 2 * (linear(ctx, tokens, 2048, 2 * f_s).fwd + linear(ctx, tokens, f_s, 2048).fwd
                   - linear(ctx, tokens, 2048, f_s).fwd))
    sync = dispatch_sync(ctx)
    assert sync > 0
    assert float(cost.fwd - cost.recompute - cost.attn_fwd) == pytest.approx(
        float(kept) + sync, rel=1e-9)
