"""Ring attention emulated in one process (SPEC §8) against plain full attention."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.emulate.ring_attention import RingStats, causal_block_work, ring_attention
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import cp_comm_bytes_per_layer
from shardwise.ops.attention import (
    LAYOUTS,
    SoftmaxState,
    absorb_block,
    attend_block,
    block_forward,
    from_layout,
    layout_positions,
    merge_attention,
    plan_block,
    shard_sequence,
    to_layout,
    unshard_sequence,
)
from tests.figures import matches_figure

TOL = 1e-12


def full_attention(q, k, v, causal, scale=None):
    """softmax(scale·QKᵀ + mask)·V with plain torch ops; GQA by repeating K/V heads."""
    _, s, h_q, d = q.shape
    group = h_q // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # (b, s, h_kv, d) -> (b, s, h_q, d)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (scale or 1 / math.sqrt(d))
    if causal:
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, dim=-1), v)


def qkv(b=2, s=16, h_q=4, h_kv=2, d=8, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    def t(h):
        return (scale * torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
                ).requires_grad_()
    return t(h_q), t(h_kv), t(h_kv)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("c", [1, 2, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
def test_ring_equals_full_attention_outputs_and_gradients(layout, causal, c, heads):
    q, k, v = qkv(h_q=heads[0], h_kv=heads[1], seed=c)
    out = ring_attention(q, k, v, c, causal, layout)
    ref = full_attention(q, k, v, causal)
    assert (out - ref).abs().max() < TOL
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                         dtype=torch.float64)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < TOL


def test_large_logits_stay_finite_and_exact():
    q, k, v = qkv(scale=30.0)  # scores of order 10^3: exp would overflow without the max shift
    out = ring_attention(q, k, v, 4, True, "zigzag")
    ref = full_attention(q, k, v, True)
    assert torch.isfinite(out).all()
    assert ((out - ref).abs() / ref.abs().clamp_min(1)).max() < 1e-10


def test_custom_scale():
    q, k, v = qkv()
    out = ring_attention(q, k, v, 2, True, "striped", scale=0.05)
    assert (out - full_attention(q, k, v, True, scale=0.05)).abs().max() < TOL


# ------------------------------------------------------------------ SPEC §8 load balance
def test_spec_contiguous_causal_counts():
    counts = causal_block_work(8, 16, "contiguous")
    assert counts == [136, 392, 648, 904, 1160, 1416, 1672, 1928]
    assert matches_figure(max(counts) / min(counts), 14.18)


def test_spec_striped_causal_counts():
    counts = causal_block_work(8, 16, "striped")
    assert counts == list(range(976, 1089, 16))
    assert counts[0] == 976 and counts[-1] == 1088
    assert matches_figure(max(counts) / min(counts), 1.11)


def test_spec_equal_totals_and_zigzag_balance():
    s = 8 * 16
    totals = {layout: sum(causal_block_work(8, 16, layout)) for layout in LAYOUTS}
    assert set(totals.values()) == {s * (s + 1) // 2}
    zigzag = causal_block_work(8, 16, "zigzag")
    assert max(zigzag) == min(zigzag)  # chunks p and 2c-1-p: (p+1) + (2c-p) is constant


@settings(max_examples=40, deadline=None)
@given(c=st.integers(1, 8), half=st.integers(1, 6), layout=st.sampled_from(LAYOUTS))
def test_causal_counts_by_brute_force(c, half, layout):
    n = 2 * half
    positions = layout_positions(c * n, c, layout)
    brute = [sum(1 for i in row.tolist() for j in range(c * n) if j <= i) for row in positions]
    assert causal_block_work(c, n, layout) == brute
    assert sorted(positions.flatten().tolist()) == list(range(c * n))


def test_ring_stats_skip_future_blocks_and_count_pairs():
    q, k, v = qkv(s=32)
    for layout in LAYOUTS:
        stats = RingStats()
        ring_attention(q, k, v, 4, True, layout, stats=stats)
        assert stats.pairs == causal_block_work(4, 8, layout)
        assert all(a + b == 4 for a, b in zip(stats.blocks_computed, stats.blocks_skipped))
        if layout == "contiguous":  # device p skips the c-1-p blocks of later devices
            assert stats.blocks_skipped == [3, 2, 1, 0]
        else:
            assert stats.blocks_skipped == [0, 0, 0, 0]
        assert all(p <= computed for p, computed in zip(stats.pairs, stats.pairs_computed))
    stats = RingStats()
    ring_attention(q, k, v, 4, True, "zigzag", stats=stats)
    # zigzag trims off-diagonal blocks to half blocks: 2 rows × 2 cols of 4-token chunks.
    assert stats.pairs_computed == [64 + 3 * 32] * 4


@pytest.mark.parametrize("c", [2, 4])
def test_bytes_sent_equal_spec_cp_formula(c):
    b, s, h_kv, d = 2, 16, 2, 8
    q, k, v = qkv(b=b, s=s, h_kv=h_kv, d=d)
    stats = RingStats()
    out = ring_attention(q, k, v, c, True, "contiguous", stats=stats)
    out.sum().backward()
    forward = cp_comm_bytes_per_layer(s, b, h_kv * d, c, 8, backward=False)
    total = cp_comm_bytes_per_layer(s, b, h_kv * d, c, 8)
    assert stats.bytes_forward == [forward] * c
    assert stats.bytes_backward == [2 * forward] * c
    assert [f + bw for f, bw in zip(stats.bytes_forward, stats.bytes_backward)] == [total] * c


# ---------------------------------------------------------------- online softmax pieces
def test_absorb_block_in_any_order_equals_softmax():
    q, k, v = (t.detach() for t in qkv(s=12))
    ref = full_attention(q, k, v, False)
    state = SoftmaxState.empty(q)
    for cols in (torch.tensor([7, 0, 3]), torch.tensor([11, 2]), torch.tensor([1, 4, 5, 6]),
                 torch.tensor([8, 9, 10])):
        state = absorb_block(state, q, k[:, cols], v[:, cols], 1 / math.sqrt(8))
    out, lse = state.finish()
    assert (out - ref).abs().max() < TOL
    scores = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) / math.sqrt(8)
    assert (lse - torch.logsumexp(scores, dim=-1)).abs().max() < TOL


def test_merge_attention_equals_joint_softmax_and_handles_empty_rows():
    q, k, v = (t.detach() for t in qkv(s=8))
    scale = 1 / math.sqrt(8)
    mask = torch.ones(8, 4, dtype=torch.bool)
    mask[:3] = False  # the first three queries see nothing in the second block
    o1, l1 = block_forward(q, k[:, :4], v[:, :4], scale)
    o2, l2 = block_forward(q, k[:, 4:], v[:, 4:], scale, mask)
    assert torch.isinf(l2[:, :, :3]).all() and (o2[:, :3] == 0).all()
    out, lse = merge_attention(o1, l1, o2, l2)
    full_mask = torch.cat([torch.ones(8, 4, dtype=torch.bool), mask], dim=1)
    scores = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) * scale
    scores = scores.masked_fill(~full_mask, float("-inf"))
    ref = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v.repeat_interleave(2, 2))
    assert (out - ref).abs().max() < TOL
    assert (lse - torch.logsumexp(scores, -1)).abs().max() < TOL
    # merging into an empty state (lse = -inf everywhere) returns the block unchanged
    empty_out, empty_lse = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))
    again, again_lse = merge_attention(empty_out, empty_lse, o1, l1)
    assert torch.equal(again_lse, l1) and (again - o1).abs().max() < TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_form_steps_equal_causal_attention_rows(layout):
    """The runtime's per-step kernel (block_forward + merge, trimmed by the plan) on one
    device's rows, blocks visited in ring order, equals those rows of causal attention."""
    q, k, v = (t.detach() for t in qkv(s=16))
    ref = full_attention(q, k, v, True)
    positions = layout_positions(16, 4, layout)
    for p in range(4):
        rows = positions[p]
        out = q.new_zeros(2, 4, 4, 8)
        lse = torch.full((2, 4, 4), float("-inf"), dtype=q.dtype)
        for t in range(4):
            cols = positions[(p - t) % 4]
            kv = torch.stack((k[:, cols], v[:, cols]))
            out, lse = attend_block(out, lse, q[:, rows], kv, plan_block(rows, cols, True),
                                    1 / math.sqrt(8))
        assert (out - ref[:, rows]).abs().max() < TOL


# ---------------------------------------------------------------------------- layouts
def test_layout_positions_examples():
    assert layout_positions(8, 2, "contiguous").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout_positions(8, 2, "striped").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout_positions(8, 2, "zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_round_trip(layout):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    assert torch.equal(from_layout(to_layout(x, 4, layout), 4, layout), x)
    blocks = shard_sequence(x, 4, layout)
    assert len(blocks) == 4 and all(blk.shape == (2, 6, 3) for blk in blocks)
    assert torch.equal(blocks[1][0, :, 0] // 3, layout_positions(24, 4, layout)[1])
    assert torch.equal(unshard_sequence(blocks, layout), x)


def test_errors_are_clear():
    q, k, v = qkv(s=12)
    with pytest.raises(ShardwiseError, match="zigzag"):
        ring_attention(q, k, v, 4, True, "zigzag")  # 12 tokens do not make 8 chunks
    with pytest.raises(ShardwiseError, match="unknown sequence layout"):
        ring_attention(q, k, v, 2, True, "diagonal")
    q3, k3, v3 = qkv(h_q=4, h_kv=3)
    with pytest.raises(ShardwiseError, match="does not divide"):
        ring_attention(q3, k3, v3, 2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_fused_kernels_equal_reference_block_kernels(causal, h_kv):
    # torch's fused CPU flash kernel (what the runtime runs) against the einsum kernels of
    # this module (block_forward / block_backward) and plain full attention, in fp64
    from shardwise.ops.attention import block_backward, fused_backward, fused_forward
    torch.manual_seed(3)
    b, n, h_q, d, scale = 2, 12, 4, 8, 0.3
    q = torch.randn(b, n, h_q, d, dtype=torch.float64)
    k, v = (torch.randn(b, n, h_kv, d, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(n, n, dtype=torch.bool).tril() if causal else None
    out, lse = fused_forward(q, k, v, scale, causal)
    ref_out, ref_lse = block_forward(q, k, v, scale, mask)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=TOL)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=TOL)
    torch.testing.assert_close(out, full_attention(q, k, v, causal, scale), rtol=0, atol=TOL)
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1).transpose(1, 2)
    grads = fused_backward(dout, q, k, v, out, lse, scale, causal)
    for ours, ref in zip(grads, block_backward(dout, q, k, v, lse, delta, scale, mask),
                         strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_causal_ring_block_runs_the_fused_kernel(layout):
    # after plan_block's trimming each block's mask is none or the causal triangle, so the
    # ring never falls back to the einsum kernel (ops.attention._causal_or_full)
    from shardwise.ops.attention import _causal_or_full
    positions = layout_positions(32, 4, layout)
    plans = [plan_block(positions[r], positions[src], True)
             for r in range(4) for src in range(4)]
    assert all(_causal_or_full(p.mask) is not None for p in plans if p is not None)
    kinds = {_causal_or_full(p.mask) for p in plans if p is not None}
    # striped: every block is a (trimmed) triangle; the others have full blocks too
    assert kinds == ({True} if layout == "striped" else {False, True})
