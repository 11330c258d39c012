"""Uneven pipeline stages (issue 9 item 1): `Layout.partition`, the balanced default, the
memory and step models per stage, the planner and the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardwise.arch import count_params, get_model
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.estimate.memory import stage_params, training_memory_per_gpu
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.partition import (
    Balanced,
    accounted_partition,
    chunk_span,
    first_last_partition,
    stage_partition,
)
from shardwise.plan import plan
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

BLOOM = str(Path(__file__).parent / "fixtures" / "hf" / "bloom" / "config.json")


def test_balanced_default_is_the_published_layouts():
    # Llama 3 paper §3.3.2: 126 layers over 16 stages, the first and the last one layer short
    assert stage_partition(126, 16) == (7,) + (8,) * 14 + (7,)
    # BLOOM paper §3.4 / Megatron-DeepSpeed run: first stage embedding + 5 blocks, last 5 + head
    assert stage_partition(70, 12) == (5,) + (6,) * 10 + (5,)
    assert stage_partition(32, 4) == (8, 8, 8, 8)  # dividing: even, as before
    assert stage_partition(32, 4, 2) == (4, 4, 4, 4)  # per chunk


def test_megatron_first_last_and_parsed_partitions():
    assert first_last_partition(126, 16, 7, 7) == stage_partition(126, 16)
    assert first_last_partition(10, 3, 2, None) == (2, 4, 4)
    assert Layout.parse("pp=4,partition=1:2:3:4").partition == (1, 2, 3, 4)
    with pytest.raises(ShardwiseError, match="must divide evenly"):
        first_last_partition(10, 4, 3, 2)


def test_bad_partitions_are_reported():
    model = get_model("tiny")  # 4 layers
    with pytest.raises(LayoutError) as info:
        Layout(pp=2, partition=(3, 2)).validate(model)
    assert "partition sums to 5 layers but n_layers=4" in str(info.value)
    with pytest.raises(LayoutError, match="must be a multiple of 2"):  # Megatron's rule
        Layout(pp=2, chunks=2, schedule="interleaved", partition=(3, 1)).validate(model)
    with pytest.raises(LayoutError, match="≥ 1 layer"):  # only the ends may be empty
        Layout(pp=3, partition=(2, 0, 2)).validate(model)
    Layout(pp=2, partition=(4, 0)).validate(model)  # a loss-only last stage (Megatron's "L")
    with pytest.raises(LayoutError, match="partition has 3 stages but pp=2"):
        Layout(pp=2, partition=(1, 1, 2)).validate(model)


@pytest.mark.parametrize("partition", [(5, 3), (1, 7), (4, 4)])
def test_stage_parameters_add_up_to_the_model(partition):
    """Every parameter on exactly one stage: the stages' counts sum to `count_params`."""
    model = get_model("llama3-8b").with_(n_layers=8)
    layout = Layout(pp=2, partition=partition)
    total = sum(sum(stage_params(model, layout, i)) for i in range(2))
    assert total == pytest.approx(count_params(model).total, rel=1e-12)
    stages = training_memory_per_gpu(model, layout, TrainSpec(seq_len=1024, global_batch=8))
    assert [st.layers for st in stages] == list(partition)


def test_the_slowest_stage_sets_the_pace():
    """The busiest stage paces the pipeline: with a middle stage of 11 or 12 layers the compute
    scales 12/11 wherever the other layers go, and a lopsided split is slower than even."""
    model, cluster = get_model("llama3-8b"), Cluster.of(4, "h100")
    train = TrainSpec(seq_len=4096, global_batch=16)

    def step(*partition: int):
        return estimate_step(model, cluster, Layout(pp=4, partition=partition), train)

    assert step(8, 8, 8, 8) == estimate_step(model, cluster, Layout(pp=4), train)
    assert step(5, 11, 8, 8).compute == pytest.approx(step(8, 5, 11, 8).compute, rel=1e-12)
    assert step(4, 12, 8, 8).compute / step(5, 11, 8, 8).compute == pytest.approx(12 / 11)
    assert step(5, 11, 8, 8).total > step(8, 8, 8, 8).total


def test_llama3_405b_tp8_pp16_is_expressible_and_ranked():
    model, train = get_model("llama3-405b"), TrainSpec(seq_len=8192, global_batch=2048)
    for gpus in (8192, 16384):
        layout = Layout(dp=gpus // 128, tp=8, pp=16, sp=True, zero=1, recompute="full")
        result = plan(model, Cluster.of(gpus, "h100"), train, top=1, layout=layout)
        assert result.given is not None and result.given.rank is not None
        assert result.given.memory.layers == 8  # the biggest stage: a middle one


def test_cli_plans_bloom_with_and_without_a_layout():
    args = ("plan", BLOOM, "--gpus", "384", "--gpu", "a100", "--seq", "2048",
            "--global-batch", "2048")
    out = shardwise_json(*args, "--layout", "tp=4,pp=12,recompute=full")
    assert out["given"]["rank"] is not None
    assert out["ranked"]  # the search finds layouts (pp dividing 70 left none on 384 GPUs)
    explicit = shardwise_json(*args, "--layout", "tp=4,pp=12,recompute=full",
                              "--first-stage-layers", "5", "--last-stage-layers", "5")
    assert explicit["given"]["layout"]["partition"] == [5] + [6] * 10 + [5]
    assert explicit["given"]["estimate"] == out["given"]["estimate"]  # = the default
    bad = shardwise(*args, "--layout", "tp=4,pp=12", "--partition", "6,6", check=False)
    assert_one_line_error(bad, "partition has 2 stages but pp=12")


def test_exports_refuse_partitions_their_framework_cannot_run():
    from shardwise.emit import emit

    model = get_model("llama3-8b")  # 32 layers
    odd = Layout(dp=2, pp=4, partition=(6, 10, 8, 8))  # middle stages differ
    megatron = emit("megatron", model, odd, TrainSpec(seq_len=4096, global_batch=64))
    assert "--num-layers 32" in megatron.text  # Megatron-LM runs it with an explicit layout
    deepspeed = TrainSpec(seq_len=4096, global_batch=64, impl="megatron-deepspeed")
    with pytest.raises(ShardwiseError, match="cannot split 32 layers as 6,10,8,8"):
        emit("deepspeed", model, odd, deepspeed)
    titan = TrainSpec(seq_len=4096, global_batch=64, impl="torchtitan")
    with pytest.raises(ShardwiseError, match="cannot split 32 layers as 5,11,8,8"):
        emit("torchtitan", model, Layout(dp=2, pp=4, partition=(5, 11, 8, 8)), titan)
    first_last = emit("megatron", model, Layout(dp=2, pp=4, partition=(6, 9, 9, 8)),
                      TrainSpec(seq_len=4096, global_batch=64))
    assert "--decoder-first-pipeline-num-layers 6" in first_last.text
    assert "--decoder-last-pipeline-num-layers 8" in first_last.text


def test_chunk_spans_worked_by_hand():
    """(first layer, layers) by hand. Interleaved, 8 layers on pp = 4 with v = 2 chunks: chunk
    c of stage i is virtual stage c·4 + i, one layer each (Megatron's interleaved order).
    Balanced(1, 1), 10 layers on pp = 4: 10 + 1 + 1 = 12 units, 3 per stage; the first and the
    last stage one layer short: 2, 3, 3, 2 layers from 0, 2, 5, 8. Uneven (6, 2) on pp = 2
    with v = 2: chunk c of stage i holds partition[i]/2 layers from c·8/2 + Σ_{j<i} p_j/2."""
    for stage in range(4):
        for chunk in range(2):
            assert chunk_span(8, 4, 2, stage, chunk) == (chunk * 4 + stage, 1)
    assert [chunk_span(10, 4, 1, s, 0, Balanced(1, 1)) for s in range(4)] == [
        (0, 2), (2, 3), (5, 3), (8, 2)]
    assert [chunk_span(8, 2, 2, s, c, (6, 2)) for c in range(2) for s in range(2)] == [
        (0, 3), (3, 1), (4, 3), (7, 1)]


@pytest.mark.parametrize("n_layers", [8, 61, 94, 126])
def test_one_layouts_span_in_integers_equals_the_array_path(n_layers):
    """Plumbing: `chunk_span` answers one layout in plain integers (the simulator asks per
    stage) as its array path does over one-element arrays. The spans themselves are checked
    against hand-worked layouts in `test_chunk_spans_worked_by_hand`."""
    one = np.array([1])
    for pp in range(1, 17):
        for chunks in (1, 2, 3):
            parts = [()] if chunks > 1 else [(), Balanced(0, 0), Balanced(1, 1), Balanced(2, 0)]
            for part in parts:
                arr = part if part == () else Balanced(part.first_less * one,
                                                       part.last_less * one)
                for stage in range(pp):
                    for chunk in range(chunks):
                        got = chunk_span(n_layers, pp, chunks, stage, chunk, part)
                        ref = chunk_span(n_layers, pp * one, chunks * one, stage * one,
                                         chunk * one, arr)
                        assert got == (int(ref[0][0]), int(ref[1][0]))


@pytest.mark.parametrize(("schedule", "per_stage"), [
    ("interleaved", (12, 14, 14, 14, 14, 12)), ("interleaved", (14, 14, 12, 12, 14, 14))])
def test_virtual_stage_counts_estimate_as_the_stage_counts_they_equal(schedule, per_stage):
    """A partition of `pp·chunks` virtual stages (torchtitan's split) that puts `n_i/v` layers
    on each chunk of stage `i` is the per-stage partition `n_i` (Megatron's rule): the same
    stages, memory and step time, through the other representation."""
    model, train = get_model("llama3-70b"), TrainSpec(seq_len=8192, global_batch=96)
    cluster = Cluster.of(96, "h100")
    stages = Layout(dp=2, tp=8, pp=6, sp=True, schedule=schedule, chunks=2,
                    recompute="full", partition=per_stage)
    virtual = stages.with_(partition=tuple(n // 2 for n in per_stage) * 2)
    assert virtual.virtual_stages and virtual.stage_layers(80) == per_stage
    assert virtual.stage_sizes(80) == stages.stage_sizes(80)
    for stage in range(6):
        for chunk in range(2):
            assert chunk_span(80, 6, 2, stage, chunk, virtual.partition) == tuple(
                chunk_span(80, 6, 2, stage, chunk, stages.partition))
    assert [m.total for m in training_memory_per_gpu(model, virtual, train)] == \
        [m.total for m in training_memory_per_gpu(model, stages, train)]
    assert estimate_step(model, cluster, virtual, train, simulate=True).total == \
        estimate_step(model, cluster, stages, train, simulate=True).total


def test_virtual_stages_in_a_v_sit_on_the_ranks_the_schedule_puts_them():
    # ZBV: rank i runs virtual stages i and 2p-1-i, so Llama 3 405B's 7, 8 × 14, 7 over 8
    # ranks holds 14 on rank 0 (both short ends), 16 elsewhere; looped, 15 on the end ranks
    split = (7,) + (8,) * 14 + (7,)
    v = Layout(dp=8, tp=8, pp=8, schedule="zbv", chunks=2, partition=split)
    loop = v.with_(schedule="interleaved")
    assert v.stage_layers(126) == (14,) + (16,) * 7
    assert loop.stage_layers(126) == (15,) + (16,) * 6 + (15,)
    problems = Layout(dp=8, tp=8, pp=8, chunks=2, schedule="interleaved",
                      partition=(7, 8)).problems(get_model("llama3-405b"))
    assert any("pp·chunks=16 virtual stages" in p for p in problems)


MEGATRON_LAYOUTS = [  # (layout string, pp, decoder layers, MTP layers)
    ("Et|(tt|)*30L", 16, 61, None),  # DeepSeek-V3's recipe: embedding and loss stages
    ("Et*3|(tt|)*29,m|L", 16, 61, 1),  # megatron-core's docstring example, an MTP stage
    ("E|t*4|t*4|tL", 4, 9, None),  # an embedding-only first stage, pp = 4, one chunk
]


@pytest.mark.parametrize(("text", "pp", "layers", "mtp"), MEGATRON_LAYOUTS)
def test_megatron_pipeline_layouts_read_as_megatron_reads_them(text, pp, layers, mtp):
    """`partition=` takes Megatron's `--pipeline-model-parallel-layout`: the layers per virtual
    stage equal what megatron-core 0.16.1's own `PipelineParallelLayerLayout` builds on each
    (pp rank, vpp rank), and `validate_layer_layout` accepts the same string."""
    pl = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    from megatron.core.transformer.enums import LayerType

    theirs = pl.PipelineParallelLayerLayout(text, pp)
    theirs.validate_layer_layout(num_layers=layers, mtp_num_layers=mtp)
    vpp = theirs.virtual_pipeline_model_parallel_size
    layout = Layout.parse(f"pp={pp},partition={text}")
    assert layout.chunks == vpp and layout.schedule == ("interleaved" if vpp > 1 else "1f1b")
    for rank in range(pp):
        for chunk in range(vpp):
            # (get_num_layers_to_build reads vp_stage only with parallel_state initialised)
            want = theirs.layout[rank][chunk].count(LayerType.decoder)
            assert layout.partition[chunk * pp + rank] == want
    model = get_model("deepseek-v3") if layers == 61 else get_model("tiny")
    if layers == model.n_layers:
        layout.validate(model)
        totals = [sum(layout.partition[c * pp + r] for c in range(vpp)) for r in range(pp)]
        assert list(layout.stage_layers(model.n_layers)) == totals


@pytest.mark.parametrize("text", ["tE|L", "Et|t", "Et|tLL", "Et|mt|L", "Et|x|L", "E(t|L"])
def test_megatron_layouts_megatron_refuses_are_refused(text):
    pl = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    with pytest.raises((AssertionError, KeyError)):
        theirs = pl.PipelineParallelLayerLayout(text, 1)
        theirs.validate_layer_layout(num_layers=text.count("t"), mtp_num_layers=text.count("m"))
    with pytest.raises(ShardwiseError):
        Layout.parse(f"pp=1,partition={text}")


def test_loss_only_stage_holds_the_head_and_no_layers():
    """DeepSeek-V3 pp16 with `Et|(tt|)*30L` (Megatron interleaved, 2 chunks): rank 15's second
    chunk is the loss stage, so it holds 2 layers and the head; rank 0 3 layers and the
    embedding."""
    model = get_model("deepseek-v3")
    layout = Layout.parse("dp=128,pp=16,ep=64,zero=1,partition=Et|(tt|)*30L")
    train = TrainSpec(seq_len=4096, global_batch=16384, impl="megatron-te", mtp_layers=0)
    stages = training_memory_per_gpu(model, layout, train)
    assert [s.layers for s in stages] == [3] + [4] * 14 + [2]
    assert stages[-1].logits > 0 and all(s.logits == 0 for s in stages[:-1])
    h, v = model.d_model, model.vocab
    dense, expert = stage_params(model, layout, 15)
    dense14, expert14 = stage_params(model, layout, 14)
    assert expert == expert14 / 2  # two MoE layers' experts of the four
    assert dense - dense14 / 2 == pytest.approx(v * h + model.norm_params())  # head + final norm


ACCOUNTED = [(126, 8, 8), (126, 16, 4), (62, 4, 8), (30, 4, 8), (94, 8, 2), (94, 8, 3),
             (94, 8, 4), (94, 4, 12)]  # the published recipes' uneven interleaved splits


@pytest.mark.parametrize(("layers", "pp", "vp"), ACCOUNTED)
def test_accounted_partition_is_what_megatron_core_builds(layers, pp, vp):
    """`--account-for-embedding/loss-in-pipeline-split` with a virtual pipeline: the layers
    and offset of every (pp rank, vp stage) equal megatron-core 0.16.1's
    `get_num_layers_to_build` / `get_transformer_layer_offset`, and the same split written as
    a Megatron layout string reads back equal."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    torch = pytest.importorskip("torch")

    config = TransformerConfig(pipeline_dtype=torch.bfloat16, num_layers=layers, hidden_size=64, num_attention_heads=8,
                               pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vp,
                               account_for_embedding_in_pipeline_split=True,
                               account_for_loss_in_pipeline_split=True)
    ours = accounted_partition(layers, pp, vp)
    layout = Layout(pp=pp, chunks=vp, schedule="interleaved", partition=ours)
    for rank in range(pp):
        for chunk in range(vp):
            span = chunk_span(layers, pp, vp, rank, chunk, layout.partition)
            assert (int(span[0]), int(span[1])) == (
                get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank),
                get_num_layers_to_build(config, vp_stage=chunk, pp_rank=rank))
    per = (layers + 2) // (pp * vp)
    text = f"E{'t' * (per - 1)}|({'t' * per}|)*{pp * vp - 2}{'t' * (per - 1)}L"
    assert Layout.parse(f"pp={pp},partition={text}").partition == ours
    assert not layout.problems(get_model("tiny").with_(n_layers=layers))


def test_accounted_partition_refuses_what_megatron_core_refuses():
    with pytest.raises(ShardwiseError, match="must divide"):
        accounted_partition(61, 4, 4)  # 63 units over 16 virtual stages
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch = pytest.importorskip("torch")

    with pytest.raises((AssertionError, ValueError), match="divisible"):
        config = TransformerConfig(pipeline_dtype=torch.bfloat16, num_layers=61, hidden_size=64, num_attention_heads=8,
                                   pipeline_model_parallel_size=4,
                                   virtual_pipeline_model_parallel_size=4,
                                   account_for_embedding_in_pipeline_split=True,
                                   account_for_loss_in_pipeline_split=True)
        get_num_layers_to_build(config, vp_stage=0, pp_rank=0)


@pytest.mark.parametrize(("split", "recompute"), [
    ("partition=Et|(tt|)*62tL", "none"),  # 64 virtual stages (Megatron's layout string)
    ("partition=16:16:16:16:16:16:16:14", "full")])  # 8 stages, each ÷ 2 chunks
def test_fix_uses_an_uneven_interleaved_partition_as_given(split, recompute):
    """`--fix` takes an uneven interleaved partition the search does not enumerate and uses it
    as given: the fixed layout's row equals what `--layout` evaluates for it (Llama 3.1 405B
    as NeMo ran it: account-for-embedding/loss over pp8·vp8, or uneven stages ÷ 2 chunks)."""
    chunks = 8 if "E" in split else 2
    text = (f"dp=8,tp=8,pp=8,cp=2,cp_kind=ring,sp=1,zero=1,zero_group=8,mb=1,recompute={recompute},"
            f"schedule=interleaved,chunks={chunks},{split}")
    args = ("plan", "llama3-405b", "--gpus", "1024", "--seq", "8192", "--global-batch", "512")
    fixed = shardwise_json(*args, "--fix", text)["ranked"]
    given = shardwise_json(*args, "--layout", text)["given"]
    assert len(fixed) == 1 and fixed[0]["layout"] == given["layout"]
    assert given["layout"]["partition"] == list(Layout.parse(text).partition)
    assert fixed[0]["estimate"]["total"] == pytest.approx(given["estimate"]["total"], rel=1e-9)
    assert fixed[0]["memory"]["total"] == pytest.approx(given["memory"]["total"], rel=1e-9)


def test_fix_with_a_partition_that_does_not_fit_says_why():
    result = shardwise("plan", "llama3-405b", "--gpus", "1024", "--seq", "8192",
                       "--global-batch", "512", "--fix",
                       "partition=16:16:16:16:16:16:16:13,chunks=2", check=False)
    assert_one_line_error(result, "partition sums to 125 layers but n_layers=126")


def test_a_loss_only_virtual_stage_is_simulated():
    """DeepSeek-V3's `Et|(tt|)*30L` (a loss-only last virtual stage, no decoder layer) with few
    enough micro-batches for the event simulator: `--layout` answers (the empty stage takes no
    time) and `--fix` with the same partition ranks the same layout first."""
    args = ("plan", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--seq", "4096",
            "--global-batch", "2048")
    text = ("dp=128,pp=16,ep=64,zero=1,zero_group=64,mb=1,recompute=full,"
            "partition=Et|(tt|)*30L")
    given = shardwise_json(*args, "--layout", text)["given"]
    assert given["estimate"]["bubble_source"] == "simulator"
    assert 0 < given["estimate"]["bubble"] < given["estimate"]["total"]
    fixed = shardwise_json(*args, "--fix", text)["ranked"][0]
    assert fixed["layout"] == given["layout"]
    assert fixed["estimate"]["total"] == pytest.approx(given["estimate"]["total"], rel=1e-9)
