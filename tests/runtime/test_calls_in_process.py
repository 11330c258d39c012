"""The counted collectives (`runtime.collectives.calls`) in one process: N ranks as threads,
`torch.distributed` replaced by in-memory collectives (each rank deposits its tensor, all
meet, each takes its result), checked against the single-device reference and the bytes each
rank sends counted by hand: `2(N−1)/N·S` for all-reduce, `(N−1)/N·S` for reduce-scatter,
all-gather and broadcast, the exact bytes leaving a rank for all-to-all and send. Uneven
sizes take the p2p ring. The real process groups: tests/runtime/test_collectives.py."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from tests.runtime.in_process import MAX, SUM, Hub, Work, run_ranks  # noqa: E402

from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.runtime.collectives import calls, rings  # noqa: E402
from shardwise.runtime.collectives.meter import CommCounter  # noqa: E402
from shardwise.runtime.mesh import AxisGroup  # noqa: E402


def _run(n: int, body, monkeypatch, hub: Hub | None = None) -> list:
    hub = hub or Hub(n)
    fake = hub.module()
    monkeypatch.setattr(calls, "dist", fake)
    monkeypatch.setattr(rings, "dist", fake)
    monkeypatch.setattr(calls, "_reduce_op", lambda op: {"sum": SUM, "max": MAX}[op])
    return run_ranks(hub, "tp", body)


def _x(r: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (r + 1) + r


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("numel", [12, 13])  # 13: no N divides it, the ring runs
@pytest.mark.parametrize("async_op", [False, True])
def test_reductions_and_gathers_equal_one_device_and_count_ring_bytes(n, numel, async_op,
                                                                      monkeypatch):
    xs = [_x(r, numel) for r in range(n)]
    total = torch.stack(xs).sum(0)
    even = numel % n == 0

    def body(g, r):
        c = CommCounter()
        t = xs[r].clone()
        done = calls.all_reduce(t, g, async_op=async_op, counter=c)
        if async_op:
            done.wait()
        assert torch.equal(t, total)
        out = torch.empty(torch.tensor_split(total, n)[r].numel())
        done = calls.reduce_scatter(out, xs[r], g, async_op=async_op, counter=c)
        if async_op:
            done.wait()
        assert torch.equal(out, torch.tensor_split(total, n)[r])
        whole = torch.empty(numel)
        done = calls.all_gather(whole, torch.tensor_split(xs[0], n)[r], g, async_op=async_op,
                                counter=c)
        if async_op:
            done.wait()
        assert torch.equal(whole, xs[0])
        return c

    for r, c in enumerate(_run(n, body, monkeypatch)):
        s = 4 * numel  # bytes
        assert c.payload_bytes("tp", "all-reduce") == s
        assert c.payload_bytes("tp", "reduce-scatter") == s
        assert c.payload_bytes("tp", "all-gather") == s
        if even:  # the ring's bytes, counted as 2(N−1)/N·S and (N−1)/N·S
            assert c.bytes("tp", "all-reduce") == pytest.approx(2 * (n - 1) / n * s)
            assert c.bytes("tp", "reduce-scatter") == pytest.approx((n - 1) / n * s)
            assert c.bytes("tp", "all-gather") == pytest.approx((n - 1) / n * s)
        else:  # the p2p ring: the chunks this rank sent, as tensor_split cuts them
            sizes = [p.numel() for p in torch.tensor_split(torch.empty(numel), n)]
            rs = sum(sizes[(r - k - 1) % n] for k in range(n - 1))
            ag = sum(sizes[(r - k) % n] for k in range(n - 1))
            assert c.bytes("tp", "reduce-scatter") == 4 * rs
            assert c.bytes("tp", "all-gather") == 4 * ag
        assert c.calls("tp") == 3


def test_max_all_reduce_and_the_ring_impl(monkeypatch):
    xs = [torch.tensor([1.0, 5.0, -2.0]) * (r - 1) for r in range(3)]

    def body(g, r):
        a, b = xs[r].clone().view(3, 1), xs[r].clone()
        calls.all_reduce(a, g, op="max")
        c = CommCounter()
        calls.all_reduce(b, g, op="max", impl="ring", counter=c)
        assert c.bytes("tp", "all-reduce") == 2 * 2 * 4  # 2(N−1) chunks of one float
        out = torch.empty(1)
        assert calls.reduce_scatter(out, xs[r], g, impl="ring", async_op=True).wait()
        return a.view(-1), b, out

    for r, (a, b, out) in enumerate(_run(3, body, monkeypatch)):
        assert torch.equal(a, torch.tensor([1.0, 5.0, 2.0])) and torch.equal(a, b)
        assert torch.equal(out, torch.stack(xs).sum(0)[r:r + 1])


@pytest.mark.parametrize("n", [2, 3])
def test_the_ring_impl_all_reduces_by_send_and_recv(n, monkeypatch):
    """impl="ring" runs the p2p ring where the backend's all-reduce could run: 13 floats
    over N ranks in tensor_split chunks, each rank sends 2(N−1) messages — reduce-scatter
    chunk (r−k−1) mod N, then the reduced chunks (r−k) mod N round again — counted to the
    byte; the sum is one device's."""
    hub = Hub(n)
    xs = [_x(r, 13) for r in range(n)]

    def body(g, r):
        c = CommCounter()
        t = xs[r].clone()
        calls.all_reduce(t, g, impl="ring", counter=c)
        assert torch.equal(t, torch.stack(xs).sum(0))
        return c

    counters = _run(n, body, monkeypatch, hub)
    sizes = [p.numel() for p in torch.tensor_split(torch.empty(13), n)]
    sent = [[sizes[(r - k - 1) % n] for k in range(n - 1)]
            + [sizes[(r - k) % n] for k in range(n - 1)] for r in range(n)]
    assert sorted(hub.sizes) == sorted(x for chunks in sent for x in chunks)
    for r, c in enumerate(counters):
        assert c.bytes("tp", "all-reduce") == 4 * sum(sent[r])
        assert c.payload_bytes("tp", "all-reduce") == 4 * 13


def test_the_ring_impl_all_gathers_by_send_and_recv_and_wants_contiguous_tensors(monkeypatch):
    """impl="ring" runs the p2p ring even where the backend's all-gather could (12 floats over
    3 ranks): each rank sends its chunk of 4 and then the 4 it received, N−1 messages; a
    strided input is refused in one line before anything is sent."""
    n, hub = 3, Hub(3)
    xs = [_x(r, 12) for r in range(n)]

    def body(g, r):
        whole = torch.empty(12)
        calls.all_gather(whole, torch.tensor_split(xs[0], n)[r], g, impl="ring")
        with pytest.raises(ShardwiseError, match="contiguous tensors"):
            rings.ring_all_gather_p2p(torch.empty(24), torch.zeros(16)[::2], g)
        return whole

    for whole in _run(n, body, monkeypatch, hub):
        assert torch.equal(whole, xs[0])
    assert sorted(hub.sizes) == [4] * (n * (n - 1))


def test_all_to_all_broadcast_send_count_what_leaves_the_rank(monkeypatch):
    n = 3

    def body(g, r):
        c = CommCounter()
        rows = torch.arange(6 * 2, dtype=torch.float64).view(6, 2) + 100 * r  # 2 rows each
        out = torch.empty(6, 2, dtype=torch.float64)
        calls.all_to_all_single(out, rows, group=g, counter=c)
        expected = torch.cat([(torch.arange(12, dtype=torch.float64).view(6, 2) + 100 * q)
                              [2 * r:2 * r + 2] for q in range(n)])
        assert torch.equal(out, expected)
        # uneven splits: rank r keeps r + 1 rows of its own 6
        splits = [1, 2, 3]
        counts = [splits[r]] * n  # every rank sends splits[q] rows to q… received r+1 each
        out2 = torch.empty(sum(counts), 2, dtype=torch.float64)
        calls.all_to_all_single(out2, rows, counts, splits, group=g, counter=c)
        t = torch.full((5,), float(r), dtype=torch.float32)
        calls.broadcast(t, src=2, group=g, counter=c)
        assert torch.equal(t, torch.full((5,), 2.0))
        if r == 0:
            calls.send(torch.ones(7, dtype=torch.float16), dst=1, group=g, counter=c)
        elif r == 1:
            got = calls.recv(torch.empty(7, dtype=torch.float16), src=0, group=g, counter=c)
            assert torch.equal(got, torch.ones(7, dtype=torch.float16))
        calls.barrier(g)
        return c

    for r, c in enumerate(_run(n, body, monkeypatch)):
        row = 2 * 8
        uneven = (6 - [1, 2, 3][r]) * row
        assert c.bytes("tp", "all-to-all") == 4 * row + uneven  # 6 rows less the 2 kept
        assert c.bytes("tp", "broadcast") == pytest.approx(2 / 3 * 20)
        assert c.payload_bytes("tp", "broadcast") == 20
        assert c.bytes("tp", "send") == (14 if r == 0 else 0)
        assert c.calls("tp", "send") == (1 if r == 0 else 0)


def test_wrong_sizes_are_one_line(monkeypatch):
    def body(g, r):
        with pytest.raises(ShardwiseError, match=r"^reduce_scatter: output has 5 elements, "
                                                 r"rank \d's chunk of 12 over 2 has 6$"):
            calls.reduce_scatter(torch.empty(5), torch.ones(12), g)
        with pytest.raises(ShardwiseError, match=r"^all_gather: input has 5 elements, rank "
                                                 r"\d's chunk of 12 over 2 has 6$"):
            calls.all_gather(torch.empty(12), torch.ones(5), g)
        with pytest.raises(ShardwiseError, match="contiguous"):
            calls.all_gather(torch.empty(4, 3).t(), torch.ones(6), g)
        return True

    assert _run(2, body, monkeypatch) == [True, True]


def test_a_group_of_one_copies_or_returns():
    g = AxisGroup("tp", None, 1, 0, (0,))
    x = torch.arange(4.0)
    c = CommCounter()
    assert calls.all_reduce(x, g, counter=c) is x
    assert calls.all_reduce(x, g, async_op=True).wait()
    out = torch.empty(4)
    assert calls.reduce_scatter(out, x, g) is out and torch.equal(out, x)
    out = torch.empty(4)
    assert calls.all_gather(out, x, g) is out and torch.equal(out, x)
    out = torch.empty(4)
    assert calls.all_to_all_single(out, x, group=g) is out and torch.equal(out, x)
    assert calls.broadcast(x, 0, g) is x
    calls.barrier(g)
    assert c.bytes() == 0 and c.calls() == 0
    with calls.ranks_running(3):
        assert calls._RUNNING[-1] == 3
    assert not calls._RUNNING


class _FakeMeter:
    """Stands for `runtime.wire.Meter`: records each call's open, close and mark per rank."""

    def __init__(self, hub: Hub):
        self.hub, self.events, self.lock, self.ncalls = hub, [], threading.Lock(), 0

    def event(self, what, g, op, call=0):
        with self.lock:
            if not call:
                self.ncalls += 1
                call = self.ncalls
            self.events.append((self.hub.me.rank, what, g.name, op, call))
        return call


def test_the_wire_meter_sees_each_call_open_and_close(monkeypatch):
    """Under a wire meter every call completes before the next (an async handle comes back
    done) and is opened and closed under its op; a send issued outside the layer is marked."""
    from shardwise.runtime import wire
    from shardwise.runtime.collectives import meter as M

    def body(g, r):
        t = torch.ones(8)
        handle = calls.all_reduce(t, g, async_op=True)
        assert not isinstance(handle, calls.Pending)  # completed at once
        calls.all_reduce(t, g, impl="ring")
        calls.reduce_scatter(torch.empty(4), torch.ones(8), g)
        calls.all_gather(torch.empty(8), torch.ones(4), g)
        calls.reduce_scatter(torch.empty(4 - r), torch.ones(7), g)  # uneven: the p2p ring
        calls.all_gather(torch.empty(7), torch.ones(4 - r), g)
        # (no `labelled` here: its stack is per process, and these ranks are threads)
        calls.all_to_all_single(torch.empty(2), torch.ones(2), group=g)
        calls.broadcast(torch.ones(3), 0, g)
        if r == 0:
            calls.send(torch.ones(2), 1, g)
        else:
            calls.recv(torch.empty(2), 0, g)
        M.note_send(g, 4.0, counter=M.CommCounter())
        return True

    hub = Hub(2)
    fake = _FakeMeter(hub)
    monkeypatch.setattr(wire, "_METERS", [fake])
    assert _run(2, body, monkeypatch, hub) == [True, True]
    ops = ["all-reduce", "all-reduce", "reduce-scatter", "all-gather", "reduce-scatter",
           "all-gather", "all-to-all", "broadcast", "send"]
    for r in range(2):
        mine = [(what, op, call) for rank, what, _, op, call in fake.events if rank == r]
        opens = [(op, call) for what, op, call in mine if what == "open"]
        closes = [(op, call) for what, op, call in mine if what == "close"]
        assert [op for op, _ in opens] == ops, opens
        assert closes == opens
        assert [(what, op) for what, op, _ in mine if what == "mark"] == [("mark", "send")]
        assert all(g == "tp" for rank, _, g, _, _ in fake.events if rank == r)


def test_returns_handles_and_the_clock(monkeypatch):
    """Synchronous calls return their output tensor; a waited async handle charges its wait to
    the call's axis; a raw backend handle can be waited too; None and "world" name the world."""
    from shardwise.runtime.collectives import meter as M

    def body(g, r):
        out = torch.empty(8)
        assert calls.all_gather(out, torch.ones(4), g) is out
        a2a = torch.empty(2)
        assert calls.all_to_all_single(a2a, torch.ones(2), group=g) is a2a
        with M.clocking() as clock:
            handle = calls.all_reduce(torch.ones(4), g, async_op=True)
            assert isinstance(handle, calls.Pending) and handle.wait()
        calls.wait(Work())  # a backend handle, no axis to charge
        return dict(clock)

    for clock in _run(2, body, monkeypatch):
        assert "tp" in clock
    world = AxisGroup("world", None, 1, 0, (0,))
    monkeypatch.setattr(M.AxisGroup, "world", classmethod(lambda cls: world))
    assert M.resolve(None) is world and M.resolve("world") is world
    with M.counting() as c:
        M.note_send(world, 12.0)
    assert c.bytes("world", "send") == 12.0 and c.calls("world", "send") == 1
