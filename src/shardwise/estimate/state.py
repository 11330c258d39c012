"""Persistent training state (SPEC §2): bytes per parameter of each state class and their
ZeRO sharding. Functions return bytes and take numbers or NumPy arrays of layouts.

Mixed-precision Adam: weight + grad + fp32 master + two moments, `2+2+4+4+4 = 16` B/param
(Rajbhandari et al. 2020); ZeRO stage `k` divides the first `k` classes (optimizer, grads,
weights) by the data-parallel degree. Derivation and tables: docs/concepts/memory.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import dp_step_comm_bytes
from shardwise.units import dtype_bytes

# Optimizer moment bytes per parameter: Adam m and v in fp32; SGD momentum one fp32 buffer;
# bitsandbytes 8-bit Adam two int8 moments (Dettmers et al. 2022); Adafactor's factored
# second moment is O(rows + cols) per matrix, ~0.5 B/param as an order of magnitude.
MOMENT_BYTES = {"adam": 8.0, "sgd-momentum": 4.0, "sgd": 0.0, "adam-8bit": 2.0,
                "adafactor": 0.5}


def _plain(value: Any) -> Any:
    """A Python float for one layout (JSON, exact comparisons), the array for many."""
    return value if np.ndim(value) else float(value)



@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each persistent state class."""

    weight: float
    grad: float
    master: float
    moments: float

    @property
    def optimizer(self) -> float:
        """Master weights + moments: what ZeRO-1 shards."""
        return self.master + self.moments

    @property
    def total(self) -> float:
        return self.weight + self.grad + self.optimizer


def bytes_per_param_training(dtype: str = "bf16", grad_dtype: str | None = None,
                             optimizer: str = "adam", *, exp_avg_dtype: str | None = None,
                             exp_avg_sq_dtype: str | None = None,
                             main_params_dtype: str | None = None) -> StateBytes:
    """Weight + gradient + fp32 master (when weights are not fp32) + optimizer moments.

    bf16 weights and grads with Adam: `2 + 2 + 4 + 4 + 4 = 16` B/param (Rajbhandari et al.
    2020); Megatron's fp32 gradient accumulation makes it 18; 8-bit moments make it 10.
    Moments are kept in at least fp32: weights wider than fp32 (fp64) keep Adam's and
    momentum's buffers in their own dtype, as torch's optimizers do (fp64 Adam: 8+8+0+16).
    `exp_avg_dtype`, `exp_avg_sq_dtype`, `main_params_dtype`: Adam's moments and the master
    copy in those dtypes (Megatron's precision-aware optimizer, `train_state_bytes`).
    """
    if optimizer not in MOMENT_BYTES:
        raise ShardwiseError(f"optimizer {optimizer!r} unknown; valid: {', '.join(MOMENT_BYTES)}")
    weight = dtype_bytes(dtype)
    grad = dtype_bytes(grad_dtype or dtype)
    master = 0.0 if weight >= 4 else 4.0
    moments = MOMENT_BYTES[optimizer]
    if optimizer in ("adam", "sgd-momentum") and weight > 4:
        moments *= weight / 4  # one (momentum) or two (Adam) buffers of the weight dtype
    if optimizer == "adam" and (exp_avg_dtype or exp_avg_sq_dtype):
        moments = dtype_bytes(exp_avg_dtype or "fp32") + dtype_bytes(exp_avg_sq_dtype or "fp32")
    if main_params_dtype and master:
        master = dtype_bytes(main_params_dtype)
    return StateBytes(weight, grad, master, moments)


def train_state_bytes(train: Any) -> StateBytes:
    """`bytes_per_param_training` of a `TrainSpec`: its dtypes and optimizer, with Megatron's
    precision-aware optimizer (`--use-precision-aware-optimizer`: `exp_avg_dtype`,
    `exp_avg_sq_dtype`, `main_params_dtype`; megatron-core 0.16.1 optimizer/
    optimizer_config.py, TE's FusedAdam keeps each moment in its dtype, fp8 with a per-tensor
    scale). DeepSeek-V3 §3.3.3: BF16 moments, FP32 master weights — 2+4+4+2+2 = 14 B/param
    with fp32 gradients."""
    return bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer,
                                    exp_avg_dtype=getattr(train, "exp_avg_dtype", None),
                                    exp_avg_sq_dtype=getattr(train, "exp_avg_sq_dtype", None),
                                    main_params_dtype=getattr(train, "main_params_dtype", None))


def training_memory_bytes(n_params: float, state: StateBytes | None = None) -> dict[str, float]:
    """Unsharded training state: weights, grads, optimizer (master + moments), total."""
    state = state or bytes_per_param_training()
    parts = {"weights": n_params * state.weight, "grads": n_params * state.grad,
             "optimizer": n_params * state.optimizer}
    return parts | {"total": sum(parts.values())}


def zero_state_bytes(n_params: Any, n: Any, stage: Any,
                     state: StateBytes | None = None) -> tuple[Any, Any, Any]:
    """(weights, grads, optimizer) bytes per device under ZeRO over `n` ranks (numbers or
    arrays).

    stage 0: nothing sharded (`16P`); 1: optimizer sharded (`4P + 12P/N`);
    2: + gradients (`2P + 14P/N`); 3: + weights (`16P/N`) — Rajbhandari et al. 2020, Fig. 1.
    """
    if np.ndim(stage) == 0 and stage not in (0, 1, 2, 3):
        raise ShardwiseError(f"zero stage must be 0, 1, 2 or 3, got {stage}")
    if np.ndim(n) == 0 and n < 1:
        raise ShardwiseError(f"ZeRO needs ≥ 1 rank, got {n}")
    state = state or bytes_per_param_training()
    p = n_params
    return (
        _plain(p * state.weight / np.where(stage >= 3, n, 1)),
        _plain(p * state.grad / np.where(stage >= 2, n, 1)),
        _plain(p * state.optimizer / np.where(stage >= 1, n, 1)),
    )


def zero_memory_per_device(n_params: float, n: int, stage: int,
                           state: StateBytes | None = None) -> float:
    """Total persistent bytes per device under ZeRO `stage` over `n` ranks."""
    return sum(zero_state_bytes(n_params, n, stage, state))


@dataclass(frozen=True)
class ZeroRow:
    """One row of `zero_stage_table`: a ZeRO stage, what it shards, bytes and traffic."""

    stage: int
    sharded: str
    bytes_per_device: float
    comm_bytes_per_step: float


def zero_stage_table(n_params: float, n: int, state: StateBytes | None = None) -> list[ZeroRow]:
    """SPEC §2's table for a model: per-device bytes and per-rank traffic for stages 0..3."""
    state = state or bytes_per_param_training()
    sharded = ("nothing", "optimizer states", "+ gradients", "+ weights")
    return [
        ZeroRow(stage, sharded[stage], zero_memory_per_device(n_params, n, stage, state),
                dp_step_comm_bytes(n_params, n, stage, state.grad, state.weight))
        for stage in range(4)
    ]


def kv_cache_bytes_per_token(model: ModelSpec, dtype: str = "bf16") -> float:
    """Inference KV cache per token: `L · (a_kv·d + a_kv·d_v) · bytes` (`2·L·a_kv·d·bytes` for
    standard attention); MLA caches its kv latent and RoPE key only, `L · (r_kv + d_R) ·
    bytes` (DeepSeek-V2, arXiv:2405.04434 §2.1.3 and Table 1: `(d_c + d_h^R)·l` elements)."""
    width = (model.kv_lora_rank + model.qk_rope_head_dim if model.is_mla
             else model.kv_dim + model.v_dim)
    return model.n_layers * width * dtype_bytes(dtype)
