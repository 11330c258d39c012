"""shardwise.partition against the frameworks' own split code, over grids that reach every
branch (uneven, first/last shorter by 0, 1 or 2, interleaved, accounted, explicit): torchtitan
0.3.0's `_generate_llm_fqn_per_model_part` (the `first/last_stage_less_layers` split),
megatron-core 0.16.1's `get_transformer_layer_offset` / `get_num_layers_to_build` (even,
first/last-stage layers with virtual stages, the embedding/loss accounted) and its
`PipelineParallelLayerLayout` parser. Only documented contracts: layers and first layer of
each (virtual) stage; the placement of ZBV/DualPipeV's "v" is left to its own tests.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.partition import (
    Balanced,
    accounted_partition,
    chunk_span,
    first_last_partition,
    parse_pipeline_layout,
    stage_extremes,
    stage_partition,
)

# (layers, pp) with pp ∤ L, pp | L, and L + 2 = 2·pp (the smallest balanced split)
SPLITS = [(10, 4), (7, 3), (126, 16), (70, 12), (12, 4), (6, 4), (9, 2)]


def _titan(n_layers: int, pp: int, first_less: int, last_less: int) -> list[int]:
    """Decoder layers per stage as torchtitan 0.3.0 splits the model's modules."""
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    parts = _generate_llm_fqn_per_model_part(pp, n_layers, first_less, last_less)
    return [sum(name.startswith("layers.") for name in part) for part in parts]


def _documented(n_layers: int, pp: int, a: int, z: int) -> list[int]:
    """`stage_partition`'s documented rule where torchtitan places the extra units
    differently (it gives them to the first stages; shardwise to the stages after the
    first): `L + a + z` units, q each, the r extras on stages 1…r, then the first stage `a`
    layers short and the last `z`."""
    q, r = divmod(n_layers + a + z, pp)
    return [q + (1 <= i <= r) - a * (i == 0) - z * (i == pp - 1) for i in range(pp)]


@pytest.mark.parametrize(("n_layers", "pp"), SPLITS)
def test_balanced_splits_are_torchtitans(n_layers, pp):
    """Every (first_less, last_less) in {0, 1, 2}² that leaves each stage a layer: the counts
    (torchtitan's where the units divide evenly, the documented rule elsewhere), and each
    stage's first layer (contiguous), one layout at a time and as arrays."""
    checked = 0
    for a, z in itertools.product((0, 1, 2), repeat=2):
        if (n_layers + a + z) // pp - max(a, z) < 1 or (a == z == 0 and n_layers % pp):
            continue
        if (n_layers + a + z) % pp == 0:
            expected = _titan(n_layers, pp, a, z)
            checked += 1
        else:
            expected = _documented(n_layers, pp, a, z)
        assert sum(expected) == n_layers and min(expected) >= 1
        split = Balanced(a, z)
        assert list(stage_partition(n_layers, pp, 1, split)) == expected, (a, z)
        starts = np.concatenate([[0], np.cumsum(expected)[:-1]])
        for stage in range(pp):
            assert chunk_span(n_layers, pp, 1, stage, 0, split) == (starts[stage],
                                                                    expected[stage])
        # the planner's arrays: every stage at once, the counts as arrays of layouts
        stages = np.arange(pp)
        arrays = Balanced(np.full(pp, a), np.full(pp, z))
        first, count = chunk_span(n_layers, np.full(pp, pp), np.ones(pp, int), stages,
                                  np.zeros(pp, int), arrays)
        assert list(count) == expected and list(first) == list(starts)
        busiest, head, tail = stage_extremes(n_layers, np.array([pp]), np.array([1]),
                                             Balanced(np.array([a]), np.array([z])))
        assert (int(busiest[0]), int(head[0]), int(tail[0])) == (max(expected), expected[0],
                                                                 expected[-1])
    assert checked >= 1


@pytest.mark.parametrize(("n_layers", "pp"), [(10, 4), (126, 16), (70, 12), (22, 6)])
def test_the_default_split_is_torchtitans_one_layer_each(n_layers, pp):
    """A layout without a partition where pp ∤ L (and pp | L + 2): the embedding and the
    head a layer each — Llama 3 405B's 7, 8 × 14, 7 and BLOOM's 5, 6 × 10, 5 among them."""
    assert list(stage_partition(n_layers, pp)) == _titan(n_layers, pp, 1, 1)


def _megatron(n_layers: int, pp: int, vpp: int | None = None, first: int | None = None,
              last: int | None = None, account: bool = False) -> list[tuple[int, int]]:
    """(first layer, layers) of each virtual stage (chunk c of rank i, in order c, i) as
    megatron-core 0.16.1 builds them."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=n_layers, hidden_size=64, num_attention_heads=4,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=account,
        account_for_loss_in_pipeline_split=account, pipeline_dtype=torch.bfloat16)
    return [(get_transformer_layer_offset(config, vp_stage=c if vpp else None, pp_rank=i),
             get_num_layers_to_build(config, vp_stage=c if vpp else None, pp_rank=i))
            for c in range(vpp or 1) for i in range(pp)]


def _ours(n_layers, pp, chunks, partition=()):
    return [tuple(int(x) for x in chunk_span(n_layers, pp, chunks, i, c, partition))
            for c in range(chunks) for i in range(pp)]


@pytest.mark.parametrize(("n_layers", "pp", "chunks"), [(24, 4, 2), (24, 2, 3), (36, 3, 4),
                                                         (12, 4, 1)])
def test_even_interleaved_stages_are_megatron_cores(n_layers, pp, chunks):
    assert _ours(n_layers, pp, chunks) == _megatron(n_layers, pp, chunks if chunks > 1
                                                    else None)


@pytest.mark.parametrize(("n_layers", "pp", "chunks", "first", "last"), [
    (30, 4, 2, 6, 8), (30, 4, 1, 6, None), (30, 4, 1, None, 6), (26, 3, 2, 6, 8),
    (126, 16, 1, 7, 7)])
def test_first_last_stage_layers_are_megatron_cores(n_layers, pp, chunks, first, last):
    """Megatron's --decoder-first/last-pipeline-num-layers: the partition, and each chunk's
    layers (every stage's share ÷ chunks) from megatron-core's own offsets."""
    partition = first_last_partition(n_layers, pp, first, last)
    spans = _megatron(n_layers, pp, chunks if chunks > 1 else None, first, last)
    assert _ours(n_layers, pp, chunks, partition) == spans
    per_rank = [sum(n for (_, n) in spans[i::pp]) for i in range(pp)]
    assert list(partition) == per_rank


@pytest.mark.parametrize(("n_layers", "pp", "chunks"), [(30, 4, 1), (22, 4, 2), (61, 3, 3),
                                                         (14, 2, 4)])
def test_accounted_split_is_megatron_cores(n_layers, pp, chunks):
    """--account-for-embedding/loss-in-pipeline-split: layers per virtual stage in model
    order (virtual stage c·pp + i is chunk c of rank i)."""
    counts = accounted_partition(n_layers, pp, chunks)
    spans = _megatron(n_layers, pp, chunks if chunks > 1 else None, account=True)
    assert list(counts) == [n for _, n in spans]
    assert _ours(n_layers, pp, chunks, counts) == spans


def test_accounting_refused_where_megatron_core_refuses():
    """(L + 2) not divisible by pp·chunks: megatron-core asserts; ours is one line."""
    pytest.importorskip("megatron.core")
    with pytest.raises(ShardwiseError, match="must divide"):
        accounted_partition(30, 3, 2)
    with pytest.raises((AssertionError, ValueError)):
        _megatron(30, 3, 2, account=True)


@pytest.mark.parametrize(("text", "pp"), [
    ("Et|(tt|)*4,tL", 2), ("E|t*4|t*4|tL", 4), ("Et|(t*2|)*4tmL", 3),
    ("E(t|)*7t*2L", 8)], ids=["pp2-repeat", "pp4-empty-ends", "pp3-mtp", "pp8-nested"])
def test_pipeline_layouts_read_as_megatron_core_reads_them(text, pp):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    parsed = PipelineParallelLayerLayout(text, pp).layout  # [rank][chunk]: virtual stages
    chunks = len(parsed[0])
    theirs = [parsed[i][c].count(LayerType.decoder) for c in range(chunks) for i in range(pp)]
    assert list(parse_pipeline_layout(text, pp)) == theirs


@pytest.mark.parametrize("text", ["t*4|Et*4|t*4|tL", "Et*4|t*4|t*4|t", "Et*4|t*4|tmL|tL",
                                  "Et*4|t*4|t*4|tL|E", "Et*4|t*4|t*4L"])
def test_layouts_megatron_core_refuses_are_refused(text):
    """The embedding not opening the first stage, the loss not closing the last, a layer
    after the MTP layers, a second embedding, stages not a multiple of pp: megatron-core's
    own validation refuses each; ours is one line."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    with pytest.raises((AssertionError, ValueError)):
        layout = PipelineParallelLayerLayout(text, 2)
        layout.validate_layer_layout(num_layers=text.count("t") + 12, mtp_num_layers=text.count(
            "m") or None)
    with pytest.raises(ShardwiseError) as info:
        parse_pipeline_layout(text, 2)
    assert "\n" not in str(info.value)


def test_the_command_line_forms_of_a_partition():
    """`--partition 7,9,9,7`, a Megatron layout string, or `--first/--last-stage-layers`
    (Megatron's), never two of them."""
    from shardwise.partition import resolve_partition

    assert resolve_partition(32, 4, "7,9,9,7") == (7, 9, 9, 7)
    assert resolve_partition(32, 4, "Et*3|t*5|t*4|t*4|t*4|t*4|t*5|t*3L") == (
        3, 5, 4, 4, 4, 4, 5, 3)
    assert resolve_partition(30, 4, first=6, last=8) == (6, 8, 8, 8)
    assert resolve_partition(30, 4, last=6) == (8, 8, 8, 6)
    assert resolve_partition(30, 4) == ()
    with pytest.raises(ShardwiseError, match="not both"):
        resolve_partition(30, 4, "6,8,8,8", first=6)
    with pytest.raises(ShardwiseError, match="must divide evenly"):
        resolve_partition(30, 4, first=5, last=6)
    # an empty end (the embedding or the loss alone) is a stage of 0 layers
    assert resolve_partition(24, 4, first=0, last=8) == (0, 8, 8, 8)
    assert resolve_partition(24, 4, first=8, last=0) == (8, 8, 8, 0)
    with pytest.raises(ShardwiseError, match="not a multiple of pp=4"):
        resolve_partition(32, 4, "Et*3|t*5|t*4|t*4|t*4|t*4|t*5L")


@pytest.mark.parametrize(("n_layers", "pp", "chunks", "partition", "problems"), [
    # valid: per stage (the ends may be empty), per virtual stage (any may be empty)
    (24, 4, 1, (0, 8, 8, 8), []), (24, 4, 2, (4, 8, 6, 6), []),
    (24, 2, 2, (6, 0, 12, 6), []), (24, 4, 1, (), []), (26, 4, 1, (), []),
    # a count of stages that is neither pp nor pp·chunks
    (24, 4, 1, (8, 8, 8), ["partition has 3 stages but pp=4"]),
    (24, 4, 2, (6, 6, 6, 2, 2, 2), ["partition has 6 stages but pp=4 (or pp·chunks=8 "
                                    "virtual stages)"]),
    (24, 4, 1, (6, 6, 6, 7), ["partition sums to 25 layers but n_layers=24"]),
    (24, 4, 1, (8, 0, 8, 8), ["every pipeline stage but the first (embedding only) and the "
                              "last (loss only) needs ≥ 1 layer, got partition 8,0,8,8"]),
    (24, 2, 1, (25, -1), ["every pipeline stage but the first (embedding only) and the last "
                          "(loss only) needs ≥ 1 layer, got partition 25,-1"]),
    (24, 4, 2, (5, 7, 6, 6), ["with chunks=2 every stage's layers must be a multiple of 2 "
                              "(each chunk holds an equal share, Megatron's rule), got "
                              "partition 5,7,6,6"]),
    (26, 4, 2, (), ["pp·chunks=4·2 does not divide n_layers=26; give uneven interleaved "
                    "stages explicitly (partition=…: 4 stages each a multiple of 2 layers, or "
                    "8 virtual stages)"]),
    (5, 4, 1, (), ["pp=4 does not divide n_layers=5 and the balanced partition would leave a "
                   "stage without layers; use a smaller pp"])])
def test_partition_problems_are_the_documented_rules(n_layers, pp, chunks, partition,
                                                     problems):
    """`partition_problems`' rules, each at its threshold (an empty inner stage, one layer
    too many, a stage one short of a multiple of chunks, L + 2 < 2·pp); the interleaved
    multiple-of-chunks rule is megatron-core's (it refuses 5, 7 over two chunks)."""
    from shardwise.partition import partition_problems

    assert partition_problems(n_layers, pp, chunks, partition) == problems
    if problems and chunks == 2 and len(partition) == pp and sum(partition) == n_layers:
        with pytest.raises((AssertionError, ValueError)):
            _megatron(n_layers, pp, chunks, partition[0], partition[-1])
