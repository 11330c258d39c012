"""Tensor parallelism: the runtime's Transformer split by `parallelize.apply_tensor_parallel`
(Megatron TP, with and without sequence parallelism) equals a plainly written unsharded block
and LM; bytes per layer equal `tp_comm_bytes_per_layer`; the column-/row-parallel linears
equal nn.Linear."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.arch import ModelSpec
from shardwise.demos.common import max_rel_diff
from shardwise.demos.tensor_parallel import tp_rank_both
from shardwise.layout import Layout
from shardwise.runtime.launch import spawn
from shardwise.runtime.mesh import Mesh
from shardwise.runtime.model import Transformer
from shardwise.runtime.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
)

TOL = 1e-12
EPS = 1e-5  # runtime.model.RMSNorm's


# ------------------------------------------------- the unsharded reference, written plainly
class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form), x (b, s, heads, d), positions 0..s-1."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    ang = torch.arange(s, dtype=x.dtype)[:, None] * inv[None, :]  # (s, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]  # (s, 1, d)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ReferenceBlock(nn.Module):
    """The unsharded Llama block (explicit softmax attention, F.silu, nn.Linear), with the
    parameter names of `runtime.model.Block`."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, theta: float):
        super().__init__()
        self.spec, self.theta = spec, theta
        h, kv, f = spec.d_model, spec.kv_dim, spec.d_ff

        def linear(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, dtype=dtype)

        self.attention_norm = RMSNorm(h, dtype)
        self.attention = nn.ModuleDict({"wq": linear(h, h), "wk": linear(h, kv),
                                        "wv": linear(h, kv), "wo": linear(h, h)})
        self.mlp_norm = RMSNorm(h, dtype)
        self.mlp = nn.ModuleDict({"w_gate": linear(h, f), "w_up": linear(h, f),
                                  "w_down": linear(f, h)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, h) → (b, s, h)."""
        b, s, _ = x.shape
        a, kv, d = self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim
        att, mlp = self.attention, self.mlp
        y = self.attention_norm(x)
        q = _rope(att["wq"](y).view(b, s, a, d), self.theta)
        k = _rope(att["wk"](y).view(b, s, kv, d), self.theta)
        v = att["wv"](y).view(b, s, kv, d)
        k = k.repeat_interleave(a // kv, dim=2)  # (b, s, a_kv, d) -> (b, s, a, d)
        v = v.repeat_interleave(a // kv, dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d)  # (b, a, s, s)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v).reshape(b, s, a * d)
        x = x + att["wo"](o)
        y = self.mlp_norm(x)
        return x + mlp["w_down"](F.silu(mlp["w_gate"](y)) * mlp["w_up"](y))


class ReferenceLM(nn.Module):
    """nn.Embedding → ReferenceBlock(s) → RMSNorm → nn.Linear, `runtime.model.Transformer`'s
    parameter names; the loss is F.cross_entropy."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, theta: float):
        super().__init__()
        self.embedding = nn.Embedding(spec.vocab, spec.d_model, dtype=dtype)
        self.blocks = nn.ModuleList(ReferenceBlock(spec, dtype, theta)
                                    for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, dtype)
        self.head = nn.Linear(spec.d_model, spec.vocab, bias=False, dtype=dtype)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def plain_reference(model: Transformer) -> tuple[ReferenceLM, ReferenceBlock]:
    """`demos.tensor_parallel.tp_rank`'s reference: the single-device weights of `model` in
    ReferenceLM."""
    assert not model.spec.tie_embeddings
    ref = ReferenceLM(model.spec, model.dtype, model.spec.rope_theta)
    ref.load_state_dict(model.state_dict())
    return ref, ref.blocks[0]


# ------------------------------------------------------------------------------- the block
@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 2, 4])
def test_block_and_lm_equal_unsharded(t: int) -> None:
    for rank_results in spawn(tp_rank_both, t, "float64", plain_reference):
        for sp, o in zip((False, True), rank_results):
            label = f"t={t} sp={sp}"
            for key in ("out", "grad_x", "grads", "loss", "emb_grad", "head_grad"):
                assert o[key] <= TOL, f"{label}: {key} differs by {o[key]:g}"
            # 4 · 2(t-1)/t · s·b·h·8 bytes: 2 all-reduces forward, 2 backward (or RS + AG);
            # SP adds 2 · (t-1)/t · s·b·h·8: the backward re-gathers of the QKV and gate/up
            # input (tp_comm_bytes_per_layer(..., regather=True), the implementation's bytes)
            assert o["layer_bytes"] == o["predicted_bytes"], label
            if t > 1:
                assert o["ops"] == ({"all-gather", "reduce-scatter"} if sp else {"all-reduce"})


# -------------------------------------------------------- column- and row-parallel linears
def _linear_pair(sp: bool) -> float:
    """ColumnParallelLinear → tanh → RowParallelLinear (biases on) vs the nn.Linear pair on
    (s, b, h): output, input gradient and this rank's slices of every weight gradient."""
    r, t = dist.get_rank(), dist.get_world_size()
    Mesh.from_layout(Layout(tp=t, sp=sp))
    torch.manual_seed(0)
    h, f, dt = 16, 32, torch.float64
    fc1, fc2 = nn.Linear(h, f, dtype=dt), nn.Linear(f, h, dtype=dt)
    col = ColumnParallelLinear(h, f, "tp", bias=True, sequence_parallel=sp, dtype=dt)
    row = RowParallelLinear(f, h, "tp", bias=True, sequence_parallel=sp, dtype=dt)
    mine = slice(r * f // t, (r + 1) * f // t)
    with torch.no_grad():
        col.weight.copy_(fc1.weight[mine])
        col.bias.copy_(fc1.bias[mine])
        row.weight.copy_(fc2.weight[:, mine])
        row.bias.copy_(fc2.bias)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, h, generator=gen, dtype=dt)  # (s, b, h)
    up = torch.randn(8, 2, h, generator=gen, dtype=dt)
    xr = x.clone().requires_grad_(True)
    ref_out = fc2(torch.tanh(fc1(xr)))
    (ref_out * up).sum().backward()

    def seq(z: torch.Tensor) -> torch.Tensor:  # SP: this rank's sequence rows (s/t, b, h)
        return z.chunk(t)[r] if sp else z

    xp = seq(x).clone().requires_grad_(True)
    out = row(torch.tanh(col(xp)))
    (out * seq(up)).sum().backward()
    allreduce_sequence_parallel_grads(row)  # SP: the row bias saw a sequence slice
    pairs = [(out.detach(), seq(ref_out.detach())), (xp.grad, seq(xr.grad)),
             (col.weight.grad, fc1.weight.grad[mine]), (col.bias.grad, fc1.bias.grad[mine]),
             (row.weight.grad, fc2.weight.grad[:, mine]), (row.bias.grad, fc2.bias.grad)]
    return max(max_rel_diff(a, b) for a, b in pairs)


def _linear_pairs() -> list[float]:
    return [_linear_pair(False), _linear_pair(True)]


@pytest.mark.slow
def test_column_row_parallel_linears_equal_nn_linear() -> None:
    for diffs in spawn(_linear_pairs, 2):
        assert max(diffs) <= TOL, diffs
