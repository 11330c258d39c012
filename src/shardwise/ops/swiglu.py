"""SwiGLU as an autograd function, shared by the MoE experts (`ops.moe`) and the runtime
model's MLP (`runtime.model`), saving exactly what SPEC §3's generalised count says."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUFunction(torch.autograd.Function):
    """`silu(g)·u` (Shazeer 2020) saving only g and u: `d_u = dy·silu(g)`,
    `d_g = dy·u·σ(g)·(1 + g·(1 - σ(g)))`."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        return dy * up * sig * (1 + gate * (1 - sig)), dy * gate * sig
