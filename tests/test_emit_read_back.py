"""Exports read back by the frameworks' own parsers, in-process (not marked integration, so
mutation testing of emit/* runs them): `shardwise.emit.emit` (what `plan --emit` and the web
app call) on non-degenerate runs — MLA (d_k ≠ d_v) with shared experts and a dense first layer
over tp·cp·ep = 16, interleaved pp, uneven stages, ZeRO 1/2/3 in shard groups, DeepSpeed-MoE —
then every planned value checked field by field by tests/integration's readers
(megatron-core's TransformerConfig and process groups, Megatron-LM's parser rebuilt from its
table with `validate_args`' rules, torchtitan 0.3.0's ConfigManager and ParallelDims,
DeepSpeed 0.19.8's DeepSpeedConfig and Megatron-DeepSpeed's parser), plus the model's
published config.json values where those readers stop (MLA ranks, shared experts, dense
layers). A framework that is not installed skips its tests.
"""

from __future__ import annotations

import ast

import pytest

from shardwise.arch import get_model
from shardwise.emit import emit
from shardwise.layout import Layout, TrainSpec
from tests.integration.conftest import Emit

IMPL = {"megatron": "megatron-te", "torchtitan": "torchtitan", "deepspeed": "megatron-deepspeed"}

# DeepSeek-V2-Lite's config.json (huggingface.co/deepseek-ai/DeepSeek-V2-Lite): MLA with
# d_k = 128 + 64 ≠ d_v = 128, no query LoRA, 64 routed experts (top 6) of width 1408, 2 shared,
# the first layer dense (first_k_dense_replace 1) of width 10944, 27 layers
V2_LITE = {"num_layers": 27, "hidden_size": 2048, "ffn_hidden_size": 10944,
           "num_attention_heads": 16, "kv_lora_rank": 512, "qk_head_dim": 128,
           "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "q_lora_rank": None,
           "num_experts": 64, "moe_router_topk": 6, "moe_ffn_hidden_size": 1408,
           "moe_shared_expert_intermediate_size": 2 * 1408, "vocab_size": 102400,
           "layernorm_epsilon": 1e-6, "qk_layernorm": True, "no_rope_freq": None}
# Llama 3 8B's config.json: 32 layers, d 4096, 8 KV heads of 32, d_ff 14336, V 128256
LLAMA3_8B = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
             "num_attention_heads": 32, "num_query_groups": 8, "vocab_size": 128256,
             "rotary_base": 500000, "layernorm_epsilon": 1e-5, "qk_layernorm": False,
             "no_rope_freq": None}
# Qwen3-8B's config.json: head_dim 128, QK-norm per head (Megatron's --qk-layernorm),
# RMSNorm ε 1e-6, θ 1e6; SmolLM3-3B's: RoPE left out of every 4th layer
# (no_rope_layer_interval 4: Megatron's --no-rope-freq 4), θ 5e6
QWEN3_8B = {"num_layers": 36, "hidden_size": 4096, "ffn_hidden_size": 12288,
            "num_attention_heads": 32, "num_query_groups": 8,
            "vocab_size": 151936, "rotary_base": 1000000, "layernorm_epsilon": 1e-6,
            "qk_layernorm": True, "no_rope_freq": None}
SMOLLM3_3B = {"num_layers": 36, "hidden_size": 2048, "ffn_hidden_size": 11008,
              "num_attention_heads": 16, "num_query_groups": 4, "vocab_size": 128256,
              "rotary_base": 5000000, "qk_layernorm": False, "no_rope_freq": "4"}
PUBLISHED = {"deepseek-v2-lite": V2_LITE, "llama3-8b": LLAMA3_8B, "qwen3-8b": QWEN3_8B,
             "smollm3-3b": SMOLLM3_3B}


class Exported:
    """`shardwise plan … --emit F --json`'s fields (report.builders.emit_payload) for a given
    layout, from the Python API: what tests/integration's `reads_back` functions read."""

    def __init__(self, framework: str, model: str, layout: Layout, **train):
        spec = TrainSpec(**{"impl": IMPL[framework], "global_batch": 256, "seq_len": 4096}
                         | train)
        out = emit(framework, get_model(model), layout, spec)
        assert out.launch is not None
        self.layout, self.text, self.notes, self.launch = layout, out.text, list(out.notes), \
            out.launch
        self.plan = {"seq_len": spec.seq_len, "global_batch": spec.global_batch,
                     "dtype": spec.dtype, "grad_dtype": spec.grad_dtype or spec.dtype,
                     "stack": spec.settings().to_dict()}

    command = Emit.command  # (environment, argv) of the shell script


# --- Megatron-LM ---------------------------------------------------------------------------

MEGATRON = {
    # MLA + DeepSeekMoE over tp·cp·ep = 2·2·4, the distributed optimizer
    "v2lite-tp2-cp2-ep4": ("deepseek-v2-lite", dict(dp=4, tp=2, cp=2, ep=4, zero=1, sp=True)),
    # experts without tp (etp 1 ≠ tp 2), Ulysses context parallelism, selective recompute
    "v2lite-etp1-ulysses": ("deepseek-v2-lite", dict(dp=4, tp=2, cp=2, ep=4, etp=1, zero=1,
                                                     sp=True, cp_kind="ulysses",
                                                     recompute="selective")),
    # interleaved 1F1B: 32 layers over pp 4 × 2 virtual stages of 4
    "8b-pp4-interleaved": ("llama3-8b", dict(dp=2, tp=2, pp=4, schedule="interleaved",
                                             chunks=2, zero=1, sp=True)),
    # uneven stages with equal middles (first/last flags) and without (an explicit layout)
    "8b-pp4-7-9-9-7": ("llama3-8b", dict(dp=2, tp=2, pp=4, zero=1, partition=(7, 9, 9, 7))),
    "8b-pp4-6-10-8-8": ("llama3-8b", dict(dp=2, tp=2, pp=4, zero=1, partition=(6, 10, 8, 8))),
    # an embedding-only first stage: megatron-core refuses 0 by the first-stage flag
    "8b-pp4-0-11-11-10": ("llama3-8b", dict(dp=2, tp=2, pp=4, zero=1,
                                            partition=(0, 11, 11, 10))),
    # Megatron-FSDP: ZeRO-3 in shard groups of 4 of dp·cp = 16 (HSDP), ZeRO-2 over all
    "8b-zero3-group4-cp2": ("llama3-8b", dict(dp=8, cp=2, zero=3, zero_group=4)),
    "8b-zero2-tp2": ("llama3-8b", dict(dp=8, tp=2, zero=2, sp=True, recompute="full")),
    # the distributed optimizer in 2 instances (groups of 8 of dp·cp 16), hybrid CP
    "8b-zero1-group8-hybrid": ("llama3-8b", dict(dp=4, cp=4, tp=2, zero=1, zero_group=8,
                                                 cp_kind="hybrid", ulysses=2, sp=True)),
    "qwen3-8b-tp2": ("qwen3-8b", dict(dp=4, tp=2, zero=1, sp=True)),
    "smollm3-pp2": ("smollm3-3b", dict(dp=4, pp=2, zero=1)),
}


def _megatron_lm(out: Exported):
    """Megatron-LM's parser (rebuilt from its table) and `validate_args` on the script."""
    from tests.integration.test_megatron_lm import USER, _parse, _validate

    env, words = out.command()
    args = _parse([*words[words.index("pretrain_gpt.py") + 1:], *USER])
    _validate(args, out.layout.world_size, env)
    return args


@pytest.mark.parametrize("run", list(MEGATRON))
def test_megatron_core_reads_back_every_planned_value(run):
    """tests/integration/test_megatron.reads_back: degrees, virtual stages, each rank's
    layers (megatron-core's own offsets), CP kind and groups, ZeRO as the distributed
    optimizer or Megatron-FSDP and its instances, batch, shape, dtypes, overlaps, backend."""
    pytest.importorskip("megatron.core")
    from tests.integration import test_megatron

    model, layout = MEGATRON[run]
    out = Exported("megatron", model, Layout(**layout))
    test_megatron.reads_back(out, get_model(model))


@pytest.mark.parametrize("run", list(MEGATRON))
def test_megatron_lm_reads_back_the_degrees_and_the_published_shape(run):
    """Megatron-LM's own parser: data parallelism = world / (tp·pp·cp), the expert degrees,
    ZeRO's optimizer, the vocabulary unpadded, and the model's config.json values."""
    pytest.importorskip("megatron.core")
    model, given = MEGATRON[run]
    layout = Layout(**given)
    out = Exported("megatron", model, layout)
    args = _megatron_lm(out)
    assert (args.data_parallel_size, args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size, args.context_parallel_size,
            args.expert_model_parallel_size) == (layout.dp, layout.tp, layout.pp, layout.cp,
                                                 layout.ep)
    # Megatron's expert TP defaults to tp (None); an explicit one only where it differs
    assert (args.expert_tensor_parallel_size or layout.tp) == (layout.etp or layout.tp)
    assert args.use_distributed_optimizer == (layout.zero >= 1)  # FSDP v1 sets it too
    assert args.use_megatron_fsdp == (layout.zero >= 2)
    assert args.sequence_parallel == layout.sp
    assert (args.recompute_granularity or "none") == layout.recompute
    assert args.vocab_size % (args.make_vocab_size_divisible_by * layout.tp) == 0
    for name, value in PUBLISHED[model].items():  # (--no-rope-freq: text, a custom type)
        assert getattr(args, name) == value, name
    # head width: --kv-channels, else Megatron's h / a (128 in each of these models)
    assert (args.kv_channels or args.hidden_size // args.num_attention_heads) == (
        128 if model != "deepseek-v2-lite" else 2048 // 16)
    assert args.group_query_attention == (model != "deepseek-v2-lite")
    assert args.micro_batch_size * args.data_parallel_size * (
        256 // (args.micro_batch_size * layout.dp)) == args.global_batch_size == 256
    if model == "deepseek-v2-lite":
        assert args.multi_latent_attention
        # the dense first layer, then MoE in every layer (config.json first_k_dense_replace 1)
        assert ast.literal_eval(args.moe_layer_freq) == [0] + [1] * 26
        # V2-Lite's router: softmax over all experts, top-k unnormalised, no scaling, 1 group
        assert args.moe_router_pre_softmax and args.moe_router_score_function == "softmax"
        assert args.moe_router_topk_scaling_factor in (None, 1.0)
        assert args.moe_router_num_groups is None


def test_megatron_uneven_stages_as_megatron_lm_builds_them():
    """7, 9, 9, 7 as first/last-stage flags (the middles equal); 6, 10, 8, 8 as an explicit
    layout: megatron-core's own parser of that string gives the planned layers per stage."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    args = _megatron_lm(Exported("megatron", *_run("8b-pp4-7-9-9-7")))
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
            args.pipeline_model_parallel_layout) == (7, 7, None)
    args = _megatron_lm(Exported("megatron", *_run("8b-pp4-6-10-8-8")))
    assert args.decoder_first_pipeline_num_layers is None
    parsed = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout.strip("'"), 4)
    assert [stage[0].count(LayerType.decoder) for stage in parsed.layout] == [6, 10, 8, 8]
    assert parsed.layout[0][0][0] == LayerType.embedding and parsed.layout[-1][0][-1] == \
        LayerType.loss


def _run(name: str) -> tuple[str, Layout]:
    model, layout = MEGATRON[name]
    return model, Layout(**layout)


# --- torchtitan ----------------------------------------------------------------------------

TORCHTITAN = {
    # DeepSeek-V2-Lite (torchtitan's deepseek_v3_16b): ZeRO-3 in groups of 4 (HSDP), ep 4,
    # tp 2, all-gathered CP 2
    "v2lite-zero3-group4-tp2-ep4-cp2": ("deepseek-v2-lite", dict(
        dp=8, tp=2, cp=2, ep=4, zero=3, zero_group=4, cp_kind="allgather")),
    # interleaved pp 4 × 2, ZeRO-2 (no reshard after forward), op-level selective AC
    "8b-pp4-interleaved-zero2": ("llama3-8b", dict(dp=2, tp=2, pp=4, schedule="interleaved",
                                                   chunks=2, zero=2, recompute="op-sac")),
    # ZeRO-0: FSDP2 replicates over dp; tp 2 without SP; full AC
    "8b-zero0-tp2": ("llama3-8b", dict(dp=8, tp=2, zero=0, recompute="full")),
}


@pytest.mark.parametrize("run", list(TORCHTITAN))
def test_torchtitan_reads_back_every_planned_value(run):
    """tests/integration/test_torchtitan.reads_back: the model built on the meta device (its
    parameters, MoE layers and router), the mesh's degrees, FSDP's shard and replicate
    degrees and reshard policy, the pipeline's stages and each rank's layers, batch and
    accumulation, precision, activation checkpointing, compile."""
    pytest.importorskip("torchtitan")
    from tests.integration import test_torchtitan

    model, layout = TORCHTITAN[run]
    out = Exported("torchtitan", model, Layout(**layout))
    test_torchtitan.reads_back(out, get_model(model))


# --- DeepSpeed -----------------------------------------------------------------------------

DEEPSPEED = {
    # pipeline engine, ZeRO-1, tp 2, full recompute
    "8b-tp2-pp2-zero1": ("llama3-8b", dict(dp=4, tp=2, pp=2, zero=1, recompute="full",
                                           micro_batch=2), {}),
    # DeepSpeed-MoE: ep 8 with expert TP 2, ZeRO-2, top-2
    "mixtral-tp2-ep8-zero2": ("mixtral-8x7b", dict(dp=16, tp=2, ep=8, zero=2), {}),
    # ZeRO-3 with parameter offload, DeepSpeed-Ulysses over cp 2, fp16
    "8b-zero3-cp2-offload": ("llama3-8b", dict(dp=8, cp=2, zero=3, cp_kind="ulysses"),
                             {"offload": "params", "dtype": "fp16"}),
}


class _DeepSpeedRank:
    """DeepSpeedConfig asks deepspeed.comm for the rank before the mpu for the data-parallel
    size (runtime/config.py); without a process group it would assume one rank."""

    def __init__(self, monkeypatch):
        import deepspeed.comm

        monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *_, **__: 0)


@pytest.mark.parametrize("run", list(DEEPSPEED))
def test_deepspeed_reads_back_every_planned_value(run, monkeypatch, tmp_path):
    """tests/integration/test_deepspeed.reads_back: DeepSpeed's batch arithmetic (train =
    micro · accumulation · dp), ZeRO stage and overlap, dtypes as the engine reads them, the
    Megatron-DeepSpeed launch line through its parser and checks; DeepSpeed-MoE's experts
    per rank and gate."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    from tests.integration import test_deepspeed

    _DeepSpeedRank(monkeypatch)
    model, layout, train = DEEPSPEED[run]
    out = Exported("deepspeed", model, Layout(**layout), **train)
    test_deepspeed.reads_back(out, get_model(model), tmp_path)
    path = tmp_path / "ds_config.json"
    config = DeepSpeedConfig(str(path), mpu=test_deepspeed._Mpu(out.layout.dp))
    zero = config.zero_config
    offloaded = train.get("offload")
    assert (zero.offload_optimizer is not None) == (offloaded is not None)
    assert (zero.offload_param is not None) == (offloaded == "params")
    if offloaded:
        assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    # Megatron-LM's --clip-grad default (1.0) as DeepSpeed reads it; the buckets DeepSpeed's
    # own defaults (the plan's DP model assumes no other)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert config.gradient_clipping == 1.0
    default = DeepSpeedZeroConfig()
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (
        default.reduce_bucket_size, default.allgather_bucket_size)
    env, _, nodes, gpus = test_deepspeed.launch(out)
    assert nodes * gpus == out.layout.world_size and gpus == min(8, out.layout.world_size)
    assert (env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1") == out.layout.sp


def test_megatron_takes_yarn_defaults_that_are_its_own_and_refuses_others():
    """Megatron-LM's MLA has no flags for YaRN's beta_fast, beta_slow and original context
    (its MLATransformerConfig fixes 32, 1, 4096): a config.json that leaves them out (the
    YaRN paper's defaults, the same values) exports; one that sets another is refused."""
    from shardwise.errors import ShardwiseError

    model = get_model("deepseek-v2-lite")
    fixed = ("beta_fast", "beta_slow", "original_max_position_embeddings")
    rope = dict(model.rope_scaling)
    assert rope["rope_type"] == "yarn" and all(key in rope for key in fixed)
    train = TrainSpec(impl="megatron-te", global_batch=256, seq_len=4096)
    layout = Layout(**MEGATRON["v2lite-tp2-cp2-ep4"][1])
    bare = model.with_(rope_scaling=tuple((k, v) for k, v in model.rope_scaling
                                          if k not in fixed))
    assert emit("megatron", bare, layout, train).launch.args == emit(
        "megatron", model, layout, train).launch.args
    for key, value in zip(fixed, (16, 2, 8192), strict=True):
        other = model.with_(rope_scaling=tuple(sorted((rope | {key: value}).items())))
        with pytest.raises(ShardwiseError) as info:
            emit("megatron", other, layout, train)
        assert "\n" not in str(info.value) and "(32, 1, 4096)" in str(info.value)


def test_a_refusal_names_the_fastest_fitting_layout_one_field_away():
    """torchtitan has no selective recompute: the nearest layout it runs changes only the
    recompute policy (one field), and of its policies (none, full, op-sac) it is the
    fastest that fits 85 % of an H100 — each checked with the scalar estimate and memory."""
    import re

    from shardwise.errors import ShardwiseError
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.estimate.step import estimate_step
    from shardwise.hardware import Cluster

    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    train = TrainSpec(impl="torchtitan", global_batch=256, seq_len=4096)
    layout = Layout(dp=8, zero=3, recompute="selective")
    with pytest.raises(ShardwiseError) as info:
        emit("torchtitan", model, layout, train)
    found = re.search(r"nearest it runs: [^(]*\(--layout ([^)]*)\), ([\d.]+) s per step",
                      str(info.value))
    assert found is not None, str(info.value)
    named = Layout.parse(found.group(1), dp=8)
    budget = 0.85 * cluster.accelerator.memory_bytes
    options = [layout.with_(recompute=r) for r in ("none", "full", "op-sac")]
    fitting = [o for o in options
               if max(m.total for m in training_memory_per_gpu(model, o, train)) <= budget]
    best = min(fitting, key=lambda o: estimate_step(model, cluster, o, train).total)
    assert named == best
    assert float(found.group(2)) == pytest.approx(
        estimate_step(model, cluster, best, train).total, abs=0.05)
