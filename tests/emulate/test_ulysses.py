"""DeepSpeed-Ulysses emulated in one process against plain full attention."""

from functools import partial

import pytest
import torch

from shardwise.emulate.ulysses import ulysses_attention
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ulysses_comm_bytes_per_layer
from shardwise.ops.attention import LAYOUTS, shard_sequence
from tests.emulate.test_ring_attention import full_attention

TOL = 1e-12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("c, h_kv, d_v", [(2, 2, 4), (4, 8, 4), (2, 2, 3)])  # GQA, MHA, MLA
def test_ulysses_equals_full_attention(layout, causal, c, h_kv, d_v):
    """V and the output at d_v (MLA's narrower value heads) move at d_v, Q and K at d."""
    b, s, h_q, d = 2, 32, 8, 4
    gen = torch.Generator().manual_seed(c + h_kv)
    q = torch.randn(b, s, h_q, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, s, h_kv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, s, h_kv, d_v, generator=gen, dtype=torch.float64)
    shards = [shard_sequence(t, c, layout) for t in (q, k, v)]
    out, sent = ulysses_attention(*shards, partial(full_attention, causal=causal), layout)
    want = shard_sequence(full_attention(q, k, v, causal), c, layout)
    assert max(float((o - w).abs().max()) for o, w in zip(out, want)) < TOL
    assert sent == ulysses_comm_bytes_per_layer(s, b, h_q * d, h_kv * d, c, dtype_bytes=8,
                                                backward=False, v_dim=h_kv * d_v,
                                                o_dim=h_q * d_v)
    # by hand: (c-1)/c · (s/c)·b·(h_q + h_kv)·(d + d_v)·8
    assert sent == (c - 1) * s // c * b * (h_q + h_kv) * (d + d_v) * 8 // c


def test_ulysses_needs_the_heads_to_split():
    q, kv = [torch.zeros(1, 4, 4, 2)] * 4, [torch.zeros(1, 4, 2, 2)] * 4
    with pytest.raises(ShardwiseError, match="4 must divide n_heads=4 and n_kv_heads=2"):
        ulysses_attention(q, kv, kv, full_attention)
