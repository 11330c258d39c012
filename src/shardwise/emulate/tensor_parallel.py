"""Megatron tensor parallelism emulated on a list of shards (Shoeybi et al. 2019, §3).

Weights use the math convention `Y = X·A` with `A` of shape (in, out).

MLP `Y = GELU(X·A)·B`. Split `A = [A_1 … A_N]` by *columns*: each rank computes
`GELU(X·A_i)` with no communication, because GELU is elementwise and acts on each column
block alone (splitting `A` by rows would need a sum *before* the GELU). Split `B` by *rows*
to match: `Y = Σ_i GELU(X·A_i)·B_i`. One all-reduce per MLP forward, no other communication.

SwiGLU `Y = (SiLU(X·G) ⊙ X·U)·D`: gate `G` and up `U` are column-sharded *alike* (rank i
holds the same column block of both, so the ⊙ pairs matching columns), `D` row-sharded.

Design notes: docs/concepts/runtime.md#emulate-tensor_parallel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from shardwise.emulate.collectives import ring_all_reduce
from shardwise.errors import ShardwiseError

__all__ = [
    "attention",
    "column_shards",
    "f_copy",
    "g_sum",
    "head_parallel_attention",
    "megatron_mlp",
    "megatron_swiglu",
    "mlp",
    "row_shards",
    "swiglu",
]


# ------------------------------------------------------------------------ shard helpers
def column_shards(A: torch.Tensor, n: int, block: int = 1) -> list[torch.Tensor]:
    """Split the last dim (columns of a (in, out) weight) into `n` equal blocks; `block`
    keeps groups of `block` columns together (a head's `d` columns)."""
    return _split(A, n, A.dim() - 1, block)


def row_shards(B: torch.Tensor, n: int, block: int = 1) -> list[torch.Tensor]:
    """Split dim 0 (rows of a (in, out) weight) into `n` equal blocks."""
    return _split(B, n, 0, block)


def _split(t: torch.Tensor, n: int, dim: int, block: int) -> list[torch.Tensor]:
    size = t.shape[dim]
    if size % (n * block):
        raise ShardwiseError(f"cannot split {size} into {n} shards of whole {block}-blocks")
    return list(torch.chunk(t, n, dim=dim))


# ------------------------------------------------------------------------- f and g (illustr.)
def f_copy(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Megatron's `f`: forward hands every rank the same X (identity). Backward: autograd
    sums the gradients of the N uses of X — exactly the all-reduce `f` does across ranks."""
    return [x] * n


def g_sum(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Megatron's `g`: forward all-reduces the partial outputs (a ring here). Backward: each
    partial receives ∂L/∂Y unchanged (identity), because ∂(Σ_i P_i)/∂P_i = I."""
    if len(partials) == 1:
        return partials[0]
    # Differentiable sum with the value computed by the ring (same numbers, autograd path of
    # a plain sum): y = Σ P_i + (ring(P) - Σ P_i).detach().
    plain = torch.stack(list(partials)).sum(0)
    ring = ring_all_reduce([p.detach() for p in partials])[0]
    return plain + (ring - plain).detach()


# --------------------------------------------------------------------------------- MLPs
def mlp(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """GELU(X·A)·B — X (b, s, h), A (h, f), B (f, h)."""
    return F.gelu(X @ A) @ B


def megatron_mlp(X: torch.Tensor, A_shards: Sequence[torch.Tensor],
                 B_shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ_i GELU(f(X)_i·A_i)·B_i with A column-, B row-sharded: the `g` all-reduce after."""
    xs = f_copy(X, len(A_shards))
    return g_sum([F.gelu(x @ a) @ b for x, a, b in zip(xs, A_shards, B_shards)])


def swiglu(X: torch.Tensor, G: torch.Tensor, U: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """(SiLU(X·G) ⊙ X·U)·D — G, U (h, f), D (f, h)."""
    return (F.silu(X @ G) * (X @ U)) @ D


def megatron_swiglu(X: torch.Tensor, G_shards: Sequence[torch.Tensor],
                    U_shards: Sequence[torch.Tensor],
                    D_shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Gate and up column-sharded alike, down row-sharded; one `g` after."""
    xs = f_copy(X, len(G_shards))
    return g_sum([(F.silu(x @ g) * (x @ u)) @ d
                  for x, g, u, d in zip(xs, G_shards, U_shards, D_shards)])


# ---------------------------------------------------------------------------- attention
def attention(X: torch.Tensor, Wq: torch.Tensor, Wk: torch.Tensor, Wv: torch.Tensor,
              Wo: torch.Tensor, n_heads: int, n_kv_heads: int | None = None,
              causal: bool = True) -> torch.Tensor:
    """Multi-head (GQA when n_kv_heads < n_heads) softmax attention.

    X (b, s, h); Wq (h, a·d); Wk, Wv (h, a_kv·d); Wo (a·d, h). Query head j uses kv head
    `j // (a / a_kv)`.
    """
    b, s, _ = X.shape
    kv = n_kv_heads or n_heads
    d = Wq.shape[1] // n_heads
    q = (X @ Wq).view(b, s, n_heads, d).transpose(1, 2)  # (b, s, a·d) -> (b, a, s, d)
    k = (X @ Wk).view(b, s, kv, d).transpose(1, 2)  # (b, s, a_kv·d) -> (b, a_kv, s, d)
    v = (X @ Wv).view(b, s, kv, d).transpose(1, 2)
    rep = n_heads // kv
    k = k.repeat_interleave(rep, dim=1)  # (b, a_kv, s, d) -> (b, a, s, d)
    v = v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # (b, a, s, s)
    if causal:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    out = scores.softmax(-1) @ v  # (b, a, s, d)
    return out.transpose(1, 2).reshape(b, s, n_heads * d) @ Wo  # (b, s, a·d) @ (a·d, h)


def head_parallel_attention(X: torch.Tensor, Wq: torch.Tensor, Wk: torch.Tensor,
                            Wv: torch.Tensor, Wo: torch.Tensor, n_heads: int, n: int,
                            n_kv_heads: int | None = None, causal: bool = True
                            ) -> torch.Tensor:
    """Attention split over `n` ranks by heads: rank i takes query heads
    `[i·a/n, (i+1)·a/n)` and kv heads `[i·a_kv/n, (i+1)·a_kv/n)` (column blocks of Wq, Wk, Wv;
    row block of Wo), computes its heads alone, and `g` sums the partial outputs."""
    kv = n_kv_heads or n_heads
    if n_heads % n or kv % n:
        raise ShardwiseError(f"{n} ranks must divide n_heads={n_heads} and n_kv_heads={kv}")
    d = Wq.shape[1] // n_heads
    qs, ks, vs = column_shards(Wq, n, d), column_shards(Wk, n, d), column_shards(Wv, n, d)
    os_ = row_shards(Wo, n, d)
    xs = f_copy(X, n)
    partials = [attention(x, q, k, v, o, n_heads // n, kv // n, causal)
                for x, q, k, v, o in zip(xs, qs, ks, vs, os_)]
    return g_sum(partials)
