"""What one rank keeps, predicted: a layer's saved activations (SPEC §3's generalised count),
the training state per rank (SPEC §2), the peak, and one checkpoint's tensors and write
time."""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.estimate.check.rows import (
    EXACT,
    REPORTED,
    RUNTIME_IMPL,
    CheckRow,
)
from shardwise.estimate.check.traffic import _padded, zero_units
from shardwise.estimate.goodput import (
    checkpoint_bytes,
    checkpoint_bytes_per_param,
    checkpoint_writes,
)
from shardwise.estimate.memory import (
    activation_bytes_per_layer,
    bytes_per_param_training,
    saved_tensors_per_layer,
    stage_params,
    training_memory_per_gpu,
)
from shardwise.layout import Layout, TrainSpec
from shardwise.units import dtype_bytes


def predicted_saved(model: ModelSpec, layout: Layout, train: TrainSpec, moe: bool
                     ) -> tuple[float, float | None, float]:
    """Bytes one layer saves per micro-batch on one rank (SPEC §3's generalised count): the
    layer without its MoE block, the MoE block (None for a dense layer, or under full
    recompute, which keeps the layer input only), and the bytes the count keeps per row an
    expert runs (its input, gate, up and down-projection input; 0 for a dense layer)."""
    t, c, rc = layout.tp, layout.cp, layout.recompute
    s, b, sp = train.seq_len, layout.micro_batch, layout.sp and layout.tp > 1
    if rc == "full":
        return activation_bytes_per_layer(model, s, b, tp=t, sp=sp, cp=c, recompute=rc,
                                          dtype=train.dtype, impl=train.profile), None, 0.0
    saved = saved_tensors_per_layer(model, s, b, tp=t, sp=sp, cp=c, flash=train.flash_attention,
                                    selective=rc == "selective",
                                    dtype_bytes_=dtype_bytes(train.dtype), moe=moe,
                                    impl=train.profile, a2a=layout.ulysses_degree)
    in_moe = {name for name in saved if name == "mlp_input"
              or name.startswith(("router_", "expert_", "shared_"))} if moe else set()
    per_row = sum(saved[name] for name in ("expert_inputs", "expert_gate", "expert_up",
                                           "expert_activation_input", "expert_down_input")
                  if name in saved) / (model.top_k * s / c * b) if moe else 0.0
    return (sum(v for name, v in saved.items() if name not in in_moe),
            sum(saved[name] for name in in_moe) if moe else None, per_row)


def activation_note(row: CheckRow, layout: Layout, train: TrainSpec,
                    model: ModelSpec | None = None) -> list[str]:
    """Why an activation row differs: the runtime facts that make it differ, with their size."""
    if row.error == 0 or layout.recompute == "full":
        return []
    notes = []
    c, ab = layout.cp, dtype_bytes(train.dtype)
    if (model is not None and ab < 4 and train.impl == RUNTIME_IMPL
            and not row.what.endswith("MoE")):  # (the router's probabilities are fp32 in both)
        # the count keeps statistics in fp32, as the runtime's RMSNorm and CPU flash kernel
        # do; its reference kernel off the CPU keeps the log-sum-exp in bf16
        rows = train.seq_len / c * layout.micro_batch
        lse = (max(model.n_heads // layout.tp, 1) * rows
               if train.flash_attention and layout.recompute != "selective" else 0)
        if lse:
            notes.append(f"{train.dtype}: the runtime keeps attention's log-sum-exp in "
                         f"{train.dtype} off the CPU, the count in fp32: "
                         f"−{lse * (4 - ab):,.0f} B")
    if c > layout.ulysses_degree:  # ring attention (the hybrid's too)
        notes.append(f"ring attention also saves the zigzag token positions, (c, s/c) int64: "
                     f"+{8 * train.seq_len:,} B")
        if not train.flash_attention:
            notes.append("ring attention keeps its output and log-sum-exp, never the scores")
    return notes


def state_rows(model: ModelSpec, layout: Layout, train: TrainSpec, stage: int,
                measured: dict[str, int]) -> list[CheckRow]:
    """Weights, gradients, fp32 master weights (mixed precision) and optimizer moments one rank
    holds after a step (SPEC §2: bf16 + bf16 grads + Adam = 2 + 2 + 4 + 8 B/param). Under ZeRO
    each flat unit is padded to a multiple of its shard group (`zero_units`), and the
    gradients held after the step are the reduce-scattered shard on every stage (ZeRO-1 holds
    the full gradients only from backward until they are reduce-scattered at the step)."""
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    dense, experts = stage_params(model, layout, stage)
    n = layout.zero_degree
    note = (f"{dense:,.0f} dense + {experts:,.0f} expert params; "
            f"{state.weight:g}/{state.grad:g}/{state.master:g}/{state.moments:g} B per param "
            "(weights/grads/master/moments)")
    if layout.zero:
        units = zero_units(model, layout, stage)
        full = sum(_padded(u, k) for u, k, _ in units)
        shard = sum(_padded(u, k) // k for u, k, _ in units)
        predicted = (state.weight * (shard if layout.zero == 3 else full),
                     state.grad * shard, state.master * shard, state.moments * shard)
        note += (f", ZeRO-{layout.zero} over {n}: {len(units)} flat units padded to "
                 f"{full:,} elements, {shard:,} per shard; gradients held after the step: "
                 "the shard")
    else:
        params = dense + experts  # unsharded: every rank holds its whole share
        predicted = (state.weight * params, state.grad * params, state.master * params,
                     state.moments * params)
    notes = {"master": "fp32 master copies of the bf16 weights (mixed precision; none when "
                       "the weights are fp32 or wider)",
             "optimizer": "AdamW's two moments"}
    return [CheckRow("state", name, predicted[i], measured[name], EXACT,
                     f"{notes[name]}; {note}" if name in notes else note)
            for i, name in enumerate(("weights", "grads", "master", "optimizer"))]


def peak_row(model: ModelSpec, layout: Layout, train: TrainSpec, stage: int,
             measured: float | None) -> CheckRow:
    """The peak-memory row of `stage`: the modelled peak against `max_memory_allocated`
    (reported, no target; None on CPU)."""
    breakdown = training_memory_per_gpu(model, layout, train)[stage]
    predicted = breakdown.peak  # held memory + the largest transient (MemoryBreakdown.peak)
    if measured is None:
        return CheckRow("peak memory", "max_memory_allocated", predicted, None, REPORTED,
                        "no GPU: this run is on CPU (gloo), whose allocator cannot report "
                        f"a peak; modelled peak from {breakdown.peak_term}")
    return CheckRow("peak memory", "max_memory_allocated", predicted, measured, REPORTED,
                    "allocator peak: the model's state and activations plus transient buffers "
                    f"(modelled: {breakdown.peak_transient or 'none'}; not modelled: collective "
                    "and recompute buffers, fragmentation); CUDA context excluded")


def checkpoint_rows(model: ModelSpec, layout: Layout, train: TrainSpec,
                    measured: dict[str, float]) -> list[CheckRow]:
    """One checkpoint of the run (`runtime.saving.measure_checkpoint`) against
    `estimate.goodput`: its weights, fp32 masters and moments (exact: `P ×` the stack's bytes
    per parameter), its other tensors, the busiest rank's file, the bytes on disk (reported),
    and the write time this machine's measured disk bandwidth predicts for the whole
    checkpoint (reported: one machine writes every rank's share)."""
    per_param = checkpoint_bytes_per_param(train, layout.zero)
    whole = checkpoint_bytes(model, train, layout.zero)
    rank = float(checkpoint_writes(model, layout.world_size, train, **layout.codes(),
                                   partition=layout.partition)[0])
    bandwidth = measured["bandwidth"]
    return [
        CheckRow("checkpoint", "weights, masters, moments (bytes)", whole, measured["state"],
                 EXACT, f"{model.count_params().total:,} params × {per_param:g} B "
                 f"({train.dtype}, the {train.impl} runtime's format); measured: the chunks "
                 "DCP's .metadata lists, each once"),
        CheckRow("checkpoint", "step counters, RNG (bytes)", None, measured["other"], REPORTED,
                 "AdamW's step count per parameter and the CPU generator's state: outside "
                 "the per-parameter model"),
        CheckRow("checkpoint", "busiest rank's file (bytes)", rank,
                 measured["busiest_rank_bytes"], REPORTED,
                 "predicted: an even share of its stage (DCP gives each replicated chunk to "
                 "the rank with the least planned so far); measured: its .distcp file, "
                 "torch.save's framing of every chunk included"),
        CheckRow("checkpoint", "on disk (bytes)", None, measured["disk_bytes"], REPORTED,
                 "every file: the tensors in torch.save framing, DCP's .metadata, "
                 "shardwise.json and the checksum manifest"),
        CheckRow("checkpoint", "write (s)", whole / bandwidth, measured["seconds"], REPORTED,
                 f"predicted: the tensors ÷ this disk's {bandwidth / 1e6:,.0f} MB/s "
                 f"({measured['disk_test_bytes'] / 2**20:g} MiB written and fsync'ed into the "
                 "same directory just before); measured: the "
                 "whole save, with DCP's planning and serialisation, the manifest's SHA-256 "
                 "of every file, the fsyncs and the atomic publish"),
    ]
