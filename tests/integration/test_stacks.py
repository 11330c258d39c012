"""The stack facts (`shardwise.stacks`) against each framework's own code: the schedule names,
the gradient-reduce dtypes, the stage splits (torchtitan's and DeepSpeed's own functions over
a sweep), and every combination a stack refuses (`Stack.rules`) refused by the framework."""

import inspect
import itertools
import json
import typing

import pytest

from shardwise.schedules.registry import SCHEDULE_REGISTRY
from shardwise.stacks import STACKS, deepspeed_split, titan_split
from tests.integration import megatron_deepspeed
from tests.integration.conftest import require
from tests.integration.test_deepspeed import deepspeed_stages
from tests.test_stacks_titan_versions import TITAN_010_CHECKS

pytestmark = pytest.mark.integration


def test_torchtitan_schedule_names_and_stages_per_rank():
    """Each registry schedule torchtitan runs names a torch.distributed.pipelining class of
    the right kind: one stage per rank for unchunked schedules, several for chunked ones
    (torchtitan's `_get_pipeline_metadata` rule)."""
    require("torchtitan")
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    names = STACKS["torchtitan"].schedules()
    assert {"gpipe", "1f1b", "interleaved"} <= set(names) and "zb-h1" not in names
    for name in names:
        info = SCHEDULE_REGISTRY[name]
        single = issubclass(get_schedule_class(info.torchtitan), PipelineScheduleSingle)
        assert single == (not info.chunked)


def test_deepspeed_schedules_are_its_engine_and_megatron_deepspeeds_zbh1():
    require("deepspeed")
    from deepspeed.runtime.pipe import schedule

    assert STACKS["megatron-deepspeed"].schedules() == ("1f1b", "zb-h1")
    assert hasattr(schedule, SCHEDULE_REGISTRY["1f1b"].deepspeed)
    flags = {flag for opt in megatron_deepspeed.options() for flag in opt["flags"]}
    assert SCHEDULE_REGISTRY["zb-h1"].deepspeed in flags
    # issue 33: uneven stages have no option; GPTModelPipe always splits 'type:transformer'
    assert not any("partition" in flag for flag in flags if flag.startswith("--pp"))
    assert "--pp-partition-method" not in flags


def test_torchtitan_reduces_gradients_in_float32_only():
    require("torchtitan")
    from torchtitan.config.configs import TrainingConfig

    hint = typing.get_type_hints(TrainingConfig)["mixed_precision_reduce"]
    assert typing.get_args(hint) == ("float32",)
    assert STACKS["torchtitan"].grad_choices("bf16") == ("fp32",)


def test_torchtitan_split_is_torchtitans():
    """`titan_split` equals torchtitan's `_generate_llm_fqn_per_model_part` wherever that
    function accepts the weights."""
    require("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    checked = 0
    for layers in (16, 32, 61, 80, 126):
        for stages in (2, 3, 4, 6, 8, 12, 16):
            for first in range(3):
                for last in range(3):
                    try:
                        parts = _generate_llm_fqn_per_model_part(stages, layers, first, last)
                    except ValueError:
                        continue
                    real = [sum(n.startswith("layers.") for n in part) for part in parts]
                    assert titan_split(stages, layers, first, last) == real
                    checked += 1
    assert checked > 250


def test_deepspeed_split_is_deepspeeds():
    """`deepspeed_split` equals DeepSpeed's partition of GPTModelPipe's blocks."""
    require("deepspeed")
    for layers in (32, 61, 70, 126):
        for pp in (2, 3, 5, 7, 12, 16):
            assert tuple(deepspeed_split(layers, pp)) == deepspeed_stages(layers, pp)


def test_megatron_deepspeed_plans_and_takes_layouts_on_deepspeeds_stages(tmp_path):
    """With pp not dividing the layers (BLOOM-176B's 70 blocks on 384 GPUs: a power-of-two
    global batch leaves pp a multiple of 3), the megatron-deepspeed search holds layouts on
    DeepSpeed's own stages, and a `--layout` without stages gets them — as the CLI runs."""
    require("deepspeed")
    from tests.cli_helpers import shardwise_json

    config = tmp_path / "config.json"  # BLOOM-176B's dimensions (bigscience/bloom config.json)
    config.write_text(json.dumps({
        "model_type": "bloom", "n_layer": 70, "hidden_size": 14336, "n_head": 112,
        "vocab_size": 250880, "layer_norm_epsilon": 1e-5}))
    out = shardwise_json("plan", str(config), "--gpus", "384", "--gpu", "a100-80gb",
                         "--seq", "2048", "--global-batch", "2048", "--impl",
                         "megatron-deepspeed", "--layout", "tp=4,pp=12,zero=1,mb=2,"
                         "recompute=full", "--top", "20")
    assert out["given"]["layout"]["partition"] == list(deepspeed_stages(70, 12))
    uneven = [row["layout"] for row in out["ranked"] if 70 % row["layout"]["pp"]]
    assert uneven
    for layout in uneven:
        assert tuple(layout["partition"]) == deepspeed_stages(70, layout["pp"])


# --------------------------------------------------------------- each rule, by its source
def megatron_ep_in_shard_groups():
    """megatron-core shards the experts' ZeRO state over dp·cp/ep ranks: with ep = 8 and
    distributed-optimizer instances of 4 ranks (16 instances of dp = 64), the expert
    data-parallel size 8 does not divide into them."""
    require("megatron")
    from unittest import mock

    import torch.distributed as dist
    from megatron.core import parallel_state

    def build(instances):
        with (mock.patch.object(parallel_state, "create_group", lambda *a, **k: object()),
              mock.patch.object(dist, "is_initialized", lambda: True),
              mock.patch.object(dist, "get_world_size", lambda *a, **k: 64),
              mock.patch.object(dist, "get_rank", lambda *a, **k: 0)):
            try:
                parallel_state.initialize_model_parallel(
                    expert_model_parallel_size=8, num_distributed_optimizer_instances=instances)
            finally:
                parallel_state.destroy_model_parallel()

    build(8)  # groups of 8: each holds a whole expert data-parallel group
    with pytest.raises(AssertionError, match="Expert data parallel size"):
        build(16)  # groups of 4
    rule = STACKS["megatron-te"].rules[0]
    assert rule.refuses({"dp": 64, "cp": 1, "ep": 8, "zero_group": 4}, None)
    assert not rule.refuses({"dp": 64, "cp": 1, "ep": 8, "zero_group": 8}, None)


def megatron_precision_aware_optimizer_with_the_distributed_optimizer():
    """megatron-core's OptimizerConfig runs BF16 moments only with the distributed optimizer
    (shardwise's ZeRO-1 and up)."""
    require("megatron")
    import torch
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    with pytest.raises(AssertionError, match="only supported with distributed optimizer"):
        OptimizerConfig(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                        exp_avg_sq_dtype=torch.bfloat16)
    rule = next(r for r in STACKS["megatron-te"].rules if "optimizer_config" in r.source)
    bf16 = typing.cast(typing.Any, type("T", (), {"exp_avg_dtype": "bf16"}))
    assert rule.refuses({"zero": 0}, bf16) and not rule.refuses({"zero": 1}, bf16)
    assert not rule.refuses({"zero": 0}, None)


def deepspeed_zero_with_pp():
    require("deepspeed")
    import inspect

    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert "incompatible with pipeline parallelism" in inspect.getsource(PipelineEngine.__init__)


def deepspeed_ulysses_alone():
    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--seq-length", "8192", "--max-position-embeddings", "8192",
            "--micro-batch-size", "1", "--deepspeed", "--ds-sequence-parallel-size", "2"]
    with pytest.raises(megatron_deepspeed.Refused, match="parallel_state.py:146"):
        megatron_deepspeed.parse([*argv, "--pipeline-model-parallel-size", "2"], 8)


def deepspeed_zbh1_without_sp():
    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--seq-length", "8192", "--max-position-embeddings", "8192",
            "--micro-batch-size", "1", "--deepspeed", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--enable-zbh1-pipeline"]
    assert megatron_deepspeed.parse(argv, 4).enable_zbh1_pipeline
    with pytest.raises(megatron_deepspeed.Refused, match="arguments.py:81"):
        megatron_deepspeed.parse([*argv, "--sequence-parallel"], 4,
                                 {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def deepspeed_grads_in_the_model_dtype_without_zero(tmp_path):
    """DeepSpeed's engine: without ZeRO, bf16 weights with fp32 gradient accumulation is an
    unsupported mix; with ZeRO-1 it is the BF16 optimizer."""
    require("deepspeed")
    import json

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    from tests.integration.test_deepspeed import _Mpu

    def check(stage):
        path = tmp_path / f"zero{stage}.json"
        path.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True},
                                    "zero_optimization": {"stage": stage},
                                    "data_types": {"grad_accum_dtype": "fp32"}}))
        engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
        torch.nn.Module.__init__(engine)
        engine._config = DeepSpeedConfig(str(path), mpu=_Mpu(1))
        engine.global_rank, engine.pipeline_parallelism = 0, False
        return engine._do_optimizer_sanity_check(
            torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]))

    with pytest.MonkeyPatch.context() as mp:  # a one-rank group for DeepSpeedConfig
        mp.setenv("LOCAL_RANK", "0")
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False,
                                   init_method=f"file://{tmp_path / 'store'}", rank=0,
                                   world_size=1)
    try:
        check(1)
        with pytest.raises(NotImplementedError, match="unsupported mix"):
            check(0)
    finally:
        dist.destroy_process_group()


def torchtitan_ep_from_fsdp_cp_tp():
    """torchtitan's expert mesh: efsdp = dp_shard·cp·tp / ep must be whole (parallel_dims.py):
    ep = 8 over tp = 2 and no sharding has no mesh."""
    require("torchtitan")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.parallel_dims import ParallelDims

    def mesh(dp_shard, dp_replicate):
        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=2, pp=1,
                            ep=8, world_size=64)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
        try:
            dims.build_mesh()
        finally:
            dist.destroy_process_group()

    mesh(4, 8)  # dp_shard·tp = 8
    with pytest.raises((AssertionError, ValueError, RuntimeError)):
        mesh(1, 32)


def _rule(stack: str, source: str):
    return next(rule for rule in STACKS[stack].rules if rule.source == source)


def deepspeed_ep_inside_dp():
    """DeepSpeed-MoE's expert groups (deepspeed/utils/groups.py `_get_expert_parallel_ranks`,
    which `_create_expert_data_and_model_parallel` runs): ep must divide the data-parallel
    size; the rule refuses exactly the (dp, tp, ep) DeepSpeed refuses."""
    require("deepspeed")
    from deepspeed.utils import groups

    rule = _rule("megatron-deepspeed", "deepspeed/utils/groups.py:634 @0.19.8")
    for dp, tp, ep in ((8, 2, 4), (8, 2, 16), (24, 1, 16), (24, 1, 8), (4, 8, 8), (64, 1, 8)):
        try:
            groups._get_expert_parallel_ranks(dp * tp, tp, ep, 1)
            refused = False
        except AssertionError:
            refused = True
        assert bool(rule.refuses({"dp": dp, "tp": tp, "ep": ep}, None)) == refused, (dp, tp, ep)


def deepspeed_moe_without_zero3():
    """DeepSpeed's engine refuses its own MoE layers under ZeRO-3."""
    require("deepspeed")
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # the check alone, no process group
    torch.nn.Module.__init__(engine)
    engine.module = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2,
                                            k=2))
    engine.has_moe_layers = True
    with pytest.raises(AssertionError, match="not supported with ZeRO Stage 3"):
        engine._validate_zero3_moe_compatibility()
    rule = _rule("megatron-deepspeed", "deepspeed/runtime/engine.py:2215 @0.19.8")
    assert rule.refuses({"ep": 2, "zero": 3}, None)
    assert not rule.refuses({"ep": 2, "zero": 2}, None)


def megatron_tp_overlap_needs_sp():
    """Megatron-LM's validate_args (rebuilt parser and checks, test_megatron_lm) asserts
    sequence parallelism under --tp-comm-overlap; the rule refuses exactly those with TP
    (at tp=1 the export leaves the flag out: no TP traffic to overlap)."""
    from shardwise.layout import TrainSpec
    from tests.integration.test_megatron_lm import USER, _parse, _validate

    rule = _rule("megatron-te", "Megatron-LM megatron/training/arguments.py:1441 @d98e8a6")
    base = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--seq-length", "4096", "--max-position-embeddings", "4096",
            "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16", *USER]
    for tp, sp in ((2, 0), (8, 0), (2, 1), (8, 1)):
        args = _parse([*base, "--tensor-model-parallel-size", str(tp), "--tp-comm-overlap",
                       *(["--sequence-parallel"] if sp else [])])
        try:
            _validate(args, 16, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
            refused = False
        except AssertionError:
            refused = True
        for overlap in ("bulk", "none"):
            train = TrainSpec(tp_overlap=overlap)
            assert bool(rule.refuses({"tp": tp, "sp": sp}, train)) == (
                refused and overlap == "bulk"), (tp, sp, overlap)


def torchtitan_varlen_without_cp():
    """torchtitan's context parallelism wraps FlexAttention only: apply_cp_to_forward raises
    for its varlen attention."""
    require("torchtitan")
    from torchtitan.distributed.context_parallel.api import apply_cp_to_forward
    from torchtitan.models.common.attention import VarlenAttention

    from shardwise.layout import TrainSpec

    with pytest.raises(NotImplementedError, match="Variable-length attention CP"):
        apply_cp_to_forward([VarlenAttention(VarlenAttention.Config())], None)
    rule = _rule("torchtitan", "torchtitan/distributed/context_parallel/api.py:104 @0.3.0")
    fa3, flex = TrainSpec(impl="torchtitan", attention="fa3"), TrainSpec(impl="torchtitan")
    assert rule.refuses({"cp": 2}, fa3) and not rule.refuses({"cp": 1}, fa3)
    assert not rule.refuses({"cp": 2}, flex)


def deepspeed_no_dp_overlap_under_pp():
    """DeepSpeed's pipeline engine turns the backward all-reduce off and reduces the gradients
    in the schedule's last slot only (deepspeed/runtime/pipe/engine.py:80, schedule.py)."""
    require("deepspeed")
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from shardwise.layout import TrainSpec

    assert "self.enable_backward_allreduce = False" in inspect.getsource(PipelineEngine.__init__)
    steps = list(schedule.TrainSchedule(micro_batches=4, stages=2, stage_id=1).steps())
    assert [type(c).__name__ for c in steps[-1]][-2] == "ReduceGrads"
    for stack in ("megatron-deepspeed", "gpt-neox"):
        rule = _rule(stack, "deepspeed/runtime/pipe/engine.py:80 @0.19.8")
        on, unset = TrainSpec(impl=stack, dp_overlap=True), TrainSpec(impl=stack)
        assert rule.refuses({"pp": 2}, on) and not rule.refuses({"pp": 1}, on)
        assert not rule.refuses({"pp": 2}, unset)


RULES = {
    "deepspeed/runtime/pipe/engine.py:80 @0.19.8": deepspeed_no_dp_overlap_under_pp,
    "Megatron-LM megatron/training/arguments.py:1441 @d98e8a6": megatron_tp_overlap_needs_sp,
    "torchtitan/distributed/context_parallel/api.py:104 @0.3.0": torchtitan_varlen_without_cp,
    "megatron/core/parallel_state.py:1447 @d98e8a6": megatron_ep_in_shard_groups,
    "megatron/core/optimizer/optimizer_config.py, megatron-core 0.16.1":
        megatron_precision_aware_optimizer_with_the_distributed_optimizer,
    "deepspeed/utils/groups.py:634 @0.19.8": deepspeed_ep_inside_dp,
    "deepspeed/runtime/engine.py:2215 @0.19.8": deepspeed_moe_without_zero3,
    "deepspeed/runtime/pipe/engine.py:76 @0.19.8": deepspeed_zero_with_pp,
    "Megatron-DeepSpeed megatron/core/parallel_state.py:146 @4efb479": deepspeed_ulysses_alone,
    "Megatron-DeepSpeed megatron/arguments.py:81 @4efb479": deepspeed_zbh1_without_sp,
    "deepspeed/runtime/engine.py:2313 @0.19.8": deepspeed_grads_in_the_model_dtype_without_zero,
    "torchtitan/config/configs.py expert_parallel_degree @0.3.0": torchtitan_ep_from_fsdp_cp_tp,
}


RULES.update(TITAN_010_CHECKS)  # torchtitan@0.1.0's, against v0.1.0's code


def test_every_rule_has_its_check():
    assert {rule.source for stack in STACKS.values() for rule in stack.rules} == set(RULES)


@pytest.mark.parametrize("source", list(RULES))
def test_the_framework_refuses_what_the_rule_refuses(source, tmp_path):
    import inspect

    check = RULES[source]
    check(tmp_path) if "tmp_path" in inspect.signature(check).parameters else check()


def test_bloom_partition_method_is_refused_by_the_pinned_megatron_deepspeed_only():
    """BLOOM-176B's stages ('type:transformer|embedding': DeepSpeed's PipelineModule weighs
    the embedding, each block and the tied embedding 1, the casts and the final norm 0, and
    balances them with `partition_balanced`, deepspeed/runtime/pipe/module.py
    `_partition_layers` @0.19.8): Megatron-DeepSpeed 4efb479 cannot select that method
    (GPTModelPipe hard-codes 'type:transformer', no --pp-partition-method), so the layout is
    refused there naming the missing option; Megatron-LM takes any stage sizes."""
    require("deepspeed")
    from types import SimpleNamespace

    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.utils import partition_balanced

    from shardwise.layout import Layout

    specs = ["EmbeddingPipe", "cast"] + ["ParallelTransformerLayerPipe"] * 70 + [
        "cast", "MixedFusedLayerNorm", "EmbeddingPipe", "float16_to_fp32"]
    # DeepSpeed's own regex match over the specs' names, then its balanced partition
    named = SimpleNamespace(_layer_specs=[type(name, (), {}) for name in specs])
    found = PipelineModule._find_layer_type(named, "transformer|embedding")
    weights = [int(i in found) for i in range(len(specs))]
    assert sum(weights) == 72
    bounds = partition_balanced(weights, 12)
    blocks = tuple(sum(s == "ParallelTransformerLayerPipe" for s in specs[a:b])
                   for a, b in itertools.pairwise(bounds))
    assert sum(blocks) == 70 and blocks != tuple(deepspeed_split(70, 12))
    layout = Layout(dp=8, tp=4, pp=12, zero=1, partition=blocks)
    problems = STACKS["megatron-deepspeed"].layout_problems(layout, 70)
    assert len(problems) == 1 and "--pp-partition-method" in problems[0]
    assert STACKS["megatron-te"].layout_problems(layout, 70) == []
