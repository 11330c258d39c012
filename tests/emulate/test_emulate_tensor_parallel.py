"""Megatron MLP, SwiGLU and head-parallel attention equal the unsharded versions (SPEC §8),
in output and in gradients (the f/g operators at work)."""

from __future__ import annotations

import pytest
import torch

from shardwise.emulate.tensor_parallel import (
    attention,
    column_shards,
    f_copy,
    g_sum,
    head_parallel_attention,
    megatron_mlp,
    megatron_swiglu,
    mlp,
    row_shards,
    swiglu,
)
from shardwise.errors import ShardwiseError

TOL = {"rtol": 1e-12, "atol": 1e-12}
H, FF = 16, 32  # hidden, ffn: divisible by 8


def _rand(*shape, gen):
    return torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)


def _grads(out: torch.Tensor, tensors, seed: int = 99):
    gen = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    return torch.autograd.grad(out, tensors, upstream)


def test_shard_helpers() -> None:
    A = torch.arange(24.0).view(4, 6)
    cols = column_shards(A, 3)
    assert [c.shape for c in cols] == [(4, 2)] * 3 and torch.equal(torch.cat(cols, 1), A)
    rows = row_shards(A, 2)
    assert [r.shape for r in rows] == [(2, 6)] * 2 and torch.equal(torch.cat(rows, 0), A)
    with pytest.raises(ShardwiseError, match="cannot split 6 into 4"):
        column_shards(A, 4)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_megatron_mlp_equals_unsharded(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    X, A, B = _rand(2, 5, H, gen=gen), _rand(H, FF, gen=gen), _rand(FF, H, gen=gen)
    ref = mlp(X, A, B)
    out = megatron_mlp(X, column_shards(A, n), row_shards(B, n))
    torch.testing.assert_close(out, ref, **TOL)
    for g_par, g_ref in zip(_grads(out, (X, A, B)), _grads(ref, (X, A, B))):
        torch.testing.assert_close(g_par, g_ref, **TOL)


def test_row_split_of_A_would_be_wrong() -> None:
    """Why A is split by columns: GELU(Σ X_i A_i) ≠ Σ GELU(X_i A_i)."""
    gen = torch.Generator().manual_seed(0)
    X, A, B = _rand(2, 5, H, gen=gen), _rand(H, FF, gen=gen), _rand(FF, H, gen=gen)
    import torch.nn.functional as F
    wrong = sum(F.gelu(x @ a) for x, a in zip(X.chunk(2, -1), row_shards(A, 2))) @ B
    assert not torch.allclose(wrong, mlp(X, A, B))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_swiglu_equals_unsharded(n: int) -> None:
    gen = torch.Generator().manual_seed(10 + n)
    X = _rand(2, 5, H, gen=gen)
    G, U, D = _rand(H, FF, gen=gen), _rand(H, FF, gen=gen), _rand(FF, H, gen=gen)
    ref = swiglu(X, G, U, D)
    out = megatron_swiglu(X, column_shards(G, n), column_shards(U, n), row_shards(D, n))
    torch.testing.assert_close(out, ref, **TOL)
    for g_par, g_ref in zip(_grads(out, (X, G, U, D)), _grads(ref, (X, G, U, D))):
        torch.testing.assert_close(g_par, g_ref, **TOL)


@pytest.mark.parametrize(("n", "kv"), [(1, 8), (2, 8), (4, 8), (8, 8), (1, 4), (2, 4), (4, 4),
                                       (2, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_head_parallel_attention_equals_unsharded(n: int, kv: int, causal: bool) -> None:
    a, d = 8, 4
    gen = torch.Generator().manual_seed(100 * n + kv)
    X = _rand(2, 6, a * d, gen=gen)
    Wq, Wo = _rand(a * d, a * d, gen=gen), _rand(a * d, a * d, gen=gen)
    Wk, Wv = _rand(a * d, kv * d, gen=gen), _rand(a * d, kv * d, gen=gen)
    ref = attention(X, Wq, Wk, Wv, Wo, a, kv, causal)
    out = head_parallel_attention(X, Wq, Wk, Wv, Wo, a, n, kv, causal)
    torch.testing.assert_close(out, ref, **TOL)
    tensors = (X, Wq, Wk, Wv, Wo)
    for g_par, g_ref in zip(_grads(out, tensors), _grads(ref, tensors)):
        torch.testing.assert_close(g_par, g_ref, **TOL)


def test_attention_is_causal() -> None:
    gen = torch.Generator().manual_seed(3)
    X = _rand(1, 5, 8, gen=gen)
    W = [_rand(8, 8, gen=gen) for _ in range(4)]
    y = attention(X, *W, n_heads=2)
    X2 = X.detach().clone()
    X2[0, -1] += 1.0  # changing the last token leaves earlier positions alone
    y2 = attention(X2, *W, n_heads=2)
    torch.testing.assert_close(y[0, :-1], y2[0, :-1], rtol=0, atol=0)


def test_f_and_g_operators() -> None:
    """f: identity forward, summed (all-reduced) gradient backward; g: sum forward,
    identity backward."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    copies = f_copy(x, 3)
    assert all(c is x for c in copies)
    y = g_sum([c * (i + 1) for i, c in enumerate(copies)])  # partials 1x, 2x, 3x
    assert y.tolist() == [6.0, 12.0]
    y.sum().backward()
    assert x.grad is not None and x.grad.tolist() == [6.0, 6.0]  # 1 + 2 + 3: f's all-reduce
    p = [torch.tensor([1.0], requires_grad=True) for _ in range(4)]
    (g_sum(p) * 5).sum().backward()
    assert [t.grad.item() for t in p] == [5.0] * 4  # g backward: identity to every partial


def test_head_count_must_divide() -> None:
    X = torch.zeros(1, 2, 12, dtype=torch.float64)
    W = torch.zeros(12, 12, dtype=torch.float64)
    with pytest.raises(ShardwiseError, match="must divide n_heads=3"):
        head_parallel_attention(X, W, W, W, W, n_heads=3, n=2)
