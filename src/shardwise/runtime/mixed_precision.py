"""Mixed-precision training: bf16 weights and compute, fp32 master weights and optimizer state
(Micikevicius et al. 2018, "Mixed Precision Training"; Megatron-LM's `Float16OptimizerWithFloat16Params`
and its distributed optimizer; PyTorch FSDP's `MixedPrecision(param_dtype=bfloat16)`).

`MasterOptimizer` is that optimizer: it looks like `torch.optim.AdamW` to the training loop
(`param_groups`, `state`, `step`) but owns the fp32 masters.

Design notes: docs/concepts/runtime.md#runtime-mixed_precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["MasterOptimizer", "accumulate_in_fp32", "clear_grads", "grad", "grad_dtype",
           "keep_main_grad", "loss_dtype", "set_grad"]


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is computed in: at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------- fp32 gradient accumulation
def accumulate_in_fp32(p: torch.Tensor,
                       then: Callable[[torch.Tensor], object] | None = None) -> None:
    """Megatron's `main_grad`: from now on `p`'s gradient lives in `p.main_grad` (fp32).

    One post-accumulate-grad hook (registered before any reducer's, so it runs first): each
    time autograd has accumulated a gradient into the bf16 `p.grad`, add it into `p.main_grad`
    in fp32 (`main_grad += grad`, the bf16 operand promoted elementwise, no copy) and free
    `p.grad`; then `then(p)` (a reducer's own hook: ZeRO-2's reduce-scatter once a unit is
    complete). A call without a gradient (a function that returned None for `p`) is no
    accumulation and calls nothing."""
    keep_main_grad(p)

    def hook(p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if p.main_grad is None:  # type: ignore[attr-defined]
            p.main_grad = p.grad.to(torch.float32)  # type: ignore[attr-defined]
        else:
            p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
        p.grad = None
        if then is not None:
            then(p)

    p.register_post_accumulate_grad_hook(hook)


def keep_main_grad(t: torch.Tensor) -> None:
    """`t`'s gradient lives in `t.main_grad` (fp32, None until set): a ZeRO shard whose
    reduced fp32 gradient is stored there directly, or a parameter (`accumulate_in_fp32`)."""
    t.main_grad = None  # type: ignore[attr-defined]


def grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient reductions and the optimizer read: `p.main_grad` (fp32) where `p`
    accumulates in fp32, else `p.grad`."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def set_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Store `g` (of `grad_dtype(p)`) where `grad(p)` reads it."""
    if hasattr(p, "main_grad"):
        p.main_grad = g
    else:
        p.grad = g


def grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of `grad(p)`: fp32 for a `main_grad` holder, else the parameter's."""
    return torch.float32 if hasattr(p, "main_grad") else p.dtype


def clear_grads(params: Iterable[torch.Tensor]) -> None:
    """Drop the gradients (`.grad` and `main_grad`) of `params`."""
    for p in params:
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad = None


class MasterOptimizer:
    """AdamW over fp32 master copies of `params` (bf16 tensors the training loop updates).

    `step(scale)`: each master's gradient is `scale · fp32(grad(p))` (the clip coefficient
    applied in fp32, as Megatron clips its main gradients; an fp32 `main_grad` is used in
    place), AdamW steps the masters, and
    each `p` receives its master rounded to its dtype. The masters start from the bf16
    weights (Megatron: `param.detach().clone().float()`)."""

    def __init__(self, params: Sequence[torch.Tensor], **adamw: Any):
        self.params = list(params)
        self.masters = [p.detach().to(torch.float32).clone().requires_grad_(True)
                        for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, foreach=False, **adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @torch.no_grad()
    def step(self, scale: float = 1.0) -> None:
        for p, master in zip(self.params, self.masters):
            g = grad(p)
            if g is None:
                master.grad = None
                continue
            g = g if g.dtype == torch.float32 else g.to(torch.float32)  # bf16: a new fp32 copy
            master.grad = g.mul_(scale) if scale != 1.0 else g
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)  # fp32 -> bf16, round to nearest even
            master.grad = None

    def master_bytes(self) -> int:
        """Bytes of the fp32 master copies on this rank."""
        return sum(m.untyped_storage().nbytes() for m in self.masters)
