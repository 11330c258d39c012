"""DeepSpeed's pipeline engine in the step model and the gpt-neox stack, against DeepSpeed's
and GPT-NeoX's code: the transfers come from DeepSpeed's own TrainSchedule streams replayed
(tests/schedules/test_deepspeed_pipe.py), the split from DeepSpeed's `partition_balanced`."""

import re
from dataclasses import replace

import pytest

from shardwise.arch import ModelSpec
from shardwise.calibration import default_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.links import Links, group_collective_time
from shardwise.estimate.step import busiest_stage_params, estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.stacks import STACKS, neox_split, neox_uniform, split_refuses, stack_split
from tests.schedules.test_deepspeed_pipe import replay

# GQA, d_ff not 4h, tied embeddings: every term distinguishable
MODEL = ModelSpec(name="pipe-test", n_layers=20, d_model=2048, n_heads=16, n_kv_heads=4,
                  d_ff=5632, vocab=32000, tie_embeddings=True)
SEQ = 4096


def _without_engine(monkeypatch, stack):
    monkeypatch.setitem(STACKS, stack, replace(STACKS[stack], pipe_costs=None))


def _step(stack, layout, gpus=8, **train):
    train = TrainSpec(impl=stack, seq_len=SEQ, global_batch=train.pop("gb", 32), **train)
    return estimate_step(MODEL, Cluster.of(gpus, "h100"), Layout.parse(layout), train)


def _links(gpus=8):
    cluster = Cluster.of(gpus, "h100")
    return Links.of(cluster, default_calibration(cluster.accelerator.calibration_name))


def _transfers(p, m):
    """Blocking transfers on the critical path, from DeepSpeed's streams replayed."""
    return round((replay(p, m, 1.0, 2.0, 1e-3) - replay(p, m, 1.0, 2.0, 0.0)) / 1e-3)


def test_megatron_deepspeed_pays_deepspeeds_pipeline_terms(monkeypatch):
    """One node, tp=2 · pp=4, m=16, bf16 gradients: pipeline time grows by the serial
    transfers beyond the batched 2(m+p-1), one meta send per transfer, three TP gathers of the
    boundary tensor per slot and the tied embedding's gradient all-reduce; nothing else."""
    layout = "tp=2,pp=4,dp=1,mb=2,zero=1,partition=5:5:5:5"
    after = _step("megatron-deepspeed", layout)
    _without_engine(monkeypatch, "megatron-deepspeed")
    before = _step("megatron-deepspeed", layout)
    links = _links()
    p, m, t = 4, 16, 2
    boundary = SEQ * 2 * MODEL.d_model * 2  # (s, b, h) in bf16
    p2p = links.intra_lat + boundary / t / links.intra_bw
    gather = group_collective_time("all-gather", boundary, t, t, links)
    tied = group_collective_time("all-reduce", MODEL.vocab * MODEL.d_model / t * 2, 2, 2, links)
    slots = m + p - 1
    want = ((_transfers(p, m) - 2 * slots) * p2p + _transfers(p, m) * links.intra_lat
            + slots * 3 * gather + tied)
    assert _transfers(p, m) == 64
    assert after.pp_comm - before.pp_comm == pytest.approx(want, rel=1e-9)
    for term in ("compute", "tp_comm", "bubble", "dp_comm_exposed", "optimizer"):
        assert getattr(after, term) == getattr(before, term)


def test_bf16_optimizer_all_reduces_and_gathers(monkeypatch):
    """bf16 weights run BF16_Optimizer at ZeRO-1 with fp32 gradients (it all-reduces where
    ZeRO-1 reduce-scatters: DP time grows by AR - RS of the busiest stage's fp32 gradients)
    and at ZeRO-0 under the pipeline (its fp32 state sharded: an all-gather of the bf16
    weights ZeRO-0 does not make); ZeRO-1 with bf16 gradients runs ZeRO's own optimizer."""
    layout = "tp=2,pp=2,dp=2,mb=1,zero={},partition=10:10"
    cases = {"z1 fp32": (layout.format(1), "fp32"), "z1 bf16": (layout.format(1), None),
             "z0 bf16": (layout.format(0), None)}
    after = {k: _step("megatron-deepspeed", lay, grad_dtype=g) for k, (lay, g) in cases.items()}
    _without_engine(monkeypatch, "megatron-deepspeed")
    before = {k: _step("megatron-deepspeed", lay, grad_dtype=g) for k, (lay, g) in cases.items()}
    dense, _ = busiest_stage_params(MODEL, 2, 2, 1, 1, (10, 10))
    links = _links()
    want = {"z1 fp32": group_collective_time("all-reduce", float(dense) * 4, 2, 2, links)
            - group_collective_time("reduce-scatter", float(dense) * 4, 2, 2, links),
            "z1 bf16": 0.0,
            "z0 bf16": group_collective_time("all-gather", float(dense) * 2, 2, 2, links)}
    assert want["z1 fp32"] > 0 and want["z0 bf16"] > 0
    for key, extra in want.items():
        got = after[key].dp_comm_exposed - before[key].dp_comm_exposed
        assert got == pytest.approx(extra, rel=1e-9, abs=1e-15), key


def test_only_deepspeeds_1f1b_pays_and_not_without_a_pipeline(monkeypatch):
    zb = "tp=2,pp=4,dp=1,mb=2,zero=1,schedule=zb-h1,partition=5:5:5:5"
    flat = "tp=2,pp=1,dp=4,mb=2,zero=1"
    runs = [_step("megatron-deepspeed", zb), _step("megatron-deepspeed", flat)]
    _without_engine(monkeypatch, "megatron-deepspeed")
    assert runs == [_step("megatron-deepspeed", zb), _step("megatron-deepspeed", flat)]


def test_neox_sends_its_attention_mask_with_each_activation(monkeypatch):
    """gpt-neox against itself on DeepSpeed's engine without the mask: half the critical-path
    transfers carry activations, each with the (1, 1, s, s) mask in fp16 as one more send."""
    layout = "tp=2,pp=4,dp=1,mb=2,zero=1,partition=5:6:5:4"
    neox = _step("gpt-neox", layout)
    monkeypatch.setitem(STACKS, "gpt-neox", replace(STACKS["gpt-neox"], pipe_costs="deepspeed"))
    mds = _step("gpt-neox", layout)
    links = _links()
    mask = links.intra_lat + 2 * SEQ**2 / links.intra_bw
    assert neox.pp_comm - mds.pp_comm == pytest.approx(_transfers(4, 16) / 2 * mask, rel=1e-9)
    assert neox.compute == mds.compute and neox.dp_comm_exposed == mds.dp_comm_exposed


@pytest.mark.parametrize(("n_layers", "pp"), [(44, 4), (44, 8), (32, 4), (24, 5), (7, 3)])
def test_neox_split_is_deepspeeds_partition_of_its_specs(n_layers, pp):
    """DeepSpeed's `type:transformer|mlp` partition over GPT2ModelPipe's specs (gpt-neox
    @ea7aefd: embedding, _pre_transformer_block, the blocks, _post_transformer_block, norm,
    head), the regex matched as PipelineModule._find_layer_type does."""
    utils = pytest.importorskip("deepspeed.runtime.utils")
    names = ["EmbeddingPipe", "_pre_transformer_block",
             *["ParallelTransformerLayerPipe"] * n_layers,
             "_post_transformer_block", "NormPipe", "ParallelLinearPipe"]
    weights = [int(bool(re.search("transformer|mlp", n, re.IGNORECASE))) for n in names]
    parts = utils.partition_balanced(weights=weights, num_parts=pp)
    theirs = [names[parts[i]:parts[i + 1]].count("ParallelTransformerLayerPipe")
              for i in range(pp)]
    assert neox_split(n_layers, pp) == theirs
    assert stack_split("neox", n_layers, pp) == tuple(theirs)
    assert not split_refuses("neox", n_layers, tuple(theirs), pp)
    if theirs != sorted(theirs, reverse=True):  # not Megatron-DeepSpeed's split
        assert split_refuses("deepspeed", n_layers, tuple(theirs), pp)
    # pipe_partition_method "uniform": DeepSpeed's partition_uniform over the same specs
    parts = utils.partition_uniform(num_items=len(names), num_parts=pp)
    uniform = [names[parts[i]:parts[i + 1]].count("ParallelTransformerLayerPipe")
               for i in range(pp)]
    assert neox_uniform(n_layers, pp) == uniform
    assert not split_refuses("neox", n_layers, tuple(uniform), pp)
    others = [(n_layers - pp + 1, *[1] * (pp - 1))]  # neither method's
    assert all(split_refuses("neox", n_layers, o, pp) for o in others
               if list(o) not in (theirs, uniform))


def test_neox_refuses_what_its_engine_cannot_run():
    base = "tp=2,pp=4,dp=1,mb=2,partition=5:6:5:4"
    with pytest.raises(ShardwiseError, match="no zb-h1 pipeline schedule; valid: 1f1b"):
        _step("gpt-neox", base + ",zero=1,schedule=zb-h1")
    with pytest.raises(ShardwiseError, match="asserts ZeRO < 2"):
        _step("gpt-neox", base + ",zero=2")
    with pytest.raises(ShardwiseError, match="cannot split 20 layers as 5,5,5,5"):
        _step("gpt-neox", "tp=2,pp=4,dp=1,mb=2,zero=1,partition=5:5:5:5")
    for stack in ("gpt-neox", "megatron-deepspeed"):
        with pytest.raises(ShardwiseError, match="DP overlap has no effect"):
            _step(stack, "tp=1,pp=2,dp=4,mb=1,zero=1,partition=10:10", dp_overlap=True)
    # its "uniform" method's split runs (the search keeps to the default method's)
    assert neox_uniform(20, 4) == [5, 6, 6, 3]
    assert _step("gpt-neox", "tp=2,pp=4,dp=1,mb=2,zero=1,partition=5:6:6:3").total > 0
    # without a pipeline the engine is not there and the overlap is ZeRO's overlap_comm
    assert _step("gpt-neox", "tp=2,pp=1,dp=4,mb=1,zero=1", dp_overlap=True).total > 0
