"""Per-rank compute costs (estimate/compute.py) and the calibration file, against hand-computed
roofline values and the FLOP counts of arch.py."""

import json
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.calibration import Calibration, default_calibration, load_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.compute import (
    ComputeContext,
    _kv_heads,
    host_overhead,
    layer_cost,
    layer_model_flops,
    matmul_efficiency,
    matmul_time,
    optimizer_time,
)
from shardwise.estimate.kernels import linear
from shardwise.hardware import ACCELERATORS, get_accelerator, get_link
from shardwise.layout import TrainSpec

H100 = get_accelerator("h100")


def ctx_for(model="llama3-8b", seq=4096, flash=True, cal=None, acc=H100):
    spec = get_model(model) if isinstance(model, str) else model
    return ComputeContext.of(spec, acc, TrainSpec(seq_len=seq, flash_attention=flash), cal)


def test_large_gemm_is_compute_bound_at_the_calibrated_efficiency():
    cal = default_calibration("h100-sxm")
    ctx = ctx_for(cal=cal)
    m, k, n = 8192, 8192, 8192
    half = cal.matmul_half_dim
    eff = cal.matmul_efficiency * (m / (m + half)) ** 3
    expected = 2 * m * k * n / (989e12 * cal.sustained_compute * eff)
    assert matmul_time(ctx, m, k, n) == pytest.approx(expected, rel=1e-12)


def test_skinny_gemm_is_memory_bound():
    # at the component benchmarks' own rate (a job's sustained share aside)
    cal = replace(default_calibration("h100-sxm"), sustained_compute=1.0)
    ctx = ctx_for(cal=cal)
    m, k, n = 1, 8192, 8192  # a GEMV: reads the whole weight for 2 FLOPs per element
    traffic = 2 * (m * k + k * n + m * n) / (3.35e12 * cal.hbm_efficiency)
    assert matmul_time(ctx, m, k, n) == pytest.approx(traffic, rel=1e-12)


def test_efficiency_rises_with_size_and_saturates_below_the_maximum():
    ctx = ctx_for()
    sizes = np.array([64, 128, 512, 2048, 8192, 262144])  # saturated for d½ ≤ 256 (Hopper)
    eff = matmul_efficiency(ctx, sizes, sizes, sizes)
    assert np.all(np.diff(eff) > 0)
    assert eff[-1] < ctx.calibration.matmul_efficiency
    assert eff[-1] > 0.99 * ctx.calibration.matmul_efficiency


def test_backward_matmuls_cost_twice_the_forward():
    ctx = ctx_for()
    cost = layer_cost(ctx, t=1, c=1, b=1, sp=False, rc=0)
    # wgrad is the weight-gradient GEMMs, equal to the forward GEMMs (symmetric efficiency)
    assert cost.bwd > 2 * cost.wgrad
    assert cost.wgrad < cost.fwd


def test_recompute_adds_the_forward_or_the_attention_core():
    ctx = ctx_for()
    none, sel, full = (layer_cost(ctx, 2, 1, 1, True, rc) for rc in (0, 1, 2))
    assert none.recompute == 0
    assert sel.recompute == pytest.approx(sel.attn_fwd)
    assert full.recompute == pytest.approx(full.fwd)


def test_flash_attention_halves_the_causal_square():
    # the calibration's kernel curve (cuDNN on H100): causal FLOPs halved, backward 2.5× the
    # forward's FLOPs at the kernel's backward efficiency
    cal = default_calibration("h100-sxm")
    model = get_model("llama3-8b")
    ctx = ctx_for(cal=cal, seq=8192)
    cost = layer_cost(ctx, t=1, c=1, b=1, sp=False, rc=0)
    flops = 4 * 8192 * 8192 * model.d_model * 0.5
    curve = cal.attention_kernels[cal.attention_kernel]
    eff = (curve["efficiency"] * 128 / (128 + curve["half_dim"])
           * 4096 / (4096 + curve["half_seq"]))  # head dim 128, causal: half of 8192
    assert cost.attn_fwd == pytest.approx(flops / (989e12 * cal.sustained_compute * eff))
    assert cost.attn_bwd == pytest.approx(2.5 * flops / (989e12 * cal.sustained_compute * eff * curve["backward_ratio"]))
    # without a kernel curve (the "this machine" calibration): one scalar, both passes
    legacy = replace(cal, attention_kernel="", attention_kernels={}, matmul_half_dim=0.0)
    cost = layer_cost(ctx_for(cal=legacy, seq=8192), t=1, c=1, b=1, sp=False, rc=0)
    assert cost.attn_fwd == pytest.approx(flops / (989e12 * legacy.sustained_compute * legacy.attention_efficiency))
    assert cost.attn_bwd == pytest.approx(2.5 * cost.attn_fwd)


def test_tensor_parallel_cuts_per_rank_time_but_not_linearly():
    ctx = ctx_for("llama3-70b", seq=8192)
    t1 = layer_cost(ctx, 1, 1, 1, False, 0).fwd
    t8 = layer_cost(ctx, 8, 1, 1, True, 0).fwd
    assert t8 < t1
    assert 8 * t8 > t1  # smaller per-rank GEMMs run less efficiently


def test_array_and_scalar_inputs_agree():
    ctx = ctx_for()
    arrays = layer_cost(ctx, np.array([1, 2, 4]), 1, np.array([1, 2, 1]), np.array([0, 1, 1]),
                        np.array([0, 1, 2]))
    for i, (t, b, sp, rc) in enumerate([(1, 1, 0, 0), (2, 2, 1, 1), (4, 1, 1, 2)]):
        one = layer_cost(ctx, t, 1, b, sp, rc)
        for field in one._fields:
            assert getattr(arrays, field)[i] == pytest.approx(getattr(one, field), rel=1e-12)


def test_layer_flops_add_up_to_the_model_forward():
    model = get_model("llama2-7b")  # untied head, no learned positions
    s, b = 4096, 2
    per_layer = layer_model_flops(model, s, b, causal=True)
    head = 2 * s * b * model.vocab * model.d_model
    total = model.forward_flops_per_token(s, causal=True) * s * b
    assert model.n_layers * per_layer + head == pytest.approx(total, rel=1e-12)


def test_optimizer_step_reads_and_writes_30_bytes_per_param_for_bf16_adam():
    cal = replace(default_calibration("h100-sxm"), kernel_overhead=0.0)
    ctx = ctx_for(cal=cal)
    seconds = optimizer_time(ctx, 1e9, grad_bytes=2, weight_bytes=2, master_bytes=4,
                             moment_bytes=8)
    assert seconds == pytest.approx(1e9 * 30 / (3.35e12 * cal.hbm_efficiency))


# ------------------------------------------------------------------------------ calibration
def test_builtin_calibration_is_fitted_per_generation_and_cited():
    # Issue 30: constants per accelerator from component benchmarks, each accelerator citing
    # its points (`sources`); the H200 takes the H100's (same SM, same kernels).
    a100, h100, h200 = (default_calibration(name) for name in ("a100-80gb", "h100-sxm", "h200"))
    assert h200.to_dict() | {"accelerator": "h100-sxm"} == h100.to_dict()
    assert a100.link_efficiency == h100.link_efficiency
    data = json.loads(resources.files("shardwise").joinpath("data/calibration.json").read_text())
    own = {a.name for a in ACCELERATORS.values() if a.calibrated_as is None} - {"tpu-v5p"}
    assert own <= set(data["sources"]) and own <= set(data["accelerators"])
    assert "fit_components.py" in " ".join(data["_doc"])


def test_calibration_file_overrides_only_the_keys_it_names(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"default": {"matmul_efficiency": 0.5},
                                "accelerators": {"h100-sxm": {"hbm_efficiency": 0.6}},
                                "links": {"ndr": 0.5}}))
    cal = load_calibration("h100-sxm", path)
    base = default_calibration("h100-sxm")
    assert cal.matmul_efficiency == 0.5 and cal.hbm_efficiency == 0.6
    assert cal.matmul_half_dim == base.matmul_half_dim
    assert cal.link(get_link("ndr")).bandwidth == pytest.approx(25e9)
    a100 = default_calibration("a100-80gb")
    assert load_calibration("a100-80gb", path).hbm_efficiency == a100.hbm_efficiency


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    ('{"default": {"matmul_eff": 0.5}}', "unknown key"),
    ('{"default": {"matmul_efficiency": 1.5}}', "matmul_efficiency must be in"),
    ('{"other": {}}', "unknown section"),
])
def test_bad_calibration_files_raise_one_clear_error(tmp_path, content, fragment):
    path = tmp_path / "cal.json"
    path.write_text(content)
    with pytest.raises(ShardwiseError, match=fragment):
        load_calibration("h100-sxm", path)


def test_missing_calibration_file():
    with pytest.raises(ShardwiseError, match="not found"):
        load_calibration("h100-sxm", "/nonexistent/cal.json")


def test_calibration_to_dict_round_trips():
    cal = default_calibration("a100-80gb")
    assert Calibration(**cal.to_dict()) == cal


def test_materialised_attention_has_no_causal_saving():
    model = ModelSpec("gpt-small", 2, 1024, 16, 16, 4096, 1000, gated_mlp=False,
                      norm="layernorm", dropout=False)
    flash = layer_cost(ctx_for(model, 2048, True), 1, 1, 1, False, 0).attn_fwd
    dense = layer_cost(ctx_for(model, 2048, False), 1, 1, 1, False, 0).attn_fwd
    assert dense > flash


def _flop_exact(model: str, seq: int = 4096) -> ComputeContext:
    """Every GEMM at peak (no saturation, HBM never the bound): time × peak = FLOPs."""
    cal = replace(default_calibration("h100-sxm"), matmul_half_dim=0.0, matmul_efficiency=1.0,
                  attention_efficiency=1.0, sustained_compute=1.0, attention_kernel="",
                  attention_kernels={})
    return ctx_for(model, seq=seq, cal=cal, acc=replace(H100, hbm_bandwidth=1e30))


@pytest.mark.parametrize("tp, sp", [(1, False), (8, False), (8, True)])
def test_mla_layer_gemms_are_its_projections(tp, sp):
    """DeepSeek-V3's dense layer: the GEMM FLOPs per rank are 2·T per weight of the MLA
    projections (`mla_params`) and the MLP — the down-projections whole on every tp rank (on
    T/t rows with sequence parallelism, Megatron's duplicated linears on the sequence shard),
    the rest ÷ tp — and the attention core runs scores at d_nope + d_R, P·V at d_v."""
    ctx = _flop_exact("deepseek-v3")
    model, tokens = ctx.model, 4096
    cost = layer_cost(ctx, t=tp, c=1, b=1, sp=sp, rc=0)
    down, split = model.mla_params()
    flops = 2 * tokens * (down / (tp if sp else 1) + (split + model.mlp_params()) / tp)
    assert cost.wgrad * ctx.rate == pytest.approx(flops, rel=1e-12)
    heads = model.n_heads / tp
    core = 2 * tokens * tokens * heads * (192 + 128) * 0.5  # causal
    assert cost.attn_fwd * ctx.rate == pytest.approx(core, rel=1e-12)


def test_routed_experts_split_over_etp_run_the_same_flops_per_rank():
    """Expert tensor parallelism: each rank runs the routed rows of its etp group's share of
    the tp group's tokens at f/etp — the same FLOPs per rank as etp = tp (balanced routing);
    shared experts stay ÷ tp."""
    ctx = _flop_exact("deepseek-v3")
    by_tp = layer_cost(ctx, t=8, c=1, b=1, sp=True, rc=0, moe=True, ep=8)
    by_one = layer_cost(ctx, t=8, c=1, b=1, sp=True, rc=0, moe=True, ep=8, etp=1)
    assert by_one.wgrad == pytest.approx(by_tp.wgrad, rel=1e-12)
    model = ctx.model
    routed = 2 * 4096 * model.top_k * model.mlp_params(model.expert_d_ff) / 8
    shared = 2 * 4096 * model.mlp_params(model.expert_d_ff) / 8
    router = 2 * 4096 * model.d_model * model.n_experts
    dense = layer_cost(ctx, t=8, c=1, b=1, sp=True, rc=0).wgrad
    mlp = 2 * 4096 * model.mlp_params() / 8
    assert (by_one.wgrad - dense) * ctx.rate == pytest.approx(routed + shared + router - mlp,
                                                              rel=1e-12)
# ------------------------------------------- what mutation testing found unchecked (issue 37)
def test_model_flops_of_one_layer_causal_and_full():
    """SPEC §1: `2·T·(matmul params) + 4·T·s·h` per layer forward, T = s·b; causal attention
    halves the score and P·V term (the default, as MFU is usually quoted)."""
    model = get_model("llama3-8b")
    s, b, h = 4096, 2, model.d_model
    tokens = s * b
    params = model.attention_params() + model.mlp_params()
    full = 2 * tokens * params + 4 * tokens * s * h
    assert layer_model_flops(model, s, b, causal=False) == full
    assert layer_model_flops(model, s, b) == full - 2 * tokens * s * h
    assert layer_model_flops(model, s) == layer_model_flops(model, s, 1)
    assert layer_model_flops(model, s, 2) == 2 * layer_model_flops(model, s, 1)


def test_batched_gemms_and_the_optimizer_step_cost_by_the_roofline():
    cal = default_calibration("h100-sxm")
    ctx = ctx_for(cal=cal)
    # `batch` GEMMs cost `batch` times one (same efficiency, same per-GEMM traffic)
    assert matmul_time(ctx, 4096, 4096, 4096, batch=8) == pytest.approx(
        8 * matmul_time(ctx, 4096, 4096, 4096), rel=1e-12)
    # Adam, bf16: 2·2 + 2 + 2·(4 + 8) = 30 B/param through HBM, plus three launches
    params = 1e9
    expected = params * 30 / (3.35e12 * cal.hbm_efficiency) + 3 * cal.kernel_overhead
    assert optimizer_time(ctx, params, 2, 2, 4, 8) == pytest.approx(expected, rel=1e-12)
    assert host_overhead(ctx, 1000) == pytest.approx(1000 * cal.kernel_overhead, rel=1e-12)


def test_kv_heads_per_rank_are_split_or_one_replicated():
    """Llama-3-8B has 8 K/V heads: 4 per rank at t = 2, one at t = 8, and still one (a
    replicated head) at t = 16; an array of degrees gives integers."""
    model = get_model("llama3-8b")
    assert _kv_heads(model, np.array([2, 8, 16])).tolist() == [4, 1, 1]
    assert _kv_heads(model, 3) == 2  # ⌊8/3⌋ heads: whole heads only


def test_recomputing_the_shared_experts_replays_their_forward():
    """`--recompute-modules shared_experts` adds the shared experts' two GEMMs per expert
    (T × h)·(h × 2f/t) and (T × f/t)·(f/t × h) to the selective replay (two shared experts,
    gated, tp = 2 with SP: T = s·b)."""
    model = replace(get_model("tiny-deepseek"), n_shared_experts=2).validate()

    def selective(modules):
        train = TrainSpec(seq_len=512, impl="megatron-te", recompute_modules=modules)
        ctx = ComputeContext.of(model, H100, train)
        return ctx, layer_cost(ctx, 2, 1, 2, True, 1, moe=True, ep=2).recompute

    ctx, with_shared = selective(("core_attn", "shared_experts"))
    _, without = selective(("core_attn",))
    tokens, h, f = 512 * 2, model.d_model, model.expert_d_ff / 2
    gemms = linear(ctx, tokens, h, 2 * f).fwd + linear(ctx, tokens, f, h).fwd
    assert with_shared - without == pytest.approx(2 * gemms)


def test_selective_recompute_by_default_replays_the_attention_core():
    """Megatron's default `--recompute-modules` is core_attn: with none named, selective
    recompute replays exactly the attention core's forward."""
    ctx = ctx_for("llama3-8b")
    cost = layer_cost(ctx, 2, 1, 1, True, 1)
    assert cost.recompute == cost.attn_fwd > 0
