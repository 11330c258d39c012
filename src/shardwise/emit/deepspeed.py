"""DeepSpeed 0.19.8 JSON config (batch, ZeRO stage, precision, gradient accumulation and
communication dtypes, overlap) and, as the first note, the Megatron-DeepSpeed (4efb479)
`pretrain_gpt.py` launch line. Tested against DeepSpeed's own config classes and
Megatron-DeepSpeed's argument parser (tests/integration/test_deepspeed.py)."""

from __future__ import annotations

import json

from shardwise.arch import ModelSpec
from shardwise.emit.common import Emitted, _checked, _header, _nodes, _vocab_divisor
from shardwise.emit.launchers import Launch
from shardwise.emit.megatron_run import megatron_optimizer
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec


def _deepspeed_launch(model: ModelSpec, layout: Layout, train: TrainSpec, gb: int) -> list[str]:
    """Megatron-DeepSpeed `pretrain_gpt.py` arguments (megatron/arguments.py @4efb479) for
    the model, the degrees, the schedule, recompute, precision and attention."""
    ffn = model.expert_d_ff if model.is_moe and not model.n_dense_layers else model.d_ff
    args = [f"--num-layers {model.n_layers}", f"--hidden-size {model.d_model}",
            f"--ffn-hidden-size {ffn}", f"--num-attention-heads {model.n_heads}",
            f"--num-key-value-heads {model.n_kv_heads}",
            f"--seq-length {train.seq_len}",
            f"--max-position-embeddings {max(train.seq_len, model.max_seq)}",
            f"--make-vocab-size-divisible-by {_vocab_divisor(model, layout.tp)}",
            "--normalization " + ("rmsnorm" if model.norm == "rmsnorm" else "layernorm")]
    if model.gated_mlp:
        args.append("--swiglu")
    if not model.learned_positions:
        args += ["--use-rotary-position-embeddings", "--no-position-embedding",
                 f"--rotary-position-embeddings-theta {int(model.rope_theta)}"]
        if model.rotary_percent != 1.0:
            args.append(f"--rotary-percent {model.rotary_percent:g}")
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.bias:
        args.append("--disable-bias-linear")
    if not model.dropout:
        args += ["--attention-dropout 0.0", "--hidden-dropout 0.0"]
    args += _deepspeed_moe(model, layout, train)
    args += [f"--micro-batch-size {layout.micro_batch}", f"--global-batch-size {gb}",
             f"--tensor-model-parallel-size {layout.tp}",
             f"--pipeline-model-parallel-size {layout.pp}", f"--zero-stage {layout.zero}"]
    if layout.pp == 1:  # DeepSpeedEngine, not the pipeline engine (which refuses ZeRO-2/3)
        args.append("--no-pipeline-parallel")
    elif layout.schedule == "zb-h1":
        args.append("--enable-zbh1-pipeline")
    if layout.sp:
        args.append("--sequence-parallel")
    if layout.cp > 1:
        args.append(f"--ds-sequence-parallel-size {layout.cp}")
    if layout.recompute == "full":
        args.append("--recompute-granularity full")
        if train.recompute_share == 1:
            args += ["--recompute-method uniform", "--recompute-num-layers 1"]
    elif layout.recompute == "selective":
        args.append("--recompute-activations")
    args += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[train.dtype]
    args += _deepspeed_run(model, layout, train)
    if train.settings().attention == "fa2":
        args.append("--use-flash-attn-v2")
    return [*args, "--deepspeed", "--deepspeed_config ds_config.json"]


def _deepspeed_run(model: ModelSpec, layout: Layout, train: TrainSpec) -> list[str]:
    """The run settings a megatron-deepspeed plan accepts, as Megatron-DeepSpeed 4efb479
    runs them: the optimizer (`emit.megatron_run.megatron_optimizer`), a share of layers
    fully recomputed as `--recompute-method block` (ParallelTransformer checkpoints its first
    N layers; exact without the pipeline engine, where one module holds them all). Refused
    in one line: Megatron-Core's memory settings it lacks, DeepEP's SMs, MTP."""
    args = megatron_optimizer(train, "deepspeed")
    mtp = model.mtp_layers if train.mtp_layers is None else train.mtp_layers
    core = [name for name in ("recompute_modules", "exp_avg_dtype", "exp_avg_sq_dtype",
                              "main_params_dtype") if getattr(train, name) is not None]
    core += [name for name in ("act_fp8_store", "offload_modules") if getattr(train, name)]
    for field, bad, why in (
            (", ".join(core), bool(core), "Megatron-Core settings (--recompute-modules, the "
             "precision-aware optimizer, --activation-func-fp8-input-store, fine-grained "
             "activation offloading) that Megatron-DeepSpeed 4efb479 does not have"),
            (f"comm_sms {train.comm_sms}", model.is_moe and train.comm_sms is not None,
             "DeepSpeed-MoE's all-to-all is NCCL's, with no SM setting"),
            (f"mtp_layers {mtp}", bool(mtp), "Megatron-DeepSpeed builds no multi-token-"
             "prediction module")):
        if bad:
            raise ShardwiseError(f"--emit deepspeed cannot run {field} as planned: {why}")
    if layout.recompute == "full" and train.recompute_share != 1:
        count = train.recompute_share * model.n_layers
        if layout.pp > 1 or abs(count - round(count)) > 1e-9:
            raise ShardwiseError(
                f"--emit deepspeed cannot run recompute_share {train.recompute_share:g} as "
                "planned: Megatron-DeepSpeed's --recompute-method block recomputes a whole "
                "number of each module's first layers, exact here only without pipeline "
                f"stages and with share·{model.n_layers} layers whole")
        args += ["--recompute-method block", f"--recompute-num-layers {round(count)}"]
    return args


def _deepspeed_moe(model: ModelSpec, layout: Layout, train: TrainSpec) -> list[str]:
    """DeepSpeed-MoE as Megatron-DeepSpeed builds it (megatron/model/transformer.py:1066-1083
    @4efb479), dropless as planned: `--disable-moe-token-dropping` (capacity = the busiest
    expert's count, sharded_moe.py), the second expert chosen by the scores, not Gumbel-sampled
    (`--disable-moe-top2-2nd-expert-sampling`), experts split over tp like the dense MLP
    (`--enable-expert-tensor-parallelism`, etp = tp), and the MoE parameter group ZeRO 1/2
    assert on (`--create-moe-param-group`, stage_1_and_2.py `_configure_moe_settings`)."""
    if not model.is_moe:
        return []
    args = [f"--num-experts {model.n_experts}", f"--expert-interval {model.moe_every}",
            f"--topk {model.top_k}", f"--moe-expert-parallel-size {layout.ep}",
            "--create-moe-param-group"]
    # dropless, or the planned capacity factor (sharded_moe.py: each expert's buffer holds
    # factor·k·T/E rows, the all-to-all sends them all)
    args.append("--disable-moe-token-dropping" if train.moe_capacity is None
                else f"--moe-train-capacity-factor {train.moe_capacity:g}")
    if model.top_k == 2:
        args.append("--disable-moe-top2-2nd-expert-sampling")
    if layout.tp > 1:
        args.append("--enable-expert-tensor-parallelism")
    return args


def _deepspeed_offload(train: TrainSpec, zero: dict[str, object]) -> None:
    """ZeRO-Offload (`offload_optimizer`) and ZeRO-Infinity's parameter offload
    (`offload_param`, with the optimizer) to pinned CPU memory, in `zero_optimization`
    (deepspeed/runtime/zero/offload_config.py). FP8: DeepSpeed's stack here has none (one
    line, `Stack.fp8_recipe`)."""
    if train.fp8 is not None:
        train.stack.fp8_recipe(train.fp8)
    support = train.stack.offload_support(train.offload)
    if support is None:
        return
    cpu = {"device": "cpu", "pin_memory": True}
    zero["offload_optimizer"] = dict(cpu)
    if support.kind == "params":
        zero["offload_param"] = dict(cpu)


def deepspeed_config(model: ModelSpec, layout: Layout, train: TrainSpec,
                     gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """A DeepSpeed 0.19.8 JSON config for `layout`; the Megatron-DeepSpeed launch line is the
    first note (the tokenizer and data are the user's: its vocabulary must be the plan's V)."""
    gb, grad = _checked("deepspeed", model, layout, train, cluster, gpus_per_node)
    zero: dict[str, object] = {"stage": layout.zero,
                               "overlap_comm": bool(train.settings().dp_overlapped(layout.zero)),
                               "contiguous_gradients": True,
                               "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    if layout.zero == 3:
        zero.update({"stage3_prefetch_bucket_size": int(5e8),
                     "stage3_param_persistence_threshold": int(1e6)})
    _deepspeed_offload(train, zero)
    config: dict[str, object] = {
        "train_batch_size": gb,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.microbatches(train),
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "data_types": {"grad_accum_dtype": grad},
        "communication_data_type": grad,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if train.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif train.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    nodes, per_node = _nodes(layout, gpus_per_node)
    # Megatron-DeepSpeed raises without it under SP (megatron/arguments.py:403 @4efb479)
    env = "CUDA_DEVICE_MAX_CONNECTIONS=1 " if layout.sp else ""
    notes = [f"launch (Megatron-DeepSpeed 4efb479): {env}deepspeed --num_nodes {nodes} "
             f"--num_gpus {per_node} pretrain_gpt.py "
             + " ".join(_deepspeed_launch(model, layout, train, gb))]
    if env and nodes > 1:
        notes.append("on the other nodes CUDA_DEVICE_MAX_CONNECTIONS=1 comes from "
                     ".deepspeed_env (the launcher forwards only its listed variables, "
                     "deepspeed/launcher/runner.py:36)")
    text = json.dumps(config, indent=2) + "\n"
    # under torchrun (the launchers) DeepSpeed reads RANK, LOCAL_RANK and MASTER_ADDR from the
    # environment torchrun sets (deepspeed/comm/comm.py init_distributed)
    launch = Launch(nodes, per_node, ("CUDA_DEVICE_MAX_CONNECTIONS=1",) if layout.sp else (),
                    ("pretrain_gpt.py",), tuple(_deepspeed_launch(model, layout, train, gb)),
                    _header("deepspeed", model, layout, train, gb), {"ds_config.json": text})
    return Emitted("deepspeed", text, tuple(notes), launch)

