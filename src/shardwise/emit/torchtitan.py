"""torchtitan 0.3.0: `torchrun -m torchtitan.train --module … --config …` plus
`--section.key value` overrides and the `activation-checkpoint:<mode>` subcommand, for the
models torchtitan ships. Tested against torchtitan's own config parser
(tests/integration/test_torchtitan.py)."""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.emit.common import Emitted, _checked, _header, _launched
from shardwise.emit.models import _TITAN_CONFIGS, TITAN_ATTENTION
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules.registry import get_schedule
from shardwise.stacks import titan_partition

# `Layout.recompute` as torchtitan's activation-checkpoint subcommand
# (distributed/activation_checkpoint.py): op-sac is SelectiveAC ("selective").
_TITAN_RECOMPUTE = {"none": "none", "full": "full", "op-sac": "selective"}


def _titan_fp8_offload(config: str, train: TrainSpec, notes: list[str]) -> list[str]:
    """FSDP2 CPU offload (`--training.enable_cpu_offload`) and FP8: torchtitan 0.3 applies
    Float8 through a config_registry function's `model_registry(converters=…)`, not a flag;
    llama3_405b's is `Float8LinearConverter.Config(filter_fqns=["lm_head"])` (rowwise, the
    head in bf16). Another recipe or config: one line."""
    args = ["--training.enable_cpu_offload"] if train.offload == "params" else []
    train.stack.offload_support(train.offload)  # one line when torchtitan has no such offload
    if train.fp8 is None:
        return args
    train.stack.fp8_recipe(train.fp8)
    if config != "llama3_405b" or train.fp8 != "rowwise":
        raise ShardwiseError(
            f"torchtitan 0.3 turns on FP8 ({train.fp8}) in a config function "
            "(model_registry(..., converters=[Float8LinearConverter.Config(recipe_name=…)])), "
            "not on the command line; only its llama3_405b config has one (rowwise): write "
            "your own, or emit for Megatron-LM")
    notes.append("llama3_405b's Float8 converter leaves lm_head in bf16 (filter_fqns); the "
                 "plan charged the head's GEMMs in FP8")
    return args


def _titan_refusals(model: ModelSpec, train: TrainSpec) -> None:
    """The run settings a torchtitan plan accepts that torchtitan 0.3.0's command line cannot
    set, each refused in one line: the optimizer (`OptimizersContainer.Config.param_groups`,
    AdamW in its configs), the MoE dispatcher (`model_registry(moe_comm_backend=…)`,
    models/common/config_utils.py `make_token_dispatcher_config`), a padded capacity factor
    (its all-to-all and DeepEP dispatchers are dropless), DeepEP's SMs, multi-token
    prediction (`model_registry(num_mtp_layers=…)`, 0 in every config but the debug model's)
    and a share of layers under full
    recompute (0.3.0's activation checkpointing is FullAC, SelectiveAC per op or
    MemoryBudgetAC: no every-n-th-block option)."""
    mtp = model.mtp_layers if train.mtp_layers is None else train.mtp_layers
    for field, bad, why in (
            (f"optimizer {train.optimizer}", train.optimizer != "adam",
             "its optimizer is set in a config function's param_groups (AdamW), not on the "
             "command line"),
            (f"moe_dispatcher {train.moe_dispatcher}", model.is_moe and train.moe_dispatcher
             not in (None, "alltoall"), "the token dispatcher is a config function's "
             "model_registry(moe_comm_backend=…), not a command-line option"),
            (f"moe_capacity {train.moe_capacity}", model.is_moe and train.moe_capacity is not
             None, "its all-to-all and DeepEP dispatchers are dropless; no padded capacity"),
            (f"comm_sms {train.comm_sms}", model.is_moe and train.comm_sms is not None,
             "it has no setting for the SMs of the expert-parallel kernels"),
            (f"mtp_layers {mtp}", bool(mtp), "torchtitan 0.3 builds multi-token-prediction "
             "modules only through a config function (deepseek_v3 model_registry("
             "num_mtp_layers=…)), and its shipped configs build none: plan with "
             "--mtp-num-layers 0"),
            (f"recompute_share {train.recompute_share:g}", train.recompute_share != 1,
             "0.3.0's activation checkpointing has no every-n-th-block mode (full, per-op "
             "selective or memory budget)")):
        if bad:
            raise ShardwiseError(f"--emit torchtitan cannot run {field} as planned: {why}")


def torchtitan_args(model: ModelSpec, layout: Layout, train: TrainSpec,
                    gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """torchtitan 0.3.0 `torchrun -m torchtitan.train` command line for `layout`.

    FSDP2 wraps every run (models/llama3/parallelize.py): ZeRO-0 replicates
    (`data_parallel_replicate_degree`), ZeRO-2/3 shard over the group and reshard after
    forward never / always, HSDP across the groups; gradients reduce in float32.
    """
    gb, _ = _checked("torchtitan", model, layout, train, cluster, gpus_per_node)
    _titan_refusals(model, train)
    module, config = _TITAN_CONFIGS[model.name]
    group = (layout.zero_group or layout.dp * layout.cp) if layout.zero else layout.cp
    shard = group // layout.cp
    replicate = layout.dp // shard
    # Without pp, local_batch_size is the micro-batch and torchtitan accumulates gradients up
    # to global_batch_size; with pp, one local batch is split into pipeline micro-batches.
    local = gb // layout.dp if layout.pp > 1 else layout.micro_batch
    precision = "bfloat16" if train.dtype == "bf16" else "float32"
    settings = train.settings()
    args = [f"--module {module}", f"--config {config}",
            f"--training.local_batch_size {local}", f"--training.global_batch_size {gb}",
            f"--training.seq_len {train.seq_len}",
            f"--training.mixed_precision_param {precision}",
            "--training.mixed_precision_reduce float32"]
    if layout.pp > 1 or layout.ep > 1:
        args.append("--training.disable_cuda_graphs")
    args += [f"--parallelism.data_parallel_replicate_degree {replicate}",
             f"--parallelism.data_parallel_shard_degree {shard}",
             "--parallelism.fsdp_reshard_after_forward "
             + ("always" if layout.zero == 3 else "never"),
             f"--parallelism.tensor_parallel_degree {layout.tp}",
             f"--parallelism.pipeline_parallel_degree {layout.pp}",
             f"--parallelism.context_parallel_degree {layout.cp}",
             f"--parallelism.expert_parallel_degree {layout.ep}"]
    if layout.tp > 1:
        args.append("--parallelism." + ("" if layout.sp else "no_") + "enable_sequence_parallel")
    if layout.pp > 1:
        split = titan_partition(model.n_layers, layout.stage_sizes(model.n_layers))
        assert split is not None  # the stack's split rule passed (`_refusals`)
        per_stage, first_less, last_less = split
        name = get_schedule(layout.schedule).torchtitan
        args += [f"--parallelism.pipeline_parallel_schedule {name}",
                 f"--parallelism.pipeline_parallel_microbatch_size {layout.micro_batch}",
                 f"--parallelism.pipeline_parallel_layers_per_stage {per_stage}",
                 f"--parallelism.pipeline_parallel_first_stage_less_layers {first_less}",
                 f"--parallelism.pipeline_parallel_last_stage_less_layers {last_less}"]
    if module == "deepseek_v3":  # its configs compile the loss only by default
        args += (["--compile.enable", "--compile.components model,loss"] if settings.compile
                 else ["--compile.no_enable"])
    elif settings.compile:
        args.append("--compile.enable")
        if settings.tp_overlap == "async" and layout.tp > 1:
            args.append("--compile.enable_async_tensor_parallel")
    if settings.attention != TITAN_ATTENTION.get(module, "flex"):  # varlen: stacks.definitions
        raise ShardwiseError(
            f"torchtitan 0.3 picks the attention backend ({settings.attention}: "
            "attn_backend='varlen') in a config function (model_registry(flavor, "
            "attn_backend='varlen'), as its llama3_debugmodel_varlen_attn does), not on the "
            "command line: write your own config, or emit with --attention flex")
    notes: list[str] = []
    args += _titan_fp8_offload(config, train, notes)
    if config == "deepseek_v3_16b":
        notes.append("torchtitan's 16B flavor scales YaRN attention by mscale 0.70 (DeepSeek-"
                     "V2-Lite's config.json: 0.707) and balances its experts with a router bias "
                     "(MoE load_balance_coeff 1e-3), not DeepSeek-V2's auxiliary losses: the "
                     "same parameters, FLOPs and traffic")
    if module in ("qwen3", "gpt_oss"):  # models/common/config_utils.py make_moe_config
        notes.append(f"torchtitan's {module} balances its experts with a router bias (MoE "
                     "load_balance_coeff 1e-3), not the checkpoint's auxiliary loss "
                     "(router_aux_loss_coef): the same parameters, FLOPs and traffic")
    args.append(f"activation-checkpoint:{_TITAN_RECOMPUTE[layout.recompute]}")
    text, launch = _launched(_header("torchtitan", model, layout, train, gb), [],
                             ("-m", "torchtitan.train"), args, layout, gpus_per_node)
    return Emitted("torchtitan", text, tuple(notes), launch)

