"""estimate/kernels.py against closed forms: the roofline of a GEMM (Williams et al. 2009)
with the saturating efficiency of its docstring, FP8 GEMMs (1-byte operands, the recipe's
casts), the fitted attention-kernel curve, the compiled stacks' per-token traffic (the
fusion rule written out in `compiled_traffic`'s docstring: 38h backward for Llama's 3 + 2
norm readers), and what `ComputeContext.of` takes from a run's settings (Megatron-Core
0.16.1's `cuda_sync_point` rule, `--moe-pad-expert-input-to-capacity`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.calibration import default_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.kernels import (
    ComputeContext,
    Gemms,
    attention_efficiency,
    compiled_traffic,
    gemm_efficiency,
    linear,
    matmul_time,
    memory_time,
)
from shardwise.hardware import get_accelerator
from shardwise.layout import TrainSpec

H100 = get_accelerator("h100")
B200 = get_accelerator("b200")
LLAMA = get_model("llama3-8b")
GPT = ModelSpec(name="gpt-learned", n_layers=2, d_model=256, n_heads=8, n_kv_heads=8,
                d_ff=1024, vocab=512, gated_mlp=False, learned_positions=1024,
                norm="layernorm").validate()


def test_compiled_traffic_is_the_fusion_rule():
    """Forward: norm 4h + residual add and norm 6h + closing residual 8h = 18h, RoPE on q and
    k 4·(q + kv), activation 6f gated / 4f not; backward 18h + 4·(n_a + n_m)h with 3
    attention readers (wq, wk, wv) and 2 MLP ones gated (w1, w3; 1 without a gate), RoPE
    4·(q + kv), activation 10f / 6f. Kernels 6 each way with RoPE, 4 without."""
    (fwd, bwd), kernels = compiled_traffic(LLAMA)
    assert fwd == (18.0, 4.0, 6.0)
    assert bwd == (18.0 + 4.0 * (3 + 2), 4.0, 10.0)
    assert bwd[0] == 38.0  # docs/concepts/stacks.md: Llama's backward 38h
    assert kernels == (6.0, 6.0)
    (fwd, bwd), kernels = compiled_traffic(GPT)
    assert fwd == (18.0, 0.0, 4.0)
    assert bwd == (18.0 + 4.0 * (3 + 1), 0.0, 6.0)
    assert kernels == (4.0, 4.0)


def test_gemm_efficiency_saturates_in_each_dimension():
    cal = replace(default_calibration("h100-sxm"), matmul_efficiency=0.8, matmul_half_dim=100.0)
    m, k, n = np.array([50.0, 300.0]), 700.0, 1900.0
    expected = 0.8 * m / (m + 100) * k / (k + 100) * n / (n + 100)
    assert np.allclose(gemm_efficiency(cal, m, k, n), expected, rtol=1e-14)


def _ctx(fp8: str | None = None, accelerator=H100, **train) -> ComputeContext:
    return ComputeContext.of(LLAMA, accelerator, TrainSpec(seq_len=4096, fp8=fp8, **train))


def test_bf16_gemm_roofline_both_bounds():
    """`max(2·m·k·n·batch / (rate·e), batch·ab·(m·k + k·n + m·n) / (HBM·η))`, rate the
    datasheet peak × the job's sustained share."""
    ctx = _ctx()
    cal = ctx.calibration
    assert ctx.rate == pytest.approx(989e12 * cal.sustained_compute, rel=1e-12)
    assert ctx.hbm == pytest.approx(3.35e12 * cal.hbm_efficiency, rel=1e-12)
    for m, k, n, batch in ((4096, 3072, 5120, 3), (1, 8192, 6144, 2), (7, 64, 9, 5)):
        flops = 2.0 * m * k * n * batch / (ctx.rate * gemm_efficiency(cal, m, k, n))
        traffic = batch * 2 * (m * k + k * n + m * n) / ctx.hbm
        assert matmul_time(ctx, m, k, n, batch) == pytest.approx(max(flops, traffic),
                                                                 rel=1e-12)
        assert matmul_time(ctx, m, k, n) == pytest.approx(max(flops, traffic) / batch,
                                                          rel=1e-12)  # one GEMM by default
    assert memory_time(ctx, 3e9) == pytest.approx(3e9 / ctx.hbm, rel=1e-12)


def test_fp8_gemm_roofline_and_rate():
    """FP8: the datasheet FP8 peak × the job's share × the MAMF ratio of FP8 to BF16 GEMMs
    (0.88 on H100), 1-byte operands, the output in the activation dtype."""
    ctx = _ctx("tensorwise")
    cal = ctx.calibration
    assert ctx.fp8_peak == pytest.approx(H100.peak_flops("fp8"), rel=1e-12)
    assert ctx.fp8_peak > ctx.peak
    assert ctx.fp8_rate == pytest.approx(ctx.fp8_peak * cal.sustained_compute * 0.88,
                                         rel=0.01)
    for m, k, n, batch in ((8192, 8192, 6144, 3), (1, 8192, 6144, 2), (64, 8192, 48, 5)):
        traffic = batch * (1 * (m * k + k * n) + 2 * m * n) / ctx.hbm
        compute = 2.0 * m * k * n * batch / (ctx.fp8_rate * gemm_efficiency(cal, m, k, n))
        assert matmul_time(ctx, m, k, n, batch, fp8=True) == pytest.approx(
            max(traffic, compute), rel=1e-12)
    fast = replace(ctx, fp8_peak=1e30)  # every FP8 GEMM memory-bound
    m, k, n, batch = 300, 700, 1100, 3
    traffic = batch * (1 * (m * k + k * n) + 2 * m * n) / ctx.hbm
    assert matmul_time(fast, m, k, n, batch, fp8=True) == pytest.approx(traffic, rel=1e-12)
    assert _ctx().fp8_peak == 0.0  # no recipe, no FP8 rate


@pytest.mark.parametrize("recipe, accelerator, impl", [
    ("tensorwise", H100, "megatron-te"), ("tensorwise", B200, "megatron-te"),
    ("delayed", H100, "megatron-te"), ("mxfp8", B200, "megatron-te"),
    ("rowwise", H100, "torchtitan")])  # torchao: weights cast each pass, both directions
def test_linear_fp8_casts_per_operand(recipe, accelerator, impl):
    """The three GEMMs of a linear layer and its casts: the input `m·k` (forward and
    backward), the output gradient `m·n` (backward), the weight `k·n` (per pass or once per
    step), each × `batch`; the weight gradient in FP8 only when the recipe says so."""
    ctx = _ctx(recipe, accelerator, impl=impl)
    m, k, n, batch = 3000, 700, 1100, 3
    g = linear(ctx, m, k, n, batch)
    t8 = matmul_time(ctx, m, k, n, batch, fp8=True)
    bf16 = matmul_time(ctx, m, k, n, batch)
    assert t8 != bf16
    assert (g.fwd, g.dgrad) == (t8, t8)
    assert g.wgrad == (t8 if ctx.fp8.wgrad_fp8 else bf16)
    c = ctx.fp8.cast_bytes("blackwell" if accelerator is B200 else "hopper")
    w = batch * k * n
    assert g.cast_fwd == pytest.approx(batch * c.input_fwd * m * k + c.weight_fwd * w)
    assert g.cast_bwd == pytest.approx(batch * (c.input_bwd * m * k + c.grad_bwd * m * n)
                                       + c.weight_bwd * w)
    assert g.weights == w
    plain = linear(ctx, m, k, n, batch, fp8=False)  # a layer the recipe leaves in bf16
    assert (plain.fwd, plain.dgrad, plain.wgrad) == (bf16, bf16, bf16)
    assert (plain.cast_fwd, plain.cast_bwd, plain.weights) == (0, 0, 0)  # no casts in bf16


def test_gemms_add_and_scale_every_field_plumbing():
    """plumbing: `+` adds field by field, `*` (either side, arrays too) scales each."""
    a, b = Gemms(1.0, 2.0, 3.0, 4.0, 5.0, 6.0), Gemms(10.0, 20.0, 30.0, 40.0, 50.0, 60.0)
    assert a + b == Gemms(11.0, 22.0, 33.0, 44.0, 55.0, 66.0)
    assert a * 2 == Gemms(2.0, 4.0, 6.0, 8.0, 10.0, 12.0) == 2 * a
    scaled = np.array([1.0, 3.0]) * a
    assert np.allclose(scaled.weights, [6.0, 18.0]) and np.allclose(scaled.fwd, [1.0, 3.0])


def test_attention_efficiency_curve():
    """`e_k · d/(d + d½) · s'/(s' + s½) · (r_b backward)`, s' = s/2 causal, capped at 1; the
    accelerator by name or object; an unfitted kernel is one clear error."""
    cal = default_calibration("h100-sxm")
    kernel = cal.attention_kernel
    p = cal.attention_kernels[kernel]
    d, s = np.array([64.0, 128.0]), 8192.0
    for causal, s_eff in ((True, s / 2), (False, s)):
        base = p["efficiency"] * d / (d + p["half_dim"]) * s_eff / (s_eff + p["half_seq"])
        assert np.allclose(attention_efficiency(kernel, d, s, causal, "h100"), base)
        assert np.allclose(attention_efficiency(kernel, d, s, causal, H100, backward=True),
                           np.minimum(base * p["backward_ratio"], 1.0))
    huge = replace(cal, attention_kernels={kernel: dict(p, efficiency=5.0)})
    assert attention_efficiency(kernel, 128, s, True, H100, calibration=huge) == 1.0
    with pytest.raises(ShardwiseError, match="no fitted attention kernel 'nope'"):
        attention_efficiency("nope", 128, s, True, H100)
    with pytest.raises(ShardwiseError, match=r"kernel 'fa3' for .*; fitted: none$"):
        attention_efficiency("fa3", 128, s, True, H100,
                             calibration=replace(cal, attention_kernels={}))


def test_context_from_the_run_settings():
    """What `ComputeContext.of` reads: the dtype's bytes and datasheet peak, math attention
    is not flash, the kernel mode and traffic of the stack, the run's routing, its
    generation and recompute share and graphs."""
    ctx = _ctx()
    assert (ctx.act_bytes, ctx.peak, ctx.flash, ctx.kernels) == (2, 989e12, True, "fused")
    assert ctx.traffic is None and ctx.layer_kernels == (0.0, 0.0)
    assert ctx.generation == "hopper" and _ctx(accelerator=B200).generation == "blackwell"
    assert ctx.seq_len == 4096 and ctx.fp8 is None
    fp32 = _ctx(dtype="fp32")
    assert fp32.act_bytes == 4 and fp32.peak == H100.peak_flops("fp32")
    assert not _ctx(flash_attention=False).flash
    compiled = _ctx(impl="torchtitan", compile=True)
    assert compiled.kernels == "compiled"
    assert (compiled.traffic, compiled.layer_kernels) == compiled_traffic(LLAMA)
    eager = _ctx(impl="torchtitan", compile=False)
    assert eager.kernels == "eager" and eager.traffic is not None
    assert eager.traffic != compiled.traffic
    shared = _ctx(recompute_share=0.5, expert_load=1.7, experts_active=0.6)
    assert (shared.recompute_share, shared.expert_load, shared.experts_active) == (0.5, 1.7,
                                                                                  0.6)


@pytest.mark.parametrize("impl, dispatcher, capacity, syncs, load, active", [
    ("megatron-te", None, None, True, 1.7, 0.6),       # dropless alltoall
    ("megatron-te", None, 1.25, False, 1.25, 1.0),     # padded to capacity: no_sync
    ("megatron-te", "alltoall", 1.25, False, 1.25, 1.0),
    ("megatron-te", "allgather", 1.25, True, 1.25, 1.0),  # allgather's .cpu() stays
    ("megatron-te", "flex", 1.25, True, 1.25, 1.0),       # DeepEP's host counts stay
    ("torchtitan", None, 1.25, True, 1.25, 1.0),          # .tolist() of the splits
])
def test_routing_and_counts_sync(impl, dispatcher, capacity, syncs, load, active):
    """Megatron-Core 0.16.1 token_dispatcher.py: only the alltoall dispatcher padded to
    capacity sets `cuda_sync_point = "no_sync"`; with a capacity factor every expert runs
    `factor·T·k/E` rows (`expert_load` = the factor, all experts active)."""
    model = get_model("qwen3-30b-a3b")
    train = TrainSpec(seq_len=4096, impl=impl, moe_dispatcher=dispatcher,
                      moe_capacity=capacity, expert_load=1.7, experts_active=0.6)
    if impl == "torchtitan":
        train = replace(train, moe_dispatcher=None)
    ctx = ComputeContext.of(model, B200, train)
    assert ctx.counts_sync is syncs
    assert (ctx.expert_load, ctx.experts_active) == pytest.approx((load, active))
