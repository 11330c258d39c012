"""Tensor parallelism over the `tp` axis (Shoeybi et al. 2019, Megatron-LM) with sequence
parallelism (Korthikanti et al. 2022) and a vocabulary-parallel embedding and cross-entropy.

Activations are laid out `(s, b, h)` (sequence first, as Megatron), so a sequence shard is a
contiguous block of rows and reduce-scatter / all-gather along the sequence are flat ones.

Column-parallel linear `Y_i = X·A_i` (A split by output columns; nn.Linear's weight rows)
needs the full input on every rank; row-parallel `Y = Σ_i X_i·B_i` consumes the split
activation and sums the partial products. Pairing them (QKV→O in attention, gate/up→down in
the MLP) leaves one `g` forward and one `f` backward per pair: per layer 2 all-reduces forward
and 2 backward on an `(s, b, h)` activation, `4 · 2(t-1)/t · s·b·h·bytes` per rank
(SPEC §5, `estimate.comm.tp_comm_bytes_per_layer`).

Design notes: docs/concepts/runtime.md#runtime-tensor_parallel.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.collectives import GroupLike
from shardwise.runtime.mesh import AxisGroup

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_replicated_kv_grads",
    "allreduce_sequence_parallel_grads",
    "copy_to_tp",
    "gather_from_sequence",
    "gather_linears",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "vocab_parallel_cross_entropy",
]


# ------------------------------------------------------------------ the conjugate operators
class _CopyToTP(torch.autograd.Function):
    """`f`: identity forward; all-reduce (SUM) of the input gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        C.all_reduce(grad, ctx.g)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """`g`: all-reduce (SUM) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        C.all_reduce(out, g)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _check_seq(s: int, g: AxisGroup) -> None:
    if s % g.size:
        raise ShardwiseError(f"sequence parallel: tp={g.size} does not divide the sequence "
                             f"length {s}")


def _rs_seq(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    x = x.contiguous()
    _check_seq(x.shape[0], g)
    out = torch.empty((x.shape[0] // g.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    C.reduce_scatter(out, x, g)  # (s, b, h) -> (s/t, b, h): flat chunks = sequence blocks
    return out


def _ag_seq(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((x.shape[0] * g.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather(out, x, g)  # (s/t, b, h) -> (s, b, h)
    return out


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP's `g`: reduce-scatter along the sequence forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.g = g
        return _rs_seq(x, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _ag_seq(grad, ctx.g), None


class _GatherFromSequence(torch.autograd.Function):
    """SP's `f`: all-gather along the sequence forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.g = g
        return _ag_seq(x, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _rs_seq(grad, ctx.g), None


class _GatherLinears(torch.autograd.Function):
    """SP's `f` fused with the column-parallel linears that read its output:
    `Y_j = AG(X)·W_jᵀ`, X `(s/t, b, h)`, each Y_j `(s, b, out_j)`. Saves the shard X only (and
    the weights, which are parameters); backward all-gathers X again for `dW_j = dY_jᵀ·AG(X)`
    and reduce-scatters `dX = Σ_j dY_j·W_j` along the sequence, as `_GatherFromSequence`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup, *weights: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.g = g
        ctx.save_for_backward(x, *weights)
        full = _ag_seq(x, g)  # (s, b, h), freed after the forward
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        d_full = sum(dy.matmul(w) for dy, w in zip(grads, weights))  # (s, b, h)
        d_x = _rs_seq(d_full, ctx.g) if ctx.needs_input_grad[0] else None
        full = _ag_seq(x, ctx.g).flatten(0, -2) if any(ctx.needs_input_grad[2:]) else None
        d_weights = tuple(dy.flatten(0, -2).t().matmul(full) if need else None
                          for dy, need in zip(grads, ctx.needs_input_grad[2:]))
        return (d_x, None, *d_weights)


def gather_linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                   group: GroupLike = "tp") -> tuple[torch.Tensor, ...]:
    """`F.linear(gather_from_sequence(x), w)` for each of `weights`, the all-gathered input
    shared and never saved: x `(s/t, b, h)` → `(s, b, out_j)` each (see `_GatherLinears`)."""
    g = C.resolve(group)
    if g.size == 1:
        return tuple(F.linear(x, w) for w in weights)
    return _GatherLinears.apply(x, g, *weights)


def copy_to_tp(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    """Megatron's `f`: identity forward, all-reduce of the gradient over `group` backward."""
    g = C.resolve(group)
    return x if g.size == 1 else _CopyToTP.apply(x, g)


def reduce_from_tp(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    """Megatron's `g`: all-reduce over `group` forward, identity backward."""
    g = C.resolve(group)
    return x if g.size == 1 else _ReduceFromTP.apply(x, g)


def gather_from_sequence(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    """Sequence parallelism's entry: all-gather the sequence shards forward, reduce-scatter the
    gradient backward."""
    g = C.resolve(group)
    return x if g.size == 1 else _GatherFromSequence.apply(x, g)


def reduce_scatter_to_sequence(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    """Sequence parallelism's exit: reduce-scatter into sequence shards forward, all-gather the
    gradient backward."""
    g = C.resolve(group)
    return x if g.size == 1 else _ReduceScatterToSequence.apply(x, g)


# ---------------------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """`Y_i = f(X)·A_iᵀ`: this rank's `out_features/t` output features; input full.

    With `sequence_parallel` the input is `(s/t, b, in)` and `f` is an all-gather along the
    sequence. Output `(s, b, out/t)`, split along the last dim."""

    def __init__(self, in_features: int, out_features: int, group: GroupLike = "tp", *,
                 bias: bool = False, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.group = C.resolve(group)
        t = self.group.size
        if out_features % t:
            raise ShardwiseError(f"tp={t} does not divide out_features={out_features}")
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // t, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=1 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (gather_from_sequence(x, self.group) if self.sequence_parallel
             else copy_to_tp(x, self.group))
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`Y = g(Σ_i X_i·B_iᵀ)`: input split along its last dim (`in_features/t` here), output
    full `(s, b, out)` — or `(s/t, b, out)` with `sequence_parallel` (reduce-scatter)."""

    def __init__(self, in_features: int, out_features: int, group: GroupLike = "tp", *,
                 bias: bool = False, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.group = C.resolve(group)
        t = self.group.size
        if in_features % t:
            raise ShardwiseError(f"tp={t} does not divide in_features={in_features}")
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        nn.init.normal_(self.weight, std=1 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # partial sum (s, b, out)
        y = (reduce_scatter_to_sequence(y, self.group) if self.sequence_parallel
             else reduce_from_tp(y, self.group))
        return y if self.bias is None else y + self.bias  # bias added once, after the sum


class VocabParallelEmbedding(nn.Module):
    """Rows `[r·V/t, (r+1)·V/t)` of the table; ids outside give zeros, then `g` sums
    (reduce-scatter along the sequence with SP). ids `(s, b)` → `(s, b, h)` (or `(s/t, b, h)`)."""

    def __init__(self, vocab: int, hidden: int, group: GroupLike = "tp", *,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = C.resolve(group)
        t = self.group.size
        if vocab % t:
            raise ShardwiseError(f"tp={t} does not divide the vocabulary {vocab}")
        self.per_rank = vocab // t
        self.lo = self.group.rank * self.per_rank
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden, dtype=dtype))
        nn.init.normal_(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (s, b, h), zero where not mine
        return (reduce_scatter_to_sequence(out, self.group) if self.sequence_parallel
                else reduce_from_tp(out, self.group))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on logits split by vocabulary, `(s, b, V/t)` → loss `(s, b)`.

    loss = log Σ_v exp(z_v - m) − (z_target − m), with m = max_v z_v: three all-reduces on
    `(s, b)` tensors (MAX, then SUM of exp, SUM of the target logit owned by one rank).
    Backward: ∂loss/∂z = softmax(z) − onehot(target), computed on the local slice.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, g: AxisGroup,
                lo: int) -> torch.Tensor:
        m = logits.max(dim=-1).values.contiguous()  # (s, b)
        C.all_reduce(m, g, op="max")
        z = logits - m.unsqueeze(-1)
        local = target - lo
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = picked.contiguous()
        C.all_reduce(picked, g)
        exp = z.exp()
        total = exp.sum(-1).contiguous()
        C.all_reduce(total, g)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: GroupLike = "tp") -> torch.Tensor:
    """Per-token loss `(s, b)` from vocabulary-split logits `(s, b, V/t)` (rank r holds
    vocabulary rows `[r·V/t, (r+1)·V/t)`)."""
    g = C.resolve(group)
    return _VocabParallelCrossEntropy.apply(logits, target, g, g.rank * logits.shape[-1])


def allreduce_sequence_parallel_grads(module: nn.Module, group: GroupLike = "tp") -> None:
    """Sum over tp the gradients of parameters that saw only a sequence slice (the norms and
    row-parallel biases under SP); Megatron does this before the optimizer step."""
    g = C.resolve(group)
    if g.size == 1:
        return
    for p in module.parameters():
        grad = mp.grad(p)
        if getattr(p, "sequence_parallel", False) and grad is not None:
            C.all_reduce(grad, g)


def allreduce_replicated_kv_grads(module: nn.Module, group: GroupLike = "tp") -> None:
    """Replicated kv heads (t > a_kv): each of the `t/a_kv` ranks that hold one kv head computed
    its gradient from its own query heads only; the head's gradient is their sum. One
    all-reduce over tp of an (a_kv, …) buffer per weight: rank r fills row `r // (t/a_kv)`
    with its gradient, the others stay zero, so row j sums exactly kv head j's replicas
    (a_kv × the bytes of one head's gradient, with no extra process groups)."""
    g = C.resolve(group)
    for p in module.parameters():
        replicas, grad = getattr(p, "tp_replicas", 1), mp.grad(p)
        if replicas == 1 or grad is None:
            continue
        slots = grad.new_zeros((g.size // replicas, *grad.shape))  # (a_kv, …)
        slots[g.rank // replicas] = grad
        C.all_reduce(slots, g)
        grad.copy_(slots[g.rank // replicas])
