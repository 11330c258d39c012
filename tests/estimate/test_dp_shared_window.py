"""The dense and the expert gradients share one overlap window: Megatron-Core's DDP reduces
each kind over its own group (dense over dp·cp, experts over the expert-data-parallel group
tp·dp·cp/(etp·ep)) as its buckets fill, both during the same last backward, through the same
links. Exposed ZeRO-1 time is the closed form over their sums,

    max(Σ last buckets, Σ RS − window_b) + max(Σ last AG buckets, Σ AG − window_f),

not each group against the whole window."""

from __future__ import annotations

import pytest

from shardwise.calibration import default_calibration
from shardwise.estimate.axes import dp_time
from shardwise.estimate.links import Links, _bucketed
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec

CLUSTER = Cluster.of(64, "h100", 8)
CAL = default_calibration(CLUSTER.accelerator.calibration_name)
LINKS = Links.of(CLUSTER, CAL)
TRAIN = TrainSpec(seq_len=4096, global_batch=256, impl="megatron-te", dp_overlap=True)
BUCKET = CAL.dp_bucket_bytes


def _dp(groups, window):
    return dp_time(LINKS, TRAIN, 0.0, BUCKET, groups=groups, replicas=16, in_node=2, group=16,
                   zero=1, m=8, layers=4, window_b=window, window_f=window, big_f=1.0,
                   big_b=2.0, grad_bytes=2.0, weight_bytes=2.0, host_copy=lambda b: 0.0 * b)


def test_two_groups_are_exposed_over_their_sum():
    dense, expert, shift = 3e8, 2e9, 4  # experts reduced over 16/4 = 4 ranks, 1 of them per node
    parts = {}
    for name, params, n, g in (("dense", dense, 16, 2), ("expert", expert, 4, 1)):
        rs, rb = _bucketed("reduce-scatter", params * 2.0, n, g, LINKS, BUCKET)
        ag, ab = _bucketed("all-gather", params * 2.0, n, g, LINKS, BUCKET)
        parts[name] = (rs, rs / rb, ag, ag / ab)
    rs = sum(p[0] for p in parts.values())
    ag = sum(p[2] for p in parts.values())
    window = 0.8 * max(parts["dense"][0], parts["expert"][0])  # each alone nearly hidden
    exposed, total = _dp([(dense, 1), (expert, shift)], window)
    want = (max(parts["dense"][1] + parts["expert"][1], rs - window)
            + max(parts["dense"][3] + parts["expert"][3], ag - window))
    assert float(total) == pytest.approx(rs + ag, rel=1e-12)
    assert float(exposed) == pytest.approx(want, rel=1e-12)
    # each group against the whole window would hide far more: the sum exposes ≥ Σ − window
    alone = sum(max(p[1], p[0] - window) + max(p[3], p[2] - window) for p in parts.values())
    assert float(exposed) > alone


def test_one_group_is_unchanged_and_a_group_of_one_rank_adds_nothing():
    dense = 5e8
    rs, rb = _bucketed("reduce-scatter", dense * 2.0, 16, 2, LINKS, BUCKET)
    ag, ab = _bucketed("all-gather", dense * 2.0, 16, 2, LINKS, BUCKET)
    window = 0.5 * rs
    one, _ = _dp([(dense, 1)], window)
    assert float(one) == pytest.approx(max(rs / rb, rs - window) + max(ag / ab, ag - window),
                                       rel=1e-12)
    with_solo, _ = _dp([(dense, 1), (7e9, 16)], window)  # experts over 16/16 = 1 rank
    assert float(with_solo) == pytest.approx(float(one), rel=1e-12)
