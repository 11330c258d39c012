"""The planner searches uneven stage partitions (issue 9 item 1): besides the default, the
balanced-by-cost ones with the first/last stage shortened for the embedding and the head
(`layout.Balanced`, `plan.grid._partitions`)."""

from __future__ import annotations

import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.estimate.memory import stage_memory, training_memory_per_gpu
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import CP_KINDS, Balanced, Layout, TrainSpec, stage_partition
from shardwise.plan import (
    SearchSpace,
    _enumerate,
    _flatten,
    _layout_of,
    _Rejections,
    evaluate_candidates,
    plan,
)

# a small model with a big vocabulary: the head's GEMM (V·h = 65.5 M) costs about 4 layers'
# (4·h² + 3·h·f = 16.8 M parameters each), so the last stage wants fewer layers
BIG_VOCAB = ModelSpec("big-vocab", 32, 1024, 16, 16, 4096, 64000)
TRAIN = TrainSpec(seq_len=2048, global_batch=64)


def test_balanced_partition_by_hand():
    # L + a + z units over pp, extras on the stages after the first, first a short, last z
    assert stage_partition(32, 4, 1, Balanced(0, 4)) == (9, 9, 9, 5)  # 36 = 4·9
    assert stage_partition(32, 4, 1, Balanced(1, 1)) == (7, 9, 9, 7)  # 34 = 4·8 + 2
    assert stage_partition(32, 4, 1, Balanced(0, 0)) == stage_partition(32, 4) == (8,) * 4
    assert stage_partition(126, 16, 1, Balanced(1, 1)) == stage_partition(126, 16)


def test_planner_picks_a_shortened_last_stage_when_it_is_strictly_faster():
    cluster = Cluster.of(8, "h100")
    result = plan(BIG_VOCAB, cluster, TRAIN, top=1,
                  space=SearchSpace(tp=(1,), pp=(4,), cp=(1,)))
    best = result.ranked[0].layout
    assert best.partition == (9, 9, 9, 5)
    # the reference: the scalar step model on the winner and on it with the default partition
    searched = estimate_step(BIG_VOCAB, cluster, best, TRAIN, simulate=True)
    default = estimate_step(BIG_VOCAB, cluster, best.with_(partition=()), TRAIN, simulate=True)
    assert searched.total < 0.95 * default.total
    assert max(s.total for s in training_memory_per_gpu(BIG_VOCAB, best, TRAIN)) \
        <= result.budget
    # the searched layout, given explicitly, ranks first; its default twin ranks too
    given = plan(BIG_VOCAB, cluster, TRAIN, top=1, layout=best,
                 space=SearchSpace(tp=(1,), pp=(4,), cp=(1,)))
    assert given.given is not None and given.given.rank == 1
    twin = plan(BIG_VOCAB, cluster, TRAIN, top=1, layout=best.with_(partition=()),
                space=SearchSpace(tp=(1,), pp=(4,), cp=(1,)))
    assert twin.given is not None and twin.given.rank is not None and twin.given.rank > 1


def test_searched_partitions_evaluate_as_the_scalar_models_do():
    """Every layout of a small search, its partition searched or not: the planner's arrays
    equal `estimate_step` and `training_memory_per_gpu` of the explicit layout."""
    cluster = Cluster.of(8, "h100")
    train = TrainSpec(seq_len=512, global_batch=16)
    grid, _ = _enumerate(BIG_VOCAB, cluster, train, SearchSpace(tp=(1, 2), cp=(1,)),
                         _Rejections())
    cand, terms = _flatten(grid, evaluate_candidates(BIG_VOCAB, cluster, train, grid))
    layouts = [_layout_of(cand, i) for i in range(len(cand["tp"]))]
    searched = [i for i, lay in enumerate(layouts) if lay.partition]
    assert len(searched) > 50 and len(searched) < len(layouts)
    assert {layouts[i].partition for i in searched} >= {(7, 9, 9, 7), (9, 9, 9, 5)}
    for i in searched[::7]:
        est = estimate_step(BIG_VOCAB, cluster, layouts[i], train)
        assert terms["total"][i] == pytest.approx(est.total, rel=1e-9)
        peak = max(s.total for s in training_memory_per_gpu(BIG_VOCAB, layouts[i], train))
        assert terms["memory"][i] == pytest.approx(peak, rel=1e-9)
    # interleaving keeps the even split: searched partitions run with chunks = 1
    assert all(layouts[i].chunks == 1 for i in searched)


def test_torchtitan_all_gather_cp_evaluates_as_the_scalar_models_do():
    """torchtitan's searched context parallelism is its all-gather of K/V: every such layout of
    a small search, the planner's arrays equal `estimate_step` and `training_memory_per_gpu`;
    without recompute a layer keeps the whole sequence's K and V, `(c-1)·(s/c)·b·kv/t·(d_k+d_v)`
    bytes more than the rank's share (`gathered_kv_bytes`), with op-sac nothing more."""
    model, cluster = get_model("llama3-8b"), Cluster.of(16, "h100")
    train = TrainSpec(seq_len=32768, global_batch=8, impl="torchtitan")
    grid, _ = _enumerate(model, cluster, train, SearchSpace(tp=(1, 2), pp=(1,)), _Rejections())
    cand, terms = _flatten(grid, evaluate_candidates(model, cluster, train, grid))
    layouts = [_layout_of(cand, i) for i in range(len(cand["tp"]))]
    gathered = [i for i, lay in enumerate(layouts) if lay.cp > 1]
    assert gathered and all(layouts[i].cp_kind == "allgather" for i in gathered)
    for i in gathered[::5]:
        est = estimate_step(model, cluster, layouts[i], train)
        assert terms["total"][i] == pytest.approx(est.total, rel=1e-9)
        peak = max(s.total for s in training_memory_per_gpu(model, layouts[i], train))
        assert terms["memory"][i] == pytest.approx(peak, rel=1e-9)
    plain = Layout(dp=4, cp=4, cp_kind="allgather", zero=3)
    per_layer = 3 * 32768 / 4 * 1 * 8 * (128 + 128) * 2  # (c-1)·s/c·b·kv_heads·(d_k+d_v)·2

    def activations(layout: Layout, kind: str) -> float:  # the stage's, cp_kind forced
        codes = layout.codes() | {"cp_kind": CP_KINDS.index(kind)}
        return float(stage_memory(model, train, m=layout.microbatches(train), stage=0,
                                  **codes)["activations"])

    assert activations(plain, "allgather") - activations(plain, "ring") == pytest.approx(
        32 * per_layer, rel=1e-12)  # one micro-batch in flight
    sac = plain.with_(recompute="op-sac")
    assert activations(sac, "allgather") == activations(sac, "ring")
    assert training_memory_per_gpu(model, plain, train)[0].activations == pytest.approx(
        activations(plain, "allgather"), rel=1e-12)
