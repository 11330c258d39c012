"""Every refusal of the 15 kinds of plan × 3 frameworks (plans.EXPECTED) confirmed by the
framework's own code: each kind runs (or, for a structural fact, reads) the code that cannot
take the refused value — megatron-core 0.16.1, torchtitan 0.3.0 and torch.distributed.
pipelining 2.13, DeepSpeed 0.19.8, and Megatron-DeepSpeed 4efb479 through its pinned parser
and checks (`tests.integration.megatron_deepspeed`).
"""

import inspect
from types import SimpleNamespace

import pytest

from shardwise.arch import get_model
from shardwise.emit import framework_stack
from tests.integration import megatron_deepspeed
from tests.integration.conftest import require
from tests.integration.plans import EXPECTED

pytestmark = pytest.mark.integration


def _titan(argv, monkeypatch=None):
    require("torchtitan")
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(argv)


def megatron_schedules():
    """Megatron runs 1F1B and interleaved 1F1B only: megatron-core's schedules have no other
    forward-backward function (pipeline_parallel/schedules.py)."""
    require("megatron")
    from megatron.core.pipeline_parallel import schedules

    runners = sorted(n for n in dir(schedules) if n.startswith("forward_backward_"))
    assert runners == ["forward_backward_no_pipelining",
                       "forward_backward_pipelining_with_interleaving",
                       "forward_backward_pipelining_without_interleaving"]
    assert framework_stack("megatron").schedules() == ("1f1b", "interleaved")


def megatron_vocab():
    """Megatron's (and Megatron-DeepSpeed's) vocabulary-parallel embedding splits V evenly
    over tp: 50257 rows over 8 ranks are refused, so the vocabulary is padded."""
    require("megatron")
    from megatron.core.tensor_parallel.utils import VocabUtility

    assert VocabUtility.vocab_range_from_global_vocab_size(50264, 0, 8) == (0, 6283)
    with pytest.raises(AssertionError):
        VocabUtility.vocab_range_from_global_vocab_size(50257, 0, 8)


def torchtitan_models():
    """torchtitan 0.3.0 ships the Llama 3 shapes and, as deepseek_v3 flavors, DeepSeek-V2-Lite's
    and DeepSeek-V3's among our presets (test_torchtitan.py reads those back): no Mixtral,
    GPT-3 or BLOOM module, and its llama3 flavors are the three Llama 3 sizes."""
    require("torchtitan")
    import importlib.util

    from torchtitan.models.llama3 import llama3_configs

    for name in ("mixtral", "gpt3", "gpt", "bloom"):
        assert importlib.util.find_spec(f"torchtitan.models.{name}") is None
    with pytest.raises(ImportError, match="supported modules"):
        _titan(["--module", "mixtral", "--config", "mixtral_8x7b"])
    sizes = {(len(cfg.layers), cfg.dim) for cfg in (
        llama3_configs[f](attn_backend="flex") for f in ("8B", "70B", "405B"))}
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        model = get_model(name)
        assert (model.n_layers, model.d_model) in sizes


def torchtitan_405b_float8(monkeypatch):
    """torchtitan's llama3_405b config converts its linears to Float8 and compiles the model
    (models/llama3/config_registry.py): not the bf16 matmuls the plan prices."""
    require("torchtitan")
    import torchtitan.components.quantization.float8 as float8
    from torchtitan.components.quantization.float8 import Float8Linear

    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: True)
    config = _titan(["--module", "llama3", "--config", "llama3_405b"])
    assert config.compile.enable and any(config.model_spec.model.traverse(Float8Linear.Config))


def torchtitan_cp_allgather():
    """torchtitan's llama3 attention is FlexAttention (model_registry's attn_backend), whose
    context parallelism all-gathers K and V (distributed/context_parallel/api.py): no ring."""
    require("torchtitan")
    from torchtitan.distributed.context_parallel import api
    from torchtitan.models.llama3 import model_registry

    assert inspect.signature(model_registry).parameters["attn_backend"].default == "flex"
    source = inspect.getsource(api.apply_cp_to_forward)
    assert "isinstance(first, FlexAttention)" in source and "flex_cp_allgather" in source


def torchtitan_flex():
    """A torchtitan language model's attention is flex, flex_flash or varlen; SDPA and the
    materialised softmax are not backends (models/common/config_utils.py)."""
    require("torchtitan")
    from torchtitan.models.common.config_utils import get_attention_config

    for backend in ("sdpa", "math", "eager"):
        with pytest.raises(ValueError):
            get_attention_config(backend)
    assert framework_stack("torchtitan").attention == ("flex",)


def torchtitan_dtypes():
    """torchtitan's mixed-precision parameter dtype is bfloat16 or float32; float16 does not
    parse (config/configs.py TrainingConfig)."""
    with pytest.raises(SystemExit):
        _titan(["--module", "llama3", "--config", "llama3_8b",
                "--training.mixed_precision_param", "float16"])


def torchtitan_no_zero1():
    """torchtitan always wraps the model in FSDP2 (models/llama3/parallelize.py) and resharding
    after forward is its only choice: 'always', 'never' or 'default' — no policy shards only
    optimizer states."""
    require("torchtitan")
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.models.llama3.parallelize import parallelize_llama

    assert "apply_fsdp_to_decoder(" in inspect.getsource(parallelize_llama)
    with pytest.raises(ValueError):
        get_fsdp_reshard_after_forward_policy("optimizer", False)


def torchtitan_recompute():
    """torchtitan's activation checkpointing: SelectiveAC (per-op: it keeps the outputs of
    compute-intensive ops, our op-sac), FullAC, a memory budget or none — not Megatron's
    selective recompute of the attention core."""
    require("torchtitan")
    from torchtitan.distributed import activation_checkpoint as ac

    source = inspect.getsource(ac)
    for name in ("selective", "full", "memory-budget", "none"):
        assert f'tyro.conf.subcommand("{name}")' in source
    assert source.count("tyro.conf.subcommand(") == 4
    import torch

    # it saves the attention output that Megatron's selective recompute recomputes
    assert torch._higher_order_ops.flex_attention in ac._get_default_save_ops()


def torchtitan_zbh1():
    """ZB-H1 with one stage per rank: torchtitan builds a multi-stage schedule such as
    InterleavedZeroBubble with at least two stages per rank (pipeline_parallel.py)."""
    require("torchtitan")
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import _get_pipeline_metadata

    config = _titan(["--module", "llama3", "--config", "llama3_70b",
                     "--parallelism.pipeline_parallel_degree", "4",
                     "--parallelism.data_parallel_shard_degree", "1",
                     "--parallelism.tensor_parallel_degree", "1",
                     "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble",
                     "--parallelism.pipeline_parallel_layers_per_stage", "20",
                     "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
                     "--parallelism.pipeline_parallel_last_stage_less_layers", "0",
                     "--training.disable_cuda_graphs"])
    dims = ParallelDims.from_config(config.parallelism, 4)
    with pytest.raises(ValueError, match="at least 2 stages per rank"):
        _get_pipeline_metadata(dims, config.parallelism, config.model_spec.model)


def torchtitan_split():
    """torchtitan's stage split (first/last stages shortened, extras on the first stages)
    makes no 6,7,7,7,7,6 twice over 12 virtual stages of 80 layers, whatever the weights."""
    require("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    want = (6, 7, 7, 7, 7, 6) * 2
    for first in range(0, 7):
        for last in range(0, 7):
            try:
                parts = _generate_llm_fqn_per_model_part(12, 80, first, last)
            except ValueError:
                continue
            got = tuple(sum(n.startswith("layers.") for n in part) for part in parts)
            assert got != want


def deepspeed_1f1b_or_zbh1():
    """DeepSpeed's pipeline engine trains with TrainSchedule, 1F1B with one stage per rank
    (a stage's first backward follows its warm-up forwards, not all of them); Megatron-DeepSpeed
    can swap in ZB-H1 only (--enable-zbh1-pipeline), with no virtual stages for it."""
    require("deepspeed")
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    train = PipelineEngine._train_schedule(SimpleNamespace(micro_batches=8, num_stages=4,
                                                           stage_id=0))
    assert type(train) is schedule.TrainSchedule
    kinds = [type(cmd).__name__ for step in train.steps() for cmd in step
             if type(cmd).__name__ in ("ForwardPass", "BackwardPass")]
    assert kinds.index("BackwardPass") < kinds.count("ForwardPass")  # not GPipe's order
    assert list(inspect.signature(schedule.TrainSchedule).parameters) == [
        "micro_batches", "stages", "stage_id"]
    dests = {opt["dest"] for opt in megatron_deepspeed.options()}
    assert "enable_zbh1_pipeline" in dests


def deepspeed_zero_pp():
    """DeepSpeed's pipeline engine asserts ZeRO < 2 (runtime/pipe/engine.py)."""
    require("deepspeed")
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert ("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
            in inspect.getsource(PipelineEngine.__init__))


def deepspeed_ulysses_alone():
    """DeepSpeed's sequence parallelism is Ulysses (an all-to-all, deepspeed/sequence/
    layer.py) and Megatron-DeepSpeed runs it with neither TP nor PP (its
    initialize_model_parallel asserts; the pinned model refuses at parallel_state.py:146)."""
    require("deepspeed")
    from deepspeed.sequence import layer

    assert "_SeqAllToAll" in inspect.getsource(layer.DistributedAttention.forward)
    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--seq-length", "8192", "--max-position-embeddings", "8192",
            "--micro-batch-size", "1", "--deepspeed", "--ds-sequence-parallel-size", "2"]
    assert megatron_deepspeed.parse(argv, 4).ds_sequence_parallel_size == 2
    with pytest.raises(megatron_deepspeed.Refused, match="parallel_state.py:146"):
        megatron_deepspeed.parse([*argv, "--tensor-model-parallel-size", "2"], 8)


def deepspeed_no_groups():
    """DeepSpeed 0.19.8's ZeRO has no shard groups: MiCS's mics_shard_size is gone and ZeRO++'s
    zero_hpz_partition_size is a secondary copy of ZeRO-3 weights (runtime/zero/config.py)."""
    require("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    assert not [name for name in fields if "mics" in name]
    assert "secondary" in inspect.getsource(DeepSpeedZeroConfig).split(
        "zero_hpz_partition_size")[1][:200]


def deepspeed_split():
    """DeepSpeed's partition of GPTModelPipe: 126 blocks over 16 stages as 8 × 14, 7, 7, not
    Llama 3's 7, 8 × 14, 7 (runtime/utils.py partition_balanced)."""
    require("deepspeed")
    from tests.integration.test_deepspeed import deepspeed_stages

    assert deepspeed_stages(126, 16) == (8,) * 14 + (7, 7)
    assert deepspeed_stages(70, 12) == (6,) * 10 + (5, 5)


def _megatron_lm_options() -> list[dict]:
    from tests.integration.test_megatron_lm import TABLE

    return TABLE["options"]


def megatron_positions():
    """Megatron-LM's positions are learned, rotary (RoPE, YaRN, mRoPE), relative or none:
    `--position-embedding-type` has no ALiBi choice (the pinned parser's table)."""
    choices = next(o["choices"] for o in _megatron_lm_options()
                   if o["dest"] == "position_embedding_type")
    assert "rope" in choices and "learned_absolute" in choices
    assert not any("alibi" in str(o["flags"]).lower() or "alibi" in str(o["choices"]).lower()
                   for o in _megatron_lm_options())


def deepspeed_positions():
    """Megatron-DeepSpeed's positions are a learned table or rotary
    (`--use-rotary-position-embeddings`, `--no-position-embedding`): no ALiBi option."""
    flags = {flag for opt in megatron_deepspeed.options() for flag in opt["flags"]}
    assert {"--use-rotary-position-embeddings", "--no-position-embedding"} <= flags
    assert not any("alibi" in flag for flag in flags)


def _no_parallel_block(dests: list[str]) -> None:
    assert not any("parallel_residual" in d or "parallel_attn" in d or "parallel_block" in d
                   for d in dests)


def megatron_parallel_residual():
    """Megatron-LM's block runs attention, then the MLP on its output: neither its parser nor
    megatron-core's TransformerConfig has a parallel-residual switch."""
    require("megatron")
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    _no_parallel_block([o["dest"] for o in _megatron_lm_options()])
    _no_parallel_block([f.name for f in dataclasses.fields(TransformerConfig)])


def deepspeed_parallel_residual():
    """Megatron-DeepSpeed's ParallelTransformerLayer is sequential too: no such option."""
    _no_parallel_block([opt["dest"] for opt in megatron_deepspeed.options()])


def deepspeed_moe_sp():
    """DeepSpeed-MoE keeps 1/tp of the dispatched tokens on each tensor-parallel rank, taking
    them as duplicates (deepspeed/moe/sharded_moe.py MOELayer.forward, 0.19.8), which
    Megatron sequence parallelism makes distinct."""
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    source = inspect.getsource(sharded_moe.MOELayer.forward)
    assert "tensor_model_world_size > 1" in source
    assert "drop_tokens(dispatched_input, dim=1)" in source


CONFIRM = {
    "megatron-schedules": megatron_schedules, "megatron-vocab": megatron_vocab,
    "torchtitan-models": torchtitan_models, "torchtitan-405b-float8": torchtitan_405b_float8,
    "torchtitan-cp-allgather": torchtitan_cp_allgather, "torchtitan-flex": torchtitan_flex,
    "torchtitan-dtypes": torchtitan_dtypes, "torchtitan-no-zero1": torchtitan_no_zero1,
    "torchtitan-recompute": torchtitan_recompute, "torchtitan-zbh1": torchtitan_zbh1,
    "torchtitan-split": torchtitan_split, "deepspeed-1f1b-or-zbh1": deepspeed_1f1b_or_zbh1,
    "deepspeed-zero-pp": deepspeed_zero_pp, "deepspeed-ulysses-alone": deepspeed_ulysses_alone,
    "deepspeed-no-groups": deepspeed_no_groups, "deepspeed-split": deepspeed_split,
    "deepspeed-moe-sp": deepspeed_moe_sp, "megatron-positions": megatron_positions,
    "deepspeed-positions": deepspeed_positions,
    "megatron-parallel-residual": megatron_parallel_residual,
    "deepspeed-parallel-residual": deepspeed_parallel_residual,
}


def test_every_refusal_has_its_confirmation():
    kinds = {outcome[1] for row in EXPECTED.values() for outcome in row.values() if outcome}
    assert kinds == set(CONFIRM)


@pytest.mark.parametrize("kind", list(CONFIRM))
def test_the_framework_code_confirms(kind, monkeypatch):
    check = CONFIRM[kind]
    check(monkeypatch) if "monkeypatch" in inspect.signature(check).parameters else check()
