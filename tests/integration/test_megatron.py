"""`--emit megatron` read by megatron-core's own config classes (PyPI wheel, 0.16.1).

Megatron-LM's `core_transformer_config_from_args` copies every argument whose name is a
`TransformerConfig` field; the few renamed ones are mapped below as that function maps them
(megatron/training/arguments.py, Megatron-LM main). `TransformerConfig.__post_init__` and
`DistributedDataParallelConfig` then run megatron-core's own validation. Megatron-LM's own
`parse_args` + `validate_args` read the same scripts in test_megatron_lm.py.
"""

import dataclasses

import pytest

from shardwise.arch import get_model
from shardwise.layout import chunk_span
from shardwise.schedules.registry import get_schedule
from tests.integration.conftest import Emit, arg_value, emit, flags, require
from tests.integration.plans import EXPECTED, MEGATRON_EXTRA, PLANS

pytestmark = pytest.mark.integration

# the plan's attention kernel as Megatron's --attention-backend (emit._MEGATRON_ATTENTION)
BACKENDS = {"cudnn": "fused", "fa2": "flash", "fa3": "flash", "math": "unfused"}


def _config(argv):
    """megatron-core TransformerConfig + DistributedDataParallelConfig from Megatron-LM args."""
    require("megatron")
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = {k[2:].replace("-", "_"): v for k, v in flags(argv).items()}
    kwargs = {field.name: arg_value(args[field.name]) for field in dataclasses.fields(TransformerConfig)
              if field.name in args and field.name not in ("bf16", "fp16")}
    # renamed arguments, as core_transformer_config_from_args maps them
    dtype = torch.bfloat16 if "bf16" in args else torch.float16 if "fp16" in args else torch.float32
    kwargs.update(bf16="bf16" in args, fp16="fp16" in args, params_dtype=dtype,
                  pipeline_dtype=dtype, add_bias_linear="disable_bias_linear" not in args,
                  attention_backend=AttnBackend[args["attention_backend"]])
    if "num_experts" in args:
        kwargs["num_moe_experts"] = int(args["num_experts"])
    if "swiglu" in args:
        kwargs.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    if "recompute_activations" in args:
        kwargs["recompute_granularity"] = "selective"
    if "num_virtual_stages_per_pipeline_rank" in args:
        kwargs["virtual_pipeline_model_parallel_size"] = int(
            args["num_virtual_stages_per_pipeline_rank"])
    if "pipeline_model_parallel_layout" in args:  # validate_args derives vpp from the layout
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )
        stages = PipelineParallelLayerLayout.get_num_stages_from_str(
            args["pipeline_model_parallel_layout"])
        vpp = stages // int(args["pipeline_model_parallel_size"])
        kwargs["virtual_pipeline_model_parallel_size"] = vpp if vpp > 1 else None
    for stage in ("first", "last"):  # Megatron-LM's arguments.py renames these
        if f"decoder_{stage}_pipeline_num_layers" in args:
            kwargs[f"num_layers_in_{stage}_pipeline_stage"] = int(
                args[f"decoder_{stage}_pipeline_num_layers"])
    if "group_query_attention" not in args:
        kwargs.pop("num_query_groups", None)
    for name in ("hierarchical_context_parallel_sizes", "recompute_modules", "offload_modules",
                 "cuda_graph_scope"):  # nargs="+": every value after the flag
        if name in args:
            start = argv.index("--" + name.replace("_", "-")) + 1
            end = next(i for i in range(start, len(argv) + 1)
                       if i == len(argv) or argv[i].startswith("--"))
            kwargs[name] = [arg_value(w) for w in argv[start:end]]
    config = TransformerConfig(**kwargs)
    fsdp = "use_megatron_fsdp" in args
    ddp = DistributedDataParallelConfig(
        # validate_args: bf16 reduces in fp32 unless --grad-reduce-in-bf16; fp16 only with
        # --accumulate-allreduce-grads-in-fp32
        grad_reduce_in_fp32=dtype == torch.float32 or "accumulate_allreduce_grads_in_fp32" in args
        or (dtype == torch.bfloat16 and "grad_reduce_in_bf16" not in args),
        overlap_grad_reduce="overlap_grad_reduce" in args,
        overlap_param_gather="overlap_param_gather" in args,
        use_distributed_optimizer="use_distributed_optimizer" in args or fsdp,
        num_distributed_optimizer_instances=int(
            args.get("num_distributed_optimizer_instances") or 1),
        use_megatron_fsdp=fsdp,
        data_parallel_sharding_strategy=args.get("data_parallel_sharding_strategy") or "no_shard")
    return args, config, ddp


def reads_back(out: Emit, model) -> None:
    """Every planned value of a `--emit megatron` script, as megatron-core reads it."""
    env, argv = out.command()
    args, config, ddp = _config(argv)
    layout, plan = out.layout, out.plan
    stack = plan["stack"]
    # launch: torchrun over whole nodes, as many processes as the layout's ranks
    assert argv[0] == "torchrun" and "pretrain_gpt.py" in argv
    launch = flags(argv[:argv.index("pretrain_gpt.py")])
    assert int(launch["--nnodes"]) * int(launch["--nproc-per-node"]) == layout.world_size
    # parallel degrees, schedule, SP, recompute
    assert config.tensor_model_parallel_size == layout.tp
    assert config.pipeline_model_parallel_size == layout.pp
    chunked = layout.pp > 1 and get_schedule(layout.schedule).chunked
    assert config.virtual_pipeline_model_parallel_size == (layout.chunks if chunked else None)
    assert config.context_parallel_size == layout.cp
    # the context-parallel kind as megatron-core names it (TEDotProductAttention's cp_comm_type)
    # and, for a2a+p2p, the groups parallel_state.create_hierarchical_groups builds
    assert config.cp_comm_type == ({"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p",
                                   "allgather": "all_gather"}[
        layout.cp_kind] if layout.cp > 1 else None)
    assert config.hierarchical_context_parallel_sizes == (
        [layout.ulysses, layout.cp // layout.ulysses] if layout.cp_kind == "hybrid" else None)
    assert config.expert_model_parallel_size == layout.ep
    # the stage partition, as megatron-core builds each pipeline rank's layers
    if config.pipeline_model_parallel_layout is not None:  # the parsed explicit layout
        from megatron.core.transformer.enums import LayerType
        parsed = config.pipeline_model_parallel_layout.layout  # [pp rank][virtual stage]
        counts = [parsed[i][c].count(LayerType.decoder)
                  for c in range(layout.chunks) for i in range(layout.pp)]
        spans = [(sum(counts[:k]), n) for k, n in enumerate(counts)]
    else:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
        spans = [(get_transformer_layer_offset(config, vp_stage=c if chunked else None,
                                               pp_rank=i),
                  get_num_layers_to_build(config, vp_stage=c if chunked else None, pp_rank=i))
                 for c in range(layout.chunks) for i in range(layout.pp)]
    assert spans == [tuple(int(x) for x in chunk_span(config.num_layers, layout.pp,
                                                      layout.chunks, i, c, layout.partition))
                     for c in range(layout.chunks) for i in range(layout.pp)]
    assert config.sequence_parallel == layout.sp
    assert config.recompute_granularity == {"none": None, "selective": "selective",
                                            "full": "full"}[layout.recompute]
    # batch
    assert int(args["micro_batch_size"]) == layout.micro_batch
    assert int(args["global_batch_size"]) == plan["global_batch"]
    assert int(args["seq_length"]) == plan["seq_len"]
    # model shape, vocabulary (Megatron pads to a multiple of divisible_by·tp), rotary base
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size,
            config.num_attention_heads) == (model.n_layers, model.d_model, model.d_ff,
                                            model.n_heads)
    assert (config.num_query_groups or config.num_attention_heads) == model.n_kv_heads
    assert config.gated_linear_unit == model.gated_mlp
    assert config.normalization == ("RMSNorm" if model.norm == "rmsnorm" else "LayerNorm")
    assert config.num_moe_experts == (model.n_experts or None)
    step = int(args["make_vocab_size_divisible_by"]) * layout.tp
    assert int(args["vocab_size"]) == model.vocab and model.vocab % step == 0  # unpadded
    if not model.learned_positions:
        assert int(args["rotary_base"]) == model.rope_theta
    # ZeRO stage through the distributed optimizer / Megatron-FSDP, and its shard groups
    strategy = {0: "no_shard", 1: "no_shard", 2: "optim_grads", 3: "optim_grads_params"}
    assert ddp.use_distributed_optimizer == (layout.zero >= 1)
    assert ddp.data_parallel_sharding_strategy == strategy[layout.zero]
    instances = ddp.num_distributed_optimizer_instances
    assert (layout.dp * layout.cp // instances if layout.zero else instances) == (
        layout.zero_degree if layout.zero else 1)
    # precision and gradient dtype: the distributed optimizer's reduce dtype, or
    # Megatron-FSDP's main-gradient dtype (validate_args; megatron_fsdp.MixedPrecisionPolicy)
    assert config.bf16 == (plan["dtype"] == "bf16") and config.fp16 == (plan["dtype"] == "fp16")
    if layout.zero >= 2:
        assert args["megatron_fsdp_main_grads_dtype"] == plan["grad_dtype"]
    else:
        assert ddp.grad_reduce_in_fp32 == (plan["grad_dtype"] == "fp32")
    # the stack's overlap settings and attention kernel
    overlapped = (stack["dp_overlap"] if stack["dp_overlap"] is not None
                  else layout.zero in stack["dp_overlap_by_default_at_zero"])
    assert ddp.overlap_grad_reduce == overlapped
    assert ddp.overlap_param_gather == (overlapped and layout.zero >= 1)
    assert config.tp_comm_overlap == (stack["tp_overlap"] == "bulk" and layout.sp)
    assert config.attention_backend.name == BACKENDS[stack["attention"]]
    # Megatron wants one hardware queue for TP/CP; Megatron-FSDP refuses it
    assert (env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1") == (
        (layout.tp > 1 or layout.cp > 1) and layout.zero < 2)


def _model(plan: str):
    return get_model(PLANS[plan][0] if PLANS[plan] else "llama3-8b")


@pytest.mark.parametrize("plan", [p for p in PLANS if EXPECTED[p]["megatron"] is None])
def test_megatron_core_reads_back_the_plan(capsys, plan):
    out = emit(capsys, plan, "megatron")
    assert out.code == 0, out.err
    assert out.notes == []  # nothing runs other than planned
    reads_back(out, _model(plan))


@pytest.mark.parametrize("plan", [p for p in PLANS if EXPECTED[p]["megatron"] is not None])
def test_megatron_refuses_in_one_line(capsys, plan):
    out = emit(capsys, plan, "megatron")
    phrase, _ = EXPECTED[plan]["megatron"]
    assert out.code == 2 and len(out.err.splitlines()) == 1 and phrase in out.err, out.err
    if "cannot run this plan:" not in out.err:  # what the model is, no layout fixes
        assert "nearest it runs:" in out.err and "s per step predicted" in out.err


@pytest.mark.parametrize("case", list(MEGATRON_EXTRA))
def test_megatron_core_reads_back_the_other_runs(capsys, case):
    """fp16 with ZeRO-3 (Megatron-FSDP), an explicit pipeline layout, hybrid ZeRO-2 (HSDP),
    fp32 gradients with DP and TP overlap, all-gathered context parallelism
    (`MEGATRON_EXTRA`)."""
    out = Emit(capsys, MEGATRON_EXTRA[case], "megatron")
    assert out.code == 0, out.err
    _, argv = out.command()
    expected = {"8b-fp16-zero3": "--use-megatron-fsdp",
                "8b-pp4-7-9-8-8": "--pipeline-model-parallel-layout",
                "8b-hybrid-zero2": "--num-distributed-optimizer-instances",
                "8b-fp32-grads-overlap": "--tp-comm-overlap",
                "70b-cp8-allgather": "all_gather"}[case]
    assert expected in argv and "--use-torch-fsdp2" not in argv
    reads_back(out, get_model(MEGATRON_EXTRA[case][0]))
def _megatron_groups(world: int, args: dict) -> dict[str, list[list[int]]]:
    """The process groups megatron-core's own `parallel_state.initialize_model_parallel`
    builds from the emitted degrees, on a world of `world` ranks faked for it (rank 0's
    view; every group's rank list is recorded, not created)."""
    from unittest import mock

    import torch.distributed as dist
    from megatron.core import parallel_state

    made: dict[str, list[list[int]]] = {}

    def create_group(ranks=None, *_, group_desc=None, **__):
        made.setdefault(group_desc, []).append(list(ranks))
        return object()

    with (mock.patch.object(parallel_state, "create_group", create_group),
          mock.patch.object(dist, "is_initialized", lambda: True),
          mock.patch.object(dist, "get_world_size", lambda *_, **__: world),
          mock.patch.object(dist, "get_rank", lambda *_, **__: 0)):
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=int(args["tensor_model_parallel_size"]),
                pipeline_model_parallel_size=int(args["pipeline_model_parallel_size"]),
                context_parallel_size=int(args.get("context_parallel_size") or 1),
                num_distributed_optimizer_instances=int(
                    args.get("num_distributed_optimizer_instances") or 1))
        finally:
            parallel_state.destroy_model_parallel()
    return made


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_distributed_optimizer_instances_shard_over_the_zero_group(capsys, cp):
    """Hybrid ZeRO-1 (a shard group of 4 inside the dp × cp block) as Megatron-LM's distributed
    optimizer instances: megatron-core shards each instance over dp·cp / instances ranks of
    the data-parallel-with-context group, which must be our ZeRO group, for cp = 1, 2 and 4."""
    layout = f"tp=2,cp={cp},zero=1,zero_group=4"
    out = Emit(capsys, ["llama3-8b", "--gpus", "64", "--seq", "32768", "--global-batch", "64",
                        "--layout", layout], "megatron")
    assert out.code == 0, out.err
    assert (out.layout.cp, out.layout.zero_group, out.layout.dp) == (cp, 4, 32 // cp)
    _, argv = out.command()
    args = {k[2:].replace("-", "_"): v for k, v in flags(argv).items()}
    groups = _megatron_groups(out.layout.world_size, args)
    shards = groups["INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"]
    assert {len(ranks) for ranks in shards} == {4}
    # every dp × cp block of 32 ranks holds 8 shard groups of 4: 8 instances
    assert int(args["num_distributed_optimizer_instances"]) == 32 // 4
    assert len(shards) == out.layout.world_size // 4
