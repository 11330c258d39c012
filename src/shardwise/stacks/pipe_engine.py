"""DeepSpeed's PipelineEngine as the step model charges it (`Stack.pipe_costs`), read from
deepspeed 0.19.8's runtime/pipe (schedule.py `TrainSchedule`, engine.py, p2p.py, utils.py
`PartitionedTensor`): 1F1B's order and peak in-flight micro-batches (the registry's "1f1b"),
but blocking sends in lock-step slots, TP all-gathers of the partitioned activations, the
tied weights' gradients all-reduced at the end, and BF16_Optimizer's gradient all-reduce.
`pipe_engine_time` gives the seconds per step beyond what `estimate.step` charges Megatron's
1F1B. Derivation: docs/concepts/stacks.md#deepspeeds-pipeline-engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError


@dataclass(frozen=True)
class PipeEngine:
    """A pipeline engine's costs as data (`PIPE_ENGINES`).

    * `schedule`: the registry schedule whose per-stage order its instruction stream runs;
    * `serial_p2p`: each step slot's gradient and activation transfers are separate blocking
      sends/receives in instruction order (DeepSpeed: `p2p.send` asserts `async_op == False`
      and calls `dist.send`), not one batched send+receive (Megatron's
      `send_forward_recv_backward`); critical-path transfers: `transfers`;
    * `sends_per_transfer_tp`: blocking sends per transfer with TP > 1 (the partition's meta
      tensor, then the 1/t shard: `_exec_send_activations`, `_exec_send_grads`);
    * `gathers`: TP all-gathers of the `(s, b, h)` boundary tensor per micro-batch on the
      first, a middle and the last stage with TP > 1 (`PartitionedTensor.full()`: the input in
      the forward; the output, cleared after the send, and the gradient in the backward);
    * `tied_grad_reduce`: tied weights' gradients all-reduced once per step after the last
      backward (`_exec_reduce_tied_grads`: the embedding shared by first and last stage);
    * `bf16_allreduce`: bf16 weights run BF16_Optimizer at ZeRO-1 with fp32 gradients and,
      under the pipeline, at ZeRO-0 with bf16 ones (engine.py `_do_optimizer_sanity_check`):
      `_exec_reduce_grads` all-reduces the gradients (`buffered_allreduce_fallback`) where
      ZeRO-1 reduce-scatters them, and it shards its fp32 state over the DP ranks, gathering
      the updated weights (`update_lp_params`) where ZeRO-0 gathers nothing;
    * `min_buffers`: pipe buffers per stage at least (`TrainSchedule.num_pipe_buffers`);
    * `mask`: the model code passes its `(1, 1, s, s)` attention mask along with each
      activation (`set_has_attention_mask(True)`: sent as fp16, one more send; not with the
      gradients, `_exec_send_grads` pops it).
    """

    name: str
    source: str
    schedule: str
    serial_p2p: bool
    sends_per_transfer_tp: int
    gathers: tuple[int, int, int]
    tied_grad_reduce: bool
    bf16_allreduce: bool
    min_buffers: int
    mask: bool = False

    def transfers(self, p: Any, m: Any) -> Any:
        """Blocking transfers on the critical path of one step at equal stage times (each
        `p2p` seconds). Serial: `2(p-1)` for one micro-batch, `2m` over two stages, else
        `4m + 2p - 8` — each steady-state slot waits for the neighbour's two transfers
        (checked against DeepSpeed's own instruction streams replayed with rendezvous
        sends, tests/schedules/test_deepspeed_pipe.py). Batched: `2(m + p - 1)`."""
        p, m = np.asarray(p), np.asarray(m)
        if not self.serial_p2p:
            return 2 * (m + p - 1)
        return np.where(p < 2, 0, np.where(m == 1, 2 * (p - 1),
                                           np.where(p == 2, 2 * m, 4 * m + 2 * p - 8)))

    def buffers(self, p: int, m: int, stage: int) -> int:
        """Pipe buffers on `stage`: the 1F1B in-flight count `min(p - stage, m)`, at least
        `min_buffers`."""
        return max(self.min_buffers, min(p - stage, m))

    def critical_gathers(self, p: Any) -> Any:
        """TP all-gathers per micro-batch on the stage with the most (`gathers`)."""
        first, _, last = self.gathers
        return np.where(np.asarray(p) > 2, max(self.gathers), max(first, last))


_DS = "deepspeed 0.19.8 runtime/pipe"
DEEPSPEED_PIPE = PipeEngine(
    "deepspeed", f"{_DS}/schedule.py TrainSchedule, engine.py _exec_*, p2p.py send/recv",
    schedule="1f1b", serial_p2p=True, sends_per_transfer_tp=2, gathers=(2, 3, 1),
    tied_grad_reduce=True, bf16_allreduce=True, min_buffers=2)

# GPT-NeoX (megatron/training.py: `model.set_has_attention_mask(True)` whenever
# pipe_parallel_size ≥ 1; megatron/utils.py get_attn_mask: (1, 1, s, s))
NEOX_PIPE = replace(DEEPSPEED_PIPE, name="deepspeed-neox", mask=True,
                    source=DEEPSPEED_PIPE.source + "; gpt-neox megatron/training.py "
                    "set_has_attention_mask @ea7aefd")

PIPE_ENGINES: dict[str, PipeEngine] = {e.name: e for e in (DEEPSPEED_PIPE, NEOX_PIPE)}
"""The pipeline engines whose costs differ from Megatron's 1F1B, by `Stack.pipe_costs`."""


def get_pipe_engine(name: str) -> PipeEngine:
    """The engine called `name`; one line when there is none."""
    if name not in PIPE_ENGINES:
        raise ShardwiseError(f"pipeline engine {name!r} unknown; valid: {', '.join(PIPE_ENGINES)}")
    return PIPE_ENGINES[name]


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
    from shardwise.estimate.links import group_collective_time, p2p_latency
    from shardwise.estimate.memory import bytes_per_param_training
    from shardwise.schedules.registry import SCHEDULE_CODES

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
