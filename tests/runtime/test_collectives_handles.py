"""Which gloo handles complete by themselves (`runtime.collectives.calls._reports_completion`,
the rule `wait` polls by): torch 2.13's gloo all-reduce handle carries a future, its
reduce-scatter handle has none (it completes only inside `wait()`), and an object without
`get_future` is not polled; whether a rank polls (gloo, a core per rank on its machine) and
how `wait` polls."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from shardwise.runtime.collectives import calls  # noqa: E402
from shardwise.runtime.collectives.calls import _reports_completion  # noqa: E402


def test_gloo_handles_with_and_without_a_future(world_of_one):
    summed = dist.all_reduce(torch.ones(4), async_op=True)
    scattered = dist.reduce_scatter_single(torch.empty(4), torch.ones(4), async_op=True) \
        if hasattr(dist, "reduce_scatter_single") else \
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4), async_op=True)
    assert _reports_completion(summed) and not _reports_completion(scattered)
    assert not _reports_completion(object())
    summed.wait()
    scattered.wait()


def test_a_rank_polls_while_its_machines_ranks_have_a_core_each(world_of_one, monkeypatch):
    """gloo: the ranks on this machine — torchrun's LOCAL_WORLD_SIZE, else the world's size
    (1 here) — against the cores this process may run on."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert calls._polls()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    assert not calls._polls()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert calls._polls()


class _Handle:
    """A backend handle that completes at its third `is_completed`, with or without a
    future (`get_future` raising as gloo's reduce-scatter handle does)."""

    def __init__(self, future: bool):
        self.future, self.polls, self.waited = future, 0, False

    def get_future(self) -> None:
        if not self.future:
            raise RuntimeError("Work::getFuture not implemented.")

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls >= 3

    def wait(self) -> bool:
        self.waited = True
        return True


def test_wait_polls_only_a_handle_that_completes_by_itself(world_of_one, monkeypatch):
    """A rank that polls (one gloo rank, a core to itself) asks a handle with a future until
    it reports completion, then waits on it; one without a future it waits on at once."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    polled, blocked = _Handle(future=True), _Handle(future=False)
    calls.wait(polled)
    calls.wait(blocked)
    assert (polled.polls, polled.waited) == (3, True)
    assert (blocked.polls, blocked.waited) == (0, True)
