"""`--emit torchtitan` read by torchtitan 0.3.0's own code: `ConfigManager.parse_args` (the
`--module/--config` loader, tyro parsing and `Trainer.Config` validation), `ParallelDims` and
its device mesh (on PyTorch's fake process group, the backend of torchtitan's own dry-run
mode), the pipeline metadata, stage split and schedule class, FSDP's reshard policy, the
mixed-precision policy and the trainer's batch arithmetic.
"""

import pytest

from shardwise.arch import get_model
from shardwise.schedules.registry import get_schedule
from tests.cli_helpers import shardwise_json
from tests.integration.conftest import Emit, emit, require
from tests.integration.plans import EXPECTED, PLANS

pytestmark = pytest.mark.integration


def parse(argv):
    """torchtitan's Trainer.Config from the arguments after `-m torchtitan.train`."""
    require("torchtitan")
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(argv)


def _mesh(parallelism, world_size):
    """ParallelDims validated and its mesh built over `world_size` fake ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(parallelism, world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims.build_mesh()  # runs _validate_meshes: every axis has its expected size
        sizes = {name: mesh.size() for name, mesh in dims._single_axis_meshes.items()}
    finally:
        dist.destroy_process_group()
    return dims, sizes


def reads_back(out: Emit, model) -> None:
    """Every planned value of a `--emit torchtitan` command line, as torchtitan reads it."""
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pipeline_metadata,
        _get_pp_rank_to_stage_indices_mapping,
    )
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    layout, plan = out.layout, out.plan
    stack = plan["stack"]
    env, words = out.command()
    assert env == {}  # torchtitan needs no environment beyond torchrun's
    assert words[0] == "torchrun" and words[words.index("-m") + 1] == "torchtitan.train"
    launch = words[:words.index("-m")]
    nodes = int(launch[launch.index("--nnodes") + 1])
    assert nodes * int(launch[launch.index("--nproc-per-node") + 1]) == layout.world_size
    config = parse(words[words.index("-m") + 2:])
    par, training = config.parallelism, config.training
    # the model torchtitan builds has the planned shape and attention
    spec = config.model_spec.model
    assert (len(spec.layers), spec.dim, spec.vocab_size) == (model.n_layers, model.d_model,
                                                             model.vocab)
    kernel = {"flex": FlexAttention, "fa3": VarlenAttention}[stack["attention"]]
    assert any(spec.traverse(kernel.Config))  # gpt_oss builds varlen (emit.TITAN_ATTENTION)
    if model.is_moe:
        moe_reads_back(spec, model)
    # parallel degrees: the mesh has the planned dp·cp·tp·pp and ep
    dims, sizes = _mesh(par, layout.world_size)
    assert (sizes["tp"], sizes["pp"], sizes["cp"], sizes["ep"]) == (layout.tp, layout.pp,
                                                                    layout.cp, layout.ep)
    assert sizes["batch"] == layout.dp
    assert par.enable_sequence_parallel == (layout.sp or layout.tp == 1)
    # ZeRO: FSDP shards over dp_shard·cp ranks (the group; replicate only for ZeRO-0) and
    # reshards after forward exactly for ZeRO-3
    assert dims.dp_shard * layout.cp == (layout.zero_degree if layout.zero else layout.cp)
    assert dims.dp_replicate * dims.dp_shard == layout.dp
    assert get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward,
                                                 layout.pp > 1) == (layout.zero == 3)
    # pipeline: the schedule class, pp·chunks stages of the planned layers each
    if layout.pp > 1:
        assert get_schedule_class(par.pipeline_parallel_schedule) is get_schedule_class(
            get_schedule(layout.schedule).torchtitan)
        stages, layers, first, last = _get_pipeline_metadata(dims, par, spec)
        assert stages == layout.pp * layout.chunks
        parts = _generate_llm_fqn_per_model_part(stages, layers, first, last)
        per_stage = tuple(sum(name.startswith("layers.") for name in part) for part in parts)
        assert per_stage == layout.stage_sizes(model.n_layers)
        # each rank's virtual stages as its schedule places them (loop, or the V of ZBV)
        per_rank = tuple(sum(per_stage[k] for k in _get_pp_rank_to_stage_indices_mapping(
            rank, layout.pp, par.pipeline_parallel_schedule, stages))
                         for rank in range(layout.pp))
        assert per_rank == layout.stage_layers(model.n_layers)
        assert par.pipeline_parallel_microbatch_size == layout.micro_batch
    # batch, as the trainer computes it (torchtitan/trainer.py): accumulation steps and
    # pipeline micro-batches multiply to the planned micro-batches per step
    assert training.global_batch_size == plan["global_batch"]
    assert training.seq_len == plan["seq_len"]
    accumulation = training.global_batch_size // (training.local_batch_size * layout.dp)
    micro = (training.local_batch_size // par.pipeline_parallel_microbatch_size
             if layout.pp > 1 else 1)
    assert accumulation * micro * layout.dp * layout.micro_batch == plan["global_batch"]
    # precision: FSDP's parameter dtype and its float32 reduce (the planned gradient dtype)
    assert training.mixed_precision_param == {"bf16": "bfloat16", "fp32": "float32"}[
        plan["dtype"]]
    assert training.mixed_precision_reduce == "float32" and plan["grad_dtype"] == "fp32"
    # activation checkpointing (op-sac is SelectiveAC), compile and async TP, CUDA graphs
    kind = {"none": type(None), "op-sac": SelectiveAC.Config, "full": FullAC.Config}
    assert type(config.activation_checkpoint) is kind[layout.recompute]
    assert config.compile.enable == stack["compile"]
    assert not stack["compile"] or "model" in config.compile.components
    assert config.compile.enable_async_tensor_parallel == (
        stack["tp_overlap"] == "async" and layout.tp > 1)
    assert training.disable_cuda_graphs == (layout.pp > 1 or layout.ep > 1)


def moe_reads_back(spec, model) -> None:
    """The MoE model torchtitan builds is the planned one: its parameters (built on the meta
    device) are the plan's total, its MoE layers, experts, shared experts' and experts' widths
    (in that count) and its router (top-k, scores, groups, gate renormalisation and scale)."""
    import dataclasses

    import torch

    with torch.device("meta"):
        built = spec.build()
    assert sum(p.numel() for p in built.parameters()) == model.count_params().total
    moe = [layer.moe for layer in spec.layers if layer.moe is not None]
    assert len(moe) == model.n_moe_layers and not getattr(spec, "mtp_layers", None)
    assert [layer.moe is not None for layer in spec.layers] == [
        model.is_moe_layer(i) for i in range(model.n_layers)]
    router = {f.name: getattr(moe[0].router, f.name) for f in dataclasses.fields(moe[0].router)}
    assert (moe[0].num_experts, router["top_k"], router["score_func"], router["route_norm"],
            router["route_scale"], router["num_expert_groups"] or 1,
            router["num_limited_groups"] or 1) == (
        model.n_experts, model.top_k, model.router_score, model.norm_topk, model.routed_scaling,
        model.expert_groups, model.topk_groups)


@pytest.mark.parametrize("plan", [p for p in PLANS if EXPECTED[p]["torchtitan"] is None])
def test_torchtitan_reads_back_the_plan(capsys, plan):
    require("torchtitan")
    out = emit(capsys, plan, "torchtitan")
    assert out.code == 0, out.err
    assert out.notes == []  # nothing runs other than planned
    reads_back(out, get_model(PLANS[plan][0] if PLANS[plan] else "llama3-8b"))


@pytest.mark.parametrize("plan", [p for p in PLANS if EXPECTED[p]["torchtitan"] is not None])
def test_torchtitan_refuses_in_one_line(capsys, plan):
    out = emit(capsys, plan, "torchtitan")
    phrase, _ = EXPECTED[plan]["torchtitan"]
    assert out.code == 2 and len(out.err.splitlines()) == 1 and phrase in out.err, out.err


@pytest.mark.parametrize("args", [
    # op-sac, interleaved with chunks, HSDP ZeRO-2, torch.compile with async TP
    ["llama3-8b", "--gpus", "32", "--global-batch", "256", "--compile", "--tp-overlap", "async",
     "--layout", "tp=2,sp=1,pp=2,schedule=interleaved,chunks=2,zero=2,zero_group=4,"
                 "recompute=op-sac"],
    # GPipe, uneven stages torchtitan splits (the embedding and head as one layer each)
    ["llama3-70b", "--gpus", "64", "--global-batch", "64", "--layout",
     "tp=8,pp=4,schedule=gpipe,zero=3,recompute=full", "--partition", "19,21,21,19"],
    # its context parallelism: K and V all-gathered (FlexAttention), with TP and FSDP
    ["llama3-8b", "--gpus", "32", "--seq", "65536", "--global-batch", "8", "--layout",
     "tp=2,sp=1,cp=4,cp_kind=allgather,zero=3,recompute=full"],
    # Llama 3 405B's 126 layers over 8 ranks × 2 virtual stages, no stages given: torchtitan's
    # own 7, 8 × 14, 7 — looped (interleaved) and in a V (ZBV: ranks 0 and 7 hold 14, 16)
    *[["llama3-405b", "--gpus", "512", "--global-batch", "256", "--fp8", "rowwise",
       "--compile", "--tp-overlap", "async", "--layout",
       f"tp=8,pp=8,zero=3,sp=1,schedule={name},chunks=2,recompute=full"]
      for name in ("interleaved", "zbv")],
    # its MoE models (issue 46/47): DeepSeek-V2-Lite as its deepseek_v3 "16B" flavor, experts
    # over ep=8 inside FSDP, compiled; DeepSeek-V3 as "671B", 8 stages × ep=64, and with tp
    ["deepseek-v2-lite", "--gpus", "64", "--seq", "4096", "--global-batch", "256", "--compile",
     "--layout", "ep=8,zero=3,recompute=op-sac"],
    # (its deepseek_v3_671b config builds no MTP module: planned without, emit.torchtitan)
    ["deepseek-v3", "--gpus", "512", "--seq", "4096", "--global-batch", "1024",
     "--mtp-num-layers", "0", "--layout", "pp=8,ep=64,zero=3,recompute=full"],
    ["deepseek-v3", "--gpus", "256", "--seq", "4096", "--global-batch", "512",
     "--mtp-num-layers", "0", "--layout", "tp=8,sp=1,ep=32,zero=2,recompute=full"],
])
def test_torchtitan_reads_back_other_runs(capsys, monkeypatch, args):
    require("torchtitan")
    import torchtitan.components.quantization.float8 as float8

    # its Float8 converter checks the GPU it builds on; this machine has none
    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: True)
    out = Emit(capsys, args, "torchtitan")
    assert out.code == 0, out.err
    reads_back(out, get_model(args[0]))
    if args[0] == "deepseek-v2-lite":  # what differs from the checkpoint, named
        assert len(out.notes) == 1 and "mscale 0.70" in out.notes[0]


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v2-lite"])
def test_torchtitan_refuses_a_sequence_past_its_rope_cache(capsys, model):
    """torchtitan's deepseek_v3 flavors keep RoPE for 16384 positions: its own
    Decoder.update_from_config refuses seq_len 32768, and so does the export, in one line."""
    require("torchtitan")
    out = Emit(capsys, [model, "--gpus", "64", "--seq", "32768", "--global-batch", "64",
                        "--impl", "torchtitan", "--layout", "ep=8,cp=2,zero=3"], "torchtitan")
    assert out.code == 2 and len(out.err.splitlines()) == 1 and "16384 positions" in out.err
    config = parse(["--module", "deepseek_v3", "--config",
                    {"deepseek-v3": "deepseek_v3_671b",
                     "deepseek-v2-lite": "deepseek_v3_16b"}[model],
                    "--training.seq_len", "32768"])
    with pytest.raises(ValueError, match="exceeds attention RoPE maximum"):
        config.model_spec.model.update_from_config(config=config)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_memory_charges_each_rank_the_layers_torchtitan_builds_on_it(schedule):
    """`shardwise memory --impl torchtitan` of Llama 3 405B over 8 ranks × 2 virtual stages,
    no stages given: each stage's layers are those torchtitan's own split
    (`_generate_llm_fqn_per_model_part`, first/last stage one layer short) puts on that rank
    (`_get_pp_rank_to_stage_indices_mapping`: looped, or the V of ZBV)."""
    require("torchtitan")
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pp_rank_to_stage_indices_mapping,
    )

    out = shardwise_json("memory", "llama3-405b", "--gpus", "512", "--impl", "torchtitan",
                         "--tp", "8", "--pp", "8", "--zero", "3", "--sp", "--schedule",
                         schedule, "--chunks", "2", "--recompute", "full")
    parts = _generate_llm_fqn_per_model_part(16, 126, 1, 1)
    layers = [sum(name.startswith("layers.") for name in part) for part in parts]
    name = get_schedule(schedule).torchtitan
    expected = [sum(layers[k] for k in _get_pp_rank_to_stage_indices_mapping(r, 8, name, 16))
                for r in range(8)]
    assert [stage["layers"] for stage in out["stages"]] == expected


def test_the_attention_kernels_torchtitan_0_3_runs(capsys, monkeypatch):
    """torchtitan 0.3.0 refuses SDPA for language models and builds flex or varlen; varlen
    activates FlashAttention-3 on Hopper (FA4 on Blackwell, nothing before: PyTorch's FA2),
    refuses context parallelism, and is chosen in a config function only — so the stack
    offers flex and fa3, plans fa3 (not with cp), and refuses to export it in one line."""
    require("torchtitan")
    import torchtitan.tools.utils as titan_utils
    from torchtitan.models.common.attention import VarlenAttention
    from torchtitan.models.common.config_utils import get_attention_config
    from torchtitan.models.llama3 import model_registry

    from shardwise.stacks import STACKS

    with pytest.raises(ValueError, match="sdpa is no longer supported"):
        get_attention_config("sdpa")
    spec = model_registry("8B", attn_backend="varlen").model
    assert any(spec.traverse(VarlenAttention.Config))
    for capability, impl in (((9, 0), "FA3"), ((10, 0), "FA4"), ((8, 0), None)):
        monkeypatch.setattr(titan_utils, "has_cuda_capability",
                            lambda major, minor, c=capability: c >= (major, minor))
        assert titan_utils.get_cuda_flash_attention_impl() == impl
    assert STACKS["torchtitan"].attention == ("flex", "fa3")
    base = ["llama3-8b", "--impl", "torchtitan", "--gpus", "16", "--global-batch", "128",
            "--attention", "fa3"]
    assert shardwise_json("plan", *base)["stack"]["attention"] == "fa3"
    out = Emit(capsys, base, "torchtitan")
    assert out.code == 2 and len(out.err.splitlines()) == 1 and "varlen" in out.err
    refused = Emit(capsys, [*base, "--layout", "cp=2,cp_kind=allgather,zero=3"], "torchtitan")
    assert refused.code == 2 and "context_parallel/api.py" in refused.err
