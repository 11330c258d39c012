"""estimate/host.py against what it counts: the parameter tensors of shardwise's own runtime
model (whose optimizer step `optimizer_host_ops` prices per tensor), the aten-op counts its
comments record (`_OPS_*`: 385 for 4 experts on one rank, 349 for 2 per rank under ep = 2,
395 / 607 under ring attention at c = 2 / 4), the fused kernel count of a Megatron layer
(10 + the attention core, MLA's 5 or 3 more, CUDA-graphed scopes one launch), the eager and
compiled stacks' GEMMs, and the dispatcher's sync (the host link's latency + one launch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.estimate.compute import RC_CODES, head_cost, layer_cost
from shardwise.estimate.host import (
    _QUANTIZE_KERNELS,
    dispatch_sync,
    expert_host,
    expert_launches,
    host_ops,
    optimizer_host_ops,
)
from shardwise.estimate.kernels import ComputeContext
from shardwise.hardware import get_accelerator, get_link
from shardwise.layout import TrainSpec
from tests.estimate.test_compute_closed_forms import (
    ACTIVE,
    GQA,
    LOAD,
    MLA_MOE,
    SEQ,
    _mla_moe_flops,
    _sync,
)
from tests.estimate.test_compute_closed_forms import _ctx as _priced

H100 = get_accelerator("h100")
MOE4 = ModelSpec(name="moe4", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                 vocab=128, max_seq=128, n_experts=4, top_k=2, d_ff_expert=32).validate()
# MLA without a q latent, two shared experts, a dense first layer
MLA_NOQ = ModelSpec(name="mla-noq", n_layers=3, d_model=64, n_heads=4, n_kv_heads=4,
                    d_ff=128, vocab=128, max_seq=128, n_experts=4, top_k=2, d_ff_expert=32,
                    n_shared_experts=2, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=12, first_dense_layers=1).validate()
QKV_BIAS = ModelSpec(name="qkv-bias", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                     d_ff=128, vocab=128, qkv_bias=True, max_seq=128).validate()
_SMALL = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab=128,
              max_seq=128)
RUNTIME_MODELS = {
    "qkv-bias": QKV_BIAS, "mla-noq": MLA_NOQ,
    # every bias (q, k, v, o; the runtime's dense MLP has none), tied head
    "biased-tied": ModelSpec(name="biased-tied", bias=True, tie_embeddings=True, **_SMALL),
    "out-bias": ModelSpec(name="out-bias", out_bias=True, mlp_bias=True, **_SMALL),
    # gpt-oss-like experts: router bias, stacked expert biases
    "moe-bias": ModelSpec(name="moe-bias", n_experts=4, top_k=2, d_ff_expert=32,
                          mlp_bias=True, router_bias=True, out_bias=True, **_SMALL),
}


def _ctx(model: ModelSpec, runtime: bool = False, **train) -> ComputeContext:
    ctx = ComputeContext.of(model, H100, TrainSpec(seq_len=128, **train))
    if runtime:
        ctx = replace(ctx, calibration=replace(ctx.calibration, op_count="runtime"))
    return ctx


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-deepseek", *RUNTIME_MODELS])
def test_optimizer_ops_are_14_per_tensor_of_the_runtime_model(name):
    """`_OPS_OPT_TENSOR` = 14 aten ops (AdamW foreach=False 10, the global norm 3, the clip
    1) per parameter tensor of the runtime's model on the rank — its MoE experts are stacked
    tensors (one per matrix for all local experts, one for the shared ones); without the
    embedding on a later stage one tensor fewer; 0 on the fused GPU presets."""
    torch = pytest.importorskip("torch")
    from shardwise.runtime.model.transformer import Transformer

    model = RUNTIME_MODELS.get(name) or get_model(name)
    with torch.device("meta"):
        tensors = len(list(Transformer(model).parameters()))
    ctx = _ctx(model, runtime=True)
    for ep in (1, 2):
        assert optimizer_host_ops(ctx, model.n_dense_layers, model.n_moe_layers, ep,
                                  True) == 14 * tensors
    assert optimizer_host_ops(ctx, model.n_dense_layers, model.n_moe_layers, 1,
                              False) == 14 * (tensors - 1)
    assert optimizer_host_ops(_ctx(model), 3, 1, 1, True) == 0
    assert optimizer_host_ops(_ctx(model), 0, 2, 1, True) == 0  # a stage of MoE layers


def test_runtime_op_counts_are_the_counted_ones():
    """The runtime's counts per layer and micro-batch (⅓ forward, ⅔ backward): dense 190,
    tp's f/g +6, SP's gathers +48 more (only with tp > 1), ring attention 395 at c = 2 and
    607 at c = 4; an MoE layer with 4 experts on one rank 385, 2 per rank under ep = 2 349;
    an expert without rows launches nothing."""
    def total(ctx, t=1, c=1, sp=False, moe=False, ep=1):
        fwd, bwd = host_ops(ctx, t, c, sp, moe, ep)
        assert bwd == pytest.approx(2 * fwd)
        return fwd + bwd

    dense = _ctx(MOE4, runtime=True)
    assert total(dense) == pytest.approx(190)
    assert total(dense, t=2) == pytest.approx(196)
    assert total(dense, t=2, sp=True) == pytest.approx(244)
    assert total(dense, t=1, sp=True) == pytest.approx(190)
    assert total(dense, c=2) == pytest.approx(395)
    assert total(dense, c=4) == pytest.approx(607)
    assert total(dense, moe=True) == pytest.approx(385)
    assert total(dense, moe=True, ep=2) == pytest.approx(349)
    half = _ctx(MOE4, runtime=True, experts_active=0.5)  # 2 of 4 / 1 of 2 with rows
    assert total(half, moe=True) == pytest.approx(385 - 2 * 31)
    assert total(half, moe=True, ep=2) == pytest.approx(349 - 31 - 5)


def test_fused_kernel_counts_and_graphs():
    """Megatron's fused layer: 10 kernels forward (QKV, out-proj, two MLP GEMMs, two norms,
    two residual adds, the activation, QKV post-processing) + the attention core (1 flash,
    4 materialised), MLA 5 more with a q latent, 3 without; backward twice; a graphed scope
    is one launch (attn: all but the MLP's 4; mlp: a dense layer's 4; moe: an MoE layer's)."""
    assert host_ops(_ctx(MOE4), 2, 2, True) == (11, 22)
    assert host_ops(_ctx(MOE4, flash_attention=False), 1, 1, False) == (14, 28)
    assert host_ops(_ctx(get_model("tiny-deepseek")), 1, 1, False, True) == (16, 32)
    assert host_ops(_ctx(MLA_NOQ), 1, 1, False) == (14, 28)
    graphs = {s: replace(_ctx(MOE4), cuda_graph=s) for s in
              [("attn",), ("mlp",), ("moe",), ("attn", "mlp")]}
    assert host_ops(graphs[("attn",)], 1, 1, False) == (5, 10)
    assert host_ops(graphs[("mlp",)], 1, 1, False) == (8, 16)
    assert host_ops(graphs[("mlp",)], 1, 1, False, True) == (11, 22)  # not an MoE scope
    assert host_ops(graphs[("moe",)], 1, 1, False, True) == (8, 16)
    assert host_ops(graphs[("moe",)], 1, 1, False) == (11, 22)  # not a dense scope
    assert host_ops(graphs[("attn", "mlp")], 1, 1, False) == (2, 4)


def test_eager_and_compiled_counts_add_the_gemms():
    """Eager/compiled stacks: the stack's own kernels per layer, MLA's extra ones, the five
    GEMMs of a dense layer (three per expert that runs, and the router, in an MoE layer;
    backward two per GEMM) and the attention core."""
    for compile_ in (True, False):
        ctx = _ctx(get_model("tiny-deepseek"), impl="torchtitan", compile=compile_,
                   experts_active=0.5)
        kf, kb = ctx.layer_kernels
        assert ctx.traffic is not None and kf > 0
        assert host_ops(ctx, 1, 1, False) == pytest.approx((kf + 5 + 5 + 1, kb + 5 + 10 + 1))
        e = ctx.model.n_experts
        gemms = 2 + 3 * e / 2 * 0.5 + 1
        assert host_ops(ctx, 1, 1, False, True, 2) == pytest.approx(
            (kf + 5 + gemms + 1, kb + 5 + 2 * gemms + 1))
        assert expert_host(ctx, 4.0) == (0.0, 0.0)  # no TE grouped GEMM loop there
    materialised = replace(_ctx(MOE4, impl="torchtitan", compile=True), flash=False)
    kf, kb = materialised.layer_kernels
    assert host_ops(materialised, 1, 1, False) == pytest.approx((kf + 5 + 4, kb + 10 + 4))


def test_expert_casts_per_recipe_kernels():
    """TE v2.9 `split_quantize`: blockwise (like MXFP8) one quantize kernel per expert and
    cast; a recipe that leaves the experts in bf16 launches none."""
    assert _QUANTIZE_KERNELS["blockwise"] == 1
    ctx = _ctx(MOE4, fp8="blockwise")
    assert expert_launches(ctx, 3.0) == (3.0 * (2 + 2), 3.0 * (4 + 2))
    bf16_experts = replace(ctx, fp8=replace(ctx.fp8, experts_fp8=False))
    assert expert_launches(bf16_experts, 3.0) == (6.0, 12.0)


def test_dispatch_sync_is_the_host_links_latency_and_a_launch():
    ctx = _ctx(MOE4)
    link = get_link(H100.host, H100.links)
    assert dispatch_sync(ctx) == pytest.approx(link.latency + ctx.calibration.kernel_overhead,
                                               rel=1e-12)
    assert dispatch_sync(_ctx(MOE4, runtime=True)) == 0.0
    assert dispatch_sync(replace(ctx, cuda_graph=("moe",))) == 0.0
    assert dispatch_sync(replace(ctx, cuda_graph=("attn",))) > 0
    assert dispatch_sync(replace(ctx, counts_sync=False)) == 0.0


# ------------------------------- layer_cost with free device work: the host sets the time
def test_host_bound_layers_cost_their_launches():
    """Free device work: a fused dense layer is 10 kernels + 1 flash core forward, twice as
    many backward, at `kernel_overhead` each; MLA adds 5 (two down-projections, their two
    latent norms, a second up-projection); an MoE layer adds the dispatcher's sync and the
    experts' GEMMs through TE's multi-stream loop (TE PR #3134: 0.267 ms for 8 GEMMs),
    2 per local expert with rows forward, 4 backward."""
    ko = 1e-3
    dense = layer_cost(_priced(GQA, overhead=ko), 2, 1, 1, True, 0)
    assert (dense.fwd, dense.bwd) == pytest.approx((11 * ko, 22 * ko), rel=1e-12)
    ctx = _priced(MLA_MOE, overhead=ko, expert_load=LOAD, experts_active=ACTIVE)
    cost = layer_cost(ctx, 2, 1, 1, True, 0, moe=True, ep=4)
    local, gemm = 16 / 4 * ACTIVE, 0.267e-3 / 8
    assert cost.fwd == pytest.approx(16 * ko + _sync(ctx) + 2 * local * gemm, rel=1e-12)
    assert cost.bwd == pytest.approx(32 * ko + 4 * local * gemm, rel=1e-12)
    # full recompute replays the forward, sync included
    full = layer_cost(ctx, 2, 1, 1, True, RC_CODES["full"], moe=True, ep=4)
    assert full.recompute == pytest.approx(cost.fwd, rel=1e-12)
    # the runtime preset: the CPU runs device work and launches one after the other
    runtime = replace(ctx, calibration=replace(ctx.calibration, op_count="runtime"),
                      accelerator=replace(ctx.accelerator, hbm_bandwidth=1e6))
    slow = layer_cost(runtime, 1, 1, 1, False, 0)
    fast = layer_cost(replace(runtime, calibration=replace(runtime.calibration,
                                                           kernel_overhead=0.0)), 1, 1, 1,
                      False, 0)
    assert slow.fwd - fast.fwd == pytest.approx(190 / 3 * ko, rel=1e-9)
    assert slow.bwd - fast.bwd == pytest.approx(2 * 190 / 3 * ko, rel=1e-9)


def test_experts_host_time_waits_for_the_sync_not_for_the_attention():
    """The experts' launches start after the dispatcher's sync: a device-bound first part
    and host-bound experts add, forward = device(first part) + sync + experts' host; the
    backward, without a sync, is the slower of device and host over the whole layer."""
    peak = 2e13
    ctx = _priced(MLA_MOE, peak=peak, overhead=1e-7)
    cost = layer_cost(ctx, 1, 1, 1, False, 0, moe=True, ep=1)
    gemms, core, _ = _mla_moe_flops(1, False, load=1.0)
    experts = 2 * SEQ * 4 * 3 * 256 * 96
    host = 16 * 2 * 0.267e-3 / 8
    assert experts / peak < host  # the experts are host-bound, the rest is not
    first = (gemms - experts + core) / peak
    assert cost.fwd == pytest.approx(first + host + _sync(ctx), rel=1e-9)
    assert cost.bwd == pytest.approx(max((2 * gemms + 2.5 * core) / peak,
                                         32 * 1e-7 + 16 * 4 * 0.267e-3 / 8), rel=1e-9)


def test_head_launches_on_the_runtime_count():
    """The "this machine" preset: embedding, head and loss dispatch 64 aten ops per
    micro-batch, ⅓ forward and ⅔ backward, added to the device time."""
    ko = 1e-3
    ctx = _priced(GQA, overhead=ko)
    runtime = replace(ctx, calibration=replace(ctx.calibration, op_count="runtime"))
    fwd, bwd, _ = head_cost(runtime, 1, 1, 1, False)
    assert (fwd, bwd) == pytest.approx((64 / 3 * ko, 2 * 64 / 3 * ko), rel=1e-9)
