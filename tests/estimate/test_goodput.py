"""The goodput model (estimate/goodput.py) in closed form: Young's and Daly's intervals against
Daly's own worked examples, the complete model against its formula and its first-order
expansion, checkpoint bytes per stack by hand, Llama 3's failure rate."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import (
    CHECKPOINTS,
    DEFAULT_CHECKPOINT_BANDWIDTH,
    DEFAULT_MTBF_GPU_HOURS,
    Reliability,
    checkpoint_bytes_per_param,
    checkpoint_timing,
    checkpoint_writes,
    daly_interval,
    estimate_goodput,
    host_link,
    interval_curve,
    wall_per_useful,
    young_interval,
)
from shardwise.hardware import Cluster, get_accelerator
from shardwise.layout import Layout, TrainSpec
from shardwise.stacks import STACKS

MIN, HOUR = 60.0, 3600.0


# ----------------------------------------------------------------------------- intervals
@pytest.mark.parametrize("mtbf, published", [(24 * HOUR, 117), (6 * HOUR, 57),
                                             (15 * MIN, 9.1)])
def test_daly_reproduces_his_worked_examples(mtbf, published):
    """Daly 2006, Figs. 3-5: δ = 5 min, R = 10 min; M = 24 h → τ_opt = 117 min, M = 6 h →
    57 min, M = 15 min → 9.1 min (to the figures' precision)."""
    tau = float(daly_interval(5 * MIN, mtbf)) / MIN
    digits = 1 if published < 10 else 0
    assert round(tau, digits) == published


def test_young_and_daly_in_closed_form():
    assert young_interval(8.0, 100.0) == pytest.approx(40.0)  # √(2·8·100)
    x = 8.0 / 200.0  # δ / 2M
    assert daly_interval(8.0, 100.0) == pytest.approx(40 * (1 + math.sqrt(x) / 3 + x / 9) - 8)
    assert daly_interval(300.0, 100.0) == 100.0  # δ ≥ 2M: τ = M
    assert daly_interval(8.0, 1e12) / young_interval(8.0, 1e12) == pytest.approx(1, rel=1e-5)


def test_the_complete_model_is_dalys_formula():
    for tau, stall, mtbf, restart, lag in [(100.0, 5.0, 3600.0, 60.0, 0.0),
                                           (30.0, 0.1, 500.0, 600.0, 2.0),
                                           (1e4, 40.0, 1e4, 0.0, 0.0)]:
        want = (mtbf / tau) * math.exp((restart + lag) / mtbf) * math.expm1((tau + stall) / mtbf)
        assert wall_per_useful(tau, stall, mtbf, restart, lag) == pytest.approx(want, rel=1e-12)
    # no overflow: a job that fails far more often than it can checkpoint has goodput 0
    assert wall_per_useful(100.0, 5.0, 0.01, 60.0) == math.inf


def test_first_order_loss_is_checkpoints_plus_half_a_segment_and_the_restart():
    """For M ≫ τ, δ, R: T_w/T_s = (1 + δ/τ)·(1 + ((τ+δ)/2 + L + R)/M), and each
    interruption costs M·(1 − g·(1 + δ/τ)) = (τ+δ)/2 + L + R
    (`Goodput.lost_per_interruption_s`)."""
    tau, stall, restart, lag, mtbf = 100.0, 5.0, 60.0, 3.0, 1e8
    wall = wall_per_useful(tau, stall, mtbf, restart, lag)
    g = 1 / wall
    assert wall / (1 + stall / tau) - 1 == pytest.approx(
        ((tau + stall) / 2 + lag + restart) / mtbf, rel=1e-4)
    assert mtbf * (1 - g * (1 + stall / tau)) == pytest.approx((tau + stall) / 2 + lag + restart,
                                                                rel=1e-4)


@pytest.mark.parametrize("stall, mtbf", [(5.0, 3600.0), (30.0, 11135.0), (300.0, 21600.0),
                                         (2.0, 1e6)])
def test_dalys_interval_is_the_minimum_of_the_complete_model(stall, mtbf):
    """The wall time at Daly's interval is the smallest on a fine grid (his perturbation
    solution is accurate to O((δ/M)^2) of the optimum's wall time)."""
    grid = np.geomspace(stall / 10, mtbf, 200_001)
    best = wall_per_useful(grid, stall, mtbf, 600.0).min()
    assert wall_per_useful(daly_interval(stall, mtbf), stall, mtbf, 600.0) <= best * (1 + 1e-6)


def test_the_explainer_curve_splits_the_loss_and_finds_the_minimum():
    curve = interval_curve(30.0, 11135.0, 600.0)
    taus = np.array(curve["interval_s"])
    parts = np.array(curve["checkpoint"]) + np.array(curve["restart"]) + np.array(curve["lost"])
    assert parts == pytest.approx(np.array(curve["total"]), rel=1e-12)
    assert np.array(curve["checkpoint"]) == pytest.approx(30.0 / taus)  # δ/τ
    assert np.array(curve["restart"]) == pytest.approx(  # (1 + total)(1 − e^(−R/M))
        (1 + np.array(curve["total"])) * -math.expm1(-600 / 11135.0))
    assert min(np.array(curve["lost"])) > 0
    assert curve["young_interval_s"] == pytest.approx(math.sqrt(2 * 30 * 11135))
    step = taus[1] / taus[0]  # the grid's ratio: its best point is a neighbour of Daly's
    assert curve["daly_interval_s"] / step <= curve["best_interval_s"] <= \
        curve["daly_interval_s"] * step
    assert curve["daly_total"] <= curve["best_total"] * (1 + 1e-9)


# -------------------------------------------------------------------- checkpoint contents
def test_bytes_per_param_by_stack():
    """bf16 + Adam with fp32 masters: the fp32 master (4) and moments (8), plus the bf16
    weights (2) where the stack saves them too. Every stack lands in the issue's 12–18."""
    bf16 = {name: checkpoint_bytes_per_param(TrainSpec(impl=name)) for name in STACKS}
    assert bf16 == {"megatron-te": 2 + 4 + 8, "megatron-deepspeed": 14, "torchtitan": 4 + 8,
                    "hf-sdpa": 12, "hf-eager": 12, "pytorch-fsdp": 12, "shardwise": 14,
                    "torchtitan@0.1.0": 4 + 8,
                    "gpt-neox": 14}
    assert all(12 <= b <= 18 for b in bf16.values())
    assert set(CHECKPOINTS) == set(STACKS)
    # ZeRO-3 DeepSpeed saves no gathered 16-bit module: the fp32 partitions are the weights
    assert checkpoint_bytes_per_param(TrainSpec(impl="megatron-deepspeed"), zero=3) == 12
    # fp32 weights are the master: 4 + 8 everywhere; fp64 Adam keeps fp64 moments
    for name in STACKS:
        assert checkpoint_bytes_per_param(TrainSpec(impl=name, dtype="fp32")) == 12
    assert checkpoint_bytes_per_param(TrainSpec(impl="shardwise", dtype="fp64")) == 8 + 16
    # the optimizer's own state: SGD with momentum one fp32 buffer, plain SGD none
    assert checkpoint_bytes_per_param(TrainSpec(impl="megatron-te", optimizer="sgd-momentum")) \
        == 2 + 4 + 4
    assert checkpoint_bytes_per_param(TrainSpec(impl="torchtitan", optimizer="sgd")) == 4


def test_who_writes_what_by_hand():
    """llama3-8b (P parameters) on 8-GPU nodes, bytes the busiest rank and node write."""
    model = get_model("llama3-8b")
    p = model.count_params().total
    codes = Layout(dp=8, zero=1).codes()
    spread = checkpoint_writes(model, 8, TrainSpec(), **codes)  # Megatron: 14 B/param spread
    assert float(spread[0]) == pytest.approx(14 * p / 8) and float(spread[1]) == pytest.approx(14 * p)
    two_nodes = checkpoint_writes(model, 8, TrainSpec(), **Layout(dp=16, zero=1).codes())
    assert float(two_nodes[1]) == pytest.approx(7 * p)  # each node half of it
    # DeepSpeed: dp rank 0 writes the bf16 module and its optimizer partition
    rank, node = checkpoint_writes(model, 8, TrainSpec(impl="megatron-deepspeed"), **codes)
    assert float(rank) == pytest.approx(2 * p + 12 * p / 8)
    assert float(node) == pytest.approx(8 * 12 * p / 8 + 2 * p)
    # Hugging Face: rank 0 gathers and writes everything, whatever the layout
    rank, node = checkpoint_writes(model, 8, TrainSpec(impl="hf-sdpa"), **Layout(dp=64).codes())
    assert float(rank) == float(node) == pytest.approx(12 * p)


def test_who_writes_what_with_tp_cp_pp_by_hand():
    """llama3-8b at tp = cp = pp = dp = 2 on 8-GPU nodes (16 ranks, 2 nodes): every divisor is
    distinguishable (tp·cp = 4 ≠ dp·cp = 4 ≠ 8 ranks per node; the last stage one norm larger).
    Per rank at tp = 2: a layer is q, o 2·4096²/2, k, v 2·4096·(8/2 heads·128), 2 norms of
    4096, SwiGLU 3·4096·14336/2; stage 1 of 2: 16 layers, the final norm and the head
    128256·4096/2 (stage 0: the embedding, the same size, no norm)."""
    model = get_model("llama3-8b")
    assert (model.d_model, model.n_layers, model.n_kv_heads, model.d_ff, model.vocab) == (
        4096, 32, 8, 14336, 128256)
    layer = 2 * 4096 * 4096 // 2 + 2 * 4096 * 4 * 128 + 2 * 4096 + 3 * 4096 * 14336 // 2
    last = 16 * layer + 4096 + 128256 * 4096 // 2  # the busiest stage (stage 0: - 4096)
    assert layer == 109_060_096 and last == 2_007_633_920
    codes = Layout(tp=2, cp=2, pp=2, dp=2, zero=1).codes()
    # Megatron "spread": a rank writes its stage's state ÷ (dp·cp) at 2 + 4 + 8 = 14 B/param;
    # its node holds 8 such ranks (tp fastest)
    rank, node = checkpoint_writes(model, 8, TrainSpec(), **codes)
    assert float(rank) == pytest.approx(14 * last / 4, rel=1e-12)
    assert float(node) == pytest.approx(8 * 14 * last / 4, rel=1e-12)
    # DeepSpeed "dp0": the tp·cp = 4 ranks of data-parallel rank 0 on a node write the bf16
    # module (2 B/param), every rank its ZeRO-1 optimizer partition 12/(dp·cp)
    rank, node = checkpoint_writes(model, 8, TrainSpec(impl="megatron-deepspeed"), **codes)
    assert float(rank) == pytest.approx(2 * last + 12 * last / 4, rel=1e-12)
    assert float(node) == pytest.approx(8 * 12 * last / 4 + 4 * 2 * last, rel=1e-12)
    # on 2-GPU nodes: min(2, tp·cp) = 2 module writers, 2 partitions per node
    rank2, node2 = checkpoint_writes(model, 2, TrainSpec(impl="megatron-deepspeed"), **codes)
    assert float(rank2) == pytest.approx(2 * last + 12 * last / 4, rel=1e-12)
    assert float(node2) == pytest.approx(2 * 12 * last / 4 + 2 * 2 * last, rel=1e-12)
    # Hugging Face "rank0": the whole model (8,030,261,248 parameters) at 4 + 8 B/param
    rank, node = checkpoint_writes(model, 8, TrainSpec(impl="hf-sdpa"), **codes)
    assert float(rank) == float(node) == pytest.approx(12 * 8_030_261_248, rel=1e-12)


def test_host_links():
    assert host_link(get_accelerator("h100")).bandwidth == 64e9  # PCIe 5 x16
    assert host_link(get_accelerator("a100")).bandwidth == 32e9  # PCIe 4 x16
    assert host_link(get_accelerator("gh200")).bandwidth == 450e9  # NVLink-C2C


# ------------------------------------------------------------------------- one layout
LLAMA3_405B = (get_model("llama3-405b"), Cluster.of(16384, "h100", 8),
               Layout(tp=8, pp=16, dp=128, zero=1, sp=True), TrainSpec(global_batch=2048))


def test_llama3_405b_on_16384_h100s():
    """The per-GPU MTBF of 419 interruptions in 54 days on 16,384 GPUs gives 7.8 a day; the
    interval is Daly's (and within 5 % of Young's) for the block's own δ and M."""
    gpu_hours_per_interruption = 16384 * 54 * 24 / 419
    assert gpu_hours_per_interruption == pytest.approx(DEFAULT_MTBF_GPU_HOURS)
    g = estimate_goodput(*LLAMA3_405B, step_s=10.0)
    assert g.interruptions_per_day == pytest.approx(419 / 54)
    assert round(g.interruptions_per_day, 1) == 7.8
    delta, m = g.stall_s, g.job_mtbf_s
    assert m == pytest.approx(54 * 24 * HOUR / 419)
    x = delta / (2 * m)
    assert g.interval_s == pytest.approx(math.sqrt(2 * delta * m) * (1 + math.sqrt(x) / 3 + x / 9)
                                         - delta)
    assert abs(g.interval_s / math.sqrt(2 * delta * m) - 1) < 0.05
    assert g.daly_interval_s == g.interval_s and g.lag_s == 0.0  # no lag: Daly's is used
    assert 12 <= g.checkpoint_bytes / LLAMA3_405B[0].count_params().total <= 18
    # Megatron's spread write: the busiest node holds 8 ranks' even share of the busiest stage
    assert g.node_bandwidth == DEFAULT_CHECKPOINT_BANDWIDTH
    assert g.write_s == pytest.approx(g.rank_bytes / 64e9 + g.node_bytes / g.node_bandwidth)
    assert g.node_bytes == pytest.approx(8 * g.rank_bytes)
    assert g.goodput + sum(g.shares.values()) == pytest.approx(1)
    assert g.shares["checkpoint"] == pytest.approx(g.goodput * delta / g.interval_s)
    assert g.dominant == "restart"  # 10 minutes, 7.8 times a day
    budget = g.budget(50 * 86400)
    assert budget["days"] == pytest.approx(50 / g.goodput)
    assert budget["expected_interruptions"] == pytest.approx(budget["days"] * 419 / 54)


@settings(max_examples=40, deadline=None)
@given(mtbf=st.floats(200, 1e7), faster=st.floats(1.01, 100), restart=st.floats(0, 3600),
       bandwidth=st.floats(1e7, 1e11), asynchronous=st.booleans())
def test_goodput_falls_when_failures_come_faster(mtbf, faster, restart, bandwidth,
                                                 asynchronous):
    model, cluster, layout, train = LLAMA3_405B

    def goodput(h: float) -> float:
        rel = Reliability(h, bandwidth, restart, asynchronous)
        return float(checkpoint_timing(model, cluster, train, rel, **layout.codes())["goodput"])

    assert goodput(mtbf / faster) < goodput(mtbf)


def test_asynchronous_checkpoints_stall_only_for_the_copy():
    model, cluster, layout, train = LLAMA3_405B
    sync = estimate_goodput(model, cluster, layout, train, 10.0, Reliability())
    done = estimate_goodput(model, cluster, layout, train, 10.0,
                            Reliability(async_checkpoint=True))
    assert done.stall_s == pytest.approx(done.rank_bytes / 64e9) == done.copy_s
    assert done.lag_s == pytest.approx(sync.write_s - done.copy_s)
    assert done.interval_s >= done.lag_s and done.goodput > sync.goodput
    with pytest.raises(ShardwiseError, match="synchronously only.*megatron-te"):
        estimate_goodput(model, cluster, layout, TrainSpec(impl="hf-sdpa"), 10.0,
                         Reliability(async_checkpoint=True))


def test_arrays_equal_one_layout_at_a_time():
    model, cluster = get_model("llama3-70b"), Cluster.of(512, "h100", 8)
    train, rel = TrainSpec(global_batch=512), Reliability(2000.0, 5e8, 300.0)
    layouts = [Layout(tp=8, pp=4, dp=16, zero=1, sp=True), Layout(tp=4, pp=8, dp=16),
               Layout(tp=8, dp=64, zero=3), Layout(tp=8, pp=2, cp=2, dp=16, zero=2)]
    codes = {k: np.array([lay.codes()[k] for lay in layouts]) for k in layouts[0].codes()}
    arrays = checkpoint_timing(model, cluster, train, rel, **codes)
    for i, lay in enumerate(layouts):
        one = estimate_goodput(model, cluster, lay, train, 5.0, rel)
        assert arrays["goodput"][i] == pytest.approx(one.goodput, rel=1e-12)
        assert arrays["node_bytes"][i] == pytest.approx(one.node_bytes, rel=1e-12)


@pytest.mark.parametrize("inputs, message", [
    ({"mtbf_gpu_hours": 0.0}, "mtbf_gpu_hours"), ({"mtbf_gpu_hours": math.nan}, "finite"),
    ({"checkpoint_bandwidth": math.inf}, "checkpoint_bandwidth"),
    ({"restart_s": -1.0}, "restart_s"), ({"async_checkpoint": "yes"}, "true or false")])
def test_bad_inputs_are_one_clear_error(inputs, message):
    with pytest.raises(ShardwiseError, match=message):
        Reliability(**inputs).validate()


def test_a_job_that_cannot_progress_is_refused():
    with pytest.raises(ShardwiseError, match="makes no progress"):
        estimate_goodput(*LLAMA3_405B, step_s=10.0, reliability=Reliability(1e-6))


def test_the_job_mtbf_counts_every_rank_and_youngs_interval_is_reported():
    """llama3-8b at tp = cp = pp = dp = 2: the job holds tp·pp·dp·cp = 16 GPUs, so it fails
    every MTBF·3600/16 s; Young's interval √(2·δ·M) is reported beside Daly's; a bad MTBF
    in the explainer's curve is named."""
    model, cluster = get_model("llama3-8b"), Cluster.of(16, "h100")
    layout = Layout(tp=2, cp=2, pp=2, dp=2, zero=1)
    rel = Reliability(mtbf_gpu_hours=50_000.0)
    timing = checkpoint_timing(model, cluster, TrainSpec(), rel, **layout.codes())
    assert float(timing["job_mtbf_s"]) == pytest.approx(50_000 * 3600 / 16, rel=1e-12)
    out = estimate_goodput(model, cluster, layout, TrainSpec(), 5.0, rel)
    assert out.young_interval_s == pytest.approx(
        math.sqrt(2 * float(timing["stall_s"]) * 50_000 * 3600 / 16), rel=1e-12)
    with pytest.raises(ShardwiseError, match="^mtbf "):
        interval_curve(10.0, -1.0, 60.0)


def test_the_interval_curve_takes_a_restart_of_no_time():
    """A job that restarts instantly (R = 0, allowed: `restart` ≥ 0) loses nothing to
    restarts, e^(R/M) − 1 = 0 on every interval, and its total is the checkpoints' δ/τ plus
    the lost work's (1 + δ/τ)·(rework factor − 1) alone."""
    curve = interval_curve(10.0, 3600.0, 0.0)
    assert np.all(np.asarray(curve["restart"]) == 0.0)
    np.testing.assert_allclose(curve["total"], np.asarray(curve["checkpoint"])
                               + np.asarray(curve["lost"]), rtol=1e-12)
