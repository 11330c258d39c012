"""The one thin layer every runtime collective goes through, and ring collectives built from
point-to-point send/recv only.

Public API (stable; other runtime modules import it). `group` is an `AxisGroup`
(`mesh.axis("tp")`), an axis name resolved on the current mesh ("tp", "dp", …, "world"), a raw
`ProcessGroup`, or None (the world). On a group of size 1 every collective is a no-op that
moves (and counts) nothing. Peers (`src`, `dst`) are *global* ranks, as in torch.distributed.

    all_reduce(tensor, group=None, *, op="sum", impl="native", async_op=False, counter=None)
    reduce_scatter(output, input, group=None, *, op="sum", impl="native", async_op=False,
                   counter=None)
        input (any shape, contiguous) is split into `size` chunks along its flat order with
        `torch.tensor_split` (sizes differ by ≤ 1 when not divisible); rank i gets chunk i.
    all_gather(output, input, group=None, *, impl="native", async_op=False, counter=None)
        the inverse: output (flat order) = concatenation of every rank's input chunk.
    all_to_all_single(output, input, out_splits=None, in_splits=None, group=None, *, counter=None)
        splits along dim 0, as torch.distributed.all_to_all_single.
    broadcast(tensor, src, group=None, *, counter=None)
    send(tensor, dst, group=None, *, counter=None), recv(tensor, src, group=None, *, counter=None)
    barrier(group=None)
    wait(work)                 waits for an `async_op=True` handle (a `Pending`: work, axis)
    ranks_running(n) -> context manager: n ranks run on this machine (whether `wait` polls)
    ring_all_reduce_p2p(tensor, group=None, *, op="sum", counter=None)
    ring_reduce_scatter_p2p(output, input, group=None, *, op="sum", counter=None)
    ring_all_gather_p2p(output, input, group=None, *, counter=None)
    chunk_sizes(numel, n) -> list[int]           the tensor_split sizes every rank agrees on
    CommCounter: .add(axis, op, nbytes, payload=None, ranks=None), .bytes(axis=None, op=None),
                 .payload_bytes(axis=None, op=None), .calls(axis=None, op=None), .reset(),
                 .rows(), .as_dict()
    note_send(group, nbytes, counter=None)   a send issued outside this layer (the pipeline's)
    labelled(op) -> context manager: calls inside are counted (and metered) as `op`
    get_counter(), counting() -> context manager yielding a fresh active counter
    clocking() -> context manager yielding {axis: seconds} spent inside collectives (below)
    blocked_in(axis) -> context manager charging its wall time to `axis` on active clocks

Counting (what SPEC §9 compares with the model): every call records under (axis name, op),
with the op names of `shardwise.estimate.comm` ("all-reduce", "reduce-scatter", "all-gather",
"all-to-all", "broadcast") plus "send", two figures:

* its *payload*, exact: the bytes the call was handed — `S`, the full (unsharded) size, for
  all-reduce, reduce-scatter (its input), all-gather (its output) and broadcast; for
  all-to-all the bytes leaving the rank (everything but the split it keeps); for send the
  tensor's bytes;
* the bytes *this rank sends* (`sent`): the p2p rings count what they send; a backend
  collective is opaque here, so its `sent` is SPEC §5's ring model of the payload,
  `ring_bytes_on_wire(op, S, N)` (all-reduce `2(N-1)/N·S`, the others `(N-1)/N·S`), assumed,
  not measured. What the backend really put on the wire is `runtime.wire`'s measurement:
  every call opens and closes a call on its meter when one is active.

Clocking (what `shardwise check` reports as the time a step spent in communication, per
axis): inside `clocking()`, every collective charges to its axis the wall time this rank spends
blocked in it — from the call to completion for a synchronous one, inside `wait` for an
`async_op=True` handle (a `Pending`: the work and its axis), so communication hidden behind
compute costs only what is left to wait for. It includes waiting for the slowest peer to
arrive (on a pipeline, the bubble). The pipeline's own point-to-point waits charge `pp` through
`blocked_in`. A handful of `perf_counter` calls per collective; nothing is timed outside a
clock.

Ring algorithms (Patarasuk & Yuan 2009; what NCCL/gloo run for large messages): split the
buffer into N chunks. Reduce-scatter: at step s = 0..N-2 rank r sends chunk (r-s-1) mod N to
r+1 and adds the chunk (r-s-2) mod N arriving from r-1 into its own; after N-1 steps rank r
holds the full sum of chunk r. All-gather: at step s rank r forwards chunk (r-s) mod N and
receives chunk (r-s-1) mod N. All-reduce = reduce-scatter + all-gather, `2(N-1)` steps each
moving `S/N`. Every rank ends with bit-identical values (each chunk is summed on one rank, in one
order, then copied).

Waiting (`wait`; the synchronous collectives wait the same way): on gloo, where each local
rank has a core to itself, a rank polls its collective's handle until it completes, yielding
the core between polls, instead of blocking in `work.wait()` — the progress engines of NCCL
and of most MPI libraries busy-poll for the same reason. A rank that blocks lets its core go
idle, and gloo's threads that then carry the collective's messages wait to be woken: measured
on the 2-core VM (dp2, tiny, 13 steps × 3 alternating pairs), the gradient bucket's
all-reduce took a median 4.2–4.4 ms from the later rank's launch to done when the rank that
launched first blocked, 1.1–1.2 ms when it polled, and the step 36–51 → 31–37 ms. With more
local ranks than cores a poll would take the core from another rank, so it blocks; after
`POLL_SECONDS` it blocks too (a failed peer then surfaces through the group's timeout as
before). gloo's reduce-scatter and point-to-point handles complete only inside `wait()`, so
those block (`_reports_completion`).

gloo realities: send/recv take CPU tensors; `batch_isend_irecv` is not used (it can hang on
gloo). Each ring step pairs one send and one receive in a fixed order — even ranks post the
send first, odd ranks the receive — as non-blocking `isend`/`irecv` waited together, so both
directions of every link are busy at once and no cycle of blocking sends can form. In the
reduce-scatter phase a step's chunk travels in segments of `SEGMENT_BYTES` (1 MiB), each
added into place as soon as it arrives while the next is still on the wire (the pipelining
that gloo's and NCCL's own rings do); messages between one pair of ranks arrive in the order
they were posted, so segment i matches segment i.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ring_bytes_on_wire
from shardwise.runtime import wire
from shardwise.runtime.mesh import AxisGroup, current_mesh

__all__ = [
    "CommCounter",
    "GroupLike",
    "Pending",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "blocked_in",
    "broadcast",
    "chunk_sizes",
    "clocking",
    "counting",
    "get_counter",
    "labelled",
    "note_send",
    "ranks_running",
    "recv",
    "reduce_scatter",
    "resolve",
    "ring_all_gather_p2p",
    "ring_all_reduce_p2p",
    "ring_reduce_scatter_p2p",
    "send",
    "wait",
]

GroupLike = AxisGroup | str | Any | None


# ------------------------------------------------------------------------------ counting
@dataclass(eq=False)  # identity semantics: `counting()` pops its own counter
class CommCounter:
    """Payload, bytes sent (module docstring: Counting) and calls of this rank, per (axis, op)."""

    sent: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    payload: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    ncalls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    sizes: dict[str, int] = field(default_factory=dict)  # axis -> ranks in its group

    def add(self, axis: str, op: str, nbytes: float, payload: float | None = None,
            ranks: int | None = None) -> None:
        """One call sending `nbytes`, handed `payload` bytes (default: `nbytes`), on a group
        of `ranks`."""
        self.sent[(axis, op)] += nbytes
        self.payload[(axis, op)] += nbytes if payload is None else payload
        self.ncalls[(axis, op)] += 1
        if ranks is not None:
            self.sizes[axis] = ranks

    def bytes(self, axis: str | None = None, op: str | None = None) -> float:
        """Total bytes sent, optionally restricted to one axis and/or one op."""
        return sum(v for (a, o), v in self.sent.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def payload_bytes(self, axis: str | None = None, op: str | None = None) -> float:
        """Total payload, optionally restricted to one axis and/or one op."""
        return sum(v for (a, o), v in self.payload.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def calls(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(v for (a, o), v in self.ncalls.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def reset(self) -> None:
        self.sent.clear()
        self.payload.clear()
        self.ncalls.clear()
        self.sizes.clear()

    def rows(self) -> list[dict[str, Any]]:
        """[{"axis", "op", "calls", "bytes"}] sorted by axis then op."""
        return [{"axis": a, "op": o, "calls": self.ncalls[(a, o)], "bytes": self.sent[(a, o)]}
                for (a, o) in sorted(self.sent)]

    def as_dict(self) -> dict[str, float]:
        return {f"{a}/{o}": v for (a, o), v in sorted(self.sent.items())}


_COUNTERS: list[CommCounter] = [CommCounter()]


def get_counter() -> CommCounter:
    """The active counter (the process-wide one unless inside `counting()`)."""
    return _COUNTERS[-1]


@contextlib.contextmanager
def counting() -> Iterator[CommCounter]:
    """`with counting() as c: ...` — a fresh counter active inside the block."""
    c = CommCounter()
    _COUNTERS.append(c)
    try:
        yield c
    finally:
        for i in range(len(_COUNTERS) - 1, -1, -1):
            if _COUNTERS[i] is c:
                del _COUNTERS[i]
                break


_LABELS: list[str] = []  # `labelled`'s stack


@contextlib.contextmanager
def labelled(op: str) -> Iterator[None]:
    """Count (and meter) every call inside as `op`, e.g. expert parallelism's exchange of
    per-expert row counts as "all-to-all (counts)", apart from its dispatch."""
    _LABELS.append(op)
    try:
        yield
    finally:
        _LABELS.pop()


def _label(op: str) -> str:
    return _LABELS[-1] if _LABELS else op


def _record(g: AxisGroup, op: str, payload: float, sent: float,
            counter: CommCounter | None) -> None:
    (counter or get_counter()).add(g.name, _label(op), sent, payload, g.size)


def _open(g: AxisGroup, op: str) -> tuple[AxisGroup, str, int]:
    """Open a call on the active wire meter (`runtime.wire`); `_close` it once complete."""
    op = _label(op)
    return g, op, wire.opened(g, op)


def _close(call: tuple[AxisGroup, str, int] | None) -> None:
    if call is not None:
        wire.closed(*call)


@contextlib.contextmanager
def _metered(g: AxisGroup, op: str) -> Iterator[None]:
    call = _open(g, op)
    try:
        yield
    finally:
        _close(call)


def note_send(group: GroupLike, nbytes: float, counter: CommCounter | None = None) -> None:
    """A send issued outside this layer (the pipeline's own `isend`): counted as "send", and
    marked on the wire meter (its completion is not seen here)."""
    g = resolve(group)
    _record(g, "send", nbytes, nbytes, counter)
    wire.marked(g, _label("send"))


# ------------------------------------------------------------------------------ clocking
_CLOCKS: list[dict[str, float]] = []


@contextlib.contextmanager
def clocking() -> Iterator[dict[str, float]]:
    """`with clocking() as waited: ...` — waited[axis]: the wall seconds this rank spent
    blocked in that axis's collectives inside the block (module docstring: Clocking)."""
    clock: dict[str, float] = defaultdict(float)
    _CLOCKS.append(clock)
    try:
        yield clock
    finally:
        _CLOCKS[:] = [c for c in _CLOCKS if c is not clock]


@contextlib.contextmanager
def blocked_in(axis: str | None) -> Iterator[None]:
    """Charge the block's wall time to `axis` on every active clock (None: to none)."""
    if axis is None or not _CLOCKS:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        for clock in _CLOCKS:
            clock[axis] += time.perf_counter() - start


@dataclass(frozen=True)
class Pending:
    """The handle of an `async_op=True` collective, the axis its wait is charged to, and its
    call on the wire meter (closed when waited)."""

    work: Any
    axis: str
    call: tuple[AxisGroup, str, int] | None = None

    def wait(self) -> bool:
        wait(self)
        return True


# ------------------------------------------------------------------------------- groups
def resolve(group: GroupLike) -> AxisGroup:
    """AxisGroup | axis name (on the current mesh) | ProcessGroup | None (world) → AxisGroup."""
    if isinstance(group, AxisGroup):
        return group
    if group is None or group == "world":
        return AxisGroup.world()
    if isinstance(group, str):
        mesh = current_mesh()
        if mesh is None:
            raise ShardwiseError(f"axis {group!r} given but no mesh was built in this process")
        return mesh.axis(group)
    return AxisGroup.of(group)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


def _reduce_op(op: str) -> Any:
    try:
        return _OPS[op]
    except KeyError:
        raise ShardwiseError(f"reduce op {op!r} unknown; valid: {', '.join(_OPS)}") from None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes of `torch.tensor_split(x, n)` for a flat `x` of `numel`: the first `numel % n`
    chunks hold one element more."""
    q, r = divmod(numel, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _check_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ShardwiseError("collectives take contiguous tensors (call .contiguous())")


# -------------------------------------------------------------------- counted collectives
def all_reduce(tensor: torch.Tensor, group: GroupLike = None, *, op: str = "sum",
               impl: str = "native", async_op: bool = False,
               counter: CommCounter | None = None) -> Any:
    """In-place all-reduce; returns `tensor` (or the async work handle when `async_op`).

    Payload `S`; sent counted as `2(N-1)/N · S` (ring, assumed). `impl="ring"` runs
    `ring_all_reduce_p2p`.
    """
    g = resolve(group)
    if g.size == 1:
        return _done() if async_op else tensor
    if impl == "ring":
        ring_all_reduce_p2p(tensor, g, op=op, counter=counter)
        return _done() if async_op else tensor
    size = _nbytes(tensor)
    _record(g, "all-reduce", size, ring_bytes_on_wire("all-reduce", size, g.size), counter)
    call = _open(g, "all-reduce")
    work = Pending(dist.all_reduce(tensor, op=_reduce_op(op), group=g.group, async_op=True),
                   g.name, call)
    return _finish(work, tensor, async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: GroupLike = None, *,
                   op: str = "sum", impl: str = "native", async_op: bool = False,
                   counter: CommCounter | None = None) -> Any:
    """Rank i receives the reduction of chunk i of every rank's `input` (flat order).

    Payload `S` = bytes of `input`, sent counted as `(N-1)/N · S`. When N does not divide the size the
    backend cannot do it, so the p2p ring runs instead (uneven `tensor_split` chunks).
    Returns `output`, or a work handle with `async_op` (already complete for the ring).
    """
    g = resolve(group)
    _check_contiguous(output, input)
    sizes = chunk_sizes(input.numel(), g.size)
    if output.numel() != sizes[g.rank]:
        raise ShardwiseError(f"reduce_scatter: output has {output.numel()} elements, rank "
                             f"{g.rank}'s chunk of {input.numel()} over {g.size} has "
                             f"{sizes[g.rank]}")
    if g.size == 1:
        output.view(-1).copy_(input.view(-1))
        return _done() if async_op else output
    if impl == "ring" or input.numel() % g.size:
        ring_reduce_scatter_p2p(output, input, g, op=op, counter=counter)
        return _done() if async_op else output
    size = _nbytes(input)
    _record(g, "reduce-scatter", size, ring_bytes_on_wire("reduce-scatter", size, g.size),
            counter)
    call = _open(g, "reduce-scatter")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = Pending(fn(output.view(-1), input.view(-1), op=_reduce_op(op), group=g.group,
                      async_op=True), g.name, call)
    return _finish(work, output, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: GroupLike = None, *,
               impl: str = "native", async_op: bool = False,
               counter: CommCounter | None = None) -> Any:
    """`output` (flat order) = the ranks' `input`s concatenated in group-rank order.

    Payload `S` = bytes of `output`, sent counted as `(N-1)/N · S`; uneven chunk sizes use
    the p2p ring.
    Returns `output`, or a work handle with `async_op` (already complete for the ring).
    """
    g = resolve(group)
    _check_contiguous(output, input)
    sizes = chunk_sizes(output.numel(), g.size)
    if input.numel() != sizes[g.rank]:
        raise ShardwiseError(f"all_gather: input has {input.numel()} elements, rank "
                             f"{g.rank}'s chunk of {output.numel()} over {g.size} has "
                             f"{sizes[g.rank]}")
    if g.size == 1:
        output.view(-1).copy_(input.view(-1))
        return _done() if async_op else output
    if impl == "ring" or output.numel() % g.size:
        ring_all_gather_p2p(output, input, g, counter=counter)
        return _done() if async_op else output
    size = _nbytes(output)
    _record(g, "all-gather", size, ring_bytes_on_wire("all-gather", size, g.size), counter)
    call = _open(g, "all-gather")
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = Pending(fn(output.view(-1), input.view(-1), group=g.group, async_op=True), g.name,
                   call)
    return _finish(work, output, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      out_splits: Sequence[int] | None = None,
                      in_splits: Sequence[int] | None = None, group: GroupLike = None, *,
                      counter: CommCounter | None = None) -> torch.Tensor:
    """torch.distributed.all_to_all_single (splits along dim 0); payload and sent are the
    exact bytes that leave this rank: everything but the split it keeps (`(N-1)/N · S` when
    equal)."""
    g = resolve(group)
    if g.size == 1:
        output.copy_(input)
        return output
    row = _nbytes(input) // max(1, input.shape[0]) if input.dim() else _nbytes(input)
    kept = (in_splits[g.rank] if in_splits is not None else input.shape[0] // g.size) * row
    leaving = _nbytes(input) - kept
    _record(g, "all-to-all", leaving, leaving, counter)
    call = _open(g, "all-to-all")
    work = Pending(dist.all_to_all_single(
        output, input, list(out_splits) if out_splits is not None else None,
        list(in_splits) if in_splits is not None else None, group=g.group, async_op=True),
        g.name, call)
    return _waited(work, output)


def broadcast(tensor: torch.Tensor, src: int, group: GroupLike = None, *,
              counter: CommCounter | None = None) -> torch.Tensor:
    """Copy `tensor` from global rank `src` to every member; payload `S`, sent counted
    `(N-1)/N · S` (ring)."""
    g = resolve(group)
    if g.size == 1:
        return tensor
    size = _nbytes(tensor)
    _record(g, "broadcast", size, ring_bytes_on_wire("broadcast", size, g.size), counter)
    with blocked_in(g.name), _metered(g, "broadcast"):
        dist.broadcast(tensor, src=src, group=g.group)
    return tensor


def send(tensor: torch.Tensor, dst: int, group: GroupLike = None, *,
         counter: CommCounter | None = None) -> None:
    """Blocking send to global rank `dst`, counted (exact bytes) under the group's axis."""
    g = resolve(group)
    _record(g, "send", _nbytes(tensor), _nbytes(tensor), counter)
    with blocked_in(g.name), _metered(g, "send"):
        dist.send(tensor, dst=dst, group=g.group if g.size > 1 else None)


def recv(tensor: torch.Tensor, src: int, group: GroupLike = None, *,
         counter: CommCounter | None = None) -> torch.Tensor:
    """Blocking receive from global rank `src` into `tensor` (bytes received are not
    counted: the counter measures what each rank sends; on the wire meter the receive's
    acknowledgements are the axis's "send")."""
    g = resolve(group)
    del counter
    with blocked_in(g.name), _metered(g, "send"):
        dist.recv(tensor, src=src, group=g.group if g.size > 1 else None)
    return tensor


def barrier(group: GroupLike = None) -> None:
    """A barrier over `group`, timed as a wait in that axis's collectives; no-op on a group of
    one."""
    g = resolve(group)
    if g.size > 1:
        with blocked_in(g.name):
            dist.barrier(group=g.group)


POLL_SECONDS = 1.0  # poll at most this long, then block (module docstring: Waiting)
_RUNNING: list[int] = []  # `ranks_running`'s stack


@contextlib.contextmanager
def ranks_running(n: int) -> Iterator[None]:
    """Inside, `n` ranks run on this machine, not the world's size (`calibrate` times a group
    of a few ranks while the others idle, as a layout of that many ranks would run)."""
    _RUNNING.append(n)
    try:
        yield
    finally:
        _RUNNING.pop()


def _polls() -> bool:
    """Whether this rank polls its collectives: gloo, and a core per local rank."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return False
    ranks = _RUNNING[-1] if _RUNNING else int(os.environ.get("LOCAL_WORLD_SIZE")
                                              or dist.get_world_size())
    return ranks <= _cores()


@functools.cache
def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _reports_completion(work: Any) -> bool:
    """Whether `work.is_completed()` turns true by itself: gloo's handles with a future do
    (all-reduce, all-gather, all-to-all, broadcast); its reduce-scatter and point-to-point
    handles have none and complete only inside `wait()` (torch 2.13)."""
    try:
        work.get_future()
    except (AttributeError, RuntimeError):  # "Work::getFuture not implemented."
        return False
    return True


def wait(work: Any) -> None:
    """Wait for the handle of an `async_op=True` collective (module docstring: Waiting),
    charged to its axis (a `Pending`'s; module docstring: Clocking)."""
    axis, call, work = ((work.axis, work.call, work.work) if isinstance(work, Pending)
                        else (None, None, work))
    with blocked_in(axis):
        if _polls() and _reports_completion(work):
            deadline = time.perf_counter() + POLL_SECONDS
            while not work.is_completed() and time.perf_counter() < deadline:
                os.sched_yield()
        work.wait()
    _close(call)


def _waited(work: Any, result: torch.Tensor) -> torch.Tensor:
    wait(work)
    return result


def _finish(work: Pending, result: torch.Tensor, async_op: bool) -> Any:
    """The handle of an `async_op` call, else its result once complete. While the wire is
    metered every call completes before the next starts (`runtime.wire`)."""
    if async_op and not wire.active():
        return work
    wait(work)
    return _done() if async_op else result


class _Done:
    """A finished work handle, for no-op collectives issued with `async_op=True`."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _done() -> _Done:
    return _Done()


# ------------------------------------------------------------- rings from send/recv only
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
