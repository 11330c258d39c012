"""The host's share of a pass: operations launched per layer (`host_ops`: the fused kernel
count of the GPU stacks, or the aten operations shardwise's runtime dispatches on the "this
machine" preset) and their fixed cost each (`host_overhead`, `Calibration.kernel_overhead`).
On a GPU the host runs ahead of the device, so a pass takes the slower of the two; on the
"this machine" preset the CPU does both (`_with_host`). An MoE layer's token dispatcher stops
the host once per forward for the routing counts (`dispatch_sync`); on the fused stack the
experts' GEMMs and FP8 casts are then launched one per local expert (`expert_launches`,
`expert_host`), so small experts can leave the device waiting on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.estimate.kernels import ComputeContext
from shardwise.hardware import get_link

__all__ = ["dispatch_sync", "expert_host", "expert_launches", "host_ops", "host_overhead", "optimizer_host_ops"]

# Kernels launched per layer forward: QKV, out-proj, two MLP GEMMs (gate+up fused), two norms,
# two residual/dropout adds, activation, QKV post-processing; attention core 1 (flash) or 4
# (two batched GEMMs, softmax, dropout). Backward launches about twice as many.
_KERNELS_FWD = 10
_KERNELS_MLP = 4  # of which the MLP's: two GEMMs, the activation, its residual add
_KERNELS_ATTN_FLASH = 1
_KERNELS_ATTN_MATERIALISED = 4

# The shardwise runtime's own count (`Calibration.op_count == "runtime"`): aten operations it
# dispatches per layer and micro-batch, forward + backward together (views, transposes and the
# autograd engine's gradient ops included), counted with a `TorchDispatchMode` on `tiny` and
# `tiny-moe` (fp32, torch's fused CPU flash attention; tests/runtime/test_host_ops.py recounts
# them on the runtime): a dense layer 190; tensor parallelism's f/g functions +6; sequence
# parallelism's gathers/scatters +48 more; ring attention +99, and +106 per extra ring step
# (c − 1: 395 at c = 2, 607 at c = 4, mean over ranks); an MoE layer (router, top-k, dispatch,
# combine, aux loss) 261, + 31 per local expert that receives rows (its SwiGLU; an expert
# without rows launches nothing: `ops.moe`), and under expert parallelism +16 (the count
# exchange, the all-to-alls' autograd functions) and +5 more per such expert (its rows cut
# and joined per source rank) — counted 385 with 4 experts on one rank and 349 with 2 per
# rank under ep = 2, every expert receiving rows; one `moe_layer` call alone gives 31 per
# expert, `run_local_experts` 36. Embedding, LM head and loss add 64 per micro-batch. On a
# CPU with a small model each costs the host's ~µs regardless of its size — `shardwise
# calibrate` measures that cost per op.
_OPS_LAYER = 190
_OPS_MOE_LAYER = 261
_OPS_EXPERT = 31
_OPS_EP = 16
_OPS_EP_EXPERT = 5
_OPS_TP = 6
_OPS_SP = 48
_OPS_CP = 99
_OPS_RING_STEP = 106
_OPS_HEAD = 64


def host_ops(ctx: ComputeContext, t: Any, c: Any, sp: Any, moe: bool = False, ep: Any = 1
             ) -> tuple[Any, Any]:
    """(forward, backward) operations one layer launches per micro-batch on one rank.

    `op_count == "fused"` (the built-in GPU presets): the kernels of a fused implementation
    (Megatron-LM's): 10 per layer forward (QKV, out-proj, two MLP GEMMs, two norms, two
    residual adds, the activation, QKV post-processing) plus the attention core (1 flash, 4
    materialised; MLA's extra projections and norms, `_mla_kernels`), the backward twice as
    many. `"runtime"` (the "this machine" preset, which
    runs shardwise's own runtime): the aten operations it dispatches (`_OPS_*` above), split
    ⅓ forward, ⅔ backward like the fused count; an MoE layer's experts count when they
    receive rows (`ComputeContext.experts_active` of the `E/ep` local ones).
    """
    if ctx.calibration.op_count == "runtime":
        running = ctx.model.n_experts / ep * ctx.experts_active  # local experts with rows
        layer = (_OPS_MOE_LAYER + _OPS_EXPERT * running
                 + np.where(ep > 1, _OPS_EP + _OPS_EP_EXPERT * running, 0) if moe
                 else _OPS_LAYER)
        total = layer + np.where(t > 1, _OPS_TP, 0)
        total = total + np.where(np.logical_and(sp, t > 1), _OPS_SP, 0)
        total = total + np.where(c > 1, _OPS_CP + _OPS_RING_STEP * (c - 1), 0)
        return total / 3, 2 * total / 3
    attention = _KERNELS_ATTN_FLASH if ctx.flash else _KERNELS_ATTN_MATERIALISED
    if ctx.traffic is None:
        # a CUDA-graphed scope (`shardwise.cuda_graph`) is one graph launch each way
        attn = _KERNELS_FWD - _KERNELS_MLP + _mla_kernels(ctx.model) + attention
        mlp = _KERNELS_MLP
        graphs = ctx.cuda_graph
        attn = 1 if "attn" in graphs else attn
        mlp = 1 if ("moe" if moe else "mlp") in graphs else mlp
        return attn + mlp, 2 * (attn + mlp)
    # eager / compiled: the stack's kernels besides GEMMs and attention, its five GEMMs
    # (three per expert that runs in an MoE layer) and the attention core
    gemms = 2 + (3 * ctx.model.n_experts / ep * ctx.experts_active + 1 if moe else 3)
    return (ctx.layer_kernels[0] + _mla_kernels(ctx.model) + gemms + attention,
            ctx.layer_kernels[1] + _mla_kernels(ctx.model) + 2 * gemms + attention)


# Transformer Engine's GroupedLinear (Megatron-Core 0.16.1 `TEGroupedMLP`: linear_fc1 and
# linear_fc2 are TE GroupedLinear modules, one GEMM per local expert). TE v2.9
# `pytorch/module/grouped_linear.py` hands the per-expert operands to `general_grouped_gemm`,
# whose `common/gemm/cublaslt_gemm.cu` `multi_stream_cublas_gemm` loops `for i < num_gemms`
# launching one cuBLASLt GEMM each (descriptors built and the heuristic queried per call):
# per expert fc1 and fc2 forward (2), their dgrad and wgrad (4). The FP8 casts of the GEMM
# operands (`tex.split_quantize` → `csrc/extensions/cast.cpp`): one fused multi-tensor
# cast-transpose for all experts under delayed scaling (`nvte_multi_cast_transpose`), else a
# quantize per expert: current scaling (`tensorwise`) 3 kernels (`quantizer.cpp`
# Float8CurrentScalingQuantizer: compute_amax, compute_scale_from_amax, quantize), MXFP8 and
# blockwise 1 (`nvte_quantize_v2`) — fc1's and fc2's inputs forward, their output gradients
# backward (the weights are cast once per step, `is_first_microbatch`).
_EXPERT_GEMMS = (2, 4)
_QUANTIZE_KERNELS = {"delayed": 0, "tensorwise": 3, "mxfp8": 1, "blockwise": 1}


# Host time of one expert GEMM through TE's multi-stream cuBLASLt loop: TE PR #3134's
# benchmark (benchmarks/linear/benchmark_grouped_linear.py, SM100, "pure" multi-stream row,
# 8 experts × 128 tokens, N = K = 2048: 0.267 ms for 8 GEMMs whose math takes ~1 µs each).
_GROUPED_GEMM_HOST = 0.267e-3 / 8


def expert_host(ctx: ComputeContext, local: Any) -> tuple[Any, Any]:
    """(forward, backward) host seconds of `expert_launches`: `_GROUPED_GEMM_HOST` per GEMM,
    `kernel_overhead` per cast kernel; 0 outside the fused GPU stacks and when the MoE layer
    replays as a CUDA graph (`cuda_graph` moe)."""
    if ctx.calibration.op_count != "fused" or ctx.traffic is not None or "moe" in ctx.cuda_graph:
        return 0.0 * local, 0.0 * local
    (fwd, bwd), (gf, gb) = expert_launches(ctx, local), _EXPERT_GEMMS
    cost = ctx.calibration.kernel_overhead
    return (local * gf * _GROUPED_GEMM_HOST + (fwd - local * gf) * cost,
            local * gb * _GROUPED_GEMM_HOST + (bwd - local * gb) * cost)


def expert_launches(ctx: ComputeContext, local: Any) -> tuple[Any, Any]:
    """(forward, backward) kernels the host launches one by one for `local` experts that
    receive rows, per micro-batch, in a fused (Megatron-Core + Transformer Engine) MoE layer:
    `_EXPERT_GEMMS` GEMMs each and, with an FP8 recipe that quantises the experts, 2 casts of
    `_QUANTIZE_KERNELS[recipe]` kernels each way (TE v2.9 GroupedLinear, comment above)."""
    fp8 = ctx.fp8 is not None and ctx.fp8.experts_fp8
    quant = 2 * _QUANTIZE_KERNELS.get(ctx.fp8.name, 1) if fp8 and ctx.fp8 else 0
    return local * (_EXPERT_GEMMS[0] + quant), local * (_EXPERT_GEMMS[1] + quant)


def _mla_kernels(model: ModelSpec) -> int:
    """Kernels MLA adds to a layer's forward: two down-projection GEMMs (one without a q
    latent), their latent norms, and a second up-projection GEMM (q and kv apart)."""
    return (5 if model.q_lora_rank else 3) if model.is_mla else 0


# The runtime's optimizer step, per parameter tensor on the rank (counted with a
# TorchDispatchMode on torch 2.13, CPU): AdamW(foreach=False) 10 aten ops, the global-norm
# terms 3 (vector_norm, square, add_), the clipping scale 1 — 14; tiny's 39 tensors ≈ 566 ops.
_OPS_OPT_TENSOR = 14


def optimizer_host_ops(ctx: ComputeContext, n_dense: Any, n_moe: Any, ep: Any, single: Any
                       ) -> Any:
    """Aten ops of the optimizer step on the busiest stage, "this machine" preset only
    (`op_count == "runtime"`; 0 for the fused GPU presets, whose optimizer is a few fused
    kernels): `_OPS_OPT_TENSOR` per parameter tensor — `n_dense` dense and `n_moe` MoE
    layers (norms, q/k/v/o, the MLP's 2-3 matrices, biases where the model has them; an MoE
    layer its router and the 2-3 stacked matrices of its local experts and of its shared
    ones, `runtime.model.mlp.MoE`), the final norm and LM head, and the
    embedding with one stage (`single`)."""
    if ctx.calibration.op_count != "runtime":
        return 0.0 * n_dense
    model = ctx.model
    norm = 2 if model.norm == "layernorm" else 1
    mlp = 3 if model.gated_mlp else 2  # the runtime's dense MLP has no biases
    # q, k, v, o; MLA: q (or q-down, q-norm, q-up), kv-down, kv-norm, kv-up, o
    projections = (7 if model.q_lora_rank else 5) if model.is_mla else 4
    attn = (2 * norm + projections + 3 * (model.bias or model.qkv_bias)
            + (model.bias or model.out_bias))
    # the router (and its bias); the experts' matrices stacked, one tensor each for the
    # local experts (their biases too with mlp_bias, gpt-oss) and for the shared ones
    moe = (attn + 1 + model.router_bias + mlp * (1 + model.mlp_bias)
           + mlp * (model.n_shared_experts > 0))
    ends = norm + (0 if model.tie_embeddings else 1) + np.where(single, 1, 0)
    return _OPS_OPT_TENSOR * (n_dense * (attn + mlp) + n_moe * moe + ends)


def host_overhead(ctx: ComputeContext, ops: Any) -> Any:
    """`ops · kernel_overhead`: the host's fixed cost per operation (Python, the dispatcher,
    autograd bookkeeping, the kernel launch). GPU presets: `kernel_overhead` = 5 µs
    (data/calibration.json; a CUDA launch plus framework dispatch is a few µs), with the fused
    kernel count; the "this machine" preset: the cost per aten op `shardwise calibrate`
    fits on the runtime's one-rank training steps, with the runtime's op count."""
    return ops * ctx.calibration.kernel_overhead


def _with_host(ctx: ComputeContext, device: Any, ops: Any) -> Any:
    """A pass's time given its device time and the host's `ops` launches: on a GPU the host
    runs ahead of the device (launches are asynchronous), so the slower of the two; on the
    "this machine" preset the CPU does both, one after the other."""
    host = host_overhead(ctx, ops)
    if ctx.calibration.op_count == "runtime":
        return device + host
    return np.maximum(device, host)



def dispatch_sync(ctx: ComputeContext) -> float:
    """Device time lost once per MoE layer forward (and its full-recompute replay) to the token
    dispatcher's blocking device→host copy of the routing counts, which the host needs to size
    the all-to-all and the grouped GEMMs: the device drains, the copy crosses the host link
    (its latency) and the host launches again (one `kernel_overhead`) before the device has
    work. Every dropless dispatcher blocks so: Megatron-Core 0.16.1's alltoall
    (`token_dispatcher.py`: `d2h_event.synchronize()` at `cuda_sync_point`: before the EP
    all-to-all, or later with ep = tp = 1), allgather (`.cpu()` of the counts) and flex
    (DeepEP returns the received counts as a host list, `fused_a2a.py`), torchtitan 0.3.0's
    (`.tolist()` of the splits, `token_dispatcher.py`). 0 on the "this machine" preset (no
    device to wait for), under a `moe` CUDA graph and for Megatron's alltoall padded to
    capacity (drop-and-pad: `cuda_sync_point` "no_sync", `ComputeContext.counts_sync`)."""
    if ctx.calibration.op_count == "runtime" or "moe" in ctx.cuda_graph or not ctx.counts_sync:
        return 0.0
    host = get_link(ctx.accelerator.host, ctx.accelerator.links)
    return host.latency + ctx.calibration.kernel_overhead
