"""`--emit megatron` read by megatron-core's own config classes (PyPI wheel, 0.16.1).

Megatron-LM's `core_transformer_config_from_args` copies every argument whose name is a
`TransformerConfig` field; the few renamed ones are mapped below as that function maps them
(megatron/training/arguments.py, Megatron-LM main). `TransformerConfig.__post_init__` and
`DistributedDataParallelConfig` then run megatron-core's own validation.
"""

import dataclasses

import pytest

from shardwise.arch import get_model
from shardwise.layout import Layout, chunk_span
from tests.integration.conftest import Emit, emit, flags, planned_batch, planned_seq, require
from tests.integration.plans import PLANS

pytestmark = pytest.mark.integration


def _value(raw):
    """An argument's text as argparse's `type=` reads it: a switch, int, float or text."""
    if raw is None:
        return True
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _config(argv):
    """megatron-core TransformerConfig + DistributedDataParallelConfig from Megatron-LM args."""
    require("megatron")
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = {k[2:].replace("-", "_"): v for k, v in flags(argv).items()}
    kwargs = {field.name: _value(args[field.name]) for field in dataclasses.fields(TransformerConfig)
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
    for stage in ("first", "last"):  # Megatron-LM's arguments.py renames these
        if f"decoder_{stage}_pipeline_num_layers" in args:
            kwargs[f"num_layers_in_{stage}_pipeline_stage"] = int(
                args[f"decoder_{stage}_pipeline_num_layers"])
    if "group_query_attention" not in args:
        kwargs.pop("num_query_groups", None)
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


@pytest.mark.parametrize("plan", list(PLANS))
def test_megatron_core_reads_back_the_plan(capsys, plan):
    out = emit(capsys, plan, "megatron")
    assert out.code == 0, out.err
    env, argv = out.command()
    args, config, ddp = _config(argv)
    layout: Layout = out.layout
    model = get_model(PLANS[plan][0] if PLANS[plan] else "llama3-8b")
    dtype = "fp16" if "fp16" in PLANS[plan] else "bf16"
    # launch: torchrun over whole nodes, as many processes as the layout's ranks
    assert argv[0] == "torchrun" and "pretrain_gpt.py" in argv
    launch = flags(argv[:argv.index("pretrain_gpt.py")])
    assert int(launch["--nnodes"]) * int(launch["--nproc-per-node"]) == layout.world_size
    # parallel degrees, schedule, SP, recompute
    assert config.tensor_model_parallel_size == layout.tp
    assert config.pipeline_model_parallel_size == layout.pp
    assert config.virtual_pipeline_model_parallel_size == (
        layout.chunks if layout.schedule == "interleaved" else None)
    assert config.context_parallel_size == layout.cp
    assert config.expert_model_parallel_size == layout.ep
    # the stage partition, as megatron-core builds each pipeline rank's layers
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    if layout.chunks == 1:
        built = tuple(get_num_layers_to_build(config, pp_rank=i) for i in range(layout.pp))
        assert built == layout.stage_partition(config.num_layers)
    else:  # each (stage, chunk)'s first layer and count, as megatron-core builds them
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
        spans = [(get_transformer_layer_offset(config, vp_stage=c, pp_rank=i),
                  get_num_layers_to_build(config, vp_stage=c, pp_rank=i))
                 for c in range(layout.chunks) for i in range(layout.pp)]
        assert spans == [tuple(int(x) for x in chunk_span(config.num_layers, layout.pp,
                                                          layout.chunks, i, c, layout.partition))
                         for c in range(layout.chunks) for i in range(layout.pp)]
    assert config.sequence_parallel == layout.sp
    assert config.recompute_granularity == {"none": None, "selective": "selective",
                                            "full": "full"}[layout.recompute]
    # batch
    assert int(args["micro_batch_size"]) == layout.micro_batch
    assert int(args["global_batch_size"]) == planned_batch(plan)
    assert int(args["seq_length"]) == planned_seq(plan)
    # model shape, vocabulary (Megatron pads to a multiple of divisible_by·tp), rotary base
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size,
            config.num_attention_heads) == (model.n_layers, model.d_model, model.d_ff,
                                            model.n_heads)
    assert (config.num_query_groups or config.num_attention_heads) == model.n_kv_heads
    assert config.gated_linear_unit == model.gated_mlp
    assert config.normalization == ("RMSNorm" if model.norm == "rmsnorm" else "LayerNorm")
    assert config.num_moe_experts == (model.n_experts or None)
    step = int(args["make_vocab_size_divisible_by"]) * layout.tp
    padded = -(-int(args["vocab_size"]) // step) * step
    assert int(args["vocab_size"]) == model.vocab
    assert (padded == model.vocab) == (model.vocab % layout.tp == 0)
    if not model.learned_positions:
        # rope_theta in the Hugging Face config.json of Llama 3 and Mixtral
        # others: Megatron's default 10000 (BLOOM's ALiBi is not modelled, issue 9 item 6)
        theta = {"llama3": 500000, "mixtral": 1000000}.get(model.name.split("-")[0], 10000)
        assert int(args["rotary_base"]) == theta
    # ZeRO stage through the distributed optimizer / Megatron-FSDP
    strategy = {0: "no_shard", 1: "no_shard", 2: "optim_grads", 3: "optim_grads_params"}
    assert ddp.use_distributed_optimizer == (layout.zero >= 1)
    assert ddp.data_parallel_sharding_strategy == strategy[layout.zero]
    if layout.zero == 1 and layout.zero_group:
        assert (ddp.num_distributed_optimizer_instances * layout.zero_group
                == layout.dp * layout.cp)
    # precision and gradient reduce dtype (the plan's grads are the dtype's)
    assert config.bf16 == (dtype == "bf16") and config.fp16 == (dtype == "fp16")
    assert not ddp.grad_reduce_in_fp32  # these plans reduce gradients in the training dtype
    # attention backend and the environment Megatron wants for TP/CP
    flash = "--no-flash" not in PLANS[plan]
    assert config.attention_backend.name == ("flash" if flash else "unfused")
    assert (env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1") == (
        (layout.tp > 1 or layout.cp > 1) and layout.zero < 2)


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
