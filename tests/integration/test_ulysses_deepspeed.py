"""`estimate.comm.ulysses_comm_bytes_per_layer` against DeepSpeed 0.19.8's own
`DistributedAttention` (deepspeed/sequence/layer.py) on tensors whose value heads are
narrower than their query/key heads (MLA: d_v < d) and with fewer key/value than query heads
(GQA): what each of its all-to-alls hands the collective is counted, one rank's view.

The group is faked in this process: `deepspeed.sequence.layer.dist` answers `u` ranks and
its `all_to_all_single` records the buffer (dim 0 = the u destinations, equal splits) and
returns it unchanged, so DeepSpeed's own reshapes run at their real shapes; a rank keeps
`1/u` of each buffer and sends the rest.
"""

from types import SimpleNamespace

import pytest

from shardwise.estimate.comm import ulysses_comm_bytes_per_layer
from tests.integration.conftest import require

pytestmark = pytest.mark.integration


def _counting_dist(u: int, sent: list[tuple[tuple[int, ...], int]]) -> SimpleNamespace:
    """A stand-in for `deepspeed.comm` over `u` ranks that records (shape, bytes sent)."""

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        assert input_split_sizes is None and input.shape[0] == u  # equal splits along dim 0
        sent.append((tuple(input.shape), (u - 1) * input.numel() // u * input.element_size()))
        output.copy_(input)

    return SimpleNamespace(get_world_size=lambda group=None: u,
                           all_to_all_single=all_to_all_single)


@pytest.mark.parametrize("u, heads, kv_heads, d, d_v", [
    (2, 8, 2, 12, 8),   # GQA (4 query heads a kv head), d_v < d
    (4, 8, 8, 6, 4),    # MLA: one kv head a query head, d = 4 nope + 2 rope, d_v = 4
])
def test_distributed_attention_moves_each_tensor_at_its_width(monkeypatch, u, heads, kv_heads,
                                                              d, d_v):
    require("deepspeed")
    import torch
    from deepspeed.sequence import layer

    sent: list[tuple[tuple[int, ...], int]] = []
    monkeypatch.setattr(layer, "dist", _counting_dist(u, sent))
    b, n = 2, 6  # this rank's tokens: s = u·n

    def local_attention(q, k, v):
        """Softmax attention, GQA by repeating K/V heads: q, k (b, s, ·, d), v (b, s, ·, d_v)
        -> (b, s, heads/u, d_v)."""
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / d ** 0.5
        return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)

    attention = layer.DistributedAttention(local_attention, None, scatter_idx=2, gather_idx=1)
    gen = torch.Generator().manual_seed(u)

    def tensor(h, width):
        return torch.randn(b, n, h, width, generator=gen, dtype=torch.float64,
                           requires_grad=True)

    q, k, v = tensor(heads, d), tensor(kv_heads, d), tensor(kv_heads, d_v)
    out = attention(q, k, v, batch_dim_idx=0)
    assert out.shape == (b, n, heads, d_v)
    forward = sum(nbytes for _, nbytes in sent)
    # DeepSpeed's order: Q, K, V, then the output, each (u, b, n, heads/u, width)
    assert [shape[-2:] for shape, _ in sent] == [
        (heads // u, d), (kv_heads // u, d), (kv_heads // u, d_v), (heads // u, d_v)]
    out.sum().backward()
    total = sum(nbytes for _, nbytes in sent)
    assert len(sent) == 8  # dO, dQ, dK, dV back

    widths = dict(q_dim=heads * d, kv_dim=kv_heads * d, v_dim=kv_heads * d_v, o_dim=heads * d_v)
    assert forward == ulysses_comm_bytes_per_layer(u * n, b, c=u, dtype_bytes=8,
                                                   backward=False, **widths)
    assert total == ulysses_comm_bytes_per_layer(u * n, b, c=u, dtype_bytes=8, **widths)
    # by hand: (u-1)/u · n·b·(a·d + a_kv·d + a_kv·d_v + a·d_v)·8, twice with backward
    assert total == 2 * (u - 1) * n * b * (heads + kv_heads) * (d + d_v) * 8 / u
