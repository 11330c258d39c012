"""SwiGLU as an autograd function, shared by the MoE experts (`ops.moe`) and the runtime
model's MLP (`runtime.model`), saving exactly what SPEC §3's generalised count says."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUFunction(torch.autograd.Function):
    """`silu(g)·u` (Shazeer 2020) saving only g and u: `d_u = dy·silu(g)`,
    `d_g = dy·u·σ(g)·(1 + g·(1 - σ(g)))`.

    Backward runs torch's fused `silu_backward` kernel for `d_g` (the same kernel autograd's
    own `F.silu(g)·u` calls) in place on `dy·u`, and recomputes silu(g) for `d_u` in place:
    two elementwise products, one silu and one silu_backward, no other temporaries. Autograd's
    unfused version saves silu(g) as a third tensor instead of recomputing it.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate = dy * up
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return d_gate, F.silu(gate).mul_(dy)
