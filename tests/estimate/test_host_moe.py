"""The host's launches of an MoE layer's experts on the fused (Megatron-Core + Transformer
Engine) stack: Megatron-Core 0.16.1's `TEGroupedMLP`, run on CPU with stand-in grouped
linears, makes one grouped-linear call for fc1 and one for fc2 per forward, each over all
`E/ep` local experts (the GEMMs TE's GroupedLinear then launches one by one,
`host._EXPERT_GEMMS`); `layer_cost` charges the experts the slower of their device time
and that host time after the dispatcher's sync, and leaves a dense layer alone."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.arch import ModelSpec
from shardwise.estimate.compute import ComputeContext, layer_cost
from shardwise.estimate.host import (
    _EXPERT_GEMMS,
    _GROUPED_GEMM_HOST,
    _QUANTIZE_KERNELS,
    dispatch_sync,
    expert_host,
    expert_launches,
    host_ops,
    host_overhead,
)
from shardwise.hardware import get_accelerator
from shardwise.layout import TrainSpec

# small experts (f 96 ≠ h 128), shared experts, top-4 of 32: host-bound on a B200
MOE = ModelSpec(name="small-experts", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2,
                d_ff=384, vocab=256, max_seq=256, n_experts=32, top_k=4, d_ff_expert=96,
                n_shared_experts=1).validate()


def _ctx(fp8: str | None = None, accelerator: str = "b200") -> ComputeContext:
    train = TrainSpec(seq_len=256, global_batch=8, fp8=fp8, impl="megatron-te")
    return ComputeContext.of(MOE, get_accelerator(accelerator), train)


def test_megatron_te_grouped_mlp_calls_two_grouped_linears_over_the_local_experts():
    """Megatron-Core's TEGroupedMLP builds fc1 and fc2 with `num_local_experts` GEMMs and
    calls each once per forward with the per-expert row counts: 2 GEMMs per local expert
    forward, whose dgrad and wgrad make 4 backward — `_EXPERT_GEMMS`."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    calls: list[tuple[int, list[int]]] = []

    class GroupedLinear(torch.nn.Module):  # stands in for TE's GroupedLinear
        def __init__(self, num_gemms, in_features, out_features, **_):
            super().__init__()
            self.num_gemms, self.out = num_gemms, out_features

        def forward(self, x, m_splits):
            calls.append((self.num_gemms, list(m_splits)))
            return torch.zeros(x.shape[0], self.out), None

    local = 6
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            num_moe_experts=4 * local, moe_ffn_hidden_size=24,
                            gated_linear_unit=True, add_bias_linear=False,
                            bias_activation_fusion=False)
    groups = type("PG", (), {"ep": None, "expt_tp": None})()
    mlp = TEGroupedMLP(local, cfg, MLPSubmodules(linear_fc1=GroupedLinear,
                                                 linear_fc2=GroupedLinear), groups)
    rows = torch.tensor([3, 0, 5, 2, 1, 4])
    mlp(torch.zeros(int(rows.sum()), 32), rows, torch.ones(int(rows.sum())))
    assert calls == [(local, rows.tolist())] * _EXPERT_GEMMS[0]
    assert _EXPERT_GEMMS[1] == 2 * _EXPERT_GEMMS[0]  # each forward GEMM: dgrad + wgrad


@pytest.mark.parametrize("fp8, casts", [(None, 0), ("delayed", 0), ("tensorwise", 6),
                                         ("mxfp8", 2)])
def test_expert_launches_per_recipe(fp8, casts):
    """Per local expert: 2 GEMMs forward, 4 backward, and 2 casts each way of the recipe's
    kernels (current scaling amax + scale + cast, MXFP8 one, delayed scaling none per
    expert: one fused multi-tensor cast for all); the host time prices GEMMs at TE's
    multi-stream loop cost, casts at `kernel_overhead`."""
    accelerator = "h100-sxm" if fp8 in ("delayed", "tensorwise") else "b200"
    ctx = _ctx(fp8, accelerator)
    local = 8.0
    fwd, bwd = expert_launches(ctx, local)
    assert (fwd, bwd) == (local * (2 + casts), local * (4 + casts))
    assert casts == (2 * _QUANTIZE_KERNELS[fp8] if fp8 else 0)
    host_f, host_b = expert_host(ctx, local)
    cost = ctx.calibration.kernel_overhead
    assert host_f == pytest.approx(local * (2 * _GROUPED_GEMM_HOST + casts * cost))
    assert host_b == pytest.approx(local * (4 * _GROUPED_GEMM_HOST + casts * cost))


def test_host_bound_experts_set_the_forward_after_the_sync():
    """With 32 small experts on one rank the experts' launches outlast their GEMMs: the
    forward is the layer's first part (max of device and host), the dispatcher's sync,
    then the experts' host time; halving the local experts (ep 2) takes off half of it."""
    ctx = _ctx("mxfp8")
    t, c, b, sp, rc = 1, 1, 2, False, 0
    costs = {ep: layer_cost(ctx, t, c, b, sp, rc, moe=True, ep=ep) for ep in (1, 2)}
    for ep, cost in costs.items():
        host_f, host_b = expert_host(ctx, MOE.n_experts / ep)
        ops_f, ops_b = host_ops(ctx, t, c, sp, True, ep)
        first = host_overhead(ctx, ops_f)
        assert cost.fwd >= first + dispatch_sync(ctx) + host_f - 1e-12
        assert cost.bwd == pytest.approx(host_overhead(ctx, ops_b) + host_b)  # host-bound
    delta_f = expert_host(ctx, MOE.n_experts)[0] - expert_host(ctx, MOE.n_experts / 2)[0]
    # the first part's device time shrinks too (the tokens' share of the router is the same)
    assert costs[1].fwd - costs[2].fwd == pytest.approx(delta_f, rel=0.05)


def test_device_bound_attention_cannot_hide_the_experts_launches():
    """A wide attention part keeps the device busy longer than the host needs to launch it,
    but the dispatcher's sync drains the device before the experts: their host time adds
    to the forward instead of hiding under the attention's GEMMs (a single max over the
    whole layer would hide it)."""
    wide = ModelSpec(name="wide-attn-small-experts", n_layers=2, d_model=4096, n_heads=32,
                     n_kv_heads=8, d_ff=8192, vocab=256, max_seq=4096, n_experts=64,
                     top_k=2, d_ff_expert=64, n_shared_experts=1).validate()
    train = TrainSpec(seq_len=4096, global_batch=8, impl="megatron-te")
    ctx = ComputeContext.of(wide, get_accelerator("b200"), train)
    bf16 = layer_cost(ctx, 1, 1, 1, False, 0, moe=True, ep=1)
    host_f, _ = expert_host(ctx, wide.n_experts)
    ops_f, _ = host_ops(ctx, 1, 1, False, True, 1)
    from shardwise.estimate.compute import linear

    tokens = 4096
    rows = tokens * wide.top_k / wide.n_experts
    experts = wide.n_experts * (linear(ctx, rows, 4096, 2 * 64) + linear(ctx, rows, 64, 4096))
    assert experts.fwd < host_f  # the experts are host-bound ...
    first = bf16.fwd - dispatch_sync(ctx) - host_f
    assert first > host_overhead(ctx, ops_f)  # ... the layer's first part device-bound
    kv = 8 * 128
    gemms = linear(ctx, tokens, 4096, 4096 + 2 * kv).fwd + linear(ctx, tokens, 4096, 4096).fwd
    assert first >= gemms  # at least its QKV and output projections
    one_max = max(first + experts.fwd, host_overhead(ctx, ops_f) + host_f) + dispatch_sync(ctx)
    assert bf16.fwd - one_max > 0.5 * min(first, host_f)


def test_dense_layer_and_runtime_preset_unchanged():
    """A dense layer's passes stay max(device, host) of the fused kernel count, and the
    "this machine" preset's runtime count carries no TE expert term."""
    ctx = _ctx()
    dense = layer_cost(ctx, 1, 1, 2, False, 0)
    ops_f, _ = host_ops(ctx, 1, 1, False)
    assert dense.fwd >= host_overhead(ctx, ops_f)
    assert np.all(np.asarray(expert_host(ctx, np.array([4.0, 8.0]))) > 0)
    from dataclasses import replace

    runtime = replace(ctx, calibration=replace(ctx.calibration, op_count="runtime"))
    assert expert_host(runtime, 8.0) == (0.0, 0.0)


def test_the_runtime_count_of_an_expert_parallel_layer_in_its_cost():
    """"this machine" (runtime op count, host and device one after the other): the host part of
    an MoE layer's forward at ep = 2 is `kernel_overhead` × the runtime's ops with the EP
    exchange and its E/ep = 16 local experts (all receiving rows), not ep = 1's 32 without."""
    from dataclasses import replace

    from shardwise.estimate.host import _OPS_EP, _OPS_EP_EXPERT, _OPS_EXPERT, _OPS_MOE_LAYER

    ctx = _ctx()
    runtime = replace(ctx, calibration=replace(ctx.calibration, op_count="runtime"),
                      experts_active=1.0)
    free = replace(runtime, calibration=replace(runtime.calibration, kernel_overhead=0.0))
    host = (layer_cost(runtime, 1, 1, 1, False, 0, moe=True, ep=2).fwd
            - layer_cost(free, 1, 1, 1, False, 0, moe=True, ep=2).fwd)
    ops = _OPS_MOE_LAYER + _OPS_EXPERT * 16 + _OPS_EP + _OPS_EP_EXPERT * 16
    assert host == pytest.approx(runtime.calibration.kernel_overhead * ops / 3)
