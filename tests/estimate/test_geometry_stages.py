"""Stage geometry (estimate/geometry.py) per stage against hand counts: DualPipe's ranks
(stage i of one direction and p-1-i of the other, DeepSeek-V3 §3.2.1), ZBV's V (the head on
stage 0), uneven explicit partitions, an expert-tensor degree apart from tp, a learned
position table, arrays of layouts mixing schedules, and `_unique_rows` on rows written out.
Models: MLA with d_v ≠ d_k, a dense first layer, a shared expert; tp·ep > 1."""

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.estimate.geometry import (
    StageGeometry,
    _unique_rows,
    distinct_geometries,
    distinct_stages,
    fp8_linear_params,
    moe_layers_on_stage,
    stage_layers,
    stage_param_counts,
    stage_params,
)
from shardwise.fp8 import get_recipe
from shardwise.layout import Layout
from shardwise.partition import Balanced

DS8 = get_model("tiny-deepseek").with_(n_layers=8)  # layer 0 dense, 1-7 MoE; V 256, h 64
# one rank at tp = 2, ep = 2 (etp = tp): MLA's q_a (64·32), kv_a (64·24) and latent norms
# (32 + 16) replicated, q_b (32·96), kv_b (16·128), o (64·64) split; the layer norms (2·64)
ATTN = 64 * 32 + 64 * 24 + 48 + (32 * 96 + 16 * 128 + 64 * 64) / 2 + 2 * 64
DENSE = ATTN + 3 * 64 * 128 / 2  # SwiGLU d_ff 128 ÷ tp
MOE = ATTN + 8 * 64 + 3 * 64 * 32 / 2  # router (8·64) replicated, one shared expert ÷ tp
EXPERTS = 8 * 3 * 64 * 32 / (2 * 2)  # 8 routed experts of d_ff 32 ÷ (ep · etp)
EMBED = HEAD = 256 * 64 / 2  # vocabulary-parallel; untied
NORM = 64  # the final norm, with the head


def test_dualpipe_ranks_hold_both_directions_stages():
    """pp = 4 over 8 layers, two per stage: rank 0 holds stage 0 (layers 0, 1, embedding) of
    one direction and stage 3 (layers 6, 7, head) of the other; rank 1 stages 1 and 2."""
    layout = Layout.parse("pp=4,schedule=dualpipe,tp=2,ep=2,dp=2")
    assert [stage_layers(DS8, layout, s) for s in range(4)] == [
        [0, 1, 6, 7], [2, 3, 4, 5], [4, 5, 2, 3], [6, 7, 0, 1]]
    end = (DENSE + 3 * MOE + EMBED + HEAD + NORM, 3 * EXPERTS)
    middle = (4 * MOE, 4 * EXPERTS)
    assert [stage_params(DS8, layout, s) for s in range(4)] == [end, middle, middle, end]
    # tp = ep = 1: every rank holds two stages, the whole model twice over the pipeline
    one = Layout.parse("pp=4,schedule=dualpipe")
    assert sum(sum(stage_params(DS8, one, s)) for s in range(4)) == 2 * DS8.count_params().total


def test_dualpipe_with_an_uneven_partition():
    """Partition (3, 1, 1, 3) of one direction: rank 1 holds stages 1 and 2 (layers 3 and
    4); rank 0 stages 0 and 3 (layers 0-2 and 5-7)."""
    layout = Layout.parse("pp=4,schedule=dualpipe,tp=2,ep=2,dp=2,partition=3:1:1:3")
    assert stage_layers(DS8, layout, 1) == [3, 4]
    assert stage_layers(DS8, layout, 0) == [0, 1, 2, 5, 6, 7]
    assert stage_params(DS8, layout, 1) == (2 * MOE, 2 * EXPERTS)
    assert stage_params(DS8, layout, 0) == (DENSE + 5 * MOE + EMBED + HEAD + NORM,
                                            5 * EXPERTS)


def test_zbv_holds_the_head_on_stage_zero():
    """ZBV's V: stage 0 runs virtual stages 0 and 2p-1 (the embedding and the head)."""
    layout = Layout.parse("pp=2,schedule=zbv,chunks=2,tp=2,ep=2,dp=2")
    # 8 layers over 4 virtual stages of 2: stage 0 holds one dense and three MoE layers
    assert stage_params(DS8, layout, 0) == (DENSE + 3 * MOE + EMBED + HEAD + NORM,
                                            3 * EXPERTS)
    assert stage_params(DS8, layout, 1) == (4 * MOE, 4 * EXPERTS)


def test_an_uneven_partition_with_a_dense_first_layer():
    layout = Layout.parse("pp=2,tp=2,ep=2,dp=2,partition=5:3")  # balanced would be 4:4
    assert moe_layers_on_stage(DS8, 2, 1, 0, (5, 3)) == 4  # layers 1-4
    assert moe_layers_on_stage(DS8, 2, 1, 1, (5, 3)) == 3
    assert stage_params(DS8, layout, 0) == (DENSE + 4 * MOE + EMBED, 4 * EXPERTS)
    assert stage_params(DS8, layout, 1) == (3 * MOE + HEAD + NORM, 3 * EXPERTS)
    assert stage_param_counts(DS8, tp=2, pp=2, ep=2, chunks=1, stage=1,
                              partition=(5, 3)) == (3 * MOE + HEAD + NORM, 3 * EXPERTS)


def test_expert_tensor_degree_apart_from_tp():
    layout = Layout.parse("pp=2,tp=2,ep=2,etp=1,dp=4")
    geometry = StageGeometry.of_layout(DS8, layout, 4, 1)
    assert geometry.params(DS8, 2, 2, 1) == (4 * MOE + HEAD + NORM, 4 * 2 * EXPERTS)
    assert stage_params(DS8, layout, 1) == (4 * MOE + HEAD + NORM, 4 * 2 * EXPERTS)


def test_fp8_experts_split_by_tp_when_etp_is_default():
    te = get_recipe("te", "delayed")
    norms = 2 * 64 + 32 + 16
    _, moe, _, gemms = fp8_linear_params(DS8, te, 2, 2)
    assert moe == MOE - norms - 8 * 64 + EXPERTS
    assert gemms == 5 + 2 * 1 + 2 * 8 / 2


def test_learned_positions_on_the_first_stage():
    gpt = get_model("tiny").with_(learned_positions=128, tie_embeddings=False)
    layer = (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) / 2 + 2 * 64  # tp = 2, 2 kv heads
    layout = Layout.parse("pp=2,tp=2")
    assert stage_params(gpt, layout, 0) == (2 * layer + 256 * 64 / 2 + 128 * 64, 0.0)
    geometry = StageGeometry.of_layout(gpt, layout, 2, 0)
    assert geometry.params(gpt, 2, 1)[0] == 2 * layer + 256 * 64 / 2 + 128 * 64


def test_stage_geometry_of_one_layout_by_hand():
    """1F1B, pp = 4, m = 8: stage i holds two layers and min(p - i, m) micro-batches."""
    layout = Layout.parse("pp=4,tp=2,ep=2,dp=2")
    got = [StageGeometry.of_layout(DS8, layout, 8, s) for s in range(4)]
    assert [(g.layers, g.moe_layers, bool(g.first), bool(g.last), g.in_flight)
            for g in got] == [(2, 1, True, False, 4), (2, 2, False, False, 3),
                              (2, 2, False, False, 2), (2, 2, False, True, 1)]


def test_stage_geometry_over_an_array_mixing_dualpipe_and_1f1b():
    """Arrays of layouts: the codes of DualPipe (6) and 1F1B (1) at pp = 4, stage 3."""
    codes = np.array([Layout.parse("pp=4,schedule=dualpipe").codes()["schedule"],
                      Layout.parse("pp=4").codes()["schedule"]])
    geo = StageGeometry.of(DS8, pp=np.array([4, 4]), chunks=np.array([1, 1]),
                           stage=np.array([3, 3]), schedule=codes, m=np.array([8, 8]))
    assert list(geo.layers) == [4, 2] and list(geo.moe_layers) == [3, 2]
    assert [bool(x) for x in geo.first] == [True, False]
    assert [bool(x) for x in geo.last] == [True, True]
    dense, experts = geo.params(DS8, 2, 2)
    assert list(dense) == [DENSE + 3 * MOE + EMBED + HEAD + NORM, 2 * MOE + HEAD + NORM]
    assert list(experts) == [3 * EXPERTS, 2 * EXPERTS]


def test_unique_rows_written_out():
    # a negative entry: the mixed-radix code (0·3 + 2 = 1·3 - 1) would merge rows 0 and 1
    at, inverse = _unique_rows([np.array([0, 1, 0]), np.array([2, -1, 2])])
    assert sorted(at.tolist()) == [0, 1]
    assert inverse.ravel().tolist() == [0, 1, 0]
    # radices past 2^62 in product: 2^40 and 2^30 rows
    big = [np.array([2**40, 1, 2**40]), np.array([2**30, 7, 2**30])]
    at, inverse = _unique_rows(big)
    assert at.tolist() == [1, 0] and inverse.ravel().tolist() == [1, 0, 1]


@pytest.mark.parametrize("partition", [(), Balanced(1, 1)])
def test_distinct_stages_of_arrays_keep_the_fullest_stage_of_each_kind(partition):
    """TINY-like dense model, 1F1B, pp = 4 over 8 layers: stages 0 (embedding), 1 (middle,
    3 in flight), 3 (head) differ; stage 2 (middle, 2 in flight) is dominated by stage 1,
    with the even split and with Balanced(1, 1) (the ends a layer short) alike."""
    model = get_model("tiny").with_(n_layers=8)
    pp = np.array([4, 4])
    m = np.array([8, 8])
    one = np.array([1, 1])
    stages = [np.array([0, 0]), np.array([1, 1]), np.array([2, 2]), np.array([3, 3])]
    reps = distinct_stages(model, pp, stages, chunks=one, schedule=one, m=m,
                           partition=partition)
    assert sorted({int(r[0]) for r in reps}) == [0, 1, 3]
    geos = distinct_geometries(model, pp, stages, chunks=one, schedule=one, m=m,
                               partition=partition)
    by_stage = {int(g.stage[0]): g for g in geos}
    assert sorted(by_stage) == [0, 1, 3]
    assert [int(by_stage[s].in_flight[1]) for s in (0, 1, 3)] == [4, 3, 1]
    assert bool(by_stage[0].first[0]) and bool(by_stage[3].last[1])


def test_distinct_stages_of_one_layout():
    model = get_model("tiny").with_(n_layers=8)
    reps = distinct_stages(model, 4, [0, 1, 2, 3], chunks=1, schedule=1, m=8)
    assert sorted(int(r) for r in reps) == [0, 1, 3]
    geos = distinct_geometries(model, 4, [0, 1, 2, 3], chunks=1, schedule=1, m=8)
    assert sorted((int(g.stage), int(g.in_flight)) for g in geos) == [(0, 4), (1, 3), (3, 1)]
    # an explicit uneven partition: every stage a different count, none dominated
    reps = distinct_stages(model, 4, [0, 1, 2, 3], chunks=1, schedule=1, m=8,
                           partition=(1, 2, 3, 2))
    assert sorted(int(r) for r in reps) == [0, 1, 2, 3]


def test_distinct_stages_of_arrays_with_uneven_ends():
    """Balanced(1, 0): 8 layers + 1 unit over 4 stages, 2 each and the extra on stage 1, the
    first a layer short: [1, 3, 2, 2] — every stage a kind of its own, none dominated."""
    model = get_model("tiny").with_(n_layers=8)
    one, pp, m = np.array([1, 1]), np.array([4, 4]), np.array([8, 8])
    stages = [np.array([s, s]) for s in range(4)]
    partition = Balanced(np.array([1, 1]), np.array([0, 0]))
    reps = distinct_stages(model, pp, stages, chunks=one, schedule=one, m=m,
                           partition=partition)
    assert sorted(int(r[0]) for r in reps) == [0, 1, 2, 3]
    geos = distinct_geometries(model, pp, stages, chunks=one, schedule=one, m=m,
                               partition=partition)
    assert sorted((int(g.stage[0]), int(g.layers[0])) for g in geos) == [
        (0, 1), (1, 3), (2, 2), (3, 2)]


def test_an_explicit_virtual_stage_partition_in_the_v():
    """ZBV, pp = 2, four virtual stages of (2, 2, 1, 3) layers: stage 0 runs virtual stages
    0 and 3 (layers 0-1, the first dense, and 5-7: 4 MoE; the loop order's 0 and 2 would
    give 2, the even split 3), stage 1 runs 1 and 2 (layers 2-4)."""
    layout = Layout.parse("pp=2,schedule=zbv,chunks=2,tp=2,ep=2,dp=2,partition=2:2:1:3")
    assert stage_layers(DS8, layout, 0) == [0, 1, 5, 6, 7]
    zero = StageGeometry.of_layout(DS8, layout, 4, 0)
    one = StageGeometry.of_layout(DS8, layout, 4, 1)
    assert (zero.layers, zero.moe_layers, one.layers, one.moe_layers) == (5, 4, 3, 3)
    assert stage_params(DS8, layout, 0) == (DENSE + 4 * MOE + EMBED + HEAD + NORM,
                                            4 * EXPERTS)


def test_a_last_stage_one_moe_layer_short_of_another_keeps_its_own_composition():
    """15 layers, MoE every second (layers 1, 3, …), pp 5 of 3 layers: stages hold 1, 2, 1, 2
    and 1 MoE layers. By hand the compositions are stage 0 (first, 1 MoE), stages 1 and 3
    (2 MoE), stage 2 (1 MoE) and stage 4 (last, 1 MoE); under 1F1B stage 1 has more in
    flight than stage 3, so the stages that can hold the most are 0, 1, 2 and 4 — the last
    stage, with the head, is no middle stage's duplicate."""
    from shardwise.arch import ModelSpec
    from shardwise.estimate.geometry import candidate_stages

    model = ModelSpec("alt-moe", 15, 512, 8, 8, 2048, 262144, n_experts=8, top_k=2,
                      d_ff_expert=1024, moe_every=2).validate()
    pp = np.array([5, 5])
    kept = distinct_stages(model, pp, candidate_stages(model, pp), chunks=np.array([1, 1]),
                           schedule=np.array([1, 1]), m=np.array([8, 16]))
    assert [moe_layers_on_stage(model, 5, 1, s) for s in range(5)] == [1, 2, 1, 2, 1]
    for row in range(2):
        assert sorted({int(k[row]) for k in kept}) == [0, 1, 2, 4]


def test_stage_zero_of_an_array_mixing_dualpipe_and_1f1b_holds_the_embedding():
    """Stage 0 of both: DualPipe's rank holds stages 0 and 3 (both ends), 1F1B's the first."""
    codes = np.array([Layout.parse("pp=4,schedule=dualpipe").codes()["schedule"],
                      Layout.parse("pp=4").codes()["schedule"]])
    geo = StageGeometry.of(DS8, pp=np.array([4, 4]), chunks=np.array([1, 1]),
                           stage=np.array([0, 0]), schedule=codes, m=np.array([8, 8]))
    assert [bool(x) for x in geo.first] == [True, True]
    assert [bool(x) for x in geo.last] == [True, False]
    dense, _ = geo.params(DS8, 2, 2)
    assert float(dense[1]) == DENSE + MOE + EMBED  # layers 0 (dense) and 1


def test_gpt_oss_attention_sinks_split_over_tp():
    """gpt-oss's attention holds one sink logit per query head (`sinks`, shape (a,)), split
    with the heads: a/t per rank."""
    from shardwise.estimate.geometry import layer_params

    model = get_model("gpt-oss-20b")
    with_sinks = layer_params(model, 2, 1)[0]
    without = layer_params(model.with_(attention_sinks=False), 2, 1)[0]
    assert with_sinks - without == model.n_heads / 2


def test_a_middle_stage_and_the_last_of_one_moe_count_stay_apart():
    """7 layers over pp = 3 as (1, 4, 2), MoE every third layer (2 and 5): stage 1 holds
    layers 1-4 (one MoE), the last layers 5-6 (one MoE) and the head — two compositions,
    both evaluated though stage 1 holds more in flight; the peak is the most of every
    stage's total."""
    from shardwise.estimate.memory import peak_stage_total, training_memory_per_gpu
    from shardwise.layout import TrainSpec

    model = get_model("tiny-deepseek").with_(n_layers=7, moe_every=3, first_dense_layers=0,
                                             vocab=32000)
    layout = Layout.parse("pp=3,tp=2,ep=2,dp=2").with_(partition=(1, 4, 2))
    train = TrainSpec(seq_len=64, global_batch=16)
    reps = distinct_stages(model, 3, [0, 1, 2], chunks=1, schedule=1, m=8,
                           partition=(1, 4, 2))
    assert sorted(int(r) for r in reps) == [0, 1, 2]
    stages = training_memory_per_gpu(model, layout, train)
    assert stages[2].total > stages[1].total  # the head's logits
    codes = layout.codes() | {"m": layout.microbatches(train), "partition": (1, 4, 2)}
    assert float(peak_stage_total(model, train, **codes)) == max(s.total for s in stages)
