"""Which gloo handles complete by themselves (`runtime.collectives.calls._reports_completion`,
the rule `wait` polls by): torch 2.13's gloo all-reduce handle carries a future, its
reduce-scatter handle has none (it completes only inside `wait()`), and an object without
`get_future` is not polled."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

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
