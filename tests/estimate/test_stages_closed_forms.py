"""The busiest pipeline stage's parameters per rank (estimate/stages.py
`busiest_stage_params`, what the DP/ZeRO traffic and the optimizer step count) against hand
counts and against the memory model's per-stage counts one layout at a time: explicit and
balanced partitions, arrays of layouts mixing pipelines (chunks, the V placement, balanced
ends), MoE models whose dense first layers or alternating MoE layers put the most on a middle
stage. Non-degenerate: GQA with a shared expert and dense first layers, tp·ep > 1."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.estimate.geometry import stage_param_counts
from shardwise.estimate.step import busiest_stage_params

MODEL = ModelSpec("step-moe", n_layers=8, d_model=1024, n_heads=16, n_kv_heads=4, d_ff=4096,
                  vocab=32000, n_experts=8, top_k=2, d_ff_expert=512, n_shared_experts=1,
                  first_dense_layers=2).validate()


def test_busiest_stage_params_by_hand():
    """Per rank, tp 2, ep 4 over pp 2 stages of 4 layers (loop placement, chunks 1): stage 0
    holds the embedding (V·h/t) and layers 0-3 (both dense layers), stage 1 layers 4-7 and
    the final norm and head (V·h/t). A layer's attention: q and o h·h/t each, k and v
    h·(4·64)/t each, 2 RMSNorms of h; a dense MLP 3·h·d_ff/t; an MoE layer's router h·E, its
    shared expert 3·h·512/t (dense) and 8/4 local experts of 3·h·512 (experts' TP is tp)."""
    h, t, e, V = 1024, 2, 4, 32000
    attn = (2 * h * h + 2 * h * 4 * 64) / t + 2 * h
    dense_layer = attn + 3 * h * 4096 / t
    moe_dense = attn + h * 8 + 3 * h * 512 / t
    moe_expert = 8 / e * 3 * h * 512 / t
    first = (V * h / t + 2 * dense_layer + 2 * moe_dense, 2 * moe_expert)
    last = (4 * moe_dense + h + V * h / t, 4 * moe_expert)
    want = max(first, last, key=sum)
    got = busiest_stage_params(MODEL, t, 2, e, 1)
    assert (float(got[0]), float(got[1])) == pytest.approx(want, rel=1e-12)
    # arrays of layouts: each its own busiest stage
    dense, expert = busiest_stage_params(MODEL, np.array([2, 2]), np.array([2, 2]),
                                         np.array([4, 2]), np.array([1, 1]))
    assert dense == pytest.approx([want[0]] * 2, rel=1e-12)
    assert expert == pytest.approx([want[1], 2 * want[1]], rel=1e-12)  # ep 2: 4 experts
    # an explicit partition 2:6: the second stage (6 MoE layers and the head) is busiest
    got = busiest_stage_params(MODEL, t, 2, e, 1, partition=(2, 6))
    assert (float(got[0]), float(got[1])) == pytest.approx(
        (6 * moe_dense + h + V * h / t, 6 * moe_expert), rel=1e-12)
    # pp 4, partition 1:1:5:1, ep 1 (all 8 experts a rank): a middle stage (5 MoE layers)
    # holds the most, neither end nor the second
    expert1 = 8 * 3 * h * 512 / t
    got = busiest_stage_params(MODEL, t, 4, 1, 1, partition=(1, 1, 5, 1))
    assert 5 * (moe_dense + expert1) > max(V * h / t + dense_layer,
                                           moe_dense + expert1 + h + V * h / t)
    assert (float(got[0]), float(got[1])) == pytest.approx((5 * moe_dense, 5 * expert1),
                                                           rel=1e-12)


@pytest.mark.parametrize(("name", "pp"), [("deepseek-v3", 16), ("deepseek-v3", 32),
                                           ("kimi-k2", 32), ("llama4-maverick", 12),
                                           ("llama3-8b", 5), ("tiny-deepseek", 3)])
def test_the_busiest_stage_is_the_most_of_every_stage(name, pp):
    """The DP/ZeRO traffic and the optimizer step count the stage holding the most
    parameters: the most over every stage of the memory model's per-stage counts, for MoE
    models whose dense first layers (DeepSeek-V3: 3, Kimi K2: 1) or alternating MoE layers
    (Llama 4 Maverick) put more on a middle stage than on the second, and for dense ones."""
    model = get_model(name)
    every = [sum(stage_param_counts(model, tp=2, pp=pp, ep=8 if model.is_moe else 1,
                                    chunks=1, stage=s)) for s in range(pp)]
    dense, expert = busiest_stage_params(model, 2, pp, 8 if model.is_moe else 1, 1)
    assert dense + expert == max(every)


def test_busiest_stage_params_of_arrays_of_pipelines_each_as_its_own_layout():
    """Arrays of layouts that repeat and mix their pipelines (pp 2 and 4, chunks 1 and 2, the
    loop and the V placement, balanced ends (1, 1), (0, 1) and (0, 0)) and their tp, ep: each
    element is the most over every stage of its own layout's per-stage counts, one layout
    at a time. MLA with a dense first layer and a shared expert, MoE every second layer
    after it (layers 1, 3, 5, 7): the loop's stage 1 of pp 4 × 2 chunks holds layers 1 and 5,
    the V's 1 and 6; pp 4 holds 3 layers on its busiest stage with ends (1, 1) or (0, 1), 2 with (0, 0)."""
    from shardwise.partition import Balanced

    model = get_model("tiny-deepseek").with_(n_layers=8, moe_every=2)
    rows = [(2, 4, 1, "loop", 1, 1, 2), (1, 2, 1, "loop", 0, 1, 4), (2, 4, 2, "v", 0, 0, 2),
            (2, 4, 1, "loop", 1, 1, 4), (1, 4, 2, "loop", 0, 0, 2), (2, 2, 2, "v", 0, 0, 4),
            (1, 2, 1, "loop", 0, 1, 2), (2, 4, 2, "v", 0, 0, 4), (2, 4, 2, "loop", 0, 0, 2),
            (2, 4, 1, "loop", 0, 0, 2), (2, 4, 1, "loop", 0, 1, 2)]
    t, p, v, placement, a, z, e = (np.array(column) for column in zip(*rows, strict=True))
    dense, expert = busiest_stage_params(model, t, p, e, v, Balanced(a, z), 0, placement)
    for i, (ti, pi, vi, pl, ai, zi, ei) in enumerate(rows):
        every = [stage_param_counts(model, tp=ti, pp=pi, ep=ei, chunks=vi, stage=s,
                                    partition=Balanced(ai, zi), placement=pl)
                 for s in range(pi)]
        want = max(every, key=lambda counts: counts[0] + counts[1])
        assert (float(dense[i]), float(expert[i])) == (float(want[0]), float(want[1]))
    assert len({(float(d), float(x)) for d, x in zip(dense, expert, strict=True)}) > 3


def test_busiest_stage_params_of_an_explicit_partition_over_arrays_of_layouts():
    """An explicit partition (the planner's fixed one, `--fix partition=…`) with arrays of
    three layouts of that pp: each element is the most over the partition's stages of its
    own tp and ep (stage 1 holds 4 of the 8 layers: 3 MoE), one layout at a time."""
    model = get_model("tiny-deepseek").with_(n_layers=8)
    split = (2, 4, 1, 1)
    t, e = np.array([1, 2, 2]), np.array([2, 2, 4])
    dense, expert = busiest_stage_params(model, t, np.array([4, 4, 4]), e, np.array([1, 1, 1]),
                                         split)
    for i in range(3):
        every = [stage_param_counts(model, tp=int(t[i]), pp=4, ep=int(e[i]), chunks=1, stage=s,
                                    partition=split) for s in range(4)]
        want = max(every, key=lambda counts: counts[0] + counts[1])
        assert (float(dense[i]), float(expert[i])) == (float(want[0]), float(want[1]))
