"""Data parallelism emulated: each rank computes the gradient of its shard of the batch, a
ring all-reduce averages them, and the result equals the full-batch gradient.

For a loss that is a mean over examples, `L = (1/B) Σ_j ℓ_j`, and shards of sizes `n_i`
(Σ n_i = B) with per-shard mean gradients `g_i`,

    ∇L = Σ_i (n_i / B) · g_i,

which is the plain average `(1/N) Σ g_i` only when every `n_i = B/N`. Uneven shards are
therefore rejected unless `weighted=True` asks for the reduction weighted by shard size
(each rank scales its gradient by `n_i/B` before the sum).

The model is a linear map with a squared error, `ℓ_j = ‖x_j W − y_j‖²`, whose gradient
`(2/B) Xᵀ(XW − Y)` autograd computes here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.emulate.collectives import ring_all_reduce
from shardwise.errors import ShardwiseError

__all__ = ["data_parallel_gradients", "loss", "single_device_gradient"]


def loss(W: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over examples of the squared error: x (B, d_in), W (d_in, d_out), y (B, d_out)."""
    return ((x @ W - y) ** 2).sum(dim=-1).mean()


def single_device_gradient(W: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∂loss/∂W on the whole batch, one device."""
    w = W.detach().clone().requires_grad_(True)
    loss(w, x, y).backward()
    assert w.grad is not None
    return w.grad


def data_parallel_gradients(W: torch.Tensor, x_shards: Sequence[torch.Tensor],
                            y_shards: Sequence[torch.Tensor], *,
                            weighted: bool = False) -> list[torch.Tensor]:
    """Every rank's gradient after the data-parallel all-reduce.

    Equal shards: average of the per-shard gradients. Uneven shards raise `ShardwiseError`
    unless `weighted=True`, which reduces `Σ (n_i/B)·g_i` (exact for any split).
    """
    if len(x_shards) != len(y_shards) or not x_shards:
        raise ShardwiseError(f"need one y shard per x shard, got {len(x_shards)} x and "
                             f"{len(y_shards)} y shards")
    sizes = [x.shape[0] for x in x_shards]
    if any(x.shape[0] != y.shape[0] for x, y in zip(x_shards, y_shards)):
        raise ShardwiseError("each x shard and its y shard must hold the same examples")
    n, total = len(sizes), sum(sizes)
    if len(set(sizes)) > 1 and not weighted:
        raise ShardwiseError(
            f"uneven shards {sizes}: averaging their gradients would weight examples of small "
            "shards more; split the batch evenly or pass weighted=True (reduce Σ n_i/B · g_i)")
    local = [single_device_gradient(W, x, y) for x, y in zip(x_shards, y_shards)]
    weights = [s / total for s in sizes] if weighted else [1 / n] * n
    scaled = [g * w for g, w in zip(local, weights)]
    return ring_all_reduce(scaled)
