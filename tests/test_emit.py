"""Launch configurations (emit.py): each parses and carries the layout's degrees and batch."""

import json

import pytest

from shardwise.arch import get_model
from shardwise.emit import FRAMEWORKS, emit
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.layout import Layout, TrainSpec

tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11

MODEL = get_model("llama3-405b")
TRAIN = TrainSpec(seq_len=8192, global_batch=2048)
LAYOUT = Layout.parse("dp=1024,tp=8,pp=2,zero=1,sp=1,schedule=interleaved,chunks=21,"
                      "recompute=selective")


def _flags(text):
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        parts = line.rstrip(" \\").split(maxsplit=1)
        out[parts[0]] = parts[1] if len(parts) > 1 else None
    return out


def test_megatron_flags_carry_the_layout():
    flags = _flags(emit("megatron", MODEL, LAYOUT, TRAIN).text)
    assert flags["--tensor-model-parallel-size"] == "8"
    assert flags["--pipeline-model-parallel-size"] == "2"
    assert int(flags["--num-layers-per-virtual-pipeline-stage"]) * 2 * 21 == 126
    assert flags["--global-batch-size"] == "2048" and flags["--micro-batch-size"] == "1"
    assert flags["--num-query-groups"] == "8"
    for flag in ("--sequence-parallel", "--recompute-activations", "--swiglu",
                 "--use-distributed-optimizer", "--group-query-attention"):
        assert flag in flags


def test_megatron_full_recompute_and_fsdp():
    layout = Layout.parse("dp=2048,tp=8,zero=3,recompute=full")
    emitted = emit("megatron", MODEL, layout, TRAIN)
    flags = _flags(emitted.text)
    assert flags["--recompute-granularity"] == "full" and "--use-torch-fsdp2" in flags
    zb = emit("megatron", MODEL, LAYOUT.with_(schedule="zb-h1", chunks=1), TRAIN)
    assert any("ZB-H1" in note for note in zb.notes)


def test_torchtitan_toml_degrees_multiply_to_the_world():
    config = tomllib.loads(emit("torchtitan", MODEL, LAYOUT, TRAIN).text)
    par = config["parallelism"]
    world = (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
             * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"]
             * par["context_parallel_degree"])
    assert world == LAYOUT.world_size
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert par["pipeline_parallel_layers_per_stage"] == 3
    assert config["training"]["global_batch_size"] == 2048
    assert config["activation_checkpoint"]["mode"] == "selective"


def test_torchtitan_hybrid_shard():
    layout = Layout.parse("dp=2048,tp=8,zero=3,zero_group=16")
    par = tomllib.loads(emit("torchtitan", MODEL, layout, TRAIN).text)["parallelism"]
    assert par["data_parallel_shard_degree"] == 16
    assert par["data_parallel_replicate_degree"] == 128


def test_deepspeed_json_batch_arithmetic():
    emitted = emit("deepspeed", MODEL, LAYOUT, TRAIN)
    config = json.loads(emitted.text)
    assert config["train_batch_size"] == 2048
    assert (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
            * LAYOUT.dp == config["train_batch_size"])
    assert config["zero_optimization"]["stage"] == 1
    assert config["bf16"]["enabled"] is True
    assert any("--tensor-model-parallel-size 8" in note for note in emitted.notes)


def test_deepspeed_mics_for_hybrid_zero3():
    layout = Layout.parse("dp=2048,tp=8,zero=3,zero_group=16")
    config = json.loads(emit("deepspeed", MODEL, layout, TRAIN).text)
    assert config["zero_optimization"]["mics_shard_size"] == 16


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_framework_rejects_invalid_layouts(framework):
    with pytest.raises(LayoutError):
        emit(framework, MODEL, Layout(tp=3), TRAIN)


def test_unknown_framework():
    with pytest.raises(ShardwiseError, match="unknown framework"):
        emit("jax", MODEL, LAYOUT, TRAIN)
