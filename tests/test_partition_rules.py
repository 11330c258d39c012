"""shardwise.partition's documented rules at each threshold, against references written here
(hand counts from the docstrings' rules) or megatron-core 0.16.1's own code (layer offsets,
the layout parser): the default and searched `Balanced` counts, the planner's pinned
partition, per-stage totals of virtual stages under both placements, Megatron's first/last
stage layers and embedding-/loss-only accounting, the layout string's repetitions, and the
one-line refusals.
"""

from __future__ import annotations

import numpy as np
import pytest

import shardwise.validate as validate
from shardwise.errors import ShardwiseError
from shardwise.partition import (
    FIXED,
    Balanced,
    accounted_partition,
    chunk_span,
    first_last_partition,
    fixed_or_balanced,
    is_pipeline_layout,
    parse_partition,
    parse_pipeline_layout,
    partition_problems,
    stage_extremes,
    stage_partition,
    stage_totals,
    virtual_sizes,
)


def test_the_default_balanced_counts_are_one_exactly_where_pp_chunks_misses():
    """`Balanced.default`: (0, 0) where pp·chunks divides L, else (1, 1) — per layout of an
    array (24 layers: pp·chunks 4, 5, 12, 14, 6·4)."""
    pp, chunks = np.array([4, 5, 6, 7, 6]), np.array([1, 1, 2, 2, 4])
    ends = Balanced.default(24, pp, chunks)
    assert list(ends.first_less) == [0, 1, 0, 1, 0]
    assert list(ends.last_less) == [0, 1, 0, 1, 0]
    assert Balanced() == Balanced(1, 1)  # torchtitan's first/last_stage_less_layers = 1


@pytest.mark.parametrize(("first", "last", "n_layers", "pp", "searched"), [
    (0, 0, 24, 4, False), (1, 1, 26, 4, False),  # the defaults
    (1, 1, 24, 4, True), (0, 1, 24, 4, True), (1, 0, 24, 4, True),  # one end differs
    (0, 0, 26, 4, True), (2, 1, 26, 4, True), (1, 2, 26, 4, True)])
def test_searched_is_any_end_away_from_the_default(first, last, n_layers, pp, searched):
    assert bool(Balanced(first, last).searched(n_layers, pp)) is searched
    # as arrays of layouts: the same answer per element
    arrays = Balanced(np.array([first, 0]), np.array([last, 0])).searched(n_layers,
                                                                           np.array([pp, 4]))
    assert list(arrays) == [searched, n_layers % 4 != 0]


def test_the_planners_pinned_partition_is_used_as_given():
    """`--fix` with an uneven interleaved partition: the candidate's first_less is
    FIXED[0] and the split comes from its `_partitions` (key (pp, a, z)); otherwise the
    Balanced counts of the arrays."""
    split = (4, 8, 6, 6)
    cand = {"first_less": np.array([FIXED[0]]), "last_less": np.array([FIXED[1]]),
            "_partitions": {(4, 0, 0): (), (4, 1, 1): Balanced(1, 1), (4, *FIXED): split}}
    assert fixed_or_balanced(cand) == split
    cand = {"first_less": np.array([0, 1, 2]), "last_less": np.array([0, 1, 1]),
            "_partitions": {(4, 0, 0): ()}}
    got = fixed_or_balanced(cand)
    assert isinstance(got, Balanced)
    assert list(got.first_less) == [0, 1, 2] and list(got.last_less) == [0, 1, 1]


def test_balanced_counts_as_an_array_on_one_end_only():
    """The planner's arrays may vary only first_less: 10 layers over 4 stages, stage 1, the
    first stage 0, 1 or 2 layers short and the last 1 — by the documented rule (`L + a + z`
    units, q each, the r extras on stages 1…r): units 11, 12, 13."""
    first, count = chunk_span(10, 4, 1, 1, 0, Balanced(np.array([0, 1, 2]), 1))
    assert list(count) == [3, 3, 4] and list(first) == [2, 2, 1]
    first, count = chunk_span(10, 4, 1, 3, 0, Balanced(1, np.array([0, 1, 2])))
    assert list(count) == [3, 2, 1] and list(first) == [7, 8, 9]


def test_an_explicit_partition_belongs_to_one_layout():
    """With an explicit partition the planner's arrays hold one pp, chunks and placement;
    several are one line each."""
    split = (6, 6, 6, 6)
    first, count = chunk_span(24, np.array([4, 4]), np.array([1, 1]), 2, np.array([0, 0]),
                              split, np.array(["loop", "loop"]))
    assert (int(first), int(count)) == (12, 6)
    # one placement in an array: "v" puts chunk 1 of stage 0 on the last virtual stage
    first, count = chunk_span(11, np.array([2, 2]), 2, 0, 1, (1, 2, 3, 5), np.array(["v", "v"]))
    assert (int(first), int(count)) == (6, 5)
    with pytest.raises(ShardwiseError, match=r"one layout, got \[2 4\]"):
        chunk_span(24, np.array([2, 4]), 1, 0, 0, split)
    with pytest.raises(ShardwiseError, match="one layout, got placements"):
        chunk_span(24, 2, 2, 0, 0, (6, 6, 6, 6), np.array(["loop", "v"]))


def test_virtual_stages_per_stage_under_both_placements():
    """pp = 2, chunks = 2, virtual stages of 1, 2, 3, 5 layers: "loop" runs virtual stages
    (0, 2) on stage 0 and (1, 3) on stage 1; "v" (0, 3) and (1, 2) — by hand."""
    vs = (1, 2, 3, 5)
    assert stage_totals(2, 2, vs) == (1 + 3, 2 + 5)
    assert stage_totals(2, 2, vs, "v") == (1 + 5, 2 + 3)
    assert stage_totals(2, 2, (4, 10)) == (4, 10)  # per stage: as given
    assert stage_extremes(11, 2, 2, vs, "v") == (6, 6, 5)
    assert stage_extremes(11, 2, 2, vs) == (7, 4, 7)
    # per-stage counts, each chunk half of its stage's: loop (c·p + i), v mirrored on chunk 1
    assert virtual_sizes(2, 2, (4, 10)) == (2, 5, 2, 5)
    assert virtual_sizes(2, 2, (4, 10), "v") == (2, 5, 5, 2)
    assert virtual_sizes(2, 2, vs) == vs
    # the first layer of each chunk follows the virtual stages in model order
    assert [tuple(map(int, chunk_span(11, 2, 2, i, c, vs, "v"))) for i in range(2)
            for c in range(2)] == [(0, 1), (6, 5), (1, 2), (3, 3)]


def test_array_chunks_under_the_v_placement():
    """The planner's arrays with chunk 1 under "v": stage i runs virtual stage 2p-1-i
    (ZBV/DualPipeV), so its first layer is (2p-1-i)·L/(2p) — by hand, 16 layers over 4·2."""
    stages = np.arange(4)
    first, count = chunk_span(16, np.full(4, 4), np.full(4, 2), stages, np.ones(4, int),
                              (), np.full(4, "v"))
    assert list(first) == [(7 - i) * 2 for i in range(4)] and list(count) == [2] * 4
    assert first.dtype.kind == count.dtype.kind == "i"  # whole layers, not 2.0
    first, _ = chunk_span(16, np.full(4, 4), np.full(4, 2), stages, np.ones(4, int), (),
                          np.full(4, "loop"))
    assert list(first) == [(4 + i) * 2 for i in range(4)]


def test_stage_partition_refuses_what_it_cannot_split():
    with pytest.raises(ShardwiseError, match="n_layers"):
        stage_partition(0, 2)
    with pytest.raises(ShardwiseError, match="n_layers"):
        stage_partition(validate.MAX_LAYERS + 1, 2)
    with pytest.raises(ShardwiseError, match="tuple of layer counts"):
        stage_partition(24, 4, 1, [6, 6, 6, 6])  # type: ignore[arg-type]
    with pytest.raises(ShardwiseError, match="tuple of layer counts"):
        stage_partition(24, 2, 1, (25, -1))
    with pytest.raises(ShardwiseError, match="tuple of layer counts") as info:
        stage_partition(24, 2, 1, [6] * 500)  # type: ignore[arg-type]
    assert len(str(info.value)) <= 200  # the value quoted, cut
    with pytest.raises(ShardwiseError, match="partition has 3 counts; give pp=4 or "
                                             "pp·chunks=8"):
        stage_partition(24, 4, 2, (8, 8, 8))
    # one layer over four stages: the balanced split would put -1 on the first stage
    with pytest.raises(ShardwiseError, match=r"cannot fill pp=4 stages × 1 chunk\(s\) \(a "
                                             r"stage would hold -1\); use pp·chunks ≤ 1"):
        stage_partition(1, 4)
    # two layers over four stages: L + 2 = 4 units, one each, the ends one short (empty)
    assert stage_partition(2, 4) == (0, 1, 1, 0)
    assert stage_partition(24, 4, 2, (4, 8, 6, 6)) == (2, 4, 3, 3)  # per chunk


@pytest.mark.parametrize(("n_layers", "pp", "first", "last", "expected"), [
    (12, 2, 6, 6, (6, 6)), (12, 2, None, None, (6, 6)), (13, 3, 5, None, (5, 4, 4)),
    (13, 3, None, 5, (4, 4, 5)), (12, 3, 0, 0, (0, 12, 0)), (9, 2, 9, None, (9, 0)),
    (14, 4, 4, 4, (4, 3, 3, 4))])
def test_first_last_stage_layers_at_each_edge(n_layers, pp, first, last, expected):
    """Megatron's first/last-stage layers, the middle spread evenly — no middle stage left
    (pp = 2, both given), an end of 0 layers (embedding/loss only), by hand."""
    assert first_last_partition(n_layers, pp, first, last) == expected


@pytest.mark.parametrize(("n_layers", "pp", "first", "last", "rest", "middle"), [
    (12, 2, 5, 5, 2, 0), (13, 2, None, None, 13, 2), (12, 1, 6, None, 6, 0),
    (12, 3, 8, 8, -4, 1), (15, 4, 4, 4, 7, 2), (8, 1, 8, None, 0, 0)])
def test_first_last_stage_layers_refused(n_layers, pp, first, last, rest, middle):
    """Layers left over with no middle stage, an odd middle, pp = 1 (with layers left over
    or none), more layers at the ends than the model has, a middle that does not divide (7
    over 2)."""
    with pytest.raises(ShardwiseError) as info:
        first_last_partition(n_layers, pp, first, last)
    assert (f"leave {rest} layers for {middle} middle stages of pp={pp}; they must divide "
            f"evenly (n_layers={n_layers})") in str(info.value)


def _megatron_accounted(n_layers, pp, chunks, embedding, loss):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=n_layers, hidden_size=64, num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss, pipeline_dtype=torch.bfloat16)
    return [get_num_layers_to_build(config, vp_stage=c if chunks > 1 else None, pp_rank=i)
            for c in range(chunks) for i in range(pp)]


@pytest.mark.parametrize(("n_layers", "pp", "chunks", "embedding", "loss"), [
    (31, 4, 1, True, False), (31, 4, 1, False, True), (23, 4, 2, True, False),
    (23, 4, 2, False, True), (32, 4, 2, False, False)])
def test_embedding_or_loss_alone_accounted_as_megatron_core_builds(n_layers, pp, chunks,
                                                                   embedding, loss):
    """Only one of --account-for-embedding/loss-in-pipeline-split: that end alone one layer
    short (virtual stages in model order), as megatron-core builds them."""
    counts = accounted_partition(n_layers, pp, chunks, embedding, loss)
    assert list(counts) == _megatron_accounted(n_layers, pp, chunks, embedding, loss)
    assert sum(counts) == n_layers


def test_accounting_refuses_one_stage_and_names_the_units():
    with pytest.raises(ShardwiseError, match="gives 32 layer units, which pp·chunks=1·1 must"):
        accounted_partition(30, 1)
    with pytest.raises(ShardwiseError, match=r"gives 31 layer units, which pp·chunks=4·1 "
                                             r"must divide .* divisors of 31"):
        accounted_partition(30, 4, 1, embedding=False)


def test_counts_per_stage_read_strictly():
    assert parse_partition("7,8,8,7") == (7, 8, 8, 7)
    assert parse_partition("12") == (12,)
    for text in ("7,,8", ",,,", "7;8", "7.5,8"):
        with pytest.raises(ShardwiseError, match=f"partition {text!r} must be layer counts "
                                                 "per stage, e.g. 7,8,8,7"):
            parse_partition(text)
    assert is_pipeline_layout("Et|tL") and not is_pipeline_layout("7,8,8,7")


@pytest.mark.parametrize(("text", "pp"), [
    ("Et*12|(t|)*3mL", 5), ("E(tt|)*10t*11L", 11), ("Et*3|t*10|(t*2|)*2t*3L", 5),
    ("E,t*2|t*2,L", 2)])
def test_repetitions_read_as_megatron_core_reads_them(text, pp):
    """Counts of two digits, a group repeated ten times, several groups, commas."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    parsed = PipelineParallelLayerLayout(text, pp).layout
    chunks = len(parsed[0])
    theirs = [parsed[i][c].count(LayerType.decoder) for c in range(chunks) for i in range(pp)]
    assert list(parse_pipeline_layout(text, pp)) == theirs


def test_nested_repetitions_and_spaces_are_ours():
    """Beyond megatron-core (which refuses both): groups inside groups, innermost first,
    and spaces — by hand: (t(t|)*2)*2 = tt|t|tt|t|."""
    assert parse_pipeline_layout("E(t(t|)*2)*2L") == (2, 1, 2, 1, 0)
    assert parse_pipeline_layout("E t t | t L", 2) == (2, 1)
    assert parse_pipeline_layout("E(t*2|)*2t*3L") == (2, 2, 3)


@pytest.mark.parametrize(("text", "message"), [
    ("E(t|tL", "pipeline layout 'E(t|tL': unclosed '('"),
    ("E((t|)*2tL", "pipeline layout 'E((t|)*2tL': unclosed '('"),
    ("Et*|tL", "pipeline layout 'Et*|tL': '*' needs a count"),
    ("E(t|)*tL", "pipeline layout 'E(t|)*tL': '*' needs a count"),
    ("Ext|tLy", "pipeline layout 'Ext|tLy': unknown layer character(s) xy; known: E "
                "(embedding), t (layer), m (MTP), L (loss)"),
    ("EtL|t", "the embedding E must open the first stage and the loss L close the last"),
    ("Et|tL|L", "the embedding E must open the first stage and the loss L close the last"),
    ("Et|tmtL", "MTP layers m come after every Transformer layer t"),
    ("Et|t|tL", "pipeline layout 'Et|t|tL' has 3 stages, not a multiple of pp=2")])
def test_layout_strings_refused_in_one_line(text, message):
    with pytest.raises(ShardwiseError) as info:
        parse_pipeline_layout(text, 2)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("n_layers", "pp", "chunks"), [(8, 2, 2), (4, 4, 1), (12, 3, 4)])
def test_a_default_partition_that_divides_is_no_problem(n_layers, pp, chunks):
    """pp·chunks dividing the layers: nothing to say — even where the balanced rule's own
    checks (uneven interleaving, L + 2 < 2·pp: 4 layers on pp 4) would speak."""
    assert partition_problems(n_layers, pp, chunks, ()) == []


def test_even_spans_of_an_array_of_stages_by_hand():
    """8 layers on pp 4, one chunk: stage s holds layers [2s, 2s + 2)."""
    start, count = chunk_span(8, 4, 1, np.array([0, 1, 2, 3]), 0)
    assert start.tolist() == [0, 2, 4, 6] and count == 2
