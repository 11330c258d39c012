"""SwiGLU, GeGLU and gpt-oss's clamped SwiGLU as autograd functions, shared by the MoE experts
(`ops.moe`) and the runtime model's MLP (`runtime.model`), saving exactly what SPEC §3's
generalised count says (the gate and up projections)."""

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


# the gated MLP activations besides SiLU (`ModelSpec.gated_act`)
GATED_ACTS = ("silu", "gelu_tanh", "swiglu_clamp")


class GatedActFunction(torch.autograd.Function):
    """`act(g)·u` for the other gated activations, saving only g and u as `SwiGLUFunction`:

    gelu_tanh (GeGLU, Gemma: `gelu_pytorch_tanh`): `gelu_tanh(g)·u`, `d_g` by torch's
    `gelu_backward(approximate="tanh")`;
    swiglu_clamp (gpt-oss, transformers 5.24 `GptOssExperts._apply_gate`): with
    `ĝ = min(g, L)`, `û = clamp(u, -L, L)`: `(û + 1)·ĝ·σ(αĝ)`; the clamps pass no gradient
    outside [−L, L] (torch's `clamp` backward keeps the bounds themselves).
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float,
                limit: float) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.alpha, ctx.limit = act, alpha, limit
        if act == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.act == "gelu_tanh":
            d_gate = torch.ops.aten.gelu_backward(dy * up, gate, approximate="tanh")
            return d_gate, F.gelu(gate, approximate="tanh").mul_(dy), None, None, None
        alpha, limit = ctx.alpha, ctx.limit
        g = gate.clamp(max=limit)
        sig = torch.sigmoid(alpha * g)
        d_up = dy * g * sig * ((up >= -limit) & (up <= limit))
        d_g = dy * (up.clamp(-limit, limit) + 1) * sig * (1 + alpha * g * (1 - sig))
        return d_g * (gate <= limit), d_up, None, None, None


def gated(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", alpha: float = 1.702,
          limit: float = 7.0) -> torch.Tensor:
    """`act(gate)·up` through the function that saves only gate and up; `alpha`, `limit`:
    swiglu_clamp's (gpt-oss's swiglu_alpha, swiglu_limit)."""
    if act == "silu":
        return SwiGLUFunction.apply(gate, up)
    return GatedActFunction.apply(gate, up, act, alpha, limit)
