"""Launch configurations (emit.py) without the frameworks: degrees, batch, refusals, notes.

The frameworks' own parsers read these configurations in tests/integration.
"""

import json
import shlex

import pytest

from shardwise.arch import get_model
from shardwise.emit import FRAMEWORKS, emit
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.layout import Layout, TrainSpec

MODEL = get_model("llama3-405b")
TRAIN = TrainSpec(seq_len=8192, global_batch=2048)
LAYOUT = Layout.parse("dp=1024,tp=8,pp=2,zero=1,sp=1,schedule=interleaved,chunks=21,"
                      "recompute=selective")


def _argv(text):
    """Environment and words of an emitted shell script."""
    env = dict(line[len("export "):].split("=", 1) for line in text.splitlines()
               if line.startswith("export "))
    words = shlex.split(" ".join(line.rstrip("\\") for line in text.splitlines()
                                 if not line.startswith(("#", "export "))))
    return env, words


def _value(words, flag):
    return words[words.index(flag) + 1]


def test_megatron_carries_the_layout_and_the_model():
    env, words = _argv(emit("megatron", MODEL, LAYOUT, TRAIN, gpus_per_node=8).text)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # TP needs one hardware queue
    assert _value(words, "--nnodes") == "2048" and _value(words, "--nproc-per-node") == "8"
    assert _value(words, "--tensor-model-parallel-size") == "8"
    assert _value(words, "--num-virtual-stages-per-pipeline-rank") == "21"
    assert _value(words, "--rotary-base") == "500000"  # Llama 3 config.json rope_theta
    assert _value(words, "--vocab-size") == "128256"
    # Megatron pads V to a multiple of divisible_by·tp; 128256 = 2^8·501 stays unpadded
    assert 128256 % (int(_value(words, "--make-vocab-size-divisible-by")) * 8) == 0
    for flag in ("--sequence-parallel", "--recompute-activations", "--swiglu",
                 "--use-distributed-optimizer", "--grad-reduce-in-bf16", "--bf16"):
        assert flag in words


def test_megatron_zero3_is_megatron_fsdp_without_the_single_queue():
    layout = Layout.parse("dp=1024,tp=8,pp=2,zero=3,sp=1")
    emitted = emit("megatron", MODEL, layout, TRAIN)
    env, words = _argv(emitted.text)
    assert "--use-torch-fsdp2" not in words  # refused with pp by Megatron-LM
    assert _value(words, "--data-parallel-sharding-strategy") == "optim_grads_params"
    assert env == {}  # Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1
    assert any("CUDA_DEVICE_MAX_CONNECTIONS" in note for note in emitted.notes)


def test_megatron_grad_reduce_dtype_follows_the_plan():
    _, bf16 = _argv(emit("megatron", MODEL, LAYOUT, TRAIN).text)
    _, fp32 = _argv(emit("megatron", MODEL, LAYOUT, TrainSpec(8192, 2048, grad_dtype="fp32"))
                    .text)
    assert "--grad-reduce-in-bf16" in bf16 and "--grad-reduce-in-bf16" not in fp32
    with pytest.raises(ShardwiseError, match="fp16"):
        emit("megatron", MODEL, LAYOUT.with_(zero=3, schedule="1f1b", chunks=1),
             TrainSpec(8192, 2048, dtype="fp16"))


def test_megatron_and_deepspeed_carry_the_overlap_options():
    # asked for: TP overlap (with SP), grad-reduce / param-gather overlap
    on_train = TrainSpec(8192, 2048, tp_overlap="bulk", dp_overlap=True)
    _, on = _argv(emit("megatron", MODEL, LAYOUT, on_train).text)
    assert {"--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather"} <= set(on)
    # Megatron-LM's defaults: none of them (its p2p overlap in the interleaved schedule is on
    # by default, so no flag)
    _, off = _argv(emit("megatron", MODEL, LAYOUT, TRAIN).text)
    assert not {"--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather",
                "--no-overlap-p2p-communication"} & set(off)
    # Megatron needs SP for TP overlap: not emitted, and the note says the plan agrees
    no_sp = emit("megatron", MODEL, LAYOUT.with_(sp=False), on_train)
    assert "--tp-comm-overlap" not in _argv(no_sp.text)[1]
    assert any("--tp-comm-overlap needs --sequence-parallel" in note for note in no_sp.notes)
    # DeepSpeed's overlap_comm defaults to ZeRO-3 only (runtime/zero/config.py)
    for zero, expected in ((1, False), (3, True)):
        layout = Layout.parse(f"dp=2048,tp=8,zero={zero}")
        config = json.loads(emit("deepspeed", MODEL, layout, TRAIN).text)
        assert config["zero_optimization"]["overlap_comm"] is expected


def test_megatron_vocabulary_padding_is_said():
    gpt3 = get_model("gpt3-175b")  # V = 50257 is odd: tp=8 must pad it
    emitted = emit("megatron", gpt3, Layout(dp=8, tp=8), TrainSpec(2048, 64))
    assert any("pads the vocabulary 50257 to 50264" in note for note in emitted.notes)


def test_torchtitan_command_line():
    emitted = emit("torchtitan", MODEL, LAYOUT, TRAIN)
    _, words = _argv(emitted.text)
    assert words[words.index("-m") + 1:words.index("-m") + 6] == [
        "torchtitan.train", "--module", "llama3", "--config", "llama3_405b"]
    assert _value(words, "--parallelism.data_parallel_shard_degree") == "1024"
    assert _value(words, "--parallelism.pipeline_parallel_layers_per_stage") == "3"
    assert _value(words, "--parallelism.pipeline_parallel_first_stage_less_layers") == "0"
    assert _value(words, "--training.local_batch_size") == "2"  # 2048 / dp, split by the pp
    assert "--training.disable_cuda_graphs" in words  # pp > 1
    assert words[-1] == "activation-checkpoint:selective"
    assert any("ZeRO-1" in note for note in emitted.notes)
    assert any("reduces gradients in float32" in note for note in emitted.notes)


def test_torchtitan_hybrid_shard_and_zero3_reshard():
    layout = Layout.parse("dp=2048,tp=8,zero=3,zero_group=16")
    _, words = _argv(emit("torchtitan", MODEL, layout, TRAIN).text)
    assert _value(words, "--parallelism.data_parallel_shard_degree") == "16"
    assert _value(words, "--parallelism.data_parallel_replicate_degree") == "128"
    assert _value(words, "--parallelism.fsdp_reshard_after_forward") == "always"


@pytest.mark.parametrize(("model", "train", "reason"), [
    ("mixtral-8x7b", TRAIN, "ships no mixtral-8x7b model"),
    ("llama3-405b", TrainSpec(8192, 2048, dtype="fp16"), "bfloat16 or float32 only"),
])
def test_torchtitan_refuses_what_it_cannot_run(model, train, reason):
    layout = Layout(dp=64, tp=8, zero=1)
    with pytest.raises(ShardwiseError, match=reason):
        emit("torchtitan", get_model(model), layout, train)


def test_deepspeed_json_batch_arithmetic_and_launch():
    emitted = emit("deepspeed", MODEL, LAYOUT, TRAIN)
    config = json.loads(emitted.text)
    assert config["train_batch_size"] == 2048
    assert (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
            * LAYOUT.dp == config["train_batch_size"])
    assert config["zero_optimization"]["stage"] == 1
    assert config["data_types"]["grad_accum_dtype"] == "bf16"
    assert emitted.notes[0].startswith("launch (Megatron-DeepSpeed): deepspeed --num_nodes 2048")
    assert "--tensor-model-parallel-size 8" in emitted.notes[0]


def test_deepspeed_hybrid_zero3_is_zeropp_not_mics():
    layout = Layout.parse("dp=2048,tp=8,zero=3,zero_group=16")
    emitted = emit("deepspeed", MODEL, layout, TRAIN)
    zero = json.loads(emitted.text)["zero_optimization"]
    assert "mics_shard_size" not in zero  # removed in DeepSpeed 0.19
    assert zero["zero_hpz_partition_size"] == 16
    assert any("MiCS was removed" in note for note in emitted.notes)


@pytest.mark.parametrize(("layout", "reason"), [
    ("dp=1024,tp=8,pp=2,zero=2", "refuses ZeRO-2 with pp=2"),
    ("dp=256,tp=8,cp=8,sp=1", "cannot combine Megatron sequence parallelism"),
    ("dp=64,tp=8,cp=32", r"Ulysses \(all-to-all over heads\) only: cp_kind=ring"),
    ("dp=64,tp=2,cp=32,cp_kind=hybrid,ulysses=4", "only: cp_kind=hybrid"),
    ("dp=64,tp=8,cp=32,cp_kind=ulysses", "32 must divide 16"),  # 128 query heads / tp 8
])
def test_deepspeed_refuses_what_it_cannot_run(layout, reason):
    with pytest.raises(ShardwiseError, match=reason):
        emit("deepspeed", MODEL, Layout.parse(layout), TrainSpec(8192, 4096))


def test_context_parallel_kind_follows_the_layout():
    """Megatron names each kind (`--cp-comm-type`, the hybrid's group sizes); DeepSpeed runs
    Ulysses only, torchtitan ring attention only — the others are refused, never converted."""
    model, train = get_model("llama3-8b"), TrainSpec(32768, 64)
    kinds = {"ring": "cp=4", "ulysses": "cp=4,cp_kind=ulysses",
             "hybrid": "cp=8,cp_kind=hybrid,ulysses=4"}
    for kind, text in kinds.items():
        layout = Layout.parse(f"tp=2,dp=2,{text}")
        _, words = _argv(emit("megatron", model, layout, train).text)
        comm = words[words.index("--cp-comm-type") + 1]
        assert comm == {"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p"}[kind]
        sizes = ("--hierarchical-context-parallel-sizes" in words
                 and words[words.index("--hierarchical-context-parallel-sizes") + 1:][:2])
        assert sizes == (["4", "2"] if kind == "hybrid" else False)
        for framework, runs in (("deepspeed", "ulysses"), ("torchtitan", "ring")):
            if kind == runs:
                emitted = emit(framework, model, layout, train)
                if framework == "deepspeed":
                    assert "--ds-sequence-parallel-size 4" in emitted.notes[0]
            else:
                with pytest.raises(ShardwiseError, match=f"cp_kind={kind} cannot run"):
                    emit(framework, model, layout, train)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_framework_rejects_invalid_layouts(framework):
    with pytest.raises(LayoutError):
        emit(framework, MODEL, Layout(tp=3), TRAIN)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_framework_refuses_dtypes_it_cannot_launch(framework):
    with pytest.raises(ShardwiseError, match="fp8 has no launch configuration"):
        emit(framework, MODEL, LAYOUT, TrainSpec(8192, 2048, dtype="fp8"))


def test_unknown_framework():
    with pytest.raises(ShardwiseError, match="unknown framework"):
        emit("jax", MODEL, LAYOUT, TRAIN)
