"""Collective communication: bytes on the wire, rounds, alpha-beta time (SPEC §5).

Ring algorithms on `N` ranks for a tensor of `S` bytes, per rank (Patarasuk & Yuan 2009;
Thakur, Rabenseifner & Gropp 2005):

    op               rounds     bytes sent per rank
    reduce-scatter   N-1        (N-1)/N · S
    all-gather       N-1        (N-1)/N · S
    all-reduce       2(N-1)     2(N-1)/N · S      (reduce-scatter then all-gather)
    all-to-all       N-1        (N-1)/N · S
    broadcast        N-1        (N-1)/N · S       (pipelined ring)

Time `rounds·α + bytes/β`. `S` is the full tensor for all-reduce, all-to-all and broadcast, and
the gathered (full) size for reduce-scatter and all-gather.
"""

from __future__ import annotations

import math

from shardwise.errors import ShardwiseError
from shardwise.hardware import Link

OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "broadcast")
ALGORITHMS = ("ring", "tree", "hierarchical")


def _check(op: str, n: int) -> None:
    if op not in OPS:
        raise ShardwiseError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")
    if n < 1:
        raise ShardwiseError(f"a collective needs ≥ 1 rank, got {n}")


def ring_steps(op: str, n: int) -> int:
    """Rounds of a ring collective: `2(N-1)` for all-reduce, `N-1` otherwise."""
    _check(op, n)
    return 2 * (n - 1) if op == "all-reduce" else n - 1


def ring_bytes_on_wire(op: str, size: float, n: int) -> float:
    """Bytes each rank sends: `2(N-1)/N·S` for all-reduce, `(N-1)/N·S` otherwise."""
    _check(op, n)
    return ring_steps(op, n) * size / n


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' busbw/algbw: `2(N-1)/N` for all-reduce, `(N-1)/N` for the others."""
    return ring_bytes_on_wire(op, 1.0, n)


def bus_bandwidth(op: str, size: float, n: int, seconds: float) -> float:
    """Bus bandwidth (bytes/s) as nccl-tests defines it: `algbw · factor`, `algbw = S/t`."""
    return size / seconds * bus_bandwidth_factor(op, n)


def collective_time(op: str, size: float, n: int, link: Link, algorithm: str = "ring",
                    *, nodes: int = 1, inter: Link | None = None) -> float:
    """Alpha-beta time of one collective (seconds).

    ring:          `rounds·α + bytes_on_wire/β`
    tree:          all-reduce only, `2·log2(N)·α + 2S/β` (latency wins for small S, large N)
    hierarchical:  all-reduce over `nodes` × `N/nodes` GPUs: reduce-scatter inside the node on
                   `link`, all-reduce of `S/g` across nodes on `inter`, all-gather inside.
    """
    _check(op, n)
    if algorithm not in ALGORITHMS:
        raise ShardwiseError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return ring_steps(op, n) * link.latency + ring_bytes_on_wire(op, size, n) / link.bandwidth
    if op != "all-reduce":
        raise ShardwiseError(f"the {algorithm} algorithm is modelled for all-reduce only")
    if algorithm == "tree":
        return 2 * math.log2(n) * link.latency + 2 * size / link.bandwidth
    return hierarchical_all_reduce_time(size, nodes, n // nodes, link, inter or link)


def hierarchical_all_reduce_time(size: float, nodes: int, gpus_per_node: int, intra: Link,
                                 inter: Link) -> float:
    """RS inside each node, ring all-reduce of `S/g` across nodes, AG inside each node."""
    if nodes < 1 or gpus_per_node < 1:
        raise ShardwiseError("hierarchical all-reduce needs nodes ≥ 1 and gpus_per_node ≥ 1")
    g = gpus_per_node
    inside = 2 * collective_time("reduce-scatter", size, g, intra) if g > 1 else 0.0
    across = collective_time("all-reduce", size / g, nodes, inter)
    return inside + across


# ------------------------------------------------------------------- traffic per parallelism
def dp_step_comm_bytes(n_params: float, n: int, zero: int = 0, grad_bytes: float = 2,
                       weight_bytes: float | None = None) -> float:
    """Bytes each data-parallel rank sends per optimizer step (SPEC §2).

    stage 0 (DDP):  all-reduce of gradients             `2(N-1)/N · P·g`
    stage 1, 2:     reduce-scatter grads + all-gather weights  `(N-1)/N · P·(g + w)`
                    (= DDP's bytes when `g = w`)
    stage 3:        all-gather weights in forward and again in backward + reduce-scatter
                    grads  `(N-1)/N · P·(2w + g)` (1.5× DDP when `g = w`)
    """
    w = grad_bytes if weight_bytes is None else weight_bytes
    return sum(bytes_ for _, bytes_ in dp_step_comm_ops(n_params, n, zero, grad_bytes, w))


def dp_step_comm_ops(n_params: float, n: int, zero: int, grad_bytes: float,
                     weight_bytes: float) -> list[tuple[str, float]]:
    """The collectives of one data-parallel step and the bytes each sends per rank."""
    if zero not in (0, 1, 2, 3):
        raise ShardwiseError(f"zero stage must be 0..3, got {zero}")
    grads, weights = n_params * grad_bytes, n_params * weight_bytes
    if zero == 0:
        return [("all-reduce", ring_bytes_on_wire("all-reduce", grads, n))]
    gathers = 2 if zero == 3 else 1
    return [("reduce-scatter", ring_bytes_on_wire("reduce-scatter", grads, n))] + [
        ("all-gather", ring_bytes_on_wire("all-gather", weights, n))
    ] * gathers


def tp_comm_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, t: int,
                            dtype_bytes: float = 2, sp: bool = False,
                            backward: bool = True) -> float:
    """Bytes one tensor-parallel rank sends per Transformer layer per micro-batch.

    Megatron (Shoeybi et al. 2019): 2 all-reduces forward (after attention, after MLP) and 2
    backward (the conjugate `f`), each on an `(s, b, h)` activation:
    `4 · 2(t-1)/t · s·b·h·bytes`. Sequence parallelism (Korthikanti et al. 2022) turns each
    all-reduce into a reduce-scatter + all-gather, which moves the same bytes.
    """
    activation = seq_len * micro_batch * hidden * dtype_bytes
    per_pass = 2 * ring_bytes_on_wire("all-reduce", activation, t)
    del sp  # same bytes either way
    return per_pass * (2 if backward else 1)


def pp_comm_bytes_per_microbatch(seq_len: int, micro_batch: int, hidden: int,
                                 dtype_bytes: float = 2, tp: int = 1,
                                 scatter_gather: bool = False) -> float:
    """Bytes crossing one stage boundary per micro-batch: activation forward + gradient
    backward, `2·s·b·h·bytes` (÷t with Megatron's scatter/gather optimisation)."""
    split = tp if scatter_gather else 1
    return 2 * seq_len * micro_batch * hidden * dtype_bytes / split


def cp_comm_bytes_per_layer(seq_len: int, micro_batch: int, kv_dim: int, c: int,
                            dtype_bytes: float = 2, backward: bool = True) -> float:
    """Ring attention (Liu et al. 2023): each rank passes its K and V blocks `(s/c, b, kv)`
    around the ring `c-1` times per layer forward: `(c-1) · 2·(s/c)·b·kv·bytes`. Backward
    rotates K, V again and their gradients dK, dV back: twice the forward bytes."""
    forward = (c - 1) * 2 * (seq_len / c) * micro_batch * kv_dim * dtype_bytes
    return forward * (3 if backward else 1)


def ep_comm_bytes_per_layer(tokens: int, top_k: int, hidden: int, e: int,
                            dtype_bytes: float = 2, backward: bool = True) -> float:
    """Expert parallelism: dispatch and combine all-to-alls per MoE layer forward (and two
    more backward), each `(e-1)/e · tokens·top_k·h·bytes` per rank (tokens = this rank's)."""
    one = ring_bytes_on_wire("all-to-all", tokens * top_k * hidden * dtype_bytes, e)
    return one * (4 if backward else 2)
