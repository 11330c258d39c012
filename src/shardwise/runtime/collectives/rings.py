"""Ring all-reduce, reduce-scatter and all-gather built from send/recv only, each chunk moved
in pipelined segments of `SEGMENT_BYTES` (what the analytic ring model charges, measured).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime.collectives.meter import (
    CommCounter,
    GroupLike,
    _check_contiguous,
    _metered,
    _nbytes,
    _record,
    resolve,
)
from shardwise.runtime.mesh import AxisGroup

SEGMENT_BYTES = 1 << 20  # ring steps move their chunk in segments of this size (pipelining)


def _segments(t: torch.Tensor) -> list[torch.Tensor]:
    """Views of flat `t` of about `SEGMENT_BYTES` each; both ends of a link split alike."""
    per = max(1, SEGMENT_BYTES // max(1, t.element_size()))
    return list(torch.split(t, per)) if t.numel() else []


def _exchange(g: AxisGroup, send_buf: torch.Tensor, recv_buf: torch.Tensor,
              on_segment: Any = None) -> None:
    """One ring step: send `send_buf` to the right neighbour, receive `recv_buf` from the
    left. Every segment's send and receive are posted in a fixed order (even ranks send
    first), non-blocking; received segments are handed to `on_segment(i, view)` as they
    arrive, so reducing segment i overlaps the transfer of segment i+1."""
    right, left = g.global_rank(g.rank + 1), g.global_rank(g.rank - 1)
    if on_segment is None:  # nothing to overlap with: one message each way
        sends = [send_buf] if send_buf.numel() else []
        recvs = [recv_buf] if recv_buf.numel() else []
    else:
        sends, recvs = _segments(send_buf), _segments(recv_buf)
    send_works, recv_works = [], []
    for i in range(max(len(sends), len(recvs))):
        # Empty chunks (numel < N) have no segments: sizes are known to every rank.
        post_send = i < len(sends)
        post_recv = i < len(recvs)
        if g.rank % 2 == 0:
            if post_send:
                send_works.append(dist.isend(sends[i], dst=right, group=g.group))
            if post_recv:
                recv_works.append(dist.irecv(recvs[i], src=left, group=g.group))
        else:
            if post_recv:
                recv_works.append(dist.irecv(recvs[i], src=left, group=g.group))
            if post_send:
                send_works.append(dist.isend(sends[i], dst=right, group=g.group))
    for i, w in enumerate(recv_works):
        w.wait()
        if on_segment is not None:
            on_segment(i, recvs[i])
    for w in send_works:
        w.wait()


_COMBINE = {"sum": torch.Tensor.add_, "max": lambda a, b: torch.maximum(a, b, out=a),
            "min": lambda a, b: torch.minimum(a, b, out=a)}


def _ring_reduce_scatter_inplace(chunks: list[torch.Tensor], g: AxisGroup, op: str) -> int:
    """Reduce-scatter over views `chunks` of one flat buffer; afterwards `chunks[g.rank]` holds
    the reduced chunk. Returns the bytes this rank sent."""
    if op not in _COMBINE:
        raise ShardwiseError(f"the p2p ring reduces with {', '.join(_COMBINE)}, not {op!r}")
    combine = _COMBINE[op]
    n, r, sent = g.size, g.rank, 0
    scratch = torch.empty_like(chunks[0])  # chunk 0 is the largest (tensor_split)
    for s in range(n - 1):
        out_chunk = chunks[(r - s - 1) % n]
        in_chunk = chunks[(r - s - 2) % n]
        buf = scratch[: in_chunk.numel()]
        targets = _segments(in_chunk)

        def reduce(i: int, seg: torch.Tensor, targets: list[torch.Tensor] = targets) -> None:
            combine(targets[i], seg)

        _exchange(g, out_chunk, buf, reduce)  # the send buffer is not written during a step
        sent += _nbytes(out_chunk)
    return sent


def _ring_all_gather_inplace(chunks: list[torch.Tensor], g: AxisGroup) -> int:
    """All-gather over views `chunks`, `chunks[g.rank]` filled on entry; returns bytes sent."""
    n, r, sent = g.size, g.rank, 0
    for s in range(n - 1):
        out_chunk = chunks[(r - s) % n]
        in_chunk = chunks[(r - s - 1) % n]
        _exchange(g, out_chunk, in_chunk)  # received straight into its place
        sent += _nbytes(out_chunk)
    return sent


def ring_all_reduce_p2p(tensor: torch.Tensor, group: GroupLike = None, *, op: str = "sum",
                        counter: CommCounter | None = None) -> torch.Tensor:
    """In-place ring all-reduce from send/recv: reduce-scatter then all-gather, `2(N-1)`
    steps of `S/N` each. Any size (chunks differ by ≤ 1 element when N ∤ numel)."""
    g = resolve(group)
    if g.size == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = list(torch.tensor_split(flat, g.size))  # views of `flat`
    with _metered(g, "all-reduce"):
        sent = _ring_reduce_scatter_inplace(chunks, g, op)
        sent += _ring_all_gather_inplace(chunks, g)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    _record(g, "all-reduce", _nbytes(flat), sent, counter)
    return tensor


def ring_reduce_scatter_p2p(output: torch.Tensor, input: torch.Tensor, group: GroupLike = None,
                            *, op: str = "sum", counter: CommCounter | None = None
                            ) -> torch.Tensor:
    """Ring reduce-scatter from send/recv: `output` = reduced chunk `rank` of `input` (flat
    order, `tensor_split` chunks). `input` is not modified."""
    g = resolve(group)
    _check_contiguous(output, input)
    work = input.detach().reshape(-1).clone()  # (numel,) accumulated in place
    chunks = list(torch.tensor_split(work, g.size))
    if output.numel() != chunks[g.rank].numel():
        raise ShardwiseError(f"ring_reduce_scatter_p2p: output has {output.numel()} elements, "
                             f"expected {chunks[g.rank].numel()}")
    if g.size > 1:
        with _metered(g, "reduce-scatter"):
            sent = _ring_reduce_scatter_inplace(chunks, g, op)
        _record(g, "reduce-scatter", _nbytes(work), sent, counter)
    output.view(-1).copy_(chunks[g.rank])
    return output


def ring_all_gather_p2p(output: torch.Tensor, input: torch.Tensor, group: GroupLike = None, *,
                        counter: CommCounter | None = None) -> torch.Tensor:
    """Ring all-gather from send/recv into the contiguous `output` (flat order)."""
    g = resolve(group)
    _check_contiguous(output, input)
    chunks = list(torch.tensor_split(output.view(-1), g.size))
    if input.numel() != chunks[g.rank].numel():
        raise ShardwiseError(f"ring_all_gather_p2p: input has {input.numel()} elements, "
                             f"expected {chunks[g.rank].numel()}")
    chunks[g.rank].copy_(input.reshape(-1))
    if g.size > 1:
        with _metered(g, "all-gather"):
            sent = _ring_all_gather_inplace(chunks, g)
        _record(g, "all-gather", _nbytes(output), sent, counter)
    return output
