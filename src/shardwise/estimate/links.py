"""Collectives on a cluster's calibrated links: the alpha-beta time of a collective over a
group with `g` members per node (hierarchical across nodes), in buckets, and the share of an
overlapped collective's time that slows the compute beside it (SPEC §5).

    ring:  rounds·(α + S/(N·β));  all-to-all: (n-1)·α + S·(g-1)/n/β_intra + S·(n-g)/n/β_inter

Every function is array-polymorphic (the planner passes arrays of layouts). Derivation and
sources: docs/concepts/communication.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardwise.calibration import Calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.offload import host_link
from shardwise.hardware import Cluster

__all__ = ["Links", "busy_fraction", "group_collective_time", "measured_call", "p2p_latency",
           "small_calls"]


@dataclass(frozen=True)
class Links:
    """Achievable link figures of a cluster (calibrated) and the node size."""

    intra_bw: float
    intra_lat: float
    inter_bw: float
    inter_lat: float
    gpus_per_node: int
    # measured fixed cost of one call per "op/ranks" (`Calibration.collective_call`)
    call: tuple[tuple[str, float], ...] = ()
    # the accelerator's host link (`Accelerator.host`, calibrated): offload's copies
    host_bw: float = 0.0
    host_lat: float = 0.0
    host: str = ""

    @classmethod
    def of(cls, cluster: Cluster, cal: Calibration) -> Links:
        intra, inter = cal.link(cluster.intra), cal.link(cluster.inter)
        host = cal.link(host_link(cluster.accelerator))
        return cls(intra.bandwidth, intra.latency, inter.bandwidth, inter.latency,
                   cluster.gpus_per_node, tuple(sorted(cal.collective_call.items())),
                   host.bandwidth, host.latency, host.name)


def _ring(rounds_per_rank: Any, size: Any, n: Any, bw: float, lat: float) -> Any:
    """Ring collective: `rounds·(α + S/(N·β))` — `rounds·α + bytes_on_wire/β` (SPEC §5)."""
    rounds = rounds_per_rank * (n - 1)
    return rounds * (lat + size / (n * bw))


def measured_call(links: Links, key: str) -> float | None:
    """The calibration's fixed cost of one call, keyed "op/ranks" ("p2p/2": one message one
    way), or None where it measured none (every built-in GPU preset)."""
    return dict(links.call).get(key)


def group_collective_time(op: str, size: Any, n: Any, in_node: Any, links: Links) -> Any:
    """Alpha-beta time of a collective over `n` ranks, `in_node` of them per node (SPEC §5).

    All-reduce: reduce-scatter inside the node, ring all-reduce of `S/g` across the `n/g`
    nodes, all-gather inside (hierarchical); with one node it is the plain ring on the intra
    link, with one rank per node the plain ring on the inter link. Reduce-scatter / all-gather:
    inside then across on `S/g`. All-to-all: the `(g-1)/n` share of `S` goes over the intra
    link, the `(n-g)/n` share over the inter link, `n-1` latencies.

    Where the calibration measured a fixed cost per call for `op` on `n` ranks
    (`links.call`, the "this machine" preset), that cost replaces the rounds' latencies:
    `t = α_call + bytes/β` (on gloo a call costs about the same with one ring round or two).
    """
    if links.call:
        table = dict(links.call)
        alpha = np.vectorize(lambda k: table.get(f"{op}/{int(k)}", np.nan), otypes=[float])(n)
        if not np.all(np.isnan(alpha)):
            plain = replace(links, call=())
            free = replace(plain, intra_lat=0.0, inter_lat=0.0)
            timed = np.where(np.isnan(alpha), group_collective_time(op, size, n, in_node, plain),
                             alpha + group_collective_time(op, size, n, in_node, free))
            return timed if np.ndim(timed) else float(timed)
    g = in_node
    k = n / g
    if op == "all-reduce":
        return (2 * _ring(1, size, g, links.intra_bw, links.intra_lat)
                + _ring(2, size / g, k, links.inter_bw, links.inter_lat))
    if op in ("reduce-scatter", "all-gather"):
        return (_ring(1, size, g, links.intra_bw, links.intra_lat)
                + _ring(1, size / g, k, links.inter_bw, links.inter_lat))
    if op == "all-to-all":
        lat = np.where(k > 1, links.inter_lat, links.intra_lat)
        return ((n - 1) * lat + size * (g - 1) / n / links.intra_bw
                + size * (n - g) / n / links.inter_bw)
    raise ShardwiseError(f"unknown collective {op!r}")


def _bucketed(op: str, size: Any, n: Any, g: Any, links: Links, bucket: float) -> Any:
    """`ceil(S/bucket)` collectives of one bucket each: bandwidth of `S`, one latency each."""
    buckets = np.maximum(np.ceil(size / bucket), 1)
    return buckets * group_collective_time(op, size / buckets, n, g, links), buckets


def busy_fraction(size: Any, n: Any, in_node: Any, links: Links, nvlink: Links) -> Any:
    """How much of an overlapped collective's wall time slows the compute beside it, relative
    to the same collective inside one node: its reduce-scatter time with every hop at the
    node's link speed over its time on the real links (1 inside a node; about
    `B_inter/B_intra` for traffic that crosses nodes).

    An overlapped collective costs the GEMMs beside it the SMs and HBM bandwidth its kernels
    use to move and reduce its bytes; over InfiniBand the same bytes trickle in over a longer
    time (NCCL's network path also runs fewer channels, so fewer SMs), so its contention per
    second is lower. `overlap_contention` is calibrated per second of node-local traffic."""
    real = group_collective_time("reduce-scatter", size, n, in_node, links)
    local = group_collective_time("reduce-scatter", size, n, in_node, nvlink)
    return np.where(real > 0, local / np.maximum(real, 1e-30), 1.0)


def p2p_latency(links: Links, latency: Any) -> Any:
    """The fixed cost of one point-to-point message: the calibration's measured one-way cost
    ("p2p/2", half a ping-pong) where it has one, else the link's α."""
    call = measured_call(links, "p2p/2")
    return latency if call is None else call + 0.0 * latency


def small_calls(links: Links, op: str, ranks: Any, count: int) -> Any:
    """`count` calls of `op` on a few bytes over `ranks` ranks, charged where the calibration
    measured a call's cost on that many ranks (the "this machine" preset; on a GPU cluster
    such a call is tens of µs, left out). The runtime makes them every step: two all-reduces
    of a scalar over all ranks (the loss for the log, the global gradient norm for clipping)
    and, with a pipeline, one all-gather of a checksum over its stages (they agree on the
    schedule before the first message, `runtime.pipeline._check_agreement`)."""
    calls = {int(k.split("/")[1]): v for k, v in links.call if k.startswith(f"{op}/")}
    if not calls:
        return 0.0 * ranks
    return np.vectorize(lambda n: count * calls.get(int(n), 0.0) if n > 1 else 0.0,
                        otypes=[float])(ranks)

