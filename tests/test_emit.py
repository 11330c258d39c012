"""Launch configurations (emit.py) without the frameworks: the stack binding, degrees, batch,
dtypes, overlaps, and refusals that name the nearest runnable layout and its step time.

The frameworks' own parsers read these configurations in tests/integration.
"""

import json
import re
import shlex

import pytest

from shardwise.arch import get_model
from shardwise.emit import FRAMEWORKS, emit, framework_stack
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.plan.evaluate import evaluate_layout
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

MODEL = get_model("llama3-405b")
TRAIN = TrainSpec(seq_len=8192, global_batch=2048)  # megatron-te, Megatron's stack
LAYOUT = Layout.parse("dp=1024,tp=8,pp=2,zero=1,sp=1,schedule=interleaved,chunks=21,"
                      "recompute=selective")
TITAN = TrainSpec(seq_len=8192, global_batch=512, impl="torchtitan")
DS = TrainSpec(seq_len=8192, global_batch=512, impl="megatron-deepspeed")
L70 = get_model("llama3-70b")


def _argv(text):
    """Environment and words of an emitted shell script."""
    env = dict(line[len("export "):].split("=", 1) for line in text.splitlines()
               if line.startswith("export "))
    words = shlex.split(" ".join(line.rstrip("\\") for line in text.splitlines()
                                 if not line.startswith(("#", "export "))))
    return env, words


def _value(words, flag):
    return words[words.index(flag) + 1]


def _refusal(framework, model, layout, train):
    with pytest.raises(ShardwiseError) as info:
        emit(framework, model, layout, train)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_plan_must_be_for_the_frameworks_stack():
    for framework in FRAMEWORKS:
        stack = framework_stack(framework).name
        other = "hf-sdpa"
        with pytest.raises(ShardwiseError, match=f"plan with --impl {stack}"):
            emit(framework, L70, Layout(dp=64), TrainSpec(8192, 512, impl=other))


def test_megatron_carries_the_layout_and_the_model():
    env, words = _argv(emit("megatron", MODEL, LAYOUT, TRAIN, gpus_per_node=8).text)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # TP needs one hardware queue
    assert _value(words, "--nnodes") == "2048" and _value(words, "--nproc-per-node") == "8"
    assert _value(words, "--tensor-model-parallel-size") == "8"
    assert _value(words, "--num-virtual-stages-per-pipeline-rank") == "21"
    assert _value(words, "--rotary-base") == "500000"  # Llama 3 config.json rope_theta
    assert "--use-rope-scaling" in words  # Llama 3.1's rope_type "llama3"
    assert _value(words, "--vocab-size") == "128256"
    # Megatron pads V to a multiple of divisible_by·tp; 128256 = 2^8·501 stays unpadded
    assert 128256 % (int(_value(words, "--make-vocab-size-divisible-by")) * 8) == 0
    for flag in ("--sequence-parallel", "--recompute-activations", "--swiglu",
                 "--use-distributed-optimizer", "--grad-reduce-in-bf16", "--bf16"):
        assert flag in words
    # megatron-te's attention kernel is TE's cuDNN fused attention ("fused")
    assert _value(words, "--attention-backend") == "fused"


def test_megatron_zero3_is_megatron_fsdp_in_fp16_too():
    """Megatron-FSDP trains fp16 (only --use-torch-fsdp2 refuses it) and takes the gradient
    dtype as its main-gradient dtype; FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1."""
    layout = Layout.parse("dp=1024,tp=8,pp=2,zero=3,sp=1")
    for dtype in ("bf16", "fp16"):
        emitted = emit("megatron", MODEL, layout, TrainSpec(8192, 2048, dtype=dtype))
        env, words = _argv(emitted.text)
        assert "--use-torch-fsdp2" not in words and "--use-megatron-fsdp" in words
        assert _value(words, "--data-parallel-sharding-strategy") == "optim_grads_params"
        assert _value(words, "--megatron-fsdp-main-grads-dtype") == dtype
        assert f"--{dtype}" in words and env == {} and emitted.notes == ()


@pytest.mark.parametrize(("zero", "groups"), [(1, 8), (2, 8), (3, 8)])
def test_megatron_shard_groups_are_optimizer_instances(zero, groups):
    """ZeRO in groups of 8 over dp=64: 8 instances (the distributed optimizer's, or
    Megatron-FSDP's HSDP outer replicas)."""
    layout = Layout(dp=64, zero=zero, zero_group=groups)
    _, words = _argv(emit("megatron", get_model("llama3-8b"), layout,
                          TrainSpec(8192, 512)).text)
    assert _value(words, "--num-distributed-optimizer-instances") == str(64 // groups)


def test_megatron_grad_reduce_dtype_follows_the_plan():
    _, bf16 = _argv(emit("megatron", MODEL, LAYOUT, TRAIN).text)
    _, fp32 = _argv(emit("megatron", MODEL, LAYOUT, TrainSpec(8192, 2048, grad_dtype="fp32"))
                    .text)
    _, fp16 = _argv(emit("megatron", MODEL, LAYOUT, TrainSpec(8192, 2048, dtype="fp16",
                                                              grad_dtype="fp32")).text)
    assert "--grad-reduce-in-bf16" in bf16 and "--grad-reduce-in-bf16" not in fp32
    assert "--accumulate-allreduce-grads-in-fp32" in fp16


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
    # Megatron-LM asserts SP under --tp-comm-overlap (arguments.py:1441): refused in one line
    assert "only with sequence parallelism" in _refusal("megatron", MODEL,
                                                        LAYOUT.with_(sp=False), on_train)
    # DeepSpeed's overlap_comm defaults to ZeRO-3 only (runtime/zero/config.py)
    for zero, expected in ((1, False), (3, True)):
        layout = Layout.parse(f"dp=64,zero={zero}")
        config = json.loads(emit("deepspeed", L70, layout, DS).text)
        assert config["zero_optimization"]["overlap_comm"] is expected


def test_megatron_explicit_pipeline_layout():
    """Middle stages that differ: every virtual stage in --pipeline-model-parallel-layout,
    the embedding on the first, the loss on the last."""
    layout = Layout.parse("dp=4,tp=2,pp=4,zero=1,partition=7:9:8:8")
    _, words = _argv(emit("megatron", get_model("llama3-8b"), layout, TrainSpec(8192, 256))
                     .text)
    assert _value(words, "--pipeline-model-parallel-layout") == "Et*7|t*9|t*8|t*8L"
    assert "--decoder-first-pipeline-num-layers" not in words


def _nearest_in(message):
    """The `--layout` text a refusal names and its predicted seconds per step."""
    match = re.search(r"\(--layout ([^)]*)\), ([0-9.]+) s per step predicted", message)
    assert match, message
    return match.group(1), float(match.group(2))


def test_a_refusal_names_the_nearest_layout_and_its_step_time():
    """GPT-3's 50257 rows cannot split over tp=8 (Megatron pads them): the refusal names a
    layout Megatron runs as planned and its step time, which `plan --layout` would show."""
    gpt3 = get_model("gpt3-175b")
    train = TrainSpec(2048, 1536)
    layout = Layout.parse("dp=8,tp=8,pp=16,zero=1,sp=1,recompute=full")
    message = _refusal("megatron", gpt3, layout, train)
    assert "pads 50257 to 50264 rows" in message
    text, seconds = _nearest_in(message)
    near = Layout.parse(text)
    near = near.with_(dp=layout.world_size // (near.tp * near.pp * near.cp))
    assert near.tp == 1 or 50257 % near.tp == 0
    emit("megatron", gpt3, near, train)  # runs as planned
    entry = evaluate_layout(gpt3, Cluster.of(1024, "h100"), train, near)
    assert seconds == pytest.approx(entry.estimate.total, rel=5e-3)


@pytest.mark.parametrize(("framework", "model", "layout", "train"), [
    ("deepspeed", "llama3-70b", "dp=8,tp=4,cp=4,sp=1", DS),  # Ulysses with TP and SP
    ("deepspeed", "llama3-70b", "dp=8,tp=8,pp=2,zero=3", DS),
    ("deepspeed", "llama3-8b", "dp=1,tp=8,pp=3,zero=1,partition=10:11:11",
     TrainSpec(8192, 96, impl="megatron-deepspeed")),
    ("torchtitan", "llama3-70b", "dp=8,tp=4,cp=2,zero=1", TITAN),
    ("megatron", "llama3-70b", "dp=4,tp=8,pp=4,schedule=gpipe", TrainSpec(8192, 256)),
])
def test_the_nearest_layout_named_runs(framework, model, layout, train):
    """The layout a refusal advises is one the framework runs as planned (issue 33: the
    SP + Ulysses advice was refused by the same rule)."""
    spec, refused = get_model(model), Layout.parse(layout)
    text, _ = _nearest_in(_refusal(framework, spec, refused, train))
    near = Layout.parse(text)
    near = near.with_(dp=refused.world_size // (near.tp * near.pp * near.cp))
    assert emit(framework, spec, near, train).text


def test_nearest_changes_the_fewest_fields():
    """ZB-H1 on Megatron: the nearest is the same layout on 1F1B."""
    layout = Layout.parse("dp=4,tp=8,pp=4,zero=1,schedule=zb-h1,recompute=full")
    message = _refusal("megatron", L70, layout, TrainSpec(8192, 256))
    assert "megatron-te has no zb-h1 pipeline schedule" in message
    assert _nearest_in(message)[0] == "tp=8,pp=4,zero=1,recompute=full"


def test_torchtitan_command_line():
    layout = Layout.parse("dp=8,tp=4,pp=2,zero=2,sp=1,schedule=interleaved,chunks=10,"
                          "recompute=op-sac")
    emitted = emit("torchtitan", L70, layout, TITAN)
    _, words = _argv(emitted.text)
    assert words[words.index("-m") + 1:words.index("-m") + 6] == [
        "torchtitan.train", "--module", "llama3", "--config", "llama3_70b"]
    assert _value(words, "--parallelism.data_parallel_shard_degree") == "8"
    assert _value(words, "--parallelism.fsdp_reshard_after_forward") == "never"  # ZeRO-2
    assert _value(words, "--parallelism.pipeline_parallel_schedule") == "Interleaved1F1B"
    assert _value(words, "--parallelism.pipeline_parallel_layers_per_stage") == "4"
    assert _value(words, "--training.local_batch_size") == "64"  # 512 / dp, split by the pp
    assert _value(words, "--training.mixed_precision_reduce") == "float32"
    assert "--training.disable_cuda_graphs" in words  # pp > 1
    assert words[-1] == "activation-checkpoint:selective"  # op-sac is torchtitan's SelectiveAC
    assert emitted.notes == ()


def test_torchtitan_hybrid_shard_and_zero3_reshard():
    layout = Layout.parse("dp=64,zero=3,zero_group=16")
    _, words = _argv(emit("torchtitan", get_model("llama3-8b"), layout, TITAN).text)
    assert _value(words, "--parallelism.data_parallel_shard_degree") == "16"
    assert _value(words, "--parallelism.data_parallel_replicate_degree") == "4"
    assert _value(words, "--parallelism.fsdp_reshard_after_forward") == "always"


def test_torchtitan_reduces_gradients_in_fp32():
    """mixed_precision_reduce is float32 only: a torchtitan run's gradients are fp32 unless it
    names another, which it cannot run."""
    assert TITAN.grad_dtype == "fp32"
    with pytest.raises(ShardwiseError, match="reduces bf16 gradients in fp32"):
        TrainSpec(8192, 512, impl="torchtitan", grad_dtype="bf16").validate()


@pytest.mark.parametrize(("model", "layout", "reason"), [
    ("mixtral-8x7b", "dp=64", "ships no mixtral-8x7b model"),
    ("llama3-405b", "dp=64", "Float8"),
    ("llama3-70b", "dp=8,tp=8,zero=1", "torchtitan has no ZeRO-1"),
    ("llama3-70b", "dp=8,tp=4,cp=2,zero=3", "an all-gather of K/V"),
    ("llama3-70b", "dp=8,tp=2,pp=4,schedule=zb-h1,zero=2", "no zb-h1 pipeline schedule"),
])
def test_torchtitan_refuses_what_it_cannot_run(model, layout, reason):
    assert reason in _refusal("torchtitan", get_model(model), Layout.parse(layout), TITAN)


def test_deepspeed_json_batch_arithmetic_and_launch():
    layout = Layout.parse("dp=8,tp=8,pp=2,zero=1,sp=1")
    emitted = emit("deepspeed", L70, layout, DS)
    config = json.loads(emitted.text)
    assert config["train_batch_size"] == 512
    assert (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
            * layout.dp == config["train_batch_size"])
    assert config["zero_optimization"]["stage"] == 1
    assert config["data_types"]["grad_accum_dtype"] == "bf16"
    launch = emitted.notes[0]
    assert launch.startswith("launch (Megatron-DeepSpeed 4efb479): CUDA_DEVICE_MAX_CONNECTIONS=1 "
                             "deepspeed --num_nodes 16")
    words = launch.split()
    assert _value(words, "--tensor-model-parallel-size") == "8"
    assert _value(words, "--num-layers") == "80" and "--sequence-parallel" in words


def test_deepspeed_uneven_stages_are_its_own_split_without_a_partition_flag():
    """32 blocks over 3 stages: Megatron-DeepSpeed's GPTModelPipe always partitions
    'type:transformer' (11, 11, 10); its parser has no --pp-partition-method."""
    model = get_model("llama3-8b")
    train = TrainSpec(8192, 96, impl="megatron-deepspeed")
    ok = emit("deepspeed", model, Layout.parse("dp=1,tp=8,pp=3,zero=1,partition=11:11:10"),
              train)
    assert "--pp-partition-method" not in ok.notes[0]
    assert "cannot split 32 layers as 10,11,11" in _refusal(
        "deepspeed", model, Layout.parse("dp=1,tp=8,pp=3,zero=1,partition=10:11:11"), train)


def test_deepspeed_zb_h1():
    words = emit("deepspeed", L70, Layout.parse("dp=4,tp=8,pp=4,zero=1,schedule=zb-h1"),
                 DS).notes[0].split()
    assert "--enable-zbh1-pipeline" in words and "--sequence-parallel" not in words


@pytest.mark.parametrize(("layout", "reason"), [
    ("dp=8,tp=8,pp=2,zero=2", "asserts ZeRO < 2"),
    ("dp=64,zero=3,zero_group=8", "cannot shard ZeRO-3 in groups"),
    ("dp=8,tp=8,pp=2,zero=1,sp=1,schedule=zb-h1", "runs ZB-H1 without sequence parallelism"),
    # Ulysses needs tp = pp = 1 (and the layout's cp is ring attention)
    ("dp=8,tp=4,cp=4,sp=1", "without tensor and pipeline parallelism only"),
])
def test_deepspeed_refuses_what_it_cannot_run(layout, reason):
    message = _refusal("deepspeed", L70, Layout.parse(layout), DS)
    assert reason in message and "nearest it runs:" in message


@pytest.mark.parametrize(("model", "layout", "reason"), [
    # DeepSpeed-MoE's softmax top-k gate has no shared experts, sigmoid scores or groups
    ("deepseek-v2-lite", "dp=64,ep=8", "shared expert"),
    ("tiny-deepseek", "dp=8,ep=2", "shared expert"),
    # its expert groups live inside the data-parallel group (cp ranks excluded), no ZeRO-3,
    # and it takes the tp ranks' tokens as duplicates (no SP)
    ("mixtral-8x7b", "dp=64,ep=8,zero=3", "without ZeRO-3"),
    ("mixtral-8x7b", "dp=32,tp=2,ep=8,sp=1", "sequence parallelism makes distinct"),
    ("mixtral-8x7b", "dp=4,cp=8,ep=8,cp_kind=ulysses", "ep=8 must divide dp=4"),
])
def test_deepspeed_refuses_what_deepspeed_moe_cannot_run(model, layout, reason):
    train = TrainSpec(seq_len=64 if model.startswith("tiny") else 8192, global_batch=512,
                      impl="megatron-deepspeed")
    assert reason in _refusal("deepspeed", get_model(model), Layout.parse(layout), train)


def test_deepspeed_moe_gate_and_layers_follow_the_model():
    """top-1 keeps the probability as the gate, top-k > 1 renormalises: the router's
    norm_topk must match; a first dense layer is not every --expert-interval-th layer."""
    mixtral = get_model("mixtral-8x7b")
    layout = Layout(dp=64, ep=8)
    assert "renormalises the top-2 gates" in _refusal(
        "deepspeed", mixtral.with_(norm_topk=False), layout, DS)
    assert "top-1 gate" in _refusal("deepspeed", mixtral.with_(top_k=1), layout, DS)
    assert "first 1 layers are dense" in _refusal(
        "deepspeed", mixtral.with_(first_dense_layers=1), layout, DS)
    assert "--ffn-hidden-size (14336), not 4096" in _refusal(
        "deepspeed", mixtral.with_(d_ff_expert=4096, moe_every=2), layout, DS)
    top1 = emit("deepspeed", mixtral.with_(top_k=1, norm_topk=False), layout, DS).notes[0]
    assert "--topk 1 " in top1 and "top2-2nd" not in top1


def test_deepspeed_refuses_fp32_grads_without_zero():
    fp32 = TrainSpec(8192, 512, impl="megatron-deepspeed", grad_dtype="fp32")
    assert "model dtype only" in _refusal("deepspeed", L70, Layout(dp=64), fp32)


def test_context_parallel_kind_follows_the_layout():
    """Megatron names each kind (`--cp-comm-type`, the hybrid's group sizes); DeepSpeed runs
    Ulysses only and only without TP and PP; torchtitan's CP is an all-gather of K/V, none of
    the first three — the others are refused, never converted."""
    model = get_model("llama3-8b")
    kinds = {"ring": "cp=4", "ulysses": "cp=4,cp_kind=ulysses",
             "hybrid": "cp=8,cp_kind=hybrid,ulysses=4", "allgather": "cp=4,cp_kind=allgather"}
    megatron = TrainSpec(32768, 64)
    for kind, text in kinds.items():
        layout = Layout.parse(f"tp=2,dp=2,{text}")
        _, words = _argv(emit("megatron", model, layout, megatron).text)
        comm = words[words.index("--cp-comm-type") + 1]
        assert comm == {"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p",
                        "allgather": "all_gather"}[kind]
        sizes = ("--hierarchical-context-parallel-sizes" in words
                 and words[words.index("--hierarchical-context-parallel-sizes") + 1:][:2])
        assert sizes == (["4", "2"] if kind == "hybrid" else False)
        for framework in ("deepspeed", "torchtitan")[:2 if kind != "allgather" else 1]:
            train = TrainSpec(32768, 64, impl=framework_stack(framework).name)
            with pytest.raises(ShardwiseError, match="context parallelism is|without tensor "
                                                     "and pipeline parallelism"):
                emit(framework, model, layout.with_(zero=2), train)
    ulysses = Layout.parse("dp=4,cp=4,cp_kind=ulysses")
    emitted = emit("deepspeed", model, ulysses,
                   TrainSpec(32768, 64, impl="megatron-deepspeed"))
    assert "--ds-sequence-parallel-size 4" in emitted.notes[0]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_framework_rejects_invalid_layouts(framework):
    train = TrainSpec(8192, 512, impl=framework_stack(framework).name)
    with pytest.raises(LayoutError):
        emit(framework, L70, Layout(tp=3), train)


def test_dtype_fp8_is_the_stacks_default_recipe_or_refused():
    """FP8 is a recipe: `--dtype fp8` reads as bf16 weights with the stack's default recipe
    (Megatron-LM's --fp8-recipe default, delayed), the same export as `--fp8 delayed`; a stack
    without FP8 (Megatron-DeepSpeed) refuses in one line pointing to the recipes."""
    as_dtype = TrainSpec(8192, 512, dtype="fp8")
    assert (as_dtype.dtype, as_dtype.fp8) == ("bf16", "delayed")
    layout = Layout(dp=8, tp=8)
    assert emit("megatron", L70, layout, as_dtype).text == emit(
        "megatron", L70, layout, TrainSpec(8192, 512, fp8="delayed")).text
    with pytest.raises(ShardwiseError, match="use --dtype bf16 --fp8 RECIPE on megatron-te"):
        emit("deepspeed", L70, Layout(dp=64), TrainSpec(8192, 512, dtype="fp8",
                                                        impl="megatron-deepspeed"))


def test_unknown_framework():
    with pytest.raises(ShardwiseError, match="unknown framework"):
        emit("jax", MODEL, LAYOUT, TRAIN)


def test_cli_emit_binds_the_search_to_the_frameworks_stack():
    args = ("plan", "llama3-8b", "--gpus", "16", "--seq", "4096", "--global-batch", "64",
            "--top", "1")
    out = shardwise_json(*args, "--emit", "torchtitan")
    assert out["plan"]["stack"]["name"] == "torchtitan" and out["plan"]["grad_dtype"] == "fp32"
    assert shardwise_json(*args, "--emit", "deepspeed", "--impl", "megatron-deepspeed")[
        "plan"]["stack"]["name"] == "megatron-deepspeed"
    assert_one_line_error(shardwise(*args, "--emit", "torchtitan", "--impl", "megatron-te",
                                    check=False),
                          "--emit torchtitan runs the torchtitan stack")


def test_cli_forced_layout_the_stack_cannot_run_is_refused_before_any_estimate():
    result = shardwise("plan", "llama3-8b", "--gpus", "32", "--global-batch", "256",
                       "--impl", "torchtitan", "--layout", "tp=2,pp=4,zero=1", check=False)
    assert_one_line_error(result, "torchtitan has no ZeRO-1", "nearest it runs:")


def test_a_launch_that_does_not_fill_its_nodes_is_refused():
    """`emit.launchers.check_shape`: 12 ranks on two 8-GPU nodes would start 16."""
    from shardwise.emit.launchers import Launch, launcher_script

    launch = Launch(2, 8, (), ("pretrain_gpt.py",), ("--num-layers 4",))
    with pytest.raises(ShardwiseError, match="12 GPUs do not fill 2 nodes of 8 GPUs"):
        launcher_script("slurm", launch, 12)
    assert launcher_script("slurm", launch, 16).count("#SBATCH --nodes=2") == 1
