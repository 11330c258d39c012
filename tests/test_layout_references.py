"""shardwise.layout against the frameworks' own code: micro-batches per step as megatron-core
0.16.1's micro-batch calculator counts them; a Megatron `--pipeline-model-parallel-layout`
given as `partition=` read as megatron-core's parser reads it (virtual stages, chunks per
rank, each rank's layers); the shard group and world as megatron-core's
`initialize_model_parallel` builds the distributed optimizer's groups (dp·cp / instances).
"""

from __future__ import annotations

import pytest

from shardwise.layout import Layout, TrainSpec


@pytest.mark.parametrize(("gb", "dp", "mb"), [(512, 8, 2), (96, 6, 4), (64, 32, 1),
                                              (24, 3, 8)])
def test_microbatches_are_megatron_cores(gb, dp, mb):
    pytest.importorskip("megatron.core")
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    calc = ConstantNumMicroBatchesCalculator(gb, mb, dp, False, 0)
    layout = Layout(dp=dp, tp=2, pp=2, micro_batch=mb)
    assert layout.microbatches(TrainSpec(seq_len=1024, global_batch=gb)) == calc.get()
    assert layout.world_size == dp * 2 * 2


@pytest.mark.parametrize(("text", "pp"), [
    ("E|t*3|t*5|t*4|t*4|t*5|t*3|L", 4),   # 8 virtual stages: 2 per rank, the ends empty
    ("Et*2|(t*3|)*4t*2L", 3),              # 6 virtual stages, 2 per rank
    ("Et*6|t*8|t*8|t*6L", 4)],             # one per rank: uneven, not interleaved
    ids=["pp4-v2-empty-ends", "pp3-v2", "pp4-uneven"])
def test_a_megatron_layout_partition_is_megatron_cores(text, pp):
    """`Layout.parse("pp=P,partition=<layout>")`: chunks = virtual stages / pp and the
    interleaved schedule when there are more than pp; layers per virtual stage in model
    order and per rank (chunk c of rank i is virtual stage c·pp + i) as megatron-core's
    `PipelineParallelLayerLayout` reads the string."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    parsed = PipelineParallelLayerLayout(text, pp).layout  # [rank][chunk]
    chunks = len(parsed[0])
    per_virtual = [parsed[i][c].count(LayerType.decoder) for c in range(chunks)
                   for i in range(pp)]
    layout = Layout.parse(f"dp=2,pp={pp},partition={text}")
    n_layers = sum(per_virtual)
    assert layout.chunks == chunks
    assert layout.schedule == ("interleaved" if chunks > 1 else Layout().schedule)
    assert list(layout.stage_sizes(n_layers)) == per_virtual
    assert list(layout.stage_layers(n_layers)) == [
        sum(parsed[i][c].count(LayerType.decoder) for c in range(chunks)) for i in range(pp)]


@pytest.mark.parametrize(("dp", "cp", "group"), [(8, 2, 4), (4, 4, 8), (16, 1, 2)])
def test_the_zero_group_is_megatron_cores_optimizer_shard(dp, cp, group):
    """`Layout.zero_degree`: the hybrid group, or every dp·cp rank; megatron-core shards the
    distributed optimizer over dp·cp / instances ranks (INTRA_PARTIAL_DATA_PARALLEL group)."""
    pytest.importorskip("megatron.core")
    from tests.integration.test_megatron import _megatron_groups

    for zero_group in (group, 0):
        layout = Layout(dp=dp, cp=cp, tp=2, zero=1, zero_group=zero_group)
        instances = dp * cp // layout.zero_degree
        groups = _megatron_groups(layout.world_size, {
            "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": 1,
            "context_parallel_size": cp, "num_distributed_optimizer_instances": instances})
        shards = groups.get("INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP") or groups[
            "DATA_PARALLEL_GROUP_WITH_CP"]
        assert {len(ranks) for ranks in shards} == {layout.zero_degree}


def test_stage_counts_under_a_v_schedule_are_torchs_v_mapping():
    """ZBV with a count per rank: each rank's two chunks hold half its layers each, on the
    virtual stages torch's V mapping gives it (`generate_stage_to_rank_mapping(style="v")`:
    rank i runs stages i and 2p-1-i)."""
    pipelining = pytest.importorskip("torch.distributed.pipelining._utils")
    ref = pipelining.generate_stage_to_rank_mapping(4, 8, style="v")
    counts = (8, 10, 8, 6)
    sizes = Layout(pp=4, dp=2, chunks=2, schedule="zbv", partition=counts).stage_sizes(32)
    for rank in range(4):
        assert [n for vs, n in enumerate(sizes) if ref[vs] == rank] == [counts[rank] // 2] * 2
