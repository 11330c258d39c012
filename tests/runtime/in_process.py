"""`torch.distributed` in one process, for the in-process collective tests
(test_calls_in_process.py, test_rings_in_process.py): N ranks as threads; the collectives
in memory (each rank deposits its tensor, all meet, each takes its result); point-to-point
messages through mailboxes, FIFO per sender and receiver as a process group's are. Every
call must name the hub's group. Not a test file: the tests import it beside the modules they
test."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from shardwise.runtime.mesh import AxisGroup

SUM, MAX = "sum", "max"


class Work:
    """A backend handle that is already done."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Hub:
    """In-memory `torch.distributed` for `n` threads, one collective at a time in the same
    order; `sizes` holds the element count of every point-to-point message sent."""

    def __init__(self, n: int):
        self.n, self.slots = n, [None] * n
        self.meet = threading.Barrier(n, timeout=30)
        self.me = threading.local()
        self.boxes: dict[tuple[int, int], list[torch.Tensor]] = {
            (s, d): [] for s in range(n) for d in range(n)}
        self.cond = threading.Condition()
        self.sizes: list[int] = []
        self.group = object()  # the process group every call must name

    def _check(self, group, async_op=True) -> None:
        assert group is self.group and async_op is True

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.me.rank] = t.detach().clone()
        self.meet.wait()
        got = list(self.slots)
        self.meet.wait()
        return got

    def _reduce(self, ts: list[torch.Tensor], op) -> torch.Tensor:
        stacked = torch.stack(ts)
        return {"sum": stacked.sum(0), "max": stacked.max(0).values}[op]

    def _take(self, tensor: torch.Tensor, src: int) -> None:
        box = self.boxes[(src, self.me.rank)]
        with self.cond:
            assert self.cond.wait_for(lambda: box, timeout=30), f"no message from rank {src}"
            tensor.copy_(box.pop(0))

    def module(self, *only: str) -> SimpleNamespace:
        """The fake `torch.distributed`; with names, only those (any other call fails)."""

        def all_reduce(tensor, op=SUM, group=None, async_op=False):
            self._check(group, async_op)
            tensor.copy_(self._reduce(self._gather(tensor), op))
            return Work()

        def reduce_scatter_tensor(output, input, op=SUM, group=None, async_op=False):
            self._check(group, async_op)
            total = self._reduce(self._gather(input), op)
            output.copy_(torch.tensor_split(total, self.n)[self.me.rank])
            return Work()

        def all_gather_into_tensor(output, input, group=None, async_op=False):
            self._check(group, async_op)
            output.copy_(torch.cat(self._gather(input)))
            return Work()

        def all_to_all_single(output, input, out_splits=None, in_splits=None, group=None,
                              async_op=False):
            self._check(group, async_op)
            everyone = self._gather(input)
            splits = self._gather(torch.tensor(in_splits or [input.shape[0] // self.n] * self.n))
            r = self.me.rank
            parts = [torch.split(x, s.tolist())[r] for x, s in zip(everyone, splits, strict=True)]
            output.copy_(torch.cat(parts))
            return Work()

        def broadcast(tensor, src, group=None):
            self._check(group)
            tensor.copy_(self._gather(tensor)[src])

        def send(tensor, dst, group=None):
            self._check(group)
            with self.cond:
                self.sizes.append(tensor.numel())
                self.boxes[(self.me.rank, dst)].append(tensor.clone())
                self.cond.notify_all()

        def recv(tensor, src, group=None):
            self._check(group)
            self._take(tensor, src)

        def isend(tensor, dst, group=None):
            send(tensor, dst, group)
            return Work()

        def irecv(tensor, src, group=None):
            self._check(group)
            hub = self

            class _Recv(Work):
                def wait(self) -> bool:
                    hub._take(tensor, src)
                    return True

            return _Recv()

        def barrier(group=None):
            self._check(group)
            self.meet.wait()

        calls = dict(
            all_reduce=all_reduce, reduce_scatter_tensor=reduce_scatter_tensor,
            all_gather_into_tensor=all_gather_into_tensor, all_to_all_single=all_to_all_single,
            broadcast=broadcast, send=send, recv=recv, isend=isend, irecv=irecv,
            barrier=barrier, is_initialized=lambda: False,
            ReduceOp=SimpleNamespace(SUM=SUM, MAX=MAX, MIN="min", AVG="avg", PRODUCT="prod"))
        return SimpleNamespace(**{k: v for k, v in calls.items() if not only or k in only})


def run_ranks(hub: Hub, axis: str, body: Callable[[AxisGroup, int], Any]) -> list:
    """`body(group, rank)` on each of the hub's ranks, one thread each, over an `axis` group
    of all of them; their results in rank order. A rank's exception is raised here (the
    first), after it broke the barrier the others wait at."""
    n = hub.n
    results: list = [None] * n
    errors: list = []

    def rank(r: int) -> None:
        hub.me.rank = r
        try:
            results[r] = body(AxisGroup(axis, hub.group, n, r, tuple(range(n))), r)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
            hub.meet.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results
