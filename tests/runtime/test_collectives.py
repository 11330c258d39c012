"""p2p ring collectives against the backend's own, and the counted layer against SPEC §5."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.estimate.comm import ring_bytes_on_wire
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.collectives import rings
from shardwise.runtime.launch import spawn
from shardwise.runtime.mesh import Mesh

SIZES = (1, 5, 7, 13, 1000, 4099)  # most not divisible by 3, 4 or 8; 1 and 5 < 8 ranks


def _native_all_gather_uneven(chunk: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Reference all-gather for tensor_split chunks: pad to the largest, gather, unpad."""
    n, big = len(sizes), max(sizes)
    padded = torch.zeros(big, dtype=chunk.dtype)
    padded[: chunk.numel()] = chunk
    parts = [torch.empty(big, dtype=chunk.dtype) for _ in range(n)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def _rings_vs_backend() -> dict[str, object]:
    r, n = dist.get_rank(), dist.get_world_size()
    worst = {"ar": 0.0, "rs": 0.0, "ag": 0.0}
    exact = True
    bytes_ok = True
    agree = True
    default_segment = C.SEGMENT_BYTES
    # Second pass with 40-byte segments: chunks travel as many (uneven) pipelined pieces.
    for numel, segment in [(k, default_segment) for k in SIZES] + [(k, 40) for k in SIZES]:
        rings.SEGMENT_BYTES = segment  # read where the rings run
        gen = torch.Generator().manual_seed(1000 * numel + r)
        x = torch.randn(numel, dtype=torch.float64, generator=gen)
        ints = torch.randint(-1000, 1000, (numel,), generator=gen).double()
        ref = x.clone()
        dist.all_reduce(ref)
        with C.counting() as c:
            y = C.ring_all_reduce_p2p(x.clone())
        sizes = C.chunk_sizes(numel, n)
        # Exact bytes: every rank sends N-1 chunks in each phase.
        sent_rs = sum(sizes[(r - s - 1) % n] for s in range(n - 1)) * 8
        sent_ag = sum(sizes[(r - s) % n] for s in range(n - 1)) * 8
        bytes_ok &= c.bytes(op="all-reduce") == sent_rs + sent_ag
        if numel % n == 0:
            bytes_ok &= c.bytes() == ring_bytes_on_wire("all-reduce", numel * 8, n)
        worst["ar"] = max(worst["ar"], float((y - ref).abs().max()))
        rs = torch.empty(sizes[r], dtype=torch.float64)
        C.ring_reduce_scatter_p2p(rs, x)
        if rs.numel():
            worst["rs"] = max(worst["rs"], float((rs - torch.tensor_split(ref, n)[r]).abs().max()))
        full = torch.empty(numel, dtype=torch.float64)
        C.ring_all_gather_p2p(full, rs)
        worst["ag"] = max(worst["ag"], float((full - _native_all_gather_uneven(rs, sizes))
                                             .abs().max()))
        # Integer-valued data: every summation order is exact, so equality is exact.
        ref_i = ints.clone()
        dist.all_reduce(ref_i)
        exact &= bool(torch.equal(C.ring_all_reduce_p2p(ints.clone()), ref_i))
        # Rank agreement: each chunk is reduced once then copied, so all ranks are bit-equal.
        mine = y.clone()
        dist.broadcast(mine, src=0)
        agree &= bool(torch.equal(mine, y))
    rings.SEGMENT_BYTES = default_segment
    return {"worst": worst, "exact": exact, "bytes_ok": bytes_ok, "agree": agree}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_p2p_rings_equal_backend_collectives(n: int) -> None:
    for res in spawn(_rings_vs_backend, n, timeout_s=60):
        assert res["exact"], "integer-valued ring all-reduce differs from the backend's"
        assert res["agree"], "ranks disagree after the ring all-reduce"
        assert res["bytes_ok"], "counted bytes differ from the chunks actually sent"
        for op, err in res["worst"].items():
            assert err <= 1e-12, f"{op}: max |ring - backend| = {err:g} (float64)"


def _counted_layer() -> dict[str, object]:
    """Each counted collective on a 2 × 2 mesh (dp × tp): values and bytes."""
    mesh = Mesh.from_layout(Layout(dp=2, tp=2))
    r = dist.get_rank()
    out: dict[str, object] = {"cp_group": mesh.group("cp")}
    with C.counting() as c:
        # SPEC §5: a ring all-reduce of 4000 bytes on N ranks sends 2(N-1)/N · 4000.
        x = torch.full((1000,), float(r), dtype=torch.float32)
        C.all_reduce(x, "tp")
        out["ar_value"] = float(x[0])
        out["ar_bytes"] = c.bytes(axis="tp", op="all-reduce")
        y = torch.full((1000,), float(r), dtype=torch.float32)
        C.all_reduce(y, mesh.axis("dp"), impl="ring")
        out["ar_ring_value"] = float(y[0])
        out["ar_ring_bytes"] = c.bytes(axis="dp", op="all-reduce")
        full = torch.arange(8, dtype=torch.float64) * (r + 1)
        part = torch.empty(4, dtype=torch.float64)
        C.reduce_scatter(part, full, "tp")
        out["rs"] = part.tolist()
        gathered = torch.empty(8, dtype=torch.float64)
        C.all_gather(gathered, part, "tp")
        out["ag"] = gathered.tolist()
        a2a_in = torch.arange(4, dtype=torch.float64) + 10 * r
        a2a_out = torch.empty(4, dtype=torch.float64)
        C.all_to_all_single(a2a_out, a2a_in, group="dp")
        out["a2a"] = a2a_out.tolist()
        b = torch.full((10,), float(r), dtype=torch.float64)
        C.broadcast(b, src=mesh.ranks("dp")[0], group="dp")
        out["bcast"] = float(b[0])
        z = torch.ones(3)
        C.all_reduce(z, "cp")  # degree 1: no group, no traffic
        out["cp_value"] = float(z[0])
        if mesh.rank("dp") == 0:
            C.send(torch.ones(5, dtype=torch.float64), mesh.ranks("dp")[1], "dp")
        else:
            t = torch.empty(5, dtype=torch.float64)
            C.recv(t, mesh.ranks("dp")[0], "dp")
        out["rows"] = c.rows()
        out["total"] = c.bytes()
        out["cp_bytes"] = c.bytes(axis="cp")
    return out


@pytest.mark.slow
def test_counted_layer_values_and_bytes() -> None:
    res = spawn(_counted_layer, 4, timeout_s=60)
    for r, o in enumerate(res):
        dp_i, tp_i = divmod(r, 2)
        tp_peers = [2 * dp_i, 2 * dp_i + 1]
        dp_peers = [tp_i, tp_i + 2]
        assert o["cp_group"] is None
        assert o["ar_value"] == sum(tp_peers)
        assert o["ar_ring_value"] == sum(dp_peers)
        assert o["ar_bytes"] == 4000 and o["ar_ring_bytes"] == 4000  # 2(2-1)/2 · 4000
        full_sum = [i * sum(p + 1 for p in tp_peers) for i in range(8)]
        assert o["rs"] == full_sum[4 * tp_i: 4 * tp_i + 4]
        assert o["ag"] == full_sum
        # all-to-all on dp: I receive split (my dp index) of every dp peer, in dp order.
        assert o["a2a"] == [10 * p + j for p in dp_peers for j in (2 * (r // 2), 2 * (r // 2) + 1)]
        assert o["bcast"] == dp_peers[0]
        assert o["cp_value"] == 1.0 and o["cp_bytes"] == 0
        per_op = {(row["axis"], row["op"]): row["bytes"] for row in o["rows"]}
        assert per_op[("tp", "reduce-scatter")] == ring_bytes_on_wire("reduce-scatter", 64, 2)
        assert per_op[("tp", "all-gather")] == ring_bytes_on_wire("all-gather", 64, 2)
        assert per_op[("dp", "all-to-all")] == 16  # two of four float64 leave the rank
        assert per_op[("dp", "broadcast")] == ring_bytes_on_wire("broadcast", 80, 2)
        assert per_op.get(("dp", "send"), 0) == (40 if dp_i == 0 else 0)


def _spec_example() -> tuple[float, float, float]:
    """SPEC §5 acceptance: 4000 bytes all-reduced on 4 ranks → 6000 bytes sent per rank: what
    the p2p ring counts it sent, and the TCP data gloo's own all-reduce put on the wire."""
    from shardwise.runtime import wire
    from shardwise.runtime.mesh import AxisGroup

    with C.counting() as c:
        C.ring_all_reduce_p2p(torch.ones(1000, dtype=torch.float32))
    with wire.metering() as meter:
        C.all_reduce(torch.ones(1000, dtype=torch.float32))
    native = meter.traffic([AxisGroup.world()])[("world", "all-reduce")]
    return c.bytes(), c.payload_bytes(), native.data


@pytest.mark.slow
def test_spec_ring_all_reduce_bytes_measured() -> None:
    from shardwise.estimate.check import FRAMING_PER_PEER

    for ring, payload, native in spawn(_spec_example, 4):
        assert (ring, payload) == (6000.0, 4000.0)
        assert 6000 <= native <= 6000 + 3 * FRAMING_PER_PEER  # + gloo's message headers


def test_counter_sums_and_resets() -> None:
    c = C.CommCounter()
    c.add("tp", "all-reduce", 100)
    c.add("tp", "all-gather", 50)
    c.add("dp", "all-reduce", 7)
    assert c.bytes() == 157 and c.bytes(axis="tp") == 150 and c.bytes(op="all-reduce") == 107
    assert c.calls(axis="dp") == 1
    assert c.rows()[0] == {"axis": "dp", "op": "all-reduce", "calls": 1, "bytes": 7}
    c.reset()
    assert c.bytes() == 0 and c.rows() == []


def test_counting_context_is_fresh_and_nested() -> None:
    outer = C.get_counter()
    with C.counting() as a:
        assert C.get_counter() is a
        with C.counting() as b:
            assert C.get_counter() is b
        assert C.get_counter() is a
    assert C.get_counter() is outer


def test_chunk_sizes_match_tensor_split() -> None:
    for numel in (0, 1, 5, 7, 64, 101):
        for n in (1, 2, 3, 4, 8):
            assert C.chunk_sizes(numel, n) == [
                c.numel() for c in torch.tensor_split(torch.empty(numel), n)]


def _late_peer_waits(delay: float) -> dict[str, object]:
    """Rank 1 arrives `delay` s late to three all-reduces; how rank 0 waited in each: its polls
    (each `os.sched_yield` of `collectives.wait`, counted) and when the last one came after
    the call began — with a core per rank (polls), with more ranks said to run than cores
    (blocks), and a peer later than `POLL_SECONDS` (polls that long, then blocks)."""
    import os
    import time

    polls: list[float] = []
    real_yield = os.sched_yield

    def counted_yield() -> None:
        polls.append(time.perf_counter())
        real_yield()

    os.sched_yield = counted_yield
    cores = len(os.sched_getaffinity(0))
    out: dict[str, object] = {"polls": C._polls()}
    for name, late, running in (("polled", delay, 2), ("blocked", delay, cores + 1),
                                ("capped", C.POLL_SECONDS + delay, 2)):
        x = torch.full((4,), float(dist.get_rank() + 1))
        dist.barrier()
        with C.ranks_running(running):
            out[f"polls_{name}"] = C._polls()
            if dist.get_rank() == 1:
                time.sleep(late)
            polls.clear()
            start = time.perf_counter()
            C.all_reduce(x)
            out[name] = (len(polls), polls[-1] - start if polls else 0.0)
        out[f"{name}_sum"] = x.tolist()
    # gloo's reduce-scatter handle reports completion only inside wait(): no poll at all
    part = torch.empty(2)
    polls.clear()
    C.reduce_scatter(part, torch.ones(4))
    out["reduce_scatter_polls"] = len(polls)
    out["reduce_scatter"] = part.tolist()
    os.sched_yield = real_yield
    return out


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_waits_poll_with_a_core_per_rank_and_block_otherwise() -> None:
    """Counted polls, not CPU time (which a loaded machine takes away): the one window is the
    poll cap's, POLL_SECONDS, checked to a quarter second."""
    delay = 0.4
    rank0, rank1 = spawn(_late_peer_waits, 2, delay, timeout_s=60)
    for r in (rank0, rank1):  # the same sums whichever way a rank waited
        assert r["polled_sum"] == r["blocked_sum"] == r["capped_sum"] == [3.0] * 4
    assert rank0["polls"] and rank0["polls_polled"] and not rank0["polls_blocked"]
    # rank 0 waited on its core, yielding it between polls, only when it polled
    assert rank0["polled"][0] > 0 and rank0["blocked"][0] == 0
    # past the cap it stopped polling and blocked until the peer came, 0.4 s later
    count, last = rank0["capped"]
    assert count > 0 and last < C.POLL_SECONDS + 0.25
    for r in (rank0, rank1):
        assert r["reduce_scatter"] == [2.0, 2.0] and r["reduce_scatter_polls"] == 0


def _clocked_waits(delay: float) -> dict[str, float]:
    """Rank 1 arrives `delay` s late to a tp all-reduce, rank 0 as late to an async one;
    what each rank's clock charged (a last call outside the clock charges nothing)."""
    import time

    mesh = Mesh.from_layout(Layout(tp=2))
    x = torch.ones(4)
    dist.barrier()
    with C.clocking() as waited:
        if dist.get_rank() == 1:
            time.sleep(delay)
        C.all_reduce(x, mesh.axis("tp"))
        if dist.get_rank() == 0:
            time.sleep(delay)  # the peer waits for rank 0 now
        work = C.all_reduce(x, mesh.axis("tp"), async_op=True)
        issued = dict(waited)
        C.wait(work)
    C.all_reduce(x, mesh.axis("tp"))  # no clock: nothing to charge
    return {"tp": waited["tp"], "issued_tp": issued["tp"], "axes": len(waited),
            "sum": x[0].item()}


@pytest.mark.slow
@pytest.mark.timing
def test_the_clock_charges_each_axis_the_time_a_rank_waits_in_its_collectives() -> None:
    """Windows that hold on a loaded machine: a charge is at least the peer's delay (less the
    ranks' skew leaving the barrier) and not twice it; nothing is charged at issue."""
    delay = 0.5
    rank0, rank1 = spawn(_clocked_waits, 2, delay, timeout_s=60)
    assert rank0["sum"] == rank1["sum"] == 8.0  # three all-reduces of ones over 2 ranks
    # rank 0 waited for the late peer in the first call; rank 1 for rank 0 in the wait
    assert delay * 0.8 <= rank0["tp"] < delay * 2 and rank0["axes"] == 1
    assert delay * 0.8 <= rank1["tp"] < delay * 2
    # an async call is charged in `wait`, not when it is issued
    assert rank1["issued_tp"] < 0.5 * delay
