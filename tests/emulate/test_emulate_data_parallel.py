"""Data-parallel gradients equal the full-batch gradient (SPEC §8)."""

from __future__ import annotations

import pytest
import torch

from shardwise.emulate.data_parallel import data_parallel_gradients, single_device_gradient
from shardwise.errors import ShardwiseError


def _data(batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(5, 3, dtype=torch.float64, generator=gen)
    x = torch.randn(batch, 5, dtype=torch.float64, generator=gen)
    y = torch.randn(batch, 3, dtype=torch.float64, generator=gen)
    return W, x, y


def _closed_form(W, x, y):
    return 2 / x.shape[0] * x.T @ (x @ W - y)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_equal_shards_give_the_full_batch_gradient(n: int) -> None:
    W, x, y = _data(16)
    full = single_device_gradient(W, x, y)
    torch.testing.assert_close(full, _closed_form(W, x, y), rtol=1e-13, atol=1e-13)
    grads = data_parallel_gradients(W, x.chunk(n), y.chunk(n))
    assert len(grads) == n
    for g in grads:
        torch.testing.assert_close(g, full, rtol=1e-13, atol=1e-13)
        assert torch.equal(g, grads[0])


def test_uneven_shards_are_rejected_with_a_clear_error() -> None:
    W, x, y = _data(10)
    with pytest.raises(ShardwiseError, match=r"uneven shards \[3, 7\].*weighted=True"):
        data_parallel_gradients(W, x.split([3, 7]), y.split([3, 7]))


@pytest.mark.parametrize("split", [[3, 7], [1, 2, 7], [4, 1, 1, 4]])
def test_weighted_reduction_matches_for_uneven_shards(split: list[int]) -> None:
    W, x, y = _data(10, seed=1)
    full = single_device_gradient(W, x, y)
    for g in data_parallel_gradients(W, x.split(split), y.split(split), weighted=True):
        torch.testing.assert_close(g, full, rtol=1e-13, atol=1e-13)
    # and the plain average would have been wrong:
    plain = sum(single_device_gradient(W, xs, ys) for xs, ys in
                zip(x.split(split), y.split(split))) / len(split)
    assert not torch.allclose(plain, full)


def test_mismatched_shards_rejected() -> None:
    W, x, y = _data(8)
    with pytest.raises(ShardwiseError):
        data_parallel_gradients(W, x.chunk(2), y.chunk(4))
