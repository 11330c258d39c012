"""Mixed-precision training: bf16 weights and compute, fp32 master weights and optimizer state
(Micikevicius et al. 2018, "Mixed Precision Training"; Megatron-LM's `Float16OptimizerWithFloat16Params`
and its distributed optimizer; PyTorch FSDP's `MixedPrecision(param_dtype=bfloat16)`).

The recipe (`TrainConfig(dtype="bf16")`, `shardwise train --dtype bf16`):

    weights     the model's parameters are bf16; forward and backward compute in bf16 (torch's
                CPU/GPU bf16 GEMMs accumulate in fp32 and round the result once)
    gradients   autograd's bf16 gradients, accumulated over micro-batches and averaged over
                the dp×cp ranks (all-reduce, or ZeRO's reduce-scatter) in bf16: `grad_dtype`
                bf16, SPEC §2's 2 + 2 + 4 + 4 + 4 = 16 B/param. (Megatron's default keeps fp32
                `main_grad` buffers, 18 B/param; the runtime refuses `grad_dtype` fp32 with
                bf16 weights, see `TrainConfig.problems`.)
    master      an fp32 copy of every tensor the optimizer updates — a parameter, or under
                ZeRO-1/2/3 this rank's flat shard, so the master is sharded over the dp×cp
                group exactly like the optimizer state (Megatron's distributed optimizer)
    optimizer   AdamW's moments in fp32, over the master copies
    step        master.grad = fp32(grad) · clip coefficient; AdamW on the master; the bf16
                weights ← round-to-nearest-even(master) (ZeRO-1/2 then all-gather the updated
                bf16 rows, ZeRO-3 keeps the bf16 row and gathers it at the next forward)
    loss        the cross-entropy (log-sum-exp over the vocabulary, vocabulary-parallel too)
                in fp32, as Megatron (`logits.float()`) and Hugging Face's Llama do; norms,
                attention softmax and RoPE compute in bf16 with fp32 accumulation inside
                torch's reductions — the single-device reference does the same

`MasterOptimizer` is that optimizer: it looks like `torch.optim.AdamW` to the training loop
(`param_groups`, `state`, `step`) but owns the fp32 masters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MasterOptimizer", "loss_dtype"]


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is computed in: at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


class MasterOptimizer:
    """AdamW over fp32 master copies of `params` (bf16 tensors the training loop updates).

    `step(scale)`: each master's gradient is `scale · fp32(p.grad)` (the clip coefficient
    applied in fp32, as Megatron clips its main gradients), AdamW steps the masters, and
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
            if p.grad is None:
                master.grad = None
                continue
            grad = p.grad.to(torch.float32)  # a new fp32 tensor: p.grad stays bf16
            master.grad = grad.mul_(scale) if scale != 1.0 else grad
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)  # fp32 -> bf16, round to nearest even
            master.grad = None

    def master_bytes(self) -> int:
        """Bytes of the fp32 master copies on this rank."""
        return sum(m.untyped_storage().nbytes() for m in self.masters)
