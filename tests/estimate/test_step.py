"""The step-time model (estimate/step.py) against SPEC figures, first-principles step times,
the schedule simulator and monotonicity properties."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.calibration import default_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import collective_time, hierarchical_all_reduce_time
from shardwise.estimate.step import (
    RC_CODES,
    SCHEDULE_CODES,
    Links,
    _bucketed,
    estimate_step,
    flops_per_token,
    group_collective_time,
    p2p_exposed,
    pipeline_bubble,
)
from shardwise.hardware import Accelerator, Cluster, Link, get_link
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules import bubble_fraction, make_schedule, simulate
from shardwise.stacks import STACKS


def links(intra_bw=450e9, inter_bw=50e9, lat=0.0, gpn=8):
    return Links(intra_bw, lat, inter_bw, lat, gpn)


# ------------------------------------------------------------------------------ SPEC §5
def test_spec_gradient_all_reduce_figures():
    # 7B bf16 gradients (13.5 GB) on 8 ranks: ≈ 52 ms at 450 GB/s, ≈ 470 ms at 50 GB/s.
    nvlink = group_collective_time("all-reduce", 13.5e9, 8, 8, links())
    assert nvlink == pytest.approx(2 * 7 / 8 * 13.5e9 / 450e9)
    assert round(nvlink * 1e3) in (52, 53)
    ib = group_collective_time("all-reduce", 13.5e9, 8, 1, links())  # one rank per node
    assert abs(ib - 0.470) < 0.005


def test_group_collectives_match_comm_module():
    ndr, nvl = get_link("ndr"), get_link("nvlink4")
    lk = Links(nvl.bandwidth, nvl.latency, ndr.bandwidth, ndr.latency, 8)
    for op in ("all-reduce", "reduce-scatter", "all-gather"):
        assert group_collective_time(op, 1e9, 8, 8, lk) == pytest.approx(
            collective_time(op, 1e9, 8, nvl))
        assert group_collective_time(op, 1e9, 16, 1, lk) == pytest.approx(
            collective_time(op, 1e9, 16, ndr))
    assert group_collective_time("all-reduce", 1e9, 64, 8, lk) == pytest.approx(
        hierarchical_all_reduce_time(1e9, 8, 8, nvl, ndr))


# ------------------------------------------------------------------------------ SPEC §6
@pytest.mark.parametrize("p, m, v", [(4, 8, 1), (8, 8, 1), (8, 16, 1), (8, 32, 1),
                                     (8, 64, 1), (4, 8, 2), (4, 16, 4)])
def test_bubble_closed_forms(p, m, v):
    sched = SCHEDULE_CODES["interleaved" if v > 1 else "1f1b"]
    idle = pipeline_bubble(sched, p, v, m, 1.0, 1.0, 0.5)
    fraction = idle / (idle + m * 2.0)
    assert fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert fraction == pytest.approx(bubble_fraction(p, m, v))


def test_spec_bubble_figures():
    for m, (num, den) in zip((8, 16, 32, 64), ((7, 15), (7, 23), (7, 39), (7, 71))):
        idle = pipeline_bubble(SCHEDULE_CODES["1f1b"], 8, 1, m, 1.0, 3.0, 1.0)
        assert idle / (idle + m * 4.0) == pytest.approx(num / den)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 1), (4, 3), (4, 8), (8, 5), (8, 16), (16, 64)])
@pytest.mark.parametrize("t_f, t_b, t_w", [(1.0, 2.0, 1.0), (1.0, 2.1, 0.9), (1.3, 2.5, 0.5)])
def test_zb_h1_closed_form_equals_the_simulator(p, m, t_f, t_b, t_w):
    timeline = simulate(make_schedule("zb-h1", p, m), t_f, t_b, t_w)
    simulated = timeline.makespan - m * (t_f + t_b)
    closed = pipeline_bubble(SCHEDULE_CODES["zb-h1"], p, 1, m, t_f, t_b, t_w)
    assert closed == pytest.approx(simulated, abs=1e-9)


@pytest.mark.parametrize("text", ["pp=4,schedule=1f1b", "pp=4,schedule=zb-h1",
                                  "pp=2,schedule=interleaved,chunks=2"])
def test_estimate_with_simulator_equals_closed_form(text):
    model = get_model("llama3-8b")
    cluster = Cluster.of(16, "h100")
    layout = Layout.parse(text + ",tp=2", dp=16 // (2 * int(text.split(",")[0][3:])))
    # a stack whose pipeline engine runs the schedule (`Stack.schedules`)
    impl = next(s.name for s in STACKS.values() if layout.schedule in s.schedules())
    train = TrainSpec(seq_len=4096, global_batch=32, impl=impl)
    closed = estimate_step(model, cluster, layout, train)
    sim = estimate_step(model, cluster, layout, train, simulate=True)
    assert sim.bubble_source == "simulator"
    assert sim.bubble == pytest.approx(closed.bubble, rel=1e-9)
    assert sim.total == pytest.approx(closed.total, rel=1e-9)


# ------------------------------------------------------------------------- first principles
SMALL = ModelSpec("small", 4, 1024, 8, 8, 4096, 32000, gated_mlp=False, norm="layernorm")


def test_single_gpu_step_is_flops_over_achieved_rate():
    """With HBM so fast that memory-bound work is free, size-independent efficiency and no
    launch overhead, one GPU's step is the training FLOPs at peak × efficiency."""
    fast = Accelerator("ideal", 80 * 2**30, 1e30, 1e15)
    cluster = Cluster(1, 1, fast, Link("x", 1e12, 0.0), Link("y", 1e12, 0.0))
    eff = 0.5
    cal = replace(default_calibration(), matmul_efficiency=eff, attention_efficiency=eff,
                  matmul_half_dim=0.0, kernel_overhead=0.0)
    s, b, m = 1024, 2, 3
    train = TrainSpec(seq_len=s, global_batch=b * m, flash_attention=False)
    est = estimate_step(SMALL, cluster, Layout(micro_batch=b), train, cal)
    tokens = s * b * m
    # materialised attention computes the whole square: non-causal FLOPs, 3 × forward
    flops = 3 * SMALL.forward_flops_per_token(s, causal=False) * tokens
    assert est.compute == pytest.approx(flops / (1e15 * eff), rel=1e-9)
    assert est.total == pytest.approx(est.compute + est.optimizer, rel=1e-12)
    assert est.tp_comm == est.bubble == est.dp_comm_exposed == est.pp_comm == 0


def test_single_gpu_optimizer_step_moves_30_bytes_per_parameter():
    h100 = Cluster.of(1, "h100")
    cal = replace(default_calibration("h100-sxm"), kernel_overhead=0.0)
    est = estimate_step(SMALL, h100, Layout(), TrainSpec(seq_len=1024, global_batch=1), cal)
    params = SMALL.count_params().total
    assert est.optimizer == pytest.approx(params * 30 / (3.35e12 * cal.hbm_efficiency))


def test_breakdown_sums_to_total_and_rates_follow():
    model = get_model("llama3-70b")
    cluster = Cluster.of(64, "h100")
    train = TrainSpec(seq_len=8192, global_batch=64)
    est = estimate_step(model, cluster, Layout.parse("dp=4,tp=8,pp=2,zero=1,sp=1,"
                                                     "recompute=selective"), train)
    assert sum(est.breakdown().values()) == pytest.approx(est.total)
    assert est.tokens_per_s == pytest.approx(64 * 8192 / est.total)
    # MFU counts full attention (Megatron, Korthikanti, PaLM: 6N + 12·L·h·s per token);
    # mfu_causal the causal half of the square
    flops = model.training_flops_per_token(8192) * 64 * 8192
    assert flops == pytest.approx(64 * 8192 * (6 * (model.count_params().total
                                                    - model.vocab * model.d_model
                                                    - model.count_params().norms)
                                               + 12 * model.n_layers * model.d_model * 8192))
    assert est.mfu == pytest.approx(flops / (est.total * 989e12 * 64))
    causal = model.training_flops_per_token(8192, causal=True) * 64 * 8192
    assert est.mfu_causal == pytest.approx(causal / (est.total * 989e12 * 64))
    assert est.mfu_causal < est.mfu < est.hfu
    assert "full s^2 attention" in est.to_dict()["flop_convention"]
    assert est.time_to_train(15e12) == pytest.approx(15e12 / est.tokens_per_s)
    assert est.cost(15e12, 2.5) == pytest.approx(est.gpu_hours(15e12) * 2.5)


def test_tp_inside_the_node_uses_nvlink():
    model = get_model("llama3-70b")
    train = TrainSpec(seq_len=8192, global_batch=16)
    fast = estimate_step(model, Cluster.of(16, "h100"), Layout(dp=2, tp=8, sp=True), train)
    slow = estimate_step(model, Cluster.of(16, "h100", intra="pcie4"),
                         Layout(dp=2, tp=8, sp=True), train)
    assert slow.tp_comm > 5 * fast.tp_comm
    assert slow.compute == pytest.approx(fast.compute)


# ------------------------------------------------------------------------- properties
def test_more_gpus_never_make_compute_per_step_larger():
    model = get_model("llama3-8b")
    train = TrainSpec(seq_len=4096, global_batch=256)
    for tp, pp in itertools.product((1, 2, 8), (1, 2)):
        computes = []
        for dp in (1, 2, 4, 8, 16):
            cluster = Cluster.of(dp * tp * pp, "h100")
            layout = Layout(dp=dp, tp=tp, pp=pp, sp=tp > 1)
            computes.append(estimate_step(model, cluster, layout, train).compute)
        assert all(b <= a for a, b in itertools.pairwise(computes)), (tp, pp, computes)
    # tensor parallelism shares each layer among more GPUs
    by_tp = [estimate_step(model, Cluster.of(tp, "h100"), Layout(tp=tp, sp=tp > 1),
                           train).compute for tp in (1, 2, 4, 8)]
    assert all(b <= a for a, b in itertools.pairwise(by_tp)), by_tp


def test_mfu_and_hfu_are_fractions():
    model = get_model("llama3-8b")
    for s in (512, 8192, 131072):
        for layout in (Layout(), Layout(recompute="full"), Layout(cp=8, dp=1)):
            cluster = Cluster.of(layout.world_size, "h100")
            est = estimate_step(model, cluster, layout, TrainSpec(seq_len=s, global_batch=1))
            assert 0 < est.mfu <= est.hfu <= 1


def test_context_parallel_transfers_hide_behind_attention():
    model = get_model("llama3-8b")
    train = TrainSpec(seq_len=131072, global_batch=1)
    est = estimate_step(model, Cluster.of(8, "h100"), Layout(cp=8, dp=1), train)
    cal = default_calibration("h100-sxm")
    # long sequences: block compute ≫ transfer, only the contention share remains
    no_contention = estimate_step(model, Cluster.of(8, "h100"), Layout(cp=8, dp=1), train,
                                  replace(cal, overlap_contention=0.0))
    assert no_contention.cp_comm_exposed == 0.0
    assert 0 < est.cp_comm_exposed < 0.05 * est.compute


def test_dp_exposure_is_at_most_the_traffic():
    model = get_model("llama3-8b")
    train = TrainSpec(seq_len=4096, global_batch=128)
    for zero in (0, 1, 2, 3):
        est = estimate_step(model, Cluster.of(64, "h100"), Layout(dp=64, zero=zero), train)
        assert 0 < est.dp_comm_exposed <= est.dp_comm_total


def test_zero3_regathers_per_micro_batch():
    model = get_model("llama3-8b")
    cluster = Cluster.of(64, "h100")
    one = estimate_step(model, cluster, Layout(dp=64, zero=3),
                        TrainSpec(seq_len=4096, global_batch=64))
    four = estimate_step(model, cluster, Layout(dp=64, zero=3),
                         TrainSpec(seq_len=4096, global_batch=256))
    assert four.dp_comm_total == pytest.approx(4 * one.dp_comm_total, rel=1e-9)


def test_arrays_broadcast_like_scalars():
    from shardwise.estimate.compute import ComputeContext
    from shardwise.estimate.step import step_terms

    model = get_model("llama3-8b")
    cluster = Cluster.of(16, "h100")
    train = TrainSpec(seq_len=4096, global_batch=64)
    ctx = ComputeContext.of(model, cluster.accelerator, train)
    lk = Links.of(cluster, ctx.calibration)
    kw = dict(tp=np.array([1, 2]), pp=np.array([1, 2]), cp=1, ep=1, dp=np.array([16, 4]),
              zero=np.array([0, 1]), zero_group=0, sp=np.array([0, 1]), schedule=1, chunks=1,
              recompute=np.array([0, 1]), micro_batch=1, m=np.array([4, 16]))
    terms = step_terms(ctx, lk, train, **kw)
    for i, text in enumerate(["dp=16", "dp=4,tp=2,pp=2,zero=1,sp=1,recompute=selective"]):
        est = estimate_step(model, cluster, Layout.parse(text), train)
        assert terms["total"][i] == pytest.approx(est.total, rel=1e-12)


# ------------------------------------------------------------------ overlap (issue 9 item 5)
def _no_contention(accelerator="h100-sxm", **changes):
    return replace(default_calibration(accelerator), overlap_contention=0.0, **changes)


def test_tp_comm_overlap_hides_behind_the_pipelined_gemm_share():
    # Closed form with κ = 0, η = 1: per layer forward max(0, 2·AR - W), backward
    # max(0, 2·AR - 2·W) with W = gemm·(t-1)/t; the head's backward AR stays exposed. AR comes
    # from the unoverlapped run: tp_comm = m·(4·L·AR + AR) (no recompute, pp = 1 adds the
    # embedding's: + AR).
    from shardwise.estimate.compute import ComputeContext
    from shardwise.estimate.step import compute_costs

    model = get_model("llama3-8b")
    cluster = Cluster.of(8, "h100")
    cal = _no_contention(tp_overlap_efficiency=1.0)
    layout = Layout(tp=8, sp=True, dp=1)
    base = TrainSpec(seq_len=4096, global_batch=2)
    off = estimate_step(model, cluster, layout, replace(base, tp_overlap="none"), cal)
    on = estimate_step(model, cluster, layout, replace(base, tp_overlap="bulk"), cal)
    m, layers, t = 2, model.n_layers, 8
    # the vocabulary-parallel cross-entropy's 3 all-reduces of one fp32 per token, exposed
    ce = 3 * group_collective_time("all-reduce", 4096 * 4, t, 8, Links.of(cluster, cal))
    ar = (off.tp_comm / m - ce) / (4 * layers + 2)
    ctx = ComputeContext.of(model, cluster.accelerator, base, cal)
    gemm = float(compute_costs(ctx, t, 1, 1, 1, 0, 1)["dense"].wgrad)
    window = gemm * (t - 1) / t
    expected = m * (layers * (max(0.0, 2 * ar - window) + max(0.0, 2 * ar - 2 * window))
                    + 2 * ar + ce)
    assert on.tp_comm == pytest.approx(expected, rel=1e-9)
    assert on.tp_comm < off.tp_comm
    # without sequence parallelism Megatron-LM refuses --tp-comm-overlap (arguments.py:1441):
    # the layout is refused, not timed as a no-op
    no_sp = Layout(tp=8, dp=1)
    with pytest.raises(ShardwiseError, match="arguments.py:1441"):
        estimate_step(model, cluster, no_sp, replace(base, tp_overlap="bulk"), cal)
    # Megatron-LM's default is no overlap (model_parallel_config.py: tp_comm_overlap False)
    assert estimate_step(model, cluster, layout, base, cal).tp_comm == off.tp_comm


def test_tp_overlapped_closed_form():
    from shardwise.estimate.step import tp_overlapped

    # window = 0.8 · 2 · 3/4 = 1.2
    assert tp_overlapped(1.0, 2.0, 4, True, 0.8, 0.1) == pytest.approx(0.1 * 1.0)
    assert tp_overlapped(2.0, 2.0, 4, True, 0.8, 0.1) == pytest.approx(0.8 + 0.1 * 1.2)
    assert tp_overlapped(2.0, 2.0, 4, False, 0.8, 0.1) == pytest.approx(2.0)


def test_p2p_overlap_leaves_warmup_and_cooldown_exposed():
    # κ = 0: exposed transfers drop from 2·(v·m + p - 1) to 2·(p - 1). Megatron-LM overlaps
    # them in the interleaved schedule (--no-overlap-p2p-communication: on by default);
    # the shardwise runtime's receives block.
    model = get_model("llama3-8b")
    cluster = Cluster.of(16, "h100", gpus_per_node=4)  # pp crosses nodes
    cal = _no_contention()
    layout = Layout(dp=1, tp=4, pp=4, sp=True, schedule="interleaved", chunks=2)
    base = TrainSpec(seq_len=4096, global_batch=8)
    off = estimate_step(model, cluster, layout, replace(base, impl="shardwise"), cal)
    on = estimate_step(model, cluster, layout, base, cal)
    p, v, m = 4, 2, 8
    assert on.pp_comm == pytest.approx(off.pp_comm * (p - 1) / (v * m + p - 1), rel=1e-9)
    # Megatron overlaps p2p only in the interleaved schedule
    plain = Layout(dp=1, tp=4, pp=4, sp=True)
    assert estimate_step(model, cluster, plain, base, cal).pp_comm == pytest.approx(
        estimate_step(model, cluster, plain, replace(base, impl="shardwise"), cal).pp_comm)


def test_dp_without_overlap_exposes_all_traffic_and_grad_dtype_sets_the_bytes():
    model = get_model("llama3-8b")
    cluster = Cluster.of(64, "h100")
    base = TrainSpec(seq_len=4096, global_batch=128)
    for zero in (0, 1, 3):
        est = estimate_step(model, cluster, Layout(dp=64, zero=zero),
                            replace(base, dp_overlap=False))
        assert est.dp_comm_exposed == est.dp_comm_total > 0
        # Megatron-LM's default (--overlap-grad-reduce is off) is the same
        default = estimate_step(model, cluster, Layout(dp=64, zero=zero), base)
        assert default.dp_comm_exposed == est.dp_comm_exposed
    # fp32 gradient reduction moves twice the bf16 bytes (latency terms aside: < 1 %)
    bf16 = estimate_step(model, cluster, Layout(dp=64), replace(base, grad_dtype="bf16"))
    fp32 = estimate_step(model, cluster, Layout(dp=64), replace(base, grad_dtype="fp32"))
    assert fp32.dp_comm_total == pytest.approx(2 * bf16.dp_comm_total, rel=0.01)


@pytest.mark.parametrize("flags", [dict(impl="shardwise"), {},
                                   dict(tp_overlap="bulk", dp_overlap=True)])
def test_planner_arrays_honour_the_overlap_options(flags):
    from shardwise.estimate.compute import ComputeContext
    from shardwise.estimate.step import step_terms

    model = get_model("llama3-8b")
    cluster = Cluster.of(16, "h100")
    train = TrainSpec(seq_len=4096, global_batch=64, **flags)
    ctx = ComputeContext.of(model, cluster.accelerator, train)
    lk = Links.of(cluster, ctx.calibration)
    texts = ["dp=4,tp=2,pp=2,zero=1,sp=1", "dp=2,tp=2,pp=4,sp=1,schedule=interleaved,chunks=2"]
    layouts = [Layout.parse(text) for text in texts]
    cols = {k: np.array([lay.codes()[k] for lay in layouts]) for k in layouts[0].codes()}
    terms = step_terms(ctx, lk, train, m=np.array([lay.microbatches(train) for lay in layouts]),
                       **cols)
    for i, lay in enumerate(layouts):
        est = estimate_step(model, cluster, lay, train)
        assert terms["total"][i] == pytest.approx(est.total, rel=1e-12)


def test_interleaved_window_is_the_cool_down_the_schedule_runs():
    # Each chunk k's last backward is followed by k·p chunk-backwards on every stage of the
    # interleaved schedule (read from the schedule generator), so the reduction of all but the
    # last chunk can hide behind (v-1)·p of them plus the chunk's own: (1 + (v-1)·p)/v passes.
    from shardwise.estimate.step import interleaved_window
    from shardwise.schedules import make_schedule

    for p, v, m in [(2, 2, 4), (4, 3, 8), (3, 4, 6), (4, 2, 12)]:
        for actions in make_schedule("interleaved", p, m, v).values():
            backward = [a for a in actions if a.kind == "B"]
            after = {k: len(backward) - 1 - max(i for i, a in enumerate(backward)
                                                if a.chunk == k) for k in range(v)}
            assert after == {k: k * p for k in range(v)}
        assert interleaved_window(p, v) * v == 1 + max(after.values())
    assert interleaved_window(8, 1) == 1  # non-interleaved: the last micro-batch's backward


def test_busy_fraction_is_node_speed_over_real_time():
    # One rank per node: a ring reduce-scatter on the inter link; busy = the same at the intra
    # link's bandwidth and latency over it (closed form, SPEC §5's α-β ring)
    from shardwise.estimate.step import Links, busy_fraction

    links = Links(300e9, 2e-6, 45e9, 5e-6, 8)
    nvlink = Links(300e9, 2e-6, 300e9, 2e-6, 8)
    size, n = 1e9, 16
    real = (n - 1) * (5e-6 + size / (n * 45e9))
    local = (n - 1) * (2e-6 + size / (n * 300e9))
    assert busy_fraction(size, n, 1, links, nvlink) == pytest.approx(local / real)
    assert busy_fraction(size, 8, 8, links, nvlink) == pytest.approx(1.0)  # inside a node


def test_contention_of_overlapped_dp_traffic_follows_its_bytes_not_its_time():
    # ZeRO-3 over 8 GPUs in one node vs 64 over 8 nodes, same per-GPU work: the cross-node
    # traffic takes longer but charges contention per byte, so the step grows by less than
    # κ times the extra traffic time.
    model = get_model("llama2-13b")
    train = TrainSpec(seq_len=2048, global_batch=16, dp_overlap=True)
    one = estimate_step(model, Cluster.of(8, "h100"), Layout(dp=8, zero=3, micro_batch=2),
                        train)
    eight = estimate_step(model, Cluster.of(64, "h100"), Layout(dp=64, zero=3, micro_batch=2),
                          replace(train, global_batch=128))
    kappa = default_calibration("h100-sxm").overlap_contention
    assert eight.dp_comm_total > one.dp_comm_total
    grown = eight.dp_comm_exposed - one.dp_comm_exposed
    assert 0 <= grown < kappa * (eight.dp_comm_total - one.dp_comm_total)


# ------------------------------------------------------------- context-parallel kinds (issue 36)
def _a2a(size, u, link):
    """One all-to-all over `u` ranks of one node, SPEC §5: `(u-1)·α + (u-1)/u·S/β`."""
    return (u - 1) * link.latency + (u - 1) / u * size / link.bandwidth


def test_ulysses_all_to_alls_are_exposed():
    """Ulysses inside one node (Jacobs et al. 2023): per layer and micro-batch the all-to-alls
    of Q, K, V and the output forward and their four conjugates backward, on the critical path
    (DeepSpeed's DistributedAttention, TE's a2a wait for them): nothing hides them."""
    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=32768, global_batch=8)
    est = estimate_step(model, cluster, Layout(tp=2, cp=4, cp_kind="ulysses"), train)
    intra = default_calibration(cluster.accelerator.name).link(cluster.intra)
    rows = 32768 / 4 * 2  # s/c tokens, 2 bytes
    q, kv = 32 * 128 / 2, 8 * 128 / 2  # per tp rank
    per_layer = 2 * (2 * _a2a(rows * q, 4, intra) + 2 * _a2a(rows * kv, 4, intra))
    assert est.cp_comm_exposed == pytest.approx(8 * 32 * per_layer, rel=1e-12)
    # recompute replays the forward's four (Megatron's core_attn recompute holds them)
    again = estimate_step(model, cluster, Layout(tp=2, cp=4, cp_kind="ulysses",
                                                 recompute="selective"), train)
    assert again.cp_comm_exposed == pytest.approx(1.5 * est.cp_comm_exposed, rel=1e-12)


def test_hybrid_all_to_all_inside_the_node_ring_across():
    """USP's hybrid on 2 nodes of 8: tp 2 leaves 4 cp ranks a node, so the all-to-all spans
    them (u = 4, NVLink) and the ring the r = 2 nodes, each hop a K/V block of 1/u of the
    heads over u·s/c tokens (`2·s/c·b·kv` bytes, InfiniBand). Without overlap every hop is
    a blocking send then receive: forward (r-1)·2 hops, backward twice as many bytes."""
    model, cluster = get_model("llama3-8b"), Cluster.of(16, "h100")
    train = TrainSpec(seq_len=65536, global_batch=4, impl="shardwise")  # blocking hops
    layout = Layout(tp=2, cp=8, cp_kind="hybrid", ulysses=4)
    est = estimate_step(model, cluster, layout, train)
    cal = default_calibration(cluster.accelerator.name)
    intra, inter = cal.link(cluster.intra), cal.link(cluster.inter)
    rows = 65536 / 8 * 2
    q, kv = 32 * 128 / 2, 8 * 128 / 2
    a2a = 2 * (2 * _a2a(rows * q, 4, intra) + 2 * _a2a(rows * kv, 4, intra))
    hop = inter.latency + 2 * rows * kv / inter.bandwidth
    ring = (2 - 1) * (2 * hop + 2 * 2 * hop)
    assert est.cp_comm_exposed == pytest.approx(4 * 32 * (a2a + ring), rel=1e-12)


def test_all_gather_context_parallelism_is_exposed():
    """torchtitan's FlexAttention CP inside one node: per layer and micro-batch torch's
    `flex_cp_allgather` gathers K and V of the whole sequence (two all-gathers, waited for),
    its backward reduce-scatters their gradients; op-sac gathers again in backward (no
    all-gather is in the SAC policy's save list). Ring all-gather: `(c-1)·(α + S/(c·β))`."""
    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=32768, global_batch=8, impl="torchtitan")
    layout = Layout(tp=2, cp=4, cp_kind="allgather", zero=3)
    est = estimate_step(model, cluster, layout, train)
    intra = default_calibration(cluster.accelerator.name).link(cluster.intra)
    whole = 32768 * 8 * 128 / 2 * 2  # s tokens, 4 K (or V) heads of 128 per tp rank, 2 bytes
    ring = 3 * (intra.latency + whole / (4 * intra.bandwidth))  # an all-gather or a RS
    per_layer = 2 * ring + 2 * ring  # K and V gathered forward, their gradients scattered
    assert est.cp_comm_exposed == pytest.approx(8 * 32 * per_layer, rel=1e-12)  # m = 8
    again = estimate_step(model, cluster, layout.with_(recompute="op-sac"), train)
    assert again.cp_comm_exposed == pytest.approx(1.5 * est.cp_comm_exposed, rel=1e-12)
    # Megatron's all_gather (TE's AttnFuncWithCPAndKVAllGather) saves the rank's own K/V and
    # gathers them again in backward; selective recompute's core attention a third time
    te = TrainSpec(seq_len=32768, global_batch=8)
    mine = estimate_step(model, cluster, layout.with_(zero=1), te)
    assert mine.cp_comm_exposed == pytest.approx(8 * 32 * 6 * ring, rel=1e-12)
    mine = estimate_step(model, cluster, layout.with_(zero=1, recompute="selective"), te)
    assert mine.cp_comm_exposed == pytest.approx(8 * 32 * 8 * ring, rel=1e-12)


# ------------------------------------------- what mutation testing found unchecked (issue 37)
def test_exposed_p2p_with_contention_written_out():
    """`p2p_exposed`: without overlap `2·(v·m + p - 1)` transfers; overlapped, the warm-up and
    cool-down `2·(p - 1)` plus κ of the steady state's `2·v·m`."""
    p2p, p, v, m, kappa = 1e-4, 4, 2, 8, 0.25
    assert p2p_exposed(p2p, p, v, m, False, kappa) == pytest.approx(2 * (v * m + p - 1) * p2p)
    assert p2p_exposed(p2p, p, v, m, True, kappa) == pytest.approx(
        2 * (p - 1) * p2p + kappa * 2 * v * m * p2p)


def test_bucketed_collectives_pay_one_latency_per_bucket():
    """`ceil(S/bucket)` all-reduces of `S/buckets`: the bandwidth of S and one α per bucket;
    a message smaller than a bucket is one call."""
    link = get_link("nvlink4")
    links = Links(link.bandwidth, link.latency, link.bandwidth, link.latency, 8)
    size, n = 10e6, 8  # one node of 8: the plain ring on the intra link
    time, buckets = _bucketed("all-reduce", size, n, 8, links, 4e6)
    assert buckets == 3
    assert time == pytest.approx(3 * collective_time("all-reduce", size / 3, n, link))
    time, buckets = _bucketed("all-reduce", 1e6, n, 8, links, 4e6)
    assert (buckets, time) == (1, pytest.approx(collective_time("all-reduce", 1e6, n, link)))


def test_flops_per_token_and_gpu_hours_follow_their_definitions():
    model = get_model("llama3-8b")
    full, hardware = flops_per_token(model, 8192)
    causal, causal_hw = flops_per_token(model, 8192, causal=True)
    assert full == model.training_flops_per_token(8192) > causal
    assert causal == model.training_flops_per_token(8192, causal=True)
    for name, code in RC_CODES.items():
        assert causal_hw[code] == model.training_flops_per_token(8192, causal=True,
                                                                 recompute=name)
        assert hardware[code] == model.training_flops_per_token(8192, recompute=name)
    step = estimate_step(model, Cluster.of(64, "h100"), Layout(dp=8, tp=8),
                         TrainSpec(seq_len=8192, global_batch=512))
    tokens = 1e12
    assert step.time_to_train(tokens) == pytest.approx(tokens / step.tokens_per_s)
    assert step.gpu_hours(tokens) == pytest.approx(tokens / step.tokens_per_s * 64 / 3600)
    assert step.cost(tokens, 2.5) == pytest.approx(2.5 * step.gpu_hours(tokens))


def test_torchtitans_varlen_attention_is_timed_with_fa3s_curve_on_hopper():
    """torchtitan 0.3.0's varlen backend runs FlashAttention-3 on Hopper: against
    FlexAttention (FA2's curve × 0.9 forward, × 0.85 backward) the step changes by exactly
    the attention FLOPs (causal 2·s²·d per head forward, 2.5× backward, every layer) over
    the two kernels' efficiencies at the sustained clock."""
    from shardwise.estimate.kernels import attention_efficiency

    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    cal, layout, s = default_calibration("h100-sxm"), Layout(dp=8, zero=3), 8192
    flex, fa3 = (estimate_step(model, cluster, layout,
                               TrainSpec(s, 8, impl="torchtitan", attention=kernel), cal)
                 for kernel in ("flex", "fa3"))
    d = model.d_model // model.n_heads
    flops = 4 * s * s * d * model.n_heads * 0.5 * model.n_layers
    peak = cluster.accelerator.peak_bf16 * cal.sustained_compute

    def eff(kernel, backward):
        return attention_efficiency(kernel, d, s, True, "h100-sxm", backward=backward)

    assert cal.attention_curve("fa3") == ("fa3", (1.0, 1.0))
    assert flex.t_forward - fa3.t_forward == pytest.approx(
        flops / peak * (1 / (0.9 * eff("fa2", False)) - 1 / eff("fa3", False)), rel=1e-6)
    assert flex.t_backward - fa3.t_backward == pytest.approx(
        2.5 * flops / peak * (1 / (0.85 * eff("fa2", True)) - 1 / eff("fa3", True)), rel=1e-6)


def test_flops_per_token_of_an_unhashable_spec_are_its_own():
    """A spec with a list where a tuple belongs (rope_scaling from a JSON config) cannot key
    the cache: `flops_per_token` counts it directly — the model's own FLOPs per token, and
    per recompute code (an MoE with shared experts and MLA; causal and full)."""
    from shardwise.estimate.compute import RC_CODES
    from shardwise.estimate.step import flops_per_token

    model = replace(get_model("tiny-deepseek"), rope_scaling=[("factor", 8.0)])
    with pytest.raises(TypeError):
        hash(model)
    for causal in (False, True):
        flops, by_code = flops_per_token(model, 256, causal)
        assert flops == model.training_flops_per_token(256, causal=causal)
        assert by_code == tuple(model.training_flops_per_token(256, causal=causal, recompute=name)
                                for name in sorted(RC_CODES, key=RC_CODES.get))
