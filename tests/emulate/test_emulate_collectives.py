"""The emulated ring all-reduce against the naive sum (SPEC §8 and §5)."""

from __future__ import annotations

import pytest
import torch

from shardwise.emulate.collectives import (
    ring_all_gather,
    ring_all_reduce,
    ring_all_reduce_bytes,
    ring_all_reduce_traced,
    ring_reduce_scatter,
)
from shardwise.errors import ShardwiseError


def test_spec_example_exact_on_every_rank() -> None:
    base = torch.tensor([1.0, 2, 3, 4])
    out = ring_all_reduce([base, base * 10, base * 100, base * 1000])
    for t in out:
        assert t.tolist() == [1111.0, 2222.0, 3333.0, 4444.0]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("numel", [1, 3, 7, 10, 64, 101])
def test_equals_naive_sum_for_any_length(n: int, numel: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + numel)
    ints = [torch.randint(-10**6, 10**6, (numel,), generator=gen).double() for _ in range(n)]
    for t in ring_all_reduce(ints):  # integers: exact whatever the summation order
        assert torch.equal(t, torch.stack(ints).sum(0))
    floats = [torch.randn(numel, dtype=torch.float64, generator=gen) for _ in range(n)]
    results = ring_all_reduce(floats)
    torch.testing.assert_close(results[0], torch.stack(floats).sum(0), rtol=1e-14, atol=1e-14)
    for t in results[1:]:  # each chunk is summed once, then copied: ranks agree bit for bit
        assert torch.equal(t, results[0])


def test_keeps_shapes_and_inputs() -> None:
    xs = [torch.arange(12.0).view(3, 4) + i for i in range(3)]
    before = [x.clone() for x in xs]
    out = ring_all_reduce(xs)
    assert out[0].shape == (3, 4)
    assert all(torch.equal(a, b) for a, b in zip(xs, before))


def test_each_step_moves_disjoint_chunks() -> None:
    """The schedule never receives into the chunk a rank is sending in the same step, so the
    snapshotted messages of a step are race-free: check the indices for several N."""
    for n in range(2, 9):
        for s in range(n - 1):
            for r in range(n):
                receiver = (r + 1) % n
                assert (r - s - 1) % n != (receiver - s - 1) % n  # reduce-scatter
                assert (r - s) % n != (receiver - s) % n  # all-gather


@pytest.mark.parametrize(("n", "numel"), [(4, 1000), (8, 64), (2, 10)])
def test_bytes_sent_match_spec_formula(n: int, numel: int) -> None:
    xs = [torch.ones(numel, dtype=torch.float32) for _ in range(n)]
    _, sent = ring_all_reduce_traced(xs)
    assert sent == [ring_all_reduce_bytes(numel * 4, n)] * n
    assert ring_all_reduce_bytes(4000, 4) == 6000  # SPEC §5 acceptance figure


def test_uneven_length_bytes_are_the_chunks_sent() -> None:
    xs = [torch.ones(10, dtype=torch.float64) for _ in range(4)]  # chunks 3, 3, 2, 2
    _, sent = ring_all_reduce_traced(xs)
    assert sum(sent) == 2 * 3 * 10 * 8  # each chunk crosses N-1 links twice


def test_reduce_scatter_and_all_gather_compose() -> None:
    xs = [torch.arange(11.0) * (r + 1) for r in range(4)]
    parts = ring_reduce_scatter(xs)
    assert [p.numel() for p in parts] == [3, 3, 3, 2]
    full = torch.stack(xs).sum(0)
    assert torch.equal(torch.cat(parts), full)
    for t in ring_all_gather(parts):
        assert torch.equal(t, full)


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ShardwiseError, match="rank 1 holds shape"):
        ring_all_reduce([torch.ones(3), torch.ones(4)])
