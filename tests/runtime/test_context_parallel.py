"""Ring attention on real gloo process groups against single-device full attention (fp64)."""

import pytest
import torch
from tests.emulate.test_ring_attention import full_attention

from shardwise.emulate.ring_attention import causal_block_work
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import cp_comm_bytes_per_layer
from shardwise.ops.attention import LAYOUTS
from shardwise.runtime.launch import RankFailure, spawn
from shardwise.runtime.mesh import AxisGroup

TOL = 1e-12
B, D = 2, 8


def _data(s, h_q, h_kv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, s, h_q, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, s, h_kv, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, s, h_kv, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, s, h_q, D, generator=gen, dtype=torch.float64)
    return q, k, v, w


def _check_ring(axis, seq_len, h_q, h_kv, layout, causal, seed):
    """On every rank: ring attention of this rank's block vs the full-attention reference
    (computed here on the whole sequence), bytes sent forward and backward, work stats."""
    from shardwise.runtime import collectives as C
    from shardwise.runtime.context_parallel import RingRankStats, ring_attention, shard_for_rank

    c, r = axis.size, axis.rank
    q, k, v, w = _data(seq_len, h_q, h_kv, seed)
    ref = full_attention(q, k, v, causal)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))

    def mine(t):
        return shard_for_rank(t.detach(), c, r, layout)

    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    stats = RingRankStats()
    with C.counting() as fwd:
        out = ring_attention(ql, kl, vl, axis, causal, layout, stats=stats)
    with C.counting() as bwd:
        (out * mine(w)).sum().backward()
    diffs = [float((out - mine(ref)).abs().max())]
    diffs += [float((got.grad - mine(want)).abs().max())
              for got, want in zip((ql, kl, vl), ref_grads)]
    return {"layout": layout, "causal": causal, "c": c, "rank": r, "h_kv": h_kv,
            "seq_len": seq_len, "diffs": diffs, "fwd": fwd.as_dict(), "bwd": bwd.as_dict(),
            "pairs": stats.pairs, "skipped": stats.blocks_skipped,
            "computed": stats.blocks_computed}


def _worker_mesh(dp, cp, seq_len):
    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh

    mesh = Mesh.from_layout(Layout(dp=dp, cp=cp))
    axis = mesh.axis("cp")
    seed = 10 + mesh.rank("dp")  # each data-parallel replica has its own sequence
    rows = []
    for layout in LAYOUTS:
        for causal in (False, True):
            for h_kv in (2, 4):  # GQA and plain multi-head
                rows.append(_check_ring(axis, seq_len, 4, h_kv, layout, causal, seed))
    return rows


def _expected_bytes(row):
    kv_dim = row["h_kv"] * D
    forward = cp_comm_bytes_per_layer(row["seq_len"], B, kv_dim, row["c"], 8, backward=False)
    total = cp_comm_bytes_per_layer(row["seq_len"], B, kv_dim, row["c"], 8)
    return forward, total


def _assert_rows(results, c):
    for rows in results:
        for row in rows:
            assert max(row["diffs"]) < TOL, row
            forward, total = _expected_bytes(row)
            assert row["fwd"] == {"cp/send": forward}
            assert row["bwd"] == {"cp/send": total - forward} == {"cp/send": 2 * forward}
            assert row["computed"] + row["skipped"] == c
            if row["causal"] and row["layout"] == "contiguous":
                assert row["skipped"] == c - 1 - row["rank"]  # later blocks are in the future
            else:
                assert row["skipped"] == 0
            if row["causal"]:
                n = row["seq_len"] // c
                assert row["pairs"] == causal_block_work(c, n, row["layout"])[row["rank"]]


@pytest.mark.slow
def test_ring_attention_c4_equals_full_attention():
    results = spawn(_worker_mesh, 4, 1, 4, 32, timeout_s=90)
    _assert_rows(results, 4)


@pytest.mark.slow
def test_ring_attention_c2_inside_dp2_mesh_equals_full_attention():
    # cp groups (0, 1) and (2, 3): ring peers are global ranks of the subgroup
    results = spawn(_worker_mesh, 4, 2, 2, 16, timeout_s=90)
    _assert_rows(results, 2)
    assert results[0][0]["rank"] == 0 and results[3][0]["rank"] == 1


def _worker_spec_eight():
    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh

    axis = Mesh.from_layout(Layout(cp=8)).axis("cp")
    return [_check_ring(axis, 8 * 16, 2, 1, layout, True, 3) for layout in LAYOUTS]


@pytest.mark.slow
def test_eight_ranks_reproduce_spec_causal_work():
    results = spawn(_worker_spec_eight, 8, timeout_s=120)
    _assert_rows(results, 8)
    pairs = {layout: [rows[i]["pairs"] for rows in results] for i, layout in enumerate(LAYOUTS)}
    assert pairs["contiguous"] == [136, 392, 648, 904, 1160, 1416, 1672, 1928]
    assert pairs["striped"] == list(range(976, 1089, 16))
    assert len(set(pairs["zigzag"])) == 1


def _worker_bad_rank():
    from shardwise.layout import Layout
    from shardwise.runtime.context_parallel import ring_attention
    from shardwise.runtime.mesh import Mesh

    mesh = Mesh.from_layout(Layout(cp=2))
    h_kv = 3 if mesh.rank("cp") == 1 else 2  # rank 1 is misconfigured
    q = torch.randn(1, 4, 4, D, dtype=torch.float64)
    k = torch.randn(1, 4, h_kv, D, dtype=torch.float64)
    return ring_attention(q, k, k, "cp").shape


@pytest.mark.slow
def test_a_failing_rank_fails_the_run_without_hanging():
    with pytest.raises(RankFailure, match="rank 1") as info:
        spawn(_worker_bad_rank, 2, timeout_s=30)
    assert "does not divide" in str(info.value)


def test_group_of_one_is_plain_attention():
    """No process group needed: a cp axis of size 1 runs the local block (no sends)."""
    from shardwise.runtime import collectives as C
    from shardwise.runtime.context_parallel import ring_attention

    single = AxisGroup("cp", None, 1, 0, (0,))
    q, k, v, w = _data(8, 4, 2, 0)
    for causal in (False, True):
        with C.counting() as counter:
            out = ring_attention(q, k, v, single, causal, "zigzag")
            grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        ref = full_attention(q, k, v, causal)
        ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
        assert (out - ref).abs().max() < TOL
        assert all((a - b).abs().max() < TOL for a, b in zip(grads, ref_grads))
        assert counter.bytes() == 0
    with pytest.raises(ShardwiseError, match="wants local q"):
        ring_attention(q, k[:, :4], v[:, :4], single)


def test_ulysses_refuses_what_its_group_cannot_split():
    """The all-to-all gives each rank 1/u of the heads: a count u does not divide is refused
    before anything is sent (one line), as are positions of the wrong shape."""
    from shardwise.runtime.ulysses import ulysses_attention

    group = AxisGroup("cp", None, 2, 0, (0, 1))  # the checks run before the group is used
    q, kv = torch.zeros(1, 4, 3, D), torch.zeros(1, 4, 2, D)
    with pytest.raises(ShardwiseError, match="2 must divide n_heads=3 and n_kv_heads=2"):
        ulysses_attention(q, kv, kv, core=None, group=group, positions=torch.zeros(2, 4))
    with pytest.raises(ShardwiseError, match=r"positions \(8,\) must be"):
        ulysses_attention(torch.zeros(1, 4, 2, D), kv, kv, core=None, group=group,
                          positions=torch.zeros(8))
