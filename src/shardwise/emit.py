"""Launch configuration of a layout for a real framework: go from the plan to a run.

    emit(framework, model, layout, train) -> Emitted(text, notes)

* `megatron` — Megatron-LM `pretrain_gpt.py` arguments (model shape, parallel degrees,
  virtual pipeline stages, sequence parallel, recompute, distributed optimizer / FSDP2),
* `torchtitan` — the `[training]`, `[parallelism]` and `[activation_checkpoint]` TOML sections,
* `deepspeed` — a DeepSpeed JSON config (batch, ZeRO stage, MiCS shard groups, precision,
  activation checkpointing); TP/PP degrees go to the Megatron-DeepSpeed launcher (in `notes`).

`notes` lists what the framework cannot express exactly (e.g. ZeRO-2 in Megatron-LM, ZB-H1 in
torchtitan), so the user knows where the run will differ from the plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")

__all__ = ["FRAMEWORKS", "Emitted", "deepspeed_config", "emit", "megatron_args",
           "torchtitan_toml"]


@dataclass(frozen=True)
class Emitted:
    """The configuration text and what it cannot express exactly."""

    framework: str
    text: str
    notes: tuple[str, ...] = ()


def _check(model: ModelSpec, layout: Layout, train: TrainSpec) -> int:
    layout.validate(model, train=train)
    if train.global_batch is None:
        raise ShardwiseError("emitting a launch configuration needs a global batch")
    return train.global_batch


def megatron_args(model: ModelSpec, layout: Layout, train: TrainSpec) -> Emitted:
    """Megatron-LM arguments (`pretrain_gpt.py`), one per line, for `layout`."""
    gb = _check(model, layout, train)
    notes: list[str] = []
    args: list[tuple[str, object]] = [
        ("--num-layers", model.n_layers), ("--hidden-size", model.d_model),
        ("--ffn-hidden-size", model.d_ff), ("--num-attention-heads", model.n_heads),
    ]
    if model.n_kv_heads != model.n_heads:
        args += [("--group-query-attention", None), ("--num-query-groups", model.n_kv_heads)]
    if model.gated_mlp:
        args.append(("--swiglu", None))
    if model.norm == "rmsnorm":
        args += [("--normalization", "RMSNorm")]
    if model.learned_positions:
        args.append(("--position-embedding-type", "learned_absolute"))
    else:
        args.append(("--position-embedding-type", "rope"))
    if not model.tie_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    if not model.bias:
        args.append(("--disable-bias-linear", None))
    if not model.dropout:
        args += [("--attention-dropout", 0.0), ("--hidden-dropout", 0.0)]
    if model.is_moe:
        args += [("--num-experts", model.n_experts), ("--moe-router-topk", model.top_k)]
        if model.d_ff_expert:
            args.append(("--moe-ffn-hidden-size", model.d_ff_expert))
    args += [("--seq-length", train.seq_len),
             ("--max-position-embeddings", max(train.seq_len, model.max_seq)),
             ("--micro-batch-size", layout.micro_batch), ("--global-batch-size", gb)]
    args += [("--tensor-model-parallel-size", layout.tp),
             ("--pipeline-model-parallel-size", layout.pp)]
    if layout.schedule == "interleaved":
        per_stage = model.n_layers // (layout.pp * layout.chunks)
        args.append(("--num-layers-per-virtual-pipeline-stage", per_stage))
    elif layout.schedule == "zb-h1":
        notes.append("ZB-H1 is not in Megatron-LM mainline (use the zero-bubble fork of Qi et "
                     "al. 2023); as emitted, Megatron runs 1F1B")
    elif layout.schedule == "gpipe":
        notes.append("Megatron-LM has no GPipe schedule; as emitted, it runs 1F1B")
    if layout.cp > 1:
        args.append(("--context-parallel-size", layout.cp))
    if layout.ep > 1:
        args.append(("--expert-model-parallel-size", layout.ep))
    if layout.sp:
        args.append(("--sequence-parallel", None))
    if layout.recompute == "selective":
        args.append(("--recompute-activations", None))
    elif layout.recompute == "full":
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", 1)]
    if layout.zero in (1, 2):
        args += [("--use-distributed-optimizer", None), ("--overlap-grad-reduce", None),
                 ("--overlap-param-gather", None)]
        if layout.zero == 2:
            notes.append("Megatron's distributed optimizer shards optimizer states (ZeRO-1); "
                         "gradients stay whole, so memory is ZeRO-1's")
        if layout.zero_group:
            args.append(("--num-distributed-optimizer-instances",
                         layout.dp * layout.cp // layout.zero_group))
    elif layout.zero == 3:
        args += [("--use-torch-fsdp2", None), ("--no-gradient-accumulation-fusion", None),
                 ("--ckpt-format", "torch_dist")]
        if layout.zero_group:
            notes.append("hybrid shard groups are not expressible with --use-torch-fsdp2; "
                         "FSDP shards over all data-parallel ranks")
    else:
        args.append(("--overlap-grad-reduce", None))
    args.append(("--fp16" if train.dtype == "fp16" else "--bf16", None))
    if train.dtype not in ("bf16", "fp16"):
        notes.append(f"dtype {train.dtype} emitted as --bf16")
    if train.grad_dtype == "fp32":
        args.append(("--accumulate-allreduce-grads-in-fp32", None))
    if train.flash_attention:
        args += [("--attention-backend", "flash")]
    lines = [f"# shardwise: {model.name}, {layout.short()}, s={train.seq_len}, "
             f"global batch {gb} sequences"]
    for i, (flag, value) in enumerate(args):
        text = flag if value is None else f"{flag} {value}"
        lines.append(text + (" \\" if i < len(args) - 1 else ""))
    return Emitted("megatron", "\n".join(lines) + "\n", tuple(notes))


_TITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe",
                    "zb-h1": "InterleavedZeroBubble"}


def torchtitan_toml(model: ModelSpec, layout: Layout, train: TrainSpec) -> Emitted:
    """torchtitan job-config TOML sections for `layout` (FSDP2 degrees from the ZeRO stage)."""
    gb = _check(model, layout, train)
    notes: list[str] = []
    replicas = layout.dp * layout.cp
    if layout.zero == 0:
        replicate, shard = layout.dp, 1
    elif layout.zero_group and layout.zero_group % layout.cp == 0:
        shard = layout.zero_group // layout.cp
        replicate = layout.dp // shard
    else:
        replicate, shard = 1, layout.dp
        if layout.zero_group:
            notes.append(f"zero_group={layout.zero_group} is not a multiple of cp={layout.cp}; "
                         "emitted as full sharding")
    reshard = "default"
    if layout.zero in (1, 2):
        reshard = "never"
        notes.append(f"torchtitan has no ZeRO-{layout.zero}: FSDP2 without resharding after "
                     "forward keeps ZeRO-2's traffic but holds each layer's full weights from "
                     "its forward to its backward")
    lines = [f"# shardwise: {model.name}, {layout.short()}, {replicas} data-parallel replicas",
             "[training]",
             # without pp, local_batch_size is the micro-batch and torchtitan accumulates
             # gradients up to global_batch_size; with pp, the pipeline splits it
             f"local_batch_size = {gb // layout.dp if layout.pp > 1 else layout.micro_batch}",
             f"global_batch_size = {gb}", f"seq_len = {train.seq_len}",
             f'mixed_precision_param = "{"bfloat16" if train.dtype == "bf16" else "float32"}"',
             "", "[parallelism]",
             f"data_parallel_replicate_degree = {replicate}",
             f"data_parallel_shard_degree = {shard}",
             f'fsdp_reshard_after_forward = "{reshard}"',
             f"tensor_parallel_degree = {layout.tp}",
             f"pipeline_parallel_degree = {layout.pp}",
             f"context_parallel_degree = {layout.cp}",
             f"expert_parallel_degree = {layout.ep}"]
    if layout.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{_TITAN_SCHEDULES[layout.schedule]}"',
                  f"pipeline_parallel_microbatch_size = {layout.micro_batch}",
                  f"pipeline_parallel_layers_per_stage = "
                  f"{model.n_layers // (layout.pp * layout.chunks)}"]
        if layout.schedule == "zb-h1":
            notes.append("ZB-H1 maps to PyTorch's InterleavedZeroBubble, which needs more than "
                         "one stage per rank: set pipeline_parallel_layers_per_stage to half "
                         "the layers per rank, or use 1F1B")
    if layout.tp > 1 and not layout.sp:
        notes.append("torchtitan's tensor parallelism always shards the sequence (SP)")
    mode = {"none": "none", "selective": "selective", "full": "full"}[layout.recompute]
    lines += ["", "[activation_checkpoint]", f'mode = "{mode}"']
    if layout.recompute == "selective":
        lines.append('selective_ac_option = "op"')
    return Emitted("torchtitan", "\n".join(lines) + "\n", tuple(notes))


def deepspeed_config(model: ModelSpec, layout: Layout, train: TrainSpec) -> Emitted:
    """A DeepSpeed JSON config for `layout`; the TP/PP/SP launcher flags are in `notes`."""
    gb = _check(model, layout, train)
    notes: list[str] = []
    m = layout.microbatches(train)
    zero: dict[str, object] = {"stage": layout.zero, "overlap_comm": True,
                               "contiguous_gradients": True,
                               "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    if layout.zero == 3:
        zero.update({"stage3_prefetch_bucket_size": int(5e8),
                     "stage3_param_persistence_threshold": int(1e6)})
        if layout.zero_group:
            zero.update({"mics_shard_size": layout.zero_group,
                         "mics_hierarchical_params_gather": False})
    elif layout.zero_group:
        notes.append(f"DeepSpeed has hybrid shard groups (MiCS) for ZeRO-3 only; ZeRO-"
                     f"{layout.zero} shards over all {layout.dp * layout.cp} replicas")
    config: dict[str, object] = {
        "train_batch_size": gb,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": m,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if train.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    else:
        config["bf16"] = {"enabled": True}
    if train.grad_dtype == "fp32":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if layout.recompute != "none":
        config["activation_checkpointing"] = {
            "partition_activations": layout.tp > 1, "contiguous_memory_optimization": False,
            "cpu_checkpointing": False, "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False, "profile": False}
    launcher = [f"--tensor-model-parallel-size {layout.tp}",
                f"--pipeline-model-parallel-size {layout.pp}"]
    if layout.sp:
        launcher.append("--sequence-parallel")
    if layout.recompute == "full":
        launcher += ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]
    elif layout.recompute == "selective":
        launcher.append("--recompute-activations")
    if layout.pp > 1 or layout.tp > 1:
        notes.append("launch with Megatron-DeepSpeed: " + " ".join(launcher))
    if layout.pp > 1 and layout.zero >= 2:
        notes.append("DeepSpeed's pipeline engine supports ZeRO-1 only; ZeRO-"
                     f"{layout.zero} with pp={layout.pp} needs ZeRO-1 there")
    if layout.schedule not in ("1f1b",) and layout.pp > 1:
        notes.append(f"DeepSpeed's pipeline engine runs 1F1B; {layout.schedule} is not available")
    if layout.cp > 1:
        notes.append("DeepSpeed's sequence parallelism is Ulysses (all-to-all), not ring "
                     f"attention: set sequence_parallel_size={layout.cp} in the model code")
    if layout.ep > 1:
        notes.append(f"expert parallelism: deepspeed.moe.layer.MoE(ep_size={layout.ep})")
    return Emitted("deepspeed", json.dumps(config, indent=2) + "\n", tuple(notes))


def emit(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec) -> Emitted:
    """The launch configuration of `layout` for `framework` (one of `FRAMEWORKS`)."""
    table = {"megatron": megatron_args, "torchtitan": torchtitan_toml,
             "deepspeed": deepspeed_config}
    key = framework.lower()
    if key not in table:
        raise ShardwiseError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    return table[key](model, layout, train)
