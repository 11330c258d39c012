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

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, TypeVar

import shardwise.validate as validate
from shardwise.choices import RECOMPUTE
from shardwise.errors import ShardwiseError
from shardwise.hardware import Link

F = TypeVar("F", bound=Callable[..., Any])
RANKS = frozenset({"n", "t", "c", "e", "p", "tp", "a2a"})  # ranks of a group: 1 ≤ x ≤ MAX_DEGREE

OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "broadcast")
ALGORITHMS = ("ring", "tree", "hierarchical")


def _check(op: str, n: int, *size: float) -> None:
    """The public boundary: a known op, 1 ≤ n ≤ MAX_DEGREE ranks, finite sizes ≥ 0."""
    if op not in OPS:
        raise ShardwiseError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")
    validate.degree(n, "n (ranks in the collective)")
    for value in size:
        validate.size(value, "size (bytes)")


def traffic(fn: F) -> F:
    """The public boundary of a per-axis traffic helper: rank counts (`RANKS`) are degrees,
    other numbers finite sizes ≥ 0, `recompute` one of `RECOMPUTE` — a bad
    argument raises `ShardwiseError` naming it, before any arithmetic. Vectorised callers'
    numpy arrays pass unchecked (they are checked once where the search begins)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            if name == "recompute":
                validate.known([value], RECOMPUTE, "recompute")
            elif name == "zero":
                continue  # dp_step_comm_ops names the valid stages
            elif isinstance(value, bool) or value is None or hasattr(value, "shape"):
                continue
            elif name in RANKS:
                validate.degree(value, name)
            else:
                validate.size(value, name)
        return fn(*args, **kwargs)
    return checked  # type: ignore[return-value]


def ring_steps(op: str, n: int) -> int:
    """Rounds of a ring collective: `2(N-1)` for all-reduce, `N-1` otherwise."""
    _check(op, n)
    return 2 * (n - 1) if op == "all-reduce" else n - 1


def ring_bytes_on_wire(op: str, size: float, n: int) -> float:
    """Bytes each rank sends: `2(N-1)/N·S` for all-reduce, `(N-1)/N·S` otherwise."""
    _check(op, n, size)
    return ring_steps(op, n) * size / n


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' busbw/algbw: `2(N-1)/N` for all-reduce, `(N-1)/N` for the others."""
    return ring_bytes_on_wire(op, 1.0, n)


def bus_bandwidth(op: str, size: float, n: int, seconds: float) -> float:
    """Bus bandwidth (bytes/s) as nccl-tests defines it: `algbw · factor`, `algbw = S/t`."""
    _check(op, n, size)
    return size / validate.positive(seconds, "seconds") * bus_bandwidth_factor(op, n)


def collective_time(op: str, size: float, n: int, link: Link, algorithm: str = "ring",
                    *, nodes: int = 1, inter: Link | None = None) -> float:
    """Alpha-beta time of one collective (seconds).

    ring:          `rounds·α + bytes_on_wire/β`
    tree:          all-reduce only, `2·log2(N)·α + 2S/β` (latency wins for small S, large N)
    hierarchical:  all-reduce over `nodes` × `N/nodes` GPUs: reduce-scatter inside the node on
                   `link`, all-reduce of `S/g` across nodes on `inter`, all-gather inside.
    """
    _check(op, n, size)
    validate.instance(link, Link, "link", " (hardware.get_link)")
    if inter is not None:
        validate.instance(inter, Link, "inter", " (hardware.get_link)")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
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
    if not all(validate._is_int(x) and 1 <= x <= validate.MAX_DEGREE
               for x in (nodes, gpus_per_node)):
        raise ShardwiseError("hierarchical all-reduce needs nodes ≥ 1 and gpus_per_node ≥ 1")
    g = gpus_per_node
    inside = 2 * collective_time("reduce-scatter", size, g, intra) if g > 1 else 0.0
    across = collective_time("all-reduce", size / g, nodes, inter)
    return inside + across


# ------------------------------------------------------------------- traffic per parallelism
@traffic
def dp_step_comm_bytes(n_params: float, n: int, zero: int = 0, grad_bytes: float = 2,
                       weight_bytes: float | None = None, microbatches: int = 1) -> float:
    """Bytes each data-parallel rank sends per optimizer step (SPEC §2).

    stage 0 (DDP):  all-reduce of gradients             `2(N-1)/N · P·g`
    stage 1, 2:     reduce-scatter grads + all-gather weights  `(N-1)/N · P·(g + w)`
                    (= DDP's bytes when `g = w`)
    stage 3:        all-gather weights in forward and again in backward + reduce-scatter
                    grads  `(N-1)/N · P·(2w + g)` (1.5× DDP when `g = w`)

    With `m = microbatches` of gradient accumulation, stage 2 reduce-scatters after every
    micro-batch (its gradients are sharded: there is no full buffer to accumulate into) and
    stage 3 gathers and reduce-scatters every micro-batch: `m` times those terms.
    """
    w = grad_bytes if weight_bytes is None else weight_bytes
    return sum(bytes_ for _, bytes_ in dp_step_comm_ops(n_params, n, zero, grad_bytes, w,
                                                        microbatches))


@traffic
def dp_step_comm_ops(n_params: float, n: int, zero: int, grad_bytes: float,
                     weight_bytes: float, microbatches: int = 1) -> list[tuple[str, float]]:
    """The collectives of one data-parallel step and the bytes each sends per rank."""
    if zero not in (0, 1, 2, 3):
        raise ShardwiseError(f"zero stage must be 0..3, got {zero}")
    grads, weights = n_params * grad_bytes, n_params * weight_bytes
    if zero == 0:
        return [("all-reduce", ring_bytes_on_wire("all-reduce", grads, n))]
    m = microbatches if zero >= 2 else 1
    gathers = 2 * m if zero == 3 else 1
    return [("reduce-scatter", m * ring_bytes_on_wire("reduce-scatter", grads, n))] + [
        ("all-gather", ring_bytes_on_wire("all-gather", weights, n))
    ] * gathers


@traffic
def tp_comm_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, t: int,
                            dtype_bytes: float = 2, sp: bool = False,
                            backward: bool = True, *, regather: bool = False) -> float:
    """Bytes one tensor-parallel rank sends per Transformer layer per micro-batch.

    Megatron (Shoeybi et al. 2019): 2 all-reduces forward (after attention, after MLP) and 2
    backward (the conjugate `f`), each on an `(s, b, h)` activation:
    `4 · 2(t-1)/t · s·b·h·bytes`. Sequence parallelism (Korthikanti et al. 2022) turns each
    all-reduce into a reduce-scatter + all-gather, which moves the same bytes (SPEC §5's
    figure, the default).

    A real SP implementation (Megatron's, `runtime.tensor_parallel.gather_linears`) keeps only
    the sequence shard of the QKV and gate/up input and all-gathers it again in backward for
    the weight gradients: 2 more all-gathers of `(t-1)/t · s·b·h·bytes` per layer backward
    (Megatron overlaps them with the input-gradient GEMMs). `regather=True` counts them — the
    bytes the runtime sends (`tp_comm_ops_per_layer`).
    """
    ops = tp_comm_ops_per_layer(seq_len, micro_batch, hidden, t, dtype_bytes, sp,
                                regather=regather)
    forward = sum(bytes_ for _, bytes_, in_forward in ops if in_forward)
    return sum(bytes_ for _, bytes_, _ in ops) if backward else forward


@traffic
def tp_comm_ops_per_layer(seq_len: int, micro_batch: int, hidden: int, t: int,
                          dtype_bytes: float = 2, sp: bool = False, *, mlp_pair: bool = True,
                          recompute: str = "none", regather: bool = True
                          ) -> list[tuple[str, float, bool]]:
    """The tensor-parallel collectives of one layer and one micro-batch, one rank:
    `(op, bytes sent, in the forward pass)` each, on the `(s, b, h)` activation `A`.

    Each column→row pair (attention QKV→O, MLP gate/up→down) has Megatron's `g` (all-reduce
    forward) and `f` (all-reduce backward): `2(t-1)/t · A` each. With sequence parallelism `f`
    becomes an all-gather forward / reduce-scatter backward and `g` a reduce-scatter forward /
    all-gather backward, `(t-1)/t · A` each. `mlp_pair=False`: an MoE layer that is replicated
    over tp (as `runtime.parallelize` does) — only the attention pair communicates.

    `regather` (SP only; on by default: what Megatron and `runtime.parallelize` do): the
    column linears after the all-gather keep only the `(s/t, b, h)` shard for their weight
    gradients (SPEC §3's ÷t count of the QKV and MLP inputs) and all-gather it again in
    backward — one more all-gather of `(t-1)/t · A` per pair backward, 2 per dense layer.
    `regather=False` is the textbook count of SPEC §5 (`tp_comm_bytes_per_layer`'s default).

    Full recompute replays the forward in backward. With PyTorch's non-reentrant checkpoint
    the replay stops after the last tensor the block saves (early stop), the MLP's
    down-projection input, so the MLP's closing `g` (or reduce-scatter) is not replayed.
    Replayed: the attention's `g`, `2(t-1)/t · A` (an `f` forward moves nothing); with SP the
    attention's all-gather and reduce-scatter and the MLP's all-gather, `3(t-1)/t · A`.
    (Megatron's reentrant checkpoint replays the closing collective too.)
    """
    activation = seq_len * micro_batch * hidden * dtype_bytes
    pairs = 2 if mlp_pair else 1
    if sp:
        one = ring_bytes_on_wire("all-gather", activation, t)
        ops = [("all-gather", one, True), ("reduce-scatter", one, True),
               ("reduce-scatter", one, False), ("all-gather", one, False)] * pairs
        if regather:
            ops += [("all-gather", one, False)] * pairs
        if recompute == "full":
            ops += [("all-gather", one, False), ("reduce-scatter", one, False)]
            ops += [("all-gather", one, False)] if mlp_pair else []
    else:
        one = ring_bytes_on_wire("all-reduce", activation, t)
        ops = [("all-reduce", one, True), ("all-reduce", one, False)] * pairs
        if recompute == "full":
            ops += [("all-reduce", one, False)]
    return ops


@traffic
def vocab_parallel_comm_ops(seq_len: int, micro_batch: int, hidden: int, t: int,
                            dtype_bytes: float = 2, sp: bool = False, *,
                            embedding: bool = True, head: bool = True,
                            loss_bytes: float | None = None) -> list[tuple[str, float]]:
    """Tensor-parallel collectives at the two ends of the model per micro-batch, one rank
    (Megatron's vocabulary-parallel embedding, output layer and cross-entropy).

    embedding (first stage): rows outside a rank's vocabulary slice are zero, `g` sums the
    `(s, b, h)` output `A`: an all-reduce `2(t-1)/t · A` forward (SP: a reduce-scatter forward
    and its conjugate all-gather backward, `(t-1)/t · A` each).
    head (last stage): the column-parallel output layer's `f`, an all-reduce of its input
    gradient backward (SP: all-gather forward + reduce-scatter backward); then the
    cross-entropy on vocabulary-split logits all-reduces three `(s, b)` tensors of logit dtype
    (the max, the target logit, Σ exp): `3 · 2(t-1)/t · s·b·bytes`; `loss_bytes`: the
    logits' dtype in the loss when it differs (mixed precision casts bf16 logits to fp32,
    as Megatron-LM does before its vocabulary-parallel cross-entropy).
    """
    activation = seq_len * micro_batch * hidden * dtype_bytes
    ops: list[tuple[str, float]] = []
    for present in (embedding, head):
        if not present:
            continue
        if sp:
            one = ring_bytes_on_wire("all-gather", activation, t)
            ops += [("reduce-scatter", one), ("all-gather", one)]
        else:
            ops.append(("all-reduce", ring_bytes_on_wire("all-reduce", activation, t)))
    if head:
        rows = seq_len * micro_batch * (dtype_bytes if loss_bytes is None else loss_bytes)
        ops += [("all-reduce", ring_bytes_on_wire("all-reduce", rows, t))] * 3
    return ops


@traffic
def sequence_parallel_grad_comm_bytes(n_params: float, t: int, grad_bytes: float = 2) -> float:
    """Per step: parameters replicated over tp that see only a sequence slice under sequence
    parallelism (the norms) have partial gradients, summed with an all-reduce over tp before
    the optimizer (Korthikanti et al. 2022): `2(t-1)/t · P_sp·g`."""
    return ring_bytes_on_wire("all-reduce", n_params * grad_bytes, t)


@traffic
def tied_embedding_comm_bytes(vocab: int, hidden: int, p: int, t: int = 1,
                              grad_bytes: float = 2) -> float:
    """Per step, every pipeline rank: tied input and output embeddings live on the first and
    the last stage; their gradients are summed with an all-reduce over the pipeline group
    (Megatron's embedding group; the middle stages add zeros): `2(p-1)/p · (V/t)·h·g`."""
    return ring_bytes_on_wire("all-reduce", vocab / t * hidden * grad_bytes, p)


@traffic
def pp_comm_bytes_per_microbatch(seq_len: int, micro_batch: int, hidden: int,
                                 dtype_bytes: float = 2, tp: int = 1,
                                 scatter_gather: bool = False) -> float:
    """Bytes crossing one stage boundary per micro-batch: activation forward + gradient
    backward, `2·s·b·h·bytes` (÷t with Megatron's scatter/gather optimisation)."""
    split = tp if scatter_gather else 1
    return 2 * seq_len * micro_batch * hidden * dtype_bytes / split


@traffic
def pp_send_bytes_per_step(seq_len: int, micro_batch: int, hidden: int, microbatches: int,
                           p: int, stage: int, chunks: int = 1, dtype_bytes: float = 2,
                           tp: int = 1, scatter_gather: bool = False) -> float:
    """Bytes pipeline rank `stage` sends per optimizer step: every boundary carries half of
    `pp_comm_bytes_per_microbatch` each way per micro-batch; the rank sends the activation out
    of each of its `chunks` virtual stages but the last of the pipeline and the input
    gradient out of each but the first (virtual stage `c·p + stage` is chunk c):
    `m · (n_out + n_back) · s·b·h·bytes (/t)`."""
    count = p * chunks
    held = [c * p + stage for c in range(chunks)]
    boundaries = sum(vs < count - 1 for vs in held) + sum(vs > 0 for vs in held)
    one_way = pp_comm_bytes_per_microbatch(seq_len, micro_batch, hidden, dtype_bytes, tp,
                                           scatter_gather) / 2
    return microbatches * boundaries * one_way


@traffic
def cp_comm_bytes_per_layer(seq_len: int, micro_batch: int, kv_dim: float, c: int,
                            dtype_bytes: float = 2, backward: bool = True,
                            recompute: str = "none") -> float:
    """Ring attention (Liu et al. 2023): each rank passes its K and V blocks `(s/c, b, kv)`
    around the ring `c-1` times per layer forward: `(c-1) · 2·(s/c)·b·kv·bytes`. Backward
    rotates K, V again and their gradients dK, dV back: twice the forward bytes. Selective
    or full recompute replays the attention forward in backward: once more the forward."""
    forward = (c - 1) * 2 * (seq_len / c) * micro_batch * kv_dim * dtype_bytes
    replays = 0 if recompute == "none" else 1
    return forward * ((3 + replays) if backward else 1)


@traffic
def ulysses_comm_bytes_per_layer(seq_len: int, micro_batch: int, q_dim: float, kv_dim: float,
                                 c: int, a2a: int | None = None, dtype_bytes: float = 2,
                                 backward: bool = True, recompute: str = "none", *,
                                 v_dim: float | None = None, o_dim: float | None = None
                                 ) -> float:
    """DeepSpeed-Ulysses (Jacobs et al. 2023, §3.2): per layer forward four all-to-alls over the
    `u = a2a` ranks (all `c` by default; the hybrid's groups of `u`), of Q, K, V before the
    attention (sequence-sharded → head-sharded) and of its output after (back): each rank
    sends `(u-1)/u` of its `(s/c)·b` rows of each, at its own width (per tp rank): Q
    `q_dim = a·d`, K `kv_dim = a_kv·d`, V `v_dim = a_kv·d_v`, O `o_dim = a·d_v` (`v_dim`,
    `o_dim` default to `kv_dim`, `q_dim`: d_v = d; MLA's d_v < d, DeepSeek-V3 128 vs 192):

        (u-1)/u · (s/c)·b·(q_dim + kv_dim + v_dim + o_dim)·bytes

    — the paper's "aggregate volume per link 4Nh/P" for MHA (N = s·b tokens, P = c) as u grows.
    Backward runs the conjugate all-to-alls of dO, dQ, dK, dV: the same bytes. Selective or
    full recompute replays the attention forward, its all-to-alls included (Megatron's
    `core_attn` recompute wraps Transformer Engine's attention, which holds them)."""
    u = c if a2a is None else a2a
    rows = seq_len / c * micro_batch
    width = (q_dim + kv_dim + (kv_dim if v_dim is None else v_dim)
             + (q_dim if o_dim is None else o_dim))
    forward = ring_bytes_on_wire("all-to-all", rows * width * dtype_bytes, u)
    replays = 0 if recompute == "none" else 1
    return forward * ((2 + replays) if backward else 1)


@traffic
def ep_comm_bytes_per_layer(tokens: int, top_k: int, hidden: int, e: int,
                            dtype_bytes: float = 2, backward: bool = True) -> float:
    """Expert parallelism: dispatch and combine all-to-alls per MoE layer forward (and two
    more backward), each `(e-1)/e · tokens·top_k·h·bytes` per rank (tokens = this rank's)."""
    rows = ring_bytes_on_wire("all-to-all", tokens * top_k, e)  # balanced: rows leaving
    return ep_comm_bytes_routed(rows, rows, hidden, dtype_bytes, backward)


@traffic
def ep_comm_bytes_routed(rows_out: float, rows_in: float, hidden: int, dtype_bytes: float = 2,
                         backward: bool = True, recompute: str = "none") -> float:
    """The same for the routing actually drawn: dispatch sends the `rows_out` token copies
    this rank routed to experts on other ranks, combine returns the `rows_in` rows its
    experts computed for other ranks; backward sends each set back the other way:
    `(rows_out + rows_in)·h·bytes` per pass. Balanced routing (`rows_out = rows_in =
    (e-1)/e·T·k`) gives `ep_comm_bytes_per_layer`. Full recompute replays both forward
    all-to-alls in backward."""
    one_pass = (rows_out + rows_in) * hidden * dtype_bytes
    forward = one_pass * (2 if recompute == "full" else 1)
    return forward + (one_pass if backward else 0.0)


@traffic
def ep_count_exchange_bytes(n_experts: int, e: int, count_bytes: int = 8,
                            recompute: str = "none") -> float:
    """Before the dispatch every rank tells every other how many rows it will send to each of
    their experts: an all-to-all of the `E` per-expert counts (int64), `(e-1)/e · E·8` per MoE
    layer forward (again when full recompute replays it). Nothing backward."""
    once = ring_bytes_on_wire("all-to-all", n_experts * count_bytes, e)
    return once * (2 if recompute == "full" else 1)
