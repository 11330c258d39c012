"""`estimate.goodput`'s checkpoint writers for MoE layouts where every divisor shows (tp 4,
dp 2, cp 2, ep 2, etp 1 or 2, pp 2, 8-GPU nodes) and the shares of lost wall time, written out
from the module's docstrings. The parameters a rank of each stage holds come from
`estimate.geometry.stage_param_counts` (another module: SPEC §4's count, tested there)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardwise.arch import PRESETS
from shardwise.estimate.geometry import stage_param_counts
from shardwise.estimate.goodput import (
    Reliability,
    checkpoint_timing,
    checkpoint_writes,
    daly_interval,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec

MOE = PRESETS["mixtral-8x7b"]  # 8 experts, 32 layers, 8 kv heads


def _stages(layout: Layout):
    return [stage_param_counts(MOE, tp=layout.tp, pp=layout.pp, ep=layout.ep,
                               chunks=layout.chunks, stage=s, etp=layout.etp)
            for s in range(layout.pp)]


@pytest.mark.parametrize("etp", [1, 2])
def test_spread_writers_share_experts_over_tp_dp_cp_over_etp_ep(etp):
    """Megatron "spread": a rank writes D/(dp·cp) + E·etp·ep/(tp·dp·cp) parameters at 14 B;
    its node holds 8 ranks."""
    layout = Layout(tp=4, dp=2, cp=2, pp=2, ep=2, etp=etp, zero=1)
    rank, node = checkpoint_writes(MOE, 8, TrainSpec(), **layout.codes())
    sharing = 4 * 2 * 2 // (etp * 2)  # 8 or 4 ranks share an expert shard; dp·cp = 4
    mine = max((d / 4 + e / sharing) * 14 for d, e in _stages(layout))
    assert float(rank) == pytest.approx(mine, rel=1e-12)
    assert float(node) == pytest.approx(8 * mine, rel=1e-12)
    assert all(e > 0 and d > 0 for d, e in _stages(layout))


@pytest.mark.parametrize(("dtype", "zero", "partitioned"), [
    ("bf16", 0, True), ("bf16", 1, True), ("fp16", 0, False), ("fp16", 2, True)])
def test_dp0_writers_module_and_partitions(dtype, zero, partitioned):
    """DeepSpeed "dp0": data-parallel rank 0 writes the module (D + E)·b_w and every rank its
    optimizer partition (D + E)·b_o/(dp·cp); unpartitioned (ZeRO-0 without bf16) rank 0 writes
    the whole optimizer too. On a node: 8 partitions and min(8, tp·cp) module writers."""
    layout = Layout(tp=2, dp=2, cp=2, pp=2, ep=2, etp=1, zero=zero)
    train = TrainSpec(impl="megatron-deepspeed", dtype=dtype)
    rank, node = checkpoint_writes(MOE, 8, train, **layout.codes())
    w = 2.0 if zero < 3 else 0.0  # the 16-bit module (ZeRO-0..2)
    o = 12.0  # fp32 master + two moments
    ranks, nodes = [], []
    for d, e in _stages(layout):
        held = d + e
        if partitioned:
            shard, module = held * o / 4, held * w
        else:
            shard, module = 0.0, held * (w + o)
        ranks.append(module + shard)
        nodes.append(8 * shard + min(8, 2 * 2) * module)
    assert float(rank) == pytest.approx(max(ranks), rel=1e-12)
    assert float(node) == pytest.approx(max(nodes), rel=1e-12)


def test_shares_of_lost_time_by_hand():
    """g·δ/τ for checkpoints; the rest, 1 − g − g·δ/τ, split in proportion to the logs of the
    restart factor R/M and of the rework factor ln(T_w/T_s) − ln(1 + δ/τ) − R/M."""
    layout = Layout(tp=8, dp=64, pp=4, zero=1)
    rel = Reliability(mtbf_gpu_hours=20_000.0, checkpoint_bandwidth=2e9, restart_s=900.0)
    t = checkpoint_timing(PRESETS["llama3-70b"], Cluster.of(2048, "h100", 8), TrainSpec(),
                          rel, **layout.codes())
    stall, m, r = float(t["stall_s"]), float(t["job_mtbf_s"]), 900.0
    assert m == pytest.approx(20_000.0 * 3600 / 2048, rel=1e-12)
    tau = float(daly_interval(stall, m))
    ratio = (m / tau) * math.exp(r / m) * math.expm1((tau + stall) / m)
    g = 1 / ratio
    checkpoint = g * stall / tau
    rework = math.log(ratio) - math.log1p(stall / tau) - r / m
    rest = 1 - g - checkpoint
    shares = t["shares"]
    assert float(t["goodput"]) == pytest.approx(g, rel=1e-12)
    assert float(shares["checkpoint"]) == pytest.approx(checkpoint, rel=1e-12)
    assert float(shares["restart"]) == pytest.approx(rest * (r / m) / (r / m + rework),
                                                     rel=1e-9)
    assert float(shares["lost work"]) == pytest.approx(rest * rework / (r / m + rework),
                                                       rel=1e-9)
    assert float(t["wall_per_useful"]) == pytest.approx(ratio, rel=1e-12)
    # no restart cost: all of the interruption's loss is lost work
    t0 = checkpoint_timing(PRESETS["llama3-70b"], Cluster.of(2048, "h100", 8), TrainSpec(),
                           Reliability(20_000.0, 2e9, 0.0), **layout.codes())
    assert float(t0["shares"]["restart"]) == 0.0 and float(t0["shares"]["lost work"]) > 0
    np.testing.assert_allclose(sum(float(v) for v in shares.values()) + g, 1.0, rtol=1e-12)


def test_an_explicit_partition_under_the_v_placement():
    """ZB-V with an explicit partition (4, 12, 10, 6) over pp 2 × 2 chunks: stage 0 holds
    chunks 0 and 3 (the V), 10 layers, the embedding and the head; stage 1 chunks 1 and 2, 22
    layers — not the loop's 14 and 18. The busiest stage's rank writes its state ÷ dp at
    14 B/param, through `checkpoint_writes` and through `estimate_goodput`."""
    from shardwise.estimate.goodput import estimate_goodput

    model = PRESETS["llama3-8b"]
    layout = Layout(tp=2, dp=2, pp=2, chunks=2, schedule="zbv", partition=(4, 12, 10, 6))

    def busiest(placement: str) -> float:
        return max(sum(stage_param_counts(model, tp=2, pp=2, ep=1, chunks=2, stage=s,
                                          partition=layout.partition, placement=placement))
                   for s in range(2)) * 14 / 2

    assert busiest("v") != pytest.approx(busiest("loop"), rel=1e-3)
    rank, node = checkpoint_writes(model, 8, TrainSpec(), **layout.codes(),
                                   partition=layout.partition)
    assert float(rank) == pytest.approx(busiest("v"), rel=1e-12)
    assert float(node) == pytest.approx(8 * busiest("v"), rel=1e-12)  # one 8-GPU node
    g = estimate_goodput(model, Cluster.of(8, "h100", 8), layout, TrainSpec(), 5.0)
    assert g.rank_bytes == pytest.approx(busiest("v"), rel=1e-12)


def test_bytes_per_param_at_each_zero_stage():
    """Megatron and shardwise save the 16-bit weights beside the fp32 master at every ZeRO
    stage (2 + 4 + 8 = 14 B); DeepSpeed's ZeRO-3 saves no gathered 16-bit module (12 B);
    torchtitan and Hugging Face keep fp32 weights as the master (12 B). A stack without a
    modelled checkpoint is one line naming those that have one."""
    from shardwise.errors import ShardwiseError
    from shardwise.estimate.goodput import (
        CHECKPOINTS,
        checkpoint_bytes_per_param,
        checkpoint_format,
    )

    for zero in (0, 1, 2, 3):
        assert checkpoint_bytes_per_param(TrainSpec(impl="shardwise"), zero) == 14.0
        assert checkpoint_bytes_per_param(TrainSpec(impl="megatron-te"), zero) == 14.0
        assert checkpoint_bytes_per_param(TrainSpec(impl="torchtitan"), zero) == 12.0
        assert checkpoint_bytes_per_param(TrainSpec(impl="megatron-deepspeed"), zero) == (
            12.0 if zero == 3 else 14.0)
    with pytest.raises(ShardwiseError) as info:
        checkpoint_format(TrainSpec(impl="deepspeed"))
    assert str(info.value) == ("no checkpoint format is modelled for stack 'deepspeed'; "
                               f"modelled: {', '.join(CHECKPOINTS)}")


def test_spread_writers_when_each_expert_shard_has_one_writer():
    """tp 1, dp 2, ep 2: each expert shard lives on one rank (tp·dp·cp/(etp·ep) = 1), which
    writes all of it; the dense state is split over the 2 replicas."""
    layout = Layout(tp=1, dp=2, pp=1, ep=2, zero=1)
    rank, _ = checkpoint_writes(MOE, 8, TrainSpec(), **layout.codes())
    d, e = stage_param_counts(MOE, tp=1, pp=1, ep=2, chunks=1, stage=0)
    assert float(rank) == pytest.approx((d / 2 + e / 1) * 14, rel=1e-12)
