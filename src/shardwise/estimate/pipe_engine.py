"""The seconds DeepSpeed's PipelineEngine adds to a step (`stacks.pipe_engine` holds the
engine as data, read from deepspeed 0.19.8's runtime/pipe). Derivation:
docs/concepts/stacks.md#deepspeeds-pipeline-engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.estimate.links import group_collective_time, p2p_latency
from shardwise.estimate.memory import bytes_per_param_training
from shardwise.schedules.registry import SCHEDULE_CODES
from shardwise.stacks.pipe_engine import get_pipe_engine

__all__ = ["pipe_engine_time"]


def pipe_engine_time(stack: Any, ctx: Any, links: Any, train: Any, *, t: Any, p: Any, c: Any,
                     b: Any, m: Any, zero: Any, schedule: Any, p2p: Any, pp_intra: Any,
                     tp_in_node: Any, params: Any, replicas: Any, dp_in_node: Any
                     ) -> tuple[Any, Any]:
    """(pipeline, data-parallel) seconds per step that `stack`'s pipeline engine adds to the
    batched 1F1B `estimate.step` charges, for layouts as numbers or arrays (zero where the
    stack has no `pipe_costs`, `p = 1`, or another schedule):

        pp += (transfers - 2(m+p-1))·p2p + [t>1]·(sends-1)·transfers·α_p2p
              + [mask]·transfers/2·(α_p2p + 2s²/β_p2p)
              + [t>1]·(m+p-1)·gathers·AG_t(s/c·b·h)  + [tied]·AR_2(V·h/t · grad bytes)
        dp += [ZeRO-1, bf16, fp32 grads]·(AR - RS)(grads)  + [ZeRO-0, bf16]·AG(weights)

    over the dp·cp replicas (BF16_Optimizer; no offload). `p2p`: one transfer's seconds;
    `params`: the busiest stage's parameters per rank.
    The gathers stretch every slot, so they count `m + p - 1` times like the compute."""
    if stack.pipe_costs is None:
        return 0.0 * t, 0.0 * t
    engine = get_pipe_engine(stack.pipe_costs)
    model = ctx.model
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    runs = (np.asarray(p) > 1) & (np.asarray(schedule) == SCHEDULE_CODES[engine.schedule])
    slots = m + p - 1
    tensor_parallel = np.asarray(t) > 1
    lat = p2p_latency(links, np.where(pp_intra, links.intra_lat, links.inter_lat))
    transfers = engine.transfers(p, m)
    pp = (transfers - 2 * slots) * p2p + np.where(
        tensor_parallel, (engine.sends_per_transfer_tp - 1) * transfers * lat, 0.0)
    boundary = ctx.seq_len / c * b * model.d_model * ctx.act_bytes
    if engine.mask:  # half the transfers carry activations; β from `p2p` and its bytes
        per_byte = (p2p - lat) / (boundary / t)
        pp = pp + transfers / 2 * (lat + 2.0 * ctx.seq_len ** 2 * per_byte)
    gather = group_collective_time("all-gather", boundary, t, np.minimum(tp_in_node, t), links)
    pp = pp + np.where(tensor_parallel, slots * engine.critical_gathers(p) * gather, 0.0)
    if engine.tied_grad_reduce and model.tie_embeddings:
        tied = model.vocab * model.d_model / t * state.grad
        pp = pp + group_collective_time("all-reduce", tied, 2, np.where(pp_intra, 2, 1), links)
    dp = 0.0 * t
    if engine.bf16_allreduce and train.dtype == "bf16" and train.offload == "none":
        grads, weights = params * state.grad, params * state.weight
        fp32_grads = (train.grad_dtype or train.dtype) == "fp32"
        # ZeRO-1, fp32 gradients: all-reduced where ZeRO-1 reduce-scatters; ZeRO-0, bf16
        # gradients: BF16_Optimizer still shards its fp32 state and all-gathers the weights
        z1 = (group_collective_time("all-reduce", grads, replicas, dp_in_node, links)
              - group_collective_time("reduce-scatter", grads, replicas, dp_in_node, links))
        z0 = group_collective_time("all-gather", weights, replicas, dp_in_node, links)
        zero = np.asarray(zero)
        dp = np.where(np.asarray(replicas) > 1, np.where(zero == 1, z1 if fp32_grads else 0.0,
                                                         np.where(zero == 0, z0, 0.0)), 0.0)
    return np.where(runs, pp, 0.0), np.where(runs, dp, 0.0)
