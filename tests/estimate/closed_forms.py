"""SPEC §5's α-β ring collectives written out by hand, for the closed-form tests to build their
expectations from (never through shardwise's own comm code, estimate/links.py or
estimate/comm.py, which those tests check). One pair of links, inside and across nodes, that
differ in both bandwidth and latency so that every term shows. Not a test file: the tests
import it beside the modules they test."""

from __future__ import annotations

B_IN, A_IN, B_OUT, A_OUT = 300e9, 3e-6, 40e9, 11e-6  # intra / inter node: bytes/s, s


def ring(rounds: int, size: float, n: float, bw: float, lat: float) -> float:
    """SPEC §5: each of `rounds·(n-1)` steps sends S/n bytes after one latency,
    `rounds·(n-1)·(α + S/(n·β))` (1 round: reduce-scatter, all-gather; 2: all-reduce)."""
    return rounds * (n - 1) * (lat + size / (n * bw))


def coll(op: str, size: float, n: float, g: float) -> float:
    """Hierarchical collective over n ranks, g per node, on the links above: inside the node
    on S, then across the n/g nodes on S/g (an all-reduce: reduce-scatter and all-gather
    inside, all-reduce across; anything else: one round each)."""
    k = n / g
    if op == "all-reduce":
        return 2 * ring(1, size, g, B_IN, A_IN) + ring(2, size / g, k, B_OUT, A_OUT)
    return ring(1, size, g, B_IN, A_IN) + ring(1, size / g, k, B_OUT, A_OUT)
