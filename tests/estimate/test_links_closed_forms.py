"""The collectives on calibrated links (estimate/links.py) against SPEC §5's α-β closed forms,
written out here: a ring collective over N ranks is `rounds·(N-1)·(α + S/(N·β))` (1 round for
reduce-scatter / all-gather, 2 for all-reduce); across nodes it is hierarchical (inside the
node on the intra link, across on `S/g` over the inter link); an all-to-all pays `n-1`
latencies and moves `(g-1)/n` of `S` on the intra link, `(n-g)/n` on the inter link. Groups
are taken at each threshold: one node (g = n), one rank per node (g = 1), and between; intra
and inter links differ in both bandwidth and latency so every term shows."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.calibration import default_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.links import (
    Links,
    _bucketed,
    busy_fraction,
    group_collective_time,
    measured_call,
    p2p_latency,
    small_calls,
)
from shardwise.hardware import Cluster
from tests.estimate.closed_forms import A_IN, A_OUT, B_IN, B_OUT, ring

LINKS = Links(B_IN, A_IN, B_OUT, A_OUT, 8)
S = 3.0e8  # bytes


@pytest.mark.parametrize("n, g", [(8, 8), (16, 8), (32, 8), (16, 1), (4, 1), (8, 4),
                                  (24, 2)])
def test_all_reduce_is_hierarchical_by_hand(n, g):
    """Reduce-scatter in the node, all-reduce of S/g across the n/g nodes, all-gather in the
    node: `2·(g-1)(α_i + S/(g·β_i)) + 2·(n/g-1)(α_o + S/g/(n/g·β_o))`."""
    k = n // g
    hand = (2 * (g - 1) * (A_IN + S / (g * B_IN))
            + 2 * (k - 1) * (A_OUT + (S / g) / (k * B_OUT)))
    assert group_collective_time("all-reduce", S, n, g, LINKS) == pytest.approx(hand, rel=1e-12)


@pytest.mark.parametrize("op", ["reduce-scatter", "all-gather"])
@pytest.mark.parametrize("n, g", [(8, 8), (16, 8), (16, 1), (8, 2), (64, 8)])
def test_reduce_scatter_and_all_gather_inside_then_across(op, n, g):
    k = n // g
    hand = (g - 1) * (A_IN + S / (g * B_IN)) + (k - 1) * (A_OUT + (S / g) / (k * B_OUT))
    assert group_collective_time(op, S, n, g, LINKS) == pytest.approx(hand, rel=1e-12)


def test_thresholds_one_node_and_one_rank_per_node():
    """A group inside one node is the plain ring on the intra link (no inter term); one rank
    per node the plain ring on the inter link (no intra term)."""
    assert group_collective_time("all-reduce", S, 8, 8, LINKS) == pytest.approx(
        ring(2, S, 8, B_IN, A_IN), rel=1e-12)
    assert group_collective_time("all-reduce", S, 8, 1, LINKS) == pytest.approx(
        ring(2, S, 8, B_OUT, A_OUT), rel=1e-12)
    assert group_collective_time("all-gather", S, 2, 2, LINKS) == pytest.approx(
        A_IN + S / (2 * B_IN), rel=1e-12)
    assert group_collective_time("all-gather", S, 2, 1, LINKS) == pytest.approx(
        A_OUT + S / (2 * B_OUT), rel=1e-12)
    # a group of one moves nothing
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert group_collective_time(op, S, 1, 1, LINKS) == 0.0


@pytest.mark.parametrize("n, g", [(8, 8), (16, 8), (16, 1), (8, 4), (4, 4)])
def test_all_to_all_by_hand(n, g):
    """`(n-1)·α + S·(g-1)/n/β_i + S·(n-g)/n/β_o`, α the inter link's once the group spans
    nodes."""
    alpha = A_OUT if n > g else A_IN
    hand = (n - 1) * alpha + S * (g - 1) / n / B_IN + S * (n - g) / n / B_OUT
    assert group_collective_time("all-to-all", S, n, g, LINKS) == pytest.approx(hand, rel=1e-12)


def test_arrays_broadcast_and_unknown_ops_are_refused():
    n, g = np.array([8, 16, 16]), np.array([8, 8, 1])
    got = group_collective_time("all-reduce", S, n, g, LINKS)
    want = [group_collective_time("all-reduce", S, int(a), int(b), LINKS) for a, b in zip(n, g)]
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(ShardwiseError, match="unknown collective 'broadcast'"):
        group_collective_time("broadcast", S, 8, 8, LINKS)


def test_a_measured_call_cost_replaces_the_latencies():
    """The "this machine" preset: where a call of `op` on `n` ranks was measured, `t =
    α_call + bytes/β` (the rounds' latencies dropped); elsewhere the plain α-β form."""
    alpha = 7e-4
    timed = Links(B_IN, A_IN, B_OUT, A_OUT, 2, call=(("all-reduce/4", alpha),
                                                     ("all-gather/8", 2 * alpha)))
    # 4 ranks over 2 nodes of 2: both levels, bandwidth only, plus the call
    bw_only = 2 * 1 * (S / (2 * B_IN)) + 2 * 1 * ((S / 2) / (2 * B_OUT))
    assert group_collective_time("all-reduce", S, 4, 2, timed) == pytest.approx(
        alpha + bw_only, rel=1e-12)
    assert isinstance(group_collective_time("all-reduce", S, 4, 2, timed), float)
    # no measurement for 8 ranks of all-reduce, nor for the reduce-scatter: the α-β form
    plain = Links(B_IN, A_IN, B_OUT, A_OUT, 2)
    assert group_collective_time("all-reduce", S, 8, 2, timed) == pytest.approx(
        group_collective_time("all-reduce", S, 8, 2, plain), rel=1e-12)
    hand8 = 2 * (A_IN + S / (2 * B_IN)) + 2 * 3 * (A_OUT + (S / 2) / (4 * B_OUT))
    assert group_collective_time("all-reduce", S, 8, 2, timed) == pytest.approx(hand8)
    assert group_collective_time("reduce-scatter", S, 4, 2, timed) == pytest.approx(
        (A_IN + S / (2 * B_IN)) + (A_OUT + (S / 2) / (2 * B_OUT)), rel=1e-12)
    # arrays: measured and unmeasured sizes side by side
    got = group_collective_time("all-reduce", S, np.array([4, 8]), 2, timed)
    assert got == pytest.approx([alpha + bw_only, hand8], rel=1e-12)
    ag = group_collective_time("all-gather", S, 8, 2, timed)
    assert ag == pytest.approx(2 * alpha + S / (2 * B_IN) + 3 * (S / 2) / (4 * B_OUT))
    assert measured_call(timed, "all-gather/8") == 2 * alpha
    assert measured_call(timed, "all-gather/4") is None
    assert measured_call(plain, "all-reduce/4") is None


@pytest.mark.parametrize("size, bucket, count", [(10e6, 4e6, 3), (8e6, 4e6, 2), (1e6, 4e6, 1),
                                                 (0.0, 4e6, 1)])
def test_buckets_pay_one_latency_each(size, bucket, count):
    """`ceil(S/bucket)` calls of `S/buckets` each (at least one), over 16 ranks of 2 nodes."""
    time, buckets = _bucketed("all-reduce", size, 16, 8, LINKS, bucket)
    assert buckets == count
    part = size / count
    one = (2 * 7 * (A_IN + part / (8 * B_IN)) + 2 * 1 * (A_OUT + part / 8 / (2 * B_OUT)))
    assert time == pytest.approx(count * one, rel=1e-12)


def test_busy_fraction_of_hierarchical_traffic_by_hand():
    """The reduce-scatter's time with every hop at node speed over its time on the real
    links; 1 for a group in one node, and 1 (not 0/0) for traffic that takes no time."""
    nvlink = Links(B_IN, A_IN, B_IN, A_IN, 8)
    n, g = 32, 8
    real = 7 * (A_IN + S / (8 * B_IN)) + 3 * (A_OUT + (S / 8) / (4 * B_OUT))
    local = 7 * (A_IN + S / (8 * B_IN)) + 3 * (A_IN + (S / 8) / (4 * B_IN))
    assert busy_fraction(S, n, g, LINKS, nvlink) == pytest.approx(local / real, rel=1e-12)
    assert busy_fraction(S, 8, 8, LINKS, nvlink) == pytest.approx(1.0, rel=1e-12)
    free = Links(B_IN, 0.0, B_OUT, 0.0, 8)
    assert busy_fraction(0.0, n, g, free, free) == 1.0
    assert busy_fraction(S, 1, 1, LINKS, nvlink) == 1.0  # a group of one: no traffic


def test_p2p_latency_and_small_calls_follow_the_measured_table():
    """p2p: the measured one-way "p2p/2" cost where there is one, else the link's α (arrays
    keep their shape). small_calls: `count` calls at the measured cost on that many ranks,
    nothing on one rank, where none was measured or on a GPU preset."""
    lat = np.array([A_IN, A_OUT])
    assert p2p_latency(LINKS, A_OUT) == A_OUT
    timed = Links(B_IN, A_IN, B_OUT, A_OUT, 2, call=(("all-gather/2", 4e-4),
                                                     ("all-reduce/1", 1e-4),
                                                     ("all-reduce/4", 5e-4),
                                                     ("all-reduce/8", 9e-4), ("p2p/2", 3e-4)))
    assert p2p_latency(timed, A_OUT) == 3e-4
    assert p2p_latency(timed, lat) == pytest.approx([3e-4, 3e-4])
    assert p2p_latency(timed, 0.0) == 3e-4  # a link without latency: still the measured cost
    assert small_calls(timed, "all-reduce", 8, 2) == pytest.approx(2 * 9e-4)
    assert small_calls(timed, "all-reduce", np.array([1, 4, 8, 16]), 3) == pytest.approx(
        [0.0, 3 * 5e-4, 3 * 9e-4, 0.0])
    assert small_calls(timed, "all-gather", 2, 1) == pytest.approx(4e-4)
    assert small_calls(timed, "reduce-scatter", 8, 2) == 0.0
    assert small_calls(LINKS, "all-reduce", 8, 2) == 0.0
    assert np.shape(small_calls(LINKS, "all-reduce", np.array([8, 16]), 2)) == (2,)


def test_links_of_a_cluster_are_the_datasheet_figures_times_the_calibration():
    """hardware.py: NVLink 4 at 450 GB/s per direction per H100, NDR InfiniBand at
    400 Gb/s = 50 GB/s per GPU, PCIe 5.0 x16 at ~64 GB/s to the host, each times the
    calibration's achievable fraction (its fitted α where it has one)."""
    cal = default_calibration("h100-sxm")
    links = Links.of(Cluster.of(16, "h100"), cal)
    eff, lat = cal.link_efficiency, cal.link_latency
    assert links.intra_bw == pytest.approx(450e9 * eff["nvlink4"])
    assert links.inter_bw == pytest.approx(50e9 * eff["ndr"])
    assert links.host_bw == pytest.approx(64e9 * eff["pcie5"])
    assert links.intra_lat == lat.get("nvlink4", 2e-6)
    assert links.inter_lat == lat.get("ndr", 5e-6)
    assert links.host_lat == lat.get("pcie5", 5e-6)
    assert (links.gpus_per_node, links.host, links.call) == (8, "pcie5", ())
    four = Links.of(Cluster.of(16, "h100", gpus_per_node=4), cal)
    assert four.gpus_per_node == 4


def test_links_without_a_host_link_have_none():
    """A `Links` made without the host link's figures has none (0 B/s, 0 s): offload is not
    timed on a made-up link; `Links.of` fills it from the accelerator."""
    assert (LINKS.host_bw, LINKS.host_lat, LINKS.host) == (0.0, 0.0, "")
