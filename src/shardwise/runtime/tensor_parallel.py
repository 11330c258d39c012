"""Tensor parallelism over the `tp` axis (Shoeybi et al. 2019, Megatron-LM) with sequence
parallelism (Korthikanti et al. 2022) and a vocabulary-parallel embedding and cross-entropy.

Activations are laid out `(s, b, h)` (sequence first, as Megatron), so a sequence shard is a
contiguous block of rows and reduce-scatter / all-gather along the sequence are flat ones.

The conjugate operators (Megatron §3):

    f  identity forward, all-reduce backward     before a column-parallel layer
    g  all-reduce forward, identity backward     after a row-parallel layer

Column-parallel linear `Y_i = X·A_i` (A split by output columns; nn.Linear's weight rows)
needs the full input on every rank; row-parallel `Y = Σ_i X_i·B_i` consumes the split
activation and sums the partial products. Pairing them (QKV→O in attention, gate/up→down in
the MLP) leaves one `g` forward and one `f` backward per pair: per layer 2 all-reduces forward
and 2 backward on an `(s, b, h)` activation, `4 · 2(t-1)/t · s·b·h·bytes` per rank
(SPEC §5, `estimate.comm.tp_comm_bytes_per_layer`).

Sequence parallelism keeps the regions between those pairs (norms, residuals, dropout)
split along the sequence: `g` becomes a reduce-scatter to `(s/t, b, h)` and `f` an all-gather
back to `(s, b, h)` — conjugates again (RS forward ↔ AG backward). An all-reduce is exactly an
RS followed by an AG, so the bytes are the same while activation memory between the pairs
shrinks by t. The norms' weights then see only a slice of the sequence, so their gradients are
partial and must be all-reduced over tp (`allreduce_sequence_parallel_grads`).

Vocabulary parallelism: the embedding table and the output projection are split by vocabulary
rows `[r·V/t, (r+1)·V/t)`; the embedding zeroes rows it does not own and `g` sums; the
cross-entropy never gathers the logits: max, Σexp and the target logit are each all-reduced
over `(s, b)` (Megatron's `vocab_parallel_cross_entropy`).

Attention is split by heads (t must divide both the query heads and the kv heads, GQA);
QKV is one fused column-parallel weight laid out `[q_local; k_local; v_local]` and gate/up one
fused `[gate_local; up_local]`, so each pair applies `f` once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.runtime import collectives as C
from shardwise.runtime.collectives import GroupLike
from shardwise.runtime.mesh import AxisGroup

__all__ = [
    "BlockConfig",
    "ColumnParallelLinear",
    "ParallelBlock",
    "RMSNorm",
    "ReferenceBlock",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "copy_to_tp",
    "gather_from_sequence",
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


def copy_to_tp(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    g = C.resolve(group)
    return x if g.size == 1 else _CopyToTP.apply(x, g)


def reduce_from_tp(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    g = C.resolve(group)
    return x if g.size == 1 else _ReduceFromTP.apply(x, g)


def gather_from_sequence(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    g = C.resolve(group)
    return x if g.size == 1 else _GatherFromSequence.apply(x, g)


def reduce_scatter_to_sequence(x: torch.Tensor, group: GroupLike = "tp") -> torch.Tensor:
    g = C.resolve(group)
    return x if g.size == 1 else _ReduceScatterToSequence.apply(x, g)


# ---------------------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """`Y_i = f(X)·A_iᵀ`: this rank's `out_features/t` output features; input full.

    With `sequence_parallel` the input is `(s/t, b, in)` and `f` is an all-gather along the
    sequence. Output `(s, b, out/t)`, split along the last dim. `local_out` overrides the
    per-rank width (fused layers whose blocks are not an even split of `out_features`)."""

    def __init__(self, in_features: int, out_features: int, group: GroupLike = "tp", *,
                 bias: bool = False, sequence_parallel: bool = False,
                 local_out: int | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = C.resolve(group)
        t = self.group.size
        if local_out is None:
            if out_features % t:
                raise ShardwiseError(f"tp={t} does not divide out_features={out_features}")
            local_out = out_features // t
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local_out, dtype=dtype)) if bias else None
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
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            C.all_reduce(p.grad, g)


# -------------------------------------------------------------------- Transformer block
@dataclass(frozen=True)
class BlockConfig:
    """A Llama-style block: RMSNorm, GQA attention with RoPE, SwiGLU MLP."""

    hidden: int = 32
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn: int = 64
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @classmethod
    def from_model(cls, model: ModelSpec) -> BlockConfig:
        """One layer of a `ModelSpec` (e.g. the "tiny" preset)."""
        return cls(hidden=model.d_model, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
                   ffn=model.d_ff)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form), x (s, b, heads, d), positions 0..s-1."""
    s, d = x.shape[0], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    ang = torch.arange(s, dtype=x.dtype, device=x.device)[:, None] * inv[None, :]  # (s, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, None, :]  # (s, 1, 1, d)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ReferenceBlock(nn.Module):
    """The unsharded block, written plainly (explicit softmax attention): the reference."""

    def __init__(self, cfg: BlockConfig, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden, cfg.head_dim
        kv = cfg.n_kv_heads * d
        self.norm1 = RMSNorm(h, cfg.eps, dtype)
        self.wq = nn.Linear(h, h, bias=False, dtype=dtype)
        self.wk = nn.Linear(h, kv, bias=False, dtype=dtype)
        self.wv = nn.Linear(h, kv, bias=False, dtype=dtype)
        self.wo = nn.Linear(h, h, bias=False, dtype=dtype)
        self.norm2 = RMSNorm(h, cfg.eps, dtype)
        self.w_gate = nn.Linear(h, cfg.ffn, bias=False, dtype=dtype)
        self.w_up = nn.Linear(h, cfg.ffn, bias=False, dtype=dtype)
        self.w_down = nn.Linear(cfg.ffn, h, bias=False, dtype=dtype)
        with torch.no_grad():  # non-trivial norm weights, so their gradients are tested
            self.norm1.weight.uniform_(0.5, 1.5)
            self.norm2.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (s, b, h) → (s, b, h)."""
        cfg = self.cfg
        s, b, _ = x.shape
        a, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        y = self.norm1(x)
        q = _rope(self.wq(y).view(s, b, a, d), cfg.rope_theta)  # (s, b, h) -> (s, b, a, d)
        k = _rope(self.wk(y).view(s, b, kv, d), cfg.rope_theta)
        v = self.wv(y).view(s, b, kv, d)
        k = k.repeat_interleave(a // kv, dim=2)  # (s, b, a_kv, d) -> (s, b, a, d)
        v = v.repeat_interleave(a // kv, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)  # (b, a, s, s)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, a * d)
        x = x + self.wo(o)
        y = self.norm2(x)
        return x + self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))


class ParallelBlock(nn.Module):
    """The same block split t ways over `group` (optionally sequence-parallel)."""

    def __init__(self, cfg: BlockConfig, group: GroupLike = "tp", *,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.cfg, self.group, self.sp = cfg, C.resolve(group), sequence_parallel
        t = self.group.size
        if cfg.n_heads % t or cfg.n_kv_heads % t or cfg.ffn % t:
            raise ShardwiseError(f"tp={t} must divide n_heads={cfg.n_heads}, n_kv_heads="
                                 f"{cfg.n_kv_heads} and ffn={cfg.ffn}")
        self.a_local, self.kv_local = cfg.n_heads // t, cfg.n_kv_heads // t
        d, h = cfg.head_dim, cfg.hidden
        sp = sequence_parallel
        self.norm1 = RMSNorm(h, cfg.eps, dtype)
        self.qkv = ColumnParallelLinear(h, 0, self.group, sequence_parallel=sp, dtype=dtype,
                                        local_out=(self.a_local + 2 * self.kv_local) * d)
        self.proj = RowParallelLinear(h, h, self.group, sequence_parallel=sp, dtype=dtype)
        self.norm2 = RMSNorm(h, cfg.eps, dtype)
        self.fc1 = ColumnParallelLinear(h, 2 * cfg.ffn, self.group, sequence_parallel=sp,
                                        dtype=dtype)
        self.fc2 = RowParallelLinear(cfg.ffn, h, self.group, sequence_parallel=sp, dtype=dtype)
        for norm in (self.norm1, self.norm2):
            norm.weight.sequence_parallel = sp  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (s, b, h) — or (s/t, b, h) with sequence parallelism — to the same shape."""
        cfg, d = self.cfg, self.cfg.head_dim
        a, kv = self.a_local, self.kv_local
        qkv = self.qkv(self.norm1(x))  # (s, b, (a_l + 2·kv_l)·d), full sequence
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([a * d, kv * d, kv * d], dim=-1)
        q = _rope(q.reshape(s, b, a, d), cfg.rope_theta).permute(1, 2, 0, 3)  # (b, a_l, s, d)
        k = _rope(k.reshape(s, b, kv, d), cfg.rope_theta).permute(1, 2, 0, 3)
        v = v.reshape(s, b, kv, d).permute(1, 2, 0, 3)
        k = k.repeat_interleave(a // kv, dim=1)  # (b, kv_l, s, d) -> (b, a_l, s, d)
        v = v.repeat_interleave(a // kv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, a_l, s, d)
        o = o.permute(2, 0, 1, 3).reshape(s, b, a * d)  # -> (s, b, a_l·d)
        x = x + self.proj(o)
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)  # (s, b, f/t) each
        return x + self.fc2(F.silu(gate) * up)

    # ---------------------------------------------------- weights from / to the reference
    def _blocks(self) -> dict[str, tuple[str, int, int, int]]:
        """reference name -> (local param, dim sharded in the reference, start, length)."""
        t, r, d, cfg = self.group.size, self.group.rank, self.cfg.head_dim, self.cfg
        qn, kvn, fn = cfg.hidden // t, cfg.n_kv_heads * d // t, cfg.ffn // t
        return {"wq": ("qkv", 0, r * qn, qn), "wk": ("qkv", 0, r * kvn, kvn),
                "wv": ("qkv", 0, r * kvn, kvn), "wo": ("proj", 1, r * qn, qn),
                "w_gate": ("fc1", 0, r * fn, fn), "w_up": ("fc1", 0, r * fn, fn),
                "w_down": ("fc2", 1, r * fn, fn)}

    _FUSED: ClassVar[frozenset[str]] = frozenset({"wq", "wk", "wv", "w_gate", "w_up"})

    def _local_rows(self, name: str) -> slice:
        """Where a reference weight's block sits inside a fused local weight (dim 0)."""
        d, cfg, t = self.cfg.head_dim, self.cfg, self.group.size
        widths = {"wq": self.a_local * d, "wk": self.kv_local * d, "wv": self.kv_local * d,
                  "w_gate": cfg.ffn // t, "w_up": cfg.ffn // t}
        order = ["wq", "wk", "wv"] if name in ("wq", "wk", "wv") else ["w_gate", "w_up"]
        start = sum(widths[n] for n in order[: order.index(name)])
        return slice(start, start + widths[name])

    @torch.no_grad()
    def load_reference(self, ref: ReferenceBlock) -> ParallelBlock:
        """Copy this rank's slices of an unsharded block's weights."""
        self.norm1.weight.copy_(ref.norm1.weight)
        self.norm2.weight.copy_(ref.norm2.weight)
        for name, (local, dim, start, length) in self._blocks().items():
            full = getattr(ref, name).weight
            piece = full.narrow(dim, start, length)
            target = getattr(self, local).weight
            if name in self._FUSED:
                target[self._local_rows(name)].copy_(piece)
            else:
                target.copy_(piece)
        return self

    def gathered_grads(self) -> dict[str, torch.Tensor]:
        """Full-size gradients under the reference's names (all-gathered; not counted).
        Call `allreduce_sequence_parallel_grads` first under SP."""
        out = {"norm1": self.norm1.weight.grad, "norm2": self.norm2.weight.grad}
        with C.counting():
            for name, (local, dim, _start, _length) in self._blocks().items():
                grad = getattr(self, local).weight.grad
                assert grad is not None
                if name in self._FUSED:
                    grad = grad[self._local_rows(name)]
                piece = grad.movedim(dim, 0).contiguous()  # sharded dim first
                full = torch.empty((piece.shape[0] * self.group.size, *piece.shape[1:]),
                                   dtype=piece.dtype)
                C.all_gather(full, piece, self.group)
                out[name] = full.movedim(0, dim)
        return {k: v for k, v in out.items() if v is not None}
