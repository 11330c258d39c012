"""The p2p rings (`runtime.collectives.rings`) run in one process: N ranks as threads, their
`isend`/`irecv` through in-memory mailboxes (FIFO per sender and receiver, as a process
group's point-to-point messages are), checked against the single-device reference (the sum,
max or min of every rank's tensor; the concatenation). Sizes where every term shows: chunks
of several `SEGMENT_BYTES` segments, N not dividing the element count, N = 2, 3, 4. The same
rings over real process groups: tests/runtime/test_collectives.py (multi-process)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.runtime.in_process import Hub, run_ranks  # noqa: E402

from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.runtime.collectives import rings  # noqa: E402
from shardwise.runtime.collectives.meter import CommCounter, chunk_sizes  # noqa: E402
from shardwise.runtime.mesh import AxisGroup  # noqa: E402

PER_SEGMENT = rings.SEGMENT_BYTES // 4  # float32 elements in one segment
SMALL = 256  # bytes: the segment size the ring tests set, so that small tensors span several


def _run(n: int, body, monkeypatch) -> tuple[list, Hub]:
    """`body` on n ranks whose `torch.distributed` has only `isend` and `irecv`."""
    hub = Hub(n)
    monkeypatch.setattr(rings, "SEGMENT_BYTES", SMALL)
    monkeypatch.setattr(rings, "dist", hub.module("isend", "irecv"))
    return run_ranks(hub, "dp", body), hub


def _inputs(n: int, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 1000 + numel)
    return [torch.randn(numel, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_all_reduce_equals_the_single_device_reduction(n, op, monkeypatch):
    numel = 2 * (SMALL // 4) * n + 7  # two segments and a bit per chunk, n ∤ numel
    xs = _inputs(n, numel)
    stacked = torch.stack(xs)
    expected = {"sum": stacked.sum(0), "max": stacked.max(0).values,
                "min": stacked.min(0).values}[op]
    counters = [CommCounter() for _ in range(n)]

    def body(g, r):
        t = xs[r].clone().view(3, -1) if numel % 3 == 0 else xs[r].clone()
        return rings.ring_all_reduce_p2p(t, g, op=op, counter=counters[r]).reshape(-1)

    out, hub = _run(n, body, monkeypatch)
    for r in range(n):
        torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-5)
    # each rank sends 2(N−1) chunks: (N−1)·S/N twice, chunks as tensor_split cuts them
    sizes = chunk_sizes(numel, n)
    for r, c in enumerate(counters):
        rs = sum(sizes[(r - s - 1) % n] for s in range(n - 1))
        ag = sum(sizes[(r - s) % n] for s in range(n - 1))
        assert c.bytes("dp", "all-reduce") == 4 * (rs + ag)
        assert c.payload_bytes("dp", "all-reduce") == 4 * numel
        assert c.calls("dp", "all-reduce") == 1
    # the reduce-scatter moves its chunks in segments of at most SEGMENT_BYTES
    # (the all-gather sends each chunk whole)
    assert sorted(set(hub.sizes)) == sorted({SMALL // 4, 7 // n + (7 % n > 0), 7 // n,
                                              *sizes} - {0})


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter_and_all_gather_equal_the_single_device_ones(n, monkeypatch):
    numel = (SMALL // 4) * n + 5
    xs = _inputs(n, numel)
    total = torch.stack(xs).sum(0)
    pieces = list(torch.tensor_split(total, n))

    def scatter(g, r):
        out = torch.empty(pieces[r].numel())
        before = xs[r].clone()
        rings.ring_reduce_scatter_p2p(out, xs[r], g, counter=CommCounter())
        assert torch.equal(xs[r], before)  # the input is not modified
        return out

    out, _ = _run(n, scatter, monkeypatch)
    for r in range(n):
        torch.testing.assert_close(out[r], pieces[r], rtol=1e-5, atol=1e-5)

    def gather(g, r):
        out = torch.empty(numel)
        counter = CommCounter()
        rings.ring_all_gather_p2p(out, pieces[r], g, counter=counter)
        sent = sum(chunk_sizes(numel, n)[(r - s) % n] for s in range(n - 1))
        assert counter.bytes("dp", "all-gather") == 4 * sent
        assert counter.payload_bytes("dp", "all-gather") == 4 * numel
        return out

    out, _ = _run(n, gather, monkeypatch)
    for r in range(n):
        assert torch.equal(out[r], total)


def test_shapes_and_ops_are_checked(monkeypatch):
    def body(g, r):
        with pytest.raises(ShardwiseError, match="reduces with sum, max, min, not 'avg'"):
            rings.ring_all_reduce_p2p(torch.ones(8), g, op="avg")
        with pytest.raises(ShardwiseError, match="output has 3 elements, expected 4"):
            rings.ring_reduce_scatter_p2p(torch.empty(3), torch.ones(8), g)
        with pytest.raises(ShardwiseError, match="input has 3 elements, expected 4"):
            rings.ring_all_gather_p2p(torch.empty(8), torch.ones(3), g)
        with pytest.raises(ShardwiseError, match="contiguous"):
            rings.ring_all_gather_p2p(torch.empty(4, 2).t(), torch.ones(4), g)
        return True

    assert _run(2, body, monkeypatch)[0] == [True, True]


def test_a_group_of_one_returns_the_tensor_untouched():
    g = AxisGroup("dp", None, 1, 0, (0,))
    x = torch.arange(5.0)
    assert rings.ring_all_reduce_p2p(x, g) is x and torch.equal(x, torch.arange(5.0))
    out = torch.empty(5)
    rings.ring_all_gather_p2p(out, x, g)
    assert torch.equal(out, x)
    assert rings._segments(torch.empty(0)) == []
    parts = rings._segments(torch.empty(PER_SEGMENT * 2 + 1))
    assert [p.numel() for p in parts] == [PER_SEGMENT, PER_SEGMENT, 1]
    wide = rings._segments(torch.empty(PER_SEGMENT + 3, dtype=torch.float64))
    assert [p.numel() for p in wide] == [PER_SEGMENT // 2, PER_SEGMENT // 2, 3]


def test_chunk_sizes_are_tensor_splits():
    for numel, n in ((10, 3), (7, 7), (3, 5), (PER_SEGMENT + 5, 4)):
        assert chunk_sizes(numel, n) == [c.numel() for c in torch.tensor_split(
            torch.empty(numel), n)]


def test_all_reduce_of_a_strided_tensor_writes_the_sum_into_it(monkeypatch):
    """A non-contiguous tensor (a transposed view) is reduced in a contiguous copy and the
    result written back into it, in place, as for a contiguous one."""
    n, numel = 3, 2 * 3 * (SMALL // 4)
    xs = _inputs(n, numel)
    expected = torch.stack(xs).sum(0).view(-1, 2).t()

    def body(g, r):
        strided = xs[r].clone().view(-1, 2).t()  # (2, numel/2), strides (1, 2)
        assert not strided.is_contiguous()
        rings.ring_all_reduce_p2p(strided, g)
        return strided

    out, _ = _run(n, body, monkeypatch)
    for r in range(n):
        torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-5)
