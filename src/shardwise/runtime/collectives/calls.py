"""The counted collectives (all-reduce, reduce-scatter, all-gather, all-to-all, broadcast,
send/recv, barrier) and how a rank waits for them: polling while the ranks have a core each,
then blocking (`ranks_running`, `POLL_SECONDS`). Docs: docs/concepts/runtime.md#collectives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ring_bytes_on_wire
from shardwise.runtime import wire
from shardwise.runtime.collectives.meter import (
    CommCounter,
    GroupLike,
    _check_contiguous,
    _close,
    _metered,
    _nbytes,
    _open,
    _record,
    _reduce_op,
    blocked_in,
    chunk_sizes,
    resolve,
)
from shardwise.runtime.collectives.rings import (
    ring_all_gather_p2p,
    ring_all_reduce_p2p,
    ring_reduce_scatter_p2p,
)
from shardwise.runtime.mesh import AxisGroup


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


