"""The layout planner: the published 405B decision, agreement of the vectorised and scalar
models on every candidate, memory agreement with estimate/memory.py, ranking, rejected
regions, the §7 baseline, errors, and the validation set."""

import random
import re
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.arch import ModelSpec, count_params, get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import (
    activation_bytes_per_layer,
    peak_stage_memory,
    training_memory_per_gpu,
)
from shardwise.estimate.step import estimate_step
from shardwise.estimate.uncertainty import resolution
from shardwise.hardware import Cluster, get_accelerator
from shardwise.layout import Layout, TrainSpec
from shardwise.plan import (
    SearchSpace,
    _enumerate,
    _flatten,
    _layout_of,
    _Rejections,
    choose_parallelism,
    evaluate_candidates,
    plan,
)
from shardwise.plan.rank import SIMPLER, simplicity
from shardwise.stacks import STACKS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama405b():
    model = get_model("llama3-405b")
    cluster = Cluster.of(16384, "h100")
    # "16M tokens" per step in Llama 3 = 2048 sequences of 8192 (2^24 tokens)
    train = TrainSpec(seq_len=8192, global_batch=2048)
    return model, cluster, train, plan(model, cluster, train, top=5)


# ------------------------------------------------------------------------------ SPEC §7
def test_llama3_405b_search_chooses_a_pipeline_across_nodes(llama405b):
    """The search now includes uneven stages (126 layers over pp=16 or 32); with TP
    communication charged fully exposed it prefers tp4 over the published tp8 (issue 9 item 5,
    overlap modelling, is what changes that)."""
    model, cluster, _, result = llama405b
    best = result.best.layout
    assert best.tp in (4, 8)
    assert best.pp > 1
    assert best.tp * best.cp * best.dp >= cluster.gpus_per_node  # stages on different nodes
    parts = best.stage_partition(model.n_layers)
    assert sum(parts) * best.chunks == model.n_layers and min(parts) >= 1


def test_llama3_405b_baseline_is_tp8_and_the_search_beats_it(llama405b):
    _, _, _, result = llama405b
    assert result.baseline is not None
    assert result.baseline.layout.tp == 8
    assert result.best.estimate.total <= result.baseline.estimate.total


def test_ranked_layouts_fit_and_are_sorted(llama405b):
    model, _, train, result = llama405b
    totals = [e.estimate.total for e in result.ranked]
    assert totals == sorted(totals)
    for entry in result.ranked:
        peak = max(s.total for s in training_memory_per_gpu(model, entry.layout, train))
        assert peak == pytest.approx(entry.memory.total)
        assert peak <= entry.budget == pytest.approx(0.85 * 80 * 2**30)


def test_rejected_regions_and_evaluated_partition_the_grid(llama405b):
    _, _, _, result = llama405b
    structural = sum(r.count for r in result.rejected if r.category != "memory")
    assert structural + result.stats.evaluated == result.stats.grid
    memory = [r for r in result.rejected if r.category == "memory"]
    assert memory and memory[0].count == result.stats.evaluated - result.stats.fits
    assert "GiB over" in memory[0].example


# ------------------------------------------------------------- vectorised == scalar
def _small_search(model, gpus, seq, batch, flash=True):
    cluster = Cluster.of(gpus, "h100")
    train = TrainSpec(seq_len=seq, global_batch=batch, flash_attention=flash)
    grid, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    cand, terms = _flatten(grid, evaluate_candidates(model, cluster, train, grid))
    flat_only, _ = _flatten(grid)
    # the flat candidates evaluated directly give the same numbers as the broadcast grid
    again = evaluate_candidates(model, cluster, train,
                                {k: v for k, v in flat_only.items() if k != "_pairs"})
    assert np.array_equal(again["total"], terms["total"])
    return cluster, train, cand, terms


def test_vectorised_and_scalar_agree_on_every_candidate_of_a_small_search():
    """Plumbing: the planner's arrays equal `estimate_step` one layout at a time; the formulas
    themselves are checked against hand closed forms in tests/estimate (and, for the
    planner's own columns, `test_planner_mfu_is_the_models_flops_over_the_step_by_hand`)."""
    model = get_model("tiny")
    cluster, train, cand, terms = _small_search(model, 8, 64, 16)
    n = len(cand["tp"])
    assert n > 500
    for i in range(n):
        est = estimate_step(model, cluster, _layout_of(cand, i), train)
        for key in ("total", "compute", "tp_comm", "cp_comm_exposed", "pp_comm", "bubble",
                    "dp_comm_exposed", "optimizer", "mfu", "hfu"):
            assert terms[key][i] == pytest.approx(getattr(est, key), rel=1e-9, abs=1e-300)


def test_planner_mfu_is_the_models_flops_over_the_step_by_hand():
    """Whatever the layout, a step does the same model FLOPs: MFU·step time·GPUs·peak is one
    number over every candidate, 3 × the forward FLOPs of the global batch — by hand for tiny,
    per token 2·(attention + MLP + head weights) + scores and P·V 2·2·L·s·h (the full square:
    model FLOPs count attention non-causal, Megatron's and PaLM's MFU convention)."""
    model = get_model("tiny")
    *_, terms = _small_search(model, 8, 64, 16)
    h, layers, s = model.d_model, model.n_layers, 64
    counts = count_params(model)
    weights = counts.attention + counts.mlp + counts.head  # the GEMMs a token passes
    fwd = 2 * weights + 2 * 2 * layers * s * h
    peak = get_accelerator("h100").peak_flops("bf16")
    flops = terms["mfu"] * terms["total"] * 8 * peak
    assert len(flops) > 500
    assert flops == pytest.approx(np.full(len(flops), 3 * fwd * s * 16), rel=1e-9)


def test_tp1_rows_skip_sequence_parallel_columns_without_changing_a_number():
    """The CLI default's grid is large enough that rows with tp = 1 are evaluated on their
    sp = 0 columns only (`_without_sp`); every valid layout's numbers equal the flat
    evaluation's, which never splits."""
    from shardwise.plan.evaluate import _without_sp

    model, cluster = get_model("llama3-8b"), Cluster.of(64, "h100")
    train = TrainSpec(seq_len=8192, global_batch=512)
    grid, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    assert _without_sp(grid) is not None
    keys = ("total", "memory", "bubble", "mfu", "dp_comm_exposed")
    _, split = _flatten(grid, evaluate_candidates(model, cluster, train, grid, keys=keys))
    flat, _ = _flatten(grid)
    direct = evaluate_candidates(model, cluster, train,
                                 {k: v for k, v in flat.items() if k != "_pairs"})
    for key in keys:
        assert np.array_equal(np.broadcast_to(direct[key], split[key].shape), split[key]), key


@pytest.mark.parametrize("model, gpus, seq, batch, flash", [
    (get_model("llama3-8b"), 16, 4096, 64, True),
    (get_model("mixtral-8x7b"), 32, 4096, 64, True),
    (get_model("tiny-moe").with_(moe_every=2, n_layers=6), 8, 64, 16, True),
    (get_model("gpt3-1.3b"), 16, 2048, 64, False),
    # MLA, a dense first layer, shared experts; etp = tp and etp = 1 both searched
    (get_model("deepseek-v2-lite"), 16, 4096, 64, True),
])
def test_vectorised_matches_scalar_and_memory_on_random_candidates(model, gpus, seq, batch,
                                                                   flash):
    cluster, train, cand, terms = _small_search(model, gpus, seq, batch, flash)
    n = len(cand["tp"])
    for i in random.Random(1).sample(range(n), min(n, 60)):
        layout = _layout_of(cand, i)
        est = estimate_step(model, cluster, layout, train)
        assert terms["total"][i] == pytest.approx(est.total, rel=1e-9)
        assert terms["ep_comm"][i] == pytest.approx(est.ep_comm, rel=1e-9, abs=1e-300)
        peak = max(s.total for s in training_memory_per_gpu(model, layout, train))
        assert terms["memory"][i] == pytest.approx(peak, rel=1e-9)


def test_the_search_compares_context_parallel_kinds():
    """With cp > 1 the search offers ring attention, Ulysses (when its degree divides a tp
    rank's heads), the hybrid (its all-to-all over the cp ranks of one node, when that is
    neither 1 nor all of them) and the all-gather, each as the scalar models evaluate it."""
    model = get_model("llama3-8b")  # 32 query, 8 key/value heads
    cluster, train = Cluster.of(32, "h100"), TrainSpec(seq_len=65536, global_batch=16)
    space = SearchSpace(tp=(2,), pp=(1,), cp=(4, 16), micro_batch=(1,), zero=(1,), sp=(False,),
                        recompute=("full",))
    rejections = _Rejections()
    grid, _ = _enumerate(model, cluster, train, space, rejections)
    cand, terms = _flatten(grid, evaluate_candidates(model, cluster, train, grid))
    layouts = [_layout_of(cand, i) for i in range(len(cand["tp"]))]
    # 8/2 = 4 kv heads a tp rank: Ulysses over 16 cannot split them; 4 cp ranks a node: the
    # hybrid of cp 4 would be Ulysses, of cp 16 an all-to-all over 4 and a ring of 4
    assert {(lay.cp, lay.cp_kind, lay.ulysses) for lay in layouts} == {
        (4, "ring", 0), (4, "ulysses", 0), (16, "hybrid", 4), (16, "ring", 0),
        (4, "allgather", 0), (16, "allgather", 0)}
    reasons = {r.reason for r in rejections.result()}
    assert "the Ulysses degree does not divide the heads" in reasons
    for i, layout in enumerate(layouts):
        assert terms["total"][i] == pytest.approx(
            estimate_step(model, cluster, layout, train).total, rel=1e-9)
        assert terms["memory"][i] == pytest.approx(
            max(s.total for s in training_memory_per_gpu(model, layout, train)), rel=1e-9)



def test_no_hybrid_context_parallelism_where_tp_fills_the_node():
    """Nodes of 4 GPUs and tp = 4: no cp rank shares a node with another (4 // 4 = 1 cp rank
    a node), so the hybrid would be ring attention — not searched; Ulysses over cp 4 cannot
    split a tp rank's 2 key/value heads. Ring and the all-gather remain."""
    model = get_model("llama3-8b")  # 8 key/value heads: 2 a tp rank
    cluster = Cluster.of(32, "h100", gpus_per_node=4)
    train = TrainSpec(seq_len=65536, global_batch=16)
    space = SearchSpace(tp=(4,), pp=(1,), cp=(4,), micro_batch=(1,), zero=(1,), sp=(False,),
                        recompute=("full",))
    rejections = _Rejections()
    grid, _ = _enumerate(model, cluster, train, space, rejections)
    cand, _ = _flatten(grid)
    kinds = {_layout_of(cand, i).cp_kind for i in range(len(cand["tp"]))}
    assert kinds == {"ring", "allgather"}
    assert any(r.reason.startswith("hybrid cp with every cp rank in one node or one per node")
               for r in rejections.result())

def test_memory_arrays_handle_gpipe_and_full_sharding():
    model = ModelSpec("m", 8, 512, 8, 4, 2048, 1000, dropout=True, norm="layernorm")
    train = TrainSpec(seq_len=256, global_batch=32, flash_attention=False, impl="shardwise")
    layouts = [Layout(dp=2, tp=2, pp=2, schedule="gpipe", zero=3, micro_batch=2),
               Layout(dp=4, pp=2, schedule="interleaved", chunks=2, zero=2, zero_group=2),
               Layout(dp=8, zero=1, recompute="full", micro_batch=4),
               Layout(dp=2, tp=4, sp=True, recompute="selective", pp=1)]
    codes = [x.codes() | {"m": x.microbatches(train)} for x in layouts]
    cand = {k: np.array([c[k] for c in codes]) for k in codes[0]}
    got = peak_stage_memory(model, train, **cand)["total"]
    for i, layout in enumerate(layouts):
        peak = max(s.total for s in training_memory_per_gpu(model, layout, train))
        assert got[i] == pytest.approx(peak, rel=1e-12)


def test_fp64_statistics_are_fp64_in_the_planner_arrays_too():
    """llama3-8b, s=4096, b=1, tp=2, FlashAttention, fp64 (8 B): one layer saves, by hand,
    4 replicated s·h inputs, q and the attention output at h/2, k and v at 4 kv heads × 128,
    2 RMSNorm rstd rows and 16 heads' log-sum-exp in fp64 (not fp32: the planner's former copy
    of the memory model counted 4 B there and said 1,409,581,056), and SwiGLU's 3 × s·f/2."""
    s, h, ab = 4096, 4096, 8
    by_hand = (4 * s * h * ab + 2 * s * h // 2 * ab + 2 * s * 4 * 128 * ab + 2 * s * 8
               + 16 * s * 8 + 3 * s * 14336 // 2 * ab)
    assert by_hand == 1_409_875_968
    arrays = activation_bytes_per_layer(get_model("llama3-8b"), s, np.array([1, 1]),
                                        tp=np.array([2, 2]), sp=np.array([0, 0]),
                                        cp=np.array([1, 1]), recompute=np.array([0, 0]),
                                        flash=True, dtype="fp64", moe=False)
    assert arrays.tolist() == [by_hand, by_hand]


@pytest.mark.parametrize("dtype", ["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("model, gpus, seq, batch", [
    (get_model("llama3-8b"), 16, 4096, 64), (get_model("mixtral-8x7b"), 32, 4096, 64),
    (ModelSpec("ln", 8, 512, 8, 8, 2048, 1000, dropout=True, norm="layernorm"), 8, 256, 32)])
def test_planner_memory_equals_the_memory_model_in_every_dtype(model, gpus, seq, batch, dtype):
    """One memory model: the planner's arrays and `training_memory_per_gpu` agree in fp32,
    fp64 and bf16 (statistics, log-sum-exp and router probabilities at least fp32)."""
    cluster = Cluster.of(gpus, "h100")
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype, impl="shardwise")
    grid, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    flat, _ = _flatten(grid)
    pick = random.Random(7).sample(range(len(flat["tp"])), min(len(flat["tp"]), 40))
    cand = {k: flat[k][pick] for k in (*Layout().codes(), "m")}
    parts = peak_stage_memory(model, train, **cand)
    if dtype != "fp64":  # the planner's own path (the step model has no fp64 peak FLOP/s)
        terms = evaluate_candidates(model, cluster, train, cand)
        assert np.array_equal(terms["memory"], parts["total"])
    for i in range(len(pick)):
        layout = _layout_of(cand, i)
        peak = max(training_memory_per_gpu(model, layout, train), key=lambda st: st.total)
        assert parts["total"][i] == pytest.approx(peak.total, rel=1e-12)
        assert parts["activations"][i] == pytest.approx(peak.activations, rel=1e-12)
        assert parts["stage"][i] == peak.stage


def test_planner_memory_takes_every_as_trained_option():
    """The planner's memory of each layout (its own vectorised path) takes the options a
    recipe states — recompute modules, activation offloading, FP8-stored SwiGLU inputs, a
    busiest-rank expert load, BF16 moments — as `training_memory_per_gpu` does, on an MLA
    model with shared experts; each option changes the peak on its own (so none can be
    dropped unseen). Plumbing: the memory model is checked against saved tensors elsewhere."""
    model = replace(get_model("deepseek-v3"), n_layers=12, first_dense_layers=2,
                    n_shared_experts=2)
    cluster = Cluster.of(64, "h100")
    train = TrainSpec(seq_len=4096, global_batch=256, impl="megatron-te", fp8="blockwise",
                      recompute_modules=("layernorm", "mla_up_proj"),
                      offload_modules=("core_attn", "expert_fc1"), act_fp8_store=True,
                      expert_load=1.25, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"
                      ).validate()
    space = SearchSpace(recompute=("selective",), micro_batch=(1, 2))
    grid, _ = _enumerate(model, cluster, train, space, _Rejections())
    flat, _ = _flatten(grid)
    pick = random.Random(3).sample(range(len(flat["tp"])), min(len(flat["tp"]), 24))
    cand = {k: flat[k][pick] for k in (*Layout().codes(), "m")}
    memory = evaluate_candidates(model, cluster, train, cand)["memory"]
    without = {"recompute_modules": None, "offload_modules": (), "act_fp8_store": False,
               "expert_load": 1.0, "exp_avg_dtype": None, "exp_avg_sq_dtype": None}
    for i in range(len(pick)):
        layout = _layout_of(cand, i)

        def peak(spec, layout=layout):
            return max(s.total for s in training_memory_per_gpu(model, layout, spec))

        assert memory[i] == pytest.approx(peak(train), rel=1e-12), layout.short()
        for option, default in without.items():
            assert peak(replace(train, **{option: default})) != peak(train), option


def test_mfu_never_exceeds_one_and_fitting_means_within_budget():
    model = get_model("llama3-8b")
    cluster, train, _, terms = _small_search(model, 16, 8192, 64)
    assert np.all(terms["mfu"] <= 1) and np.all(terms["mfu"] > 0)
    assert np.all(terms["hfu"] >= terms["mfu"] - 1e-15)
    result = plan(model, cluster, train, top=3)
    for entry in result.ranked:
        assert entry.memory.total <= 0.85 * cluster.accelerator.memory_bytes


# ------------------------------------------------------------------------------ interface
def test_given_layout_is_evaluated_and_ranked():
    model = get_model("llama3-8b")
    cluster = Cluster.of(16, "h100")
    train = TrainSpec(seq_len=4096, global_batch=64)
    first = plan(model, cluster, train, top=3)
    again = plan(model, cluster, train, top=3, layout=first.best.layout)
    assert again.given is not None and again.given.rank == 1
    slow = plan(model, cluster, train, top=1, layout=Layout(dp=2, tp=8, sp=True))
    assert slow.given.rank > 1
    assert slow.given.estimate.total > slow.best.estimate.total


def test_alternatives_name_other_axis_values():
    model = get_model("llama3-70b")
    result = plan(model, Cluster.of(64, "h100"), TrainSpec(seq_len=8192, global_batch=128),
                  top=1)
    axes = {a.axis for a in result.alternatives}
    assert {"tp", "pp", "recompute"} <= axes
    for alt in result.alternatives:
        assert (alt.best_total is None) != (alt.min_memory is None)
        if alt.best_total is not None:
            assert alt.best_total >= result.best.estimate.total * (1 - 1e-9)


def test_no_layout_fits_says_by_how_much():
    with pytest.raises(ShardwiseError, match=r"GiB over the .* budget.*would help"):
        plan(get_model("llama3-405b"), Cluster.of(8, "h100"),
             TrainSpec(seq_len=8192, global_batch=8))


def test_planning_needs_a_global_batch():
    with pytest.raises(ShardwiseError, match="global batch"):
        plan(get_model("tiny"), Cluster.of(8, "h100"), TrainSpec(seq_len=64))


def test_no_valid_layout_names_the_rules():
    with pytest.raises(ShardwiseError, match="no valid layout"):
        plan(get_model("tiny"), Cluster.of(8, "h100"), TrainSpec(seq_len=64, global_batch=3),
             space=SearchSpace(tp=(3,)))


def test_cp_requires_flash_attention():
    model = get_model("gpt3-1.3b")
    cand = _small_search(model, 16, 2048, 64, flash=False)[2]
    assert set(cand["cp"].tolist()) == {1}


def test_choose_parallelism_follows_spec_procedure():
    # 70B on 64 H100: TP 8 inside the node first, then the smallest pipeline that fits.
    layout = choose_parallelism(get_model("llama3-70b"), Cluster.of(64, "h100"),
                                TrainSpec(seq_len=8192, global_batch=128))
    assert layout.tp == 8 and layout.zero == 1 and layout.recompute == "selective"
    assert layout.sp and layout.micro_batch == 1 and layout.schedule == "1f1b"
    # a small model fits with little model parallelism
    small = choose_parallelism(get_model("llama3-8b"), Cluster.of(64, "h100"),
                               TrainSpec(seq_len=4096, global_batch=128))
    assert small.tp * small.pp <= 2


# ------------------------------------------------------------- ranking by the figure shown
def _brute_force(model, cluster, train, space=None):
    """Every fitting layout with its exact step time, the reference for the ranking: the
    closed form, and for uneven pipelines small enough to simulate `estimate_step(...,
    simulate=True)` (equal stages: the closed form equals the simulator, tested above)."""
    grid, _ = _enumerate(model, cluster, train, space or SearchSpace(), _Rejections())
    cand, terms = _flatten(grid, evaluate_candidates(model, cluster, train, grid),
                           keys=("total", "memory"))
    simple = simplicity(cand)
    rows = []
    for i in np.nonzero(terms["memory"] <= 0.85 * cluster.accelerator.memory_bytes)[0]:
        layout = _layout_of(cand, int(i))
        total = float(terms["total"][i])
        if (len(set(layout.stage_partition(model.n_layers))) > 1
                and layout.pp * layout.microbatches(train) * layout.chunks <= 4000):
            total = estimate_step(model, cluster, layout, train, simulate=True).total
        rows.append((total, int(simple[i]), layout))
    fastest = min(r[0] for r in rows)
    rows.sort(key=lambda r: (round(r[0] / fastest, 9), r[1]))
    return rows


def _family(layout):
    """What a row stands for: the layout without its second-order knobs."""
    return layout.with_(zero_group=0, partition=())


def _nontrivial(layout):
    return sum(getattr(layout, axis) > 1 for axis in ("dp", "tp", "pp", "cp", "ep"))


SMALL_MODELS = [get_model("tiny"), get_model("tiny").with_(n_layers=6),
                get_model("tiny-moe").with_(n_layers=6)]


@settings(max_examples=12)
@given(model=st.sampled_from(SMALL_MODELS), gpus=st.sampled_from([2, 3, 4, 6, 8, 16]),
       batch=st.sampled_from([4, 6, 8, 12, 16]), seq=st.sampled_from([64, 128]),
       top=st.sampled_from([1, 3, 10]))
def test_rows_are_the_exact_top_in_the_order_shown(model, gpus, batch, seq, top):
    """The rows are the first `top` families by the exact step time (every uneven pipeline
    simulated: the reference), sorted as shown, with their variant counts; the simplest
    layout within 1 % is the brute force's."""
    cluster = Cluster.of(gpus, "h100", min(gpus, 8))
    train = TrainSpec(seq_len=seq, global_batch=batch)
    try:
        result = plan(model, cluster, train, top=top, baseline=False)
    except ShardwiseError:  # no valid layout of this shape: nothing to rank
        return
    rows = _brute_force(model, cluster, train)
    families, expected = {}, []
    for total, _, layout in rows:
        families.setdefault(_family(layout), []).append(total)
        if len(families) > len(expected):
            expected.append((total, layout))
    expected = expected[:top]
    shown = [e.estimate.total for e in result.ranked]
    assert len(shown) == len(expected)
    assert shown == pytest.approx([t for t, _ in expected], rel=1e-8)
    assert all(a <= b * (1 + 1e-9) for a, b in pairwise(shown))  # sorted as shown
    assert len({_family(e.layout) for e in result.ranked}) == len(result.ranked)
    for entry in result.ranked:
        assert entry.variants == len(families[_family(entry.layout)]) - 1
    near = [(t, layout) for t, _, layout in rows if t <= rows[0][0] * 1.01]
    fewest = min(_nontrivial(layout) for _, layout in near)
    simplest = next((t, layout) for t, layout in near if _nontrivial(layout) == fewest)
    assert _nontrivial(result.simplest.layout) == fewest
    assert result.simplest.estimate.total == pytest.approx(simplest[0], rel=1e-8)


def test_uneven_pipelines_are_ranked_by_their_simulated_bubble():
    """llama3-8b on 64 H100s (the CLI's default run) on the shardwise stack, which runs ZB-H1:
    every uneven pipeline shown carries its simulated step (its closed form is an upper bound
    that would hide it), and the rows are in the order of the figures shown."""
    model, cluster = get_model("llama3-8b"), Cluster.of(64, "h100")
    train = TrainSpec(seq_len=8192, global_batch=512, impl="shardwise")
    result = plan(model, cluster, train, top=5, baseline=False)
    uneven = [e for e in result.ranked if e.layout.pp > 1 and e.layout.partition
              and len(set(e.layout.partition)) > 1]
    assert uneven
    for entry in uneven:
        assert entry.estimate.bubble_source == "simulator"
        reference = estimate_step(model, cluster, entry.layout, train, simulate=True).total
        assert entry.estimate.total == pytest.approx(reference, rel=1e-12)
        assert estimate_step(model, cluster, entry.layout, train).total >= reference
    totals = [e.estimate.total for e in result.ranked]
    assert totals == sorted(totals)
    assert result.stats.simulated < 100  # the bound spares the other uneven pipelines


def test_tie_break_prefers_the_lower_zero_stage_by_hand():
    """`plan tiny --gpus 8 --global-batch 8 --seq 64`: dp4 × mb2 leaves one micro-batch per
    step, so ZeRO-2's reduce-scatter after every micro-batch is ZeRO-1's one reduce-scatter:
    the winner and its ZeRO-2 twin take the same time (the scalar model says so), and the rule
    (`rank.SIMPLER`: the lower ZeRO stage first) puts ZeRO-1 first and the twin second."""
    model, cluster = get_model("tiny"), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=64, global_batch=8, impl="shardwise")  # hybrid ZeRO-1 and -2
    result = plan(model, cluster, train, top=2, baseline=False)
    winner, second = (e.layout for e in result.ranked)
    assert winner.dp == 4 and winner.micro_batch == 2 and winner.microbatches(train) == 1
    twin = winner.with_(zero=2)
    assert estimate_step(model, cluster, twin, train, simulate=True).total == pytest.approx(
        estimate_step(model, cluster, winner, train, simulate=True).total, rel=1e-12)
    assert winner.zero == 1 and second == twin
    assert SIMPLER.index("zero") < SIMPLER.index("zero_group")


def test_all_variants_lists_what_the_rows_fold():
    """Each folded row is the first of its family in the full listing, in the same order."""
    model, cluster = get_model("tiny"), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=64, global_batch=8)
    folded = plan(model, cluster, train, top=5, baseline=False)
    every = plan(model, cluster, train, top=40, baseline=False, all_variants=True)
    assert all(e.variants == 0 for e in every.ranked) and not folded.all_variants
    first = {}
    for entry in every.ranked:
        first.setdefault(_family(entry.layout), entry.layout)
    assert len(first) >= 5
    assert [e.layout for e in folded.ranked] == list(first.values())[:5]
    assert any(e.variants for e in folded.ranked)


# --------------------------------------------------------------------- constrained search
def test_plan_refuses_a_layout_given_as_text_before_searching():
    said: list[str] = []  # the search's progress messages
    with pytest.raises(ShardwiseError, match=re.escape(
            "layout must be a Layout (Layout(tp=…) or Layout.parse('tp=8')), got 'tp=2'")):
        plan(get_model("llama3-8b"), Cluster.of(8, "h100"),
             TrainSpec(seq_len=2048, global_batch=16), layout="tp=2", progress=said.append)
    assert said == []


@pytest.mark.parametrize("impl", ["pytorch-fsdp", "hf-sdpa"])
def test_a_stack_without_pipeline_schedules_is_planned_without_pipelines(impl):
    """Stacks that run no pipeline schedule still have their pp = 1 layouts searched (a
    pp = 1 layout names the schedule 1f1b), and only those."""
    assert not set(STACKS[impl].schedules()) & {"1f1b", "gpipe", "interleaved"}
    result = plan(get_model("llama3-8b"), Cluster.of(16, "h100"),
                  TrainSpec(seq_len=2048, global_batch=32, impl=impl), top=3, baseline=False)
    assert result.ranked
    assert all(e.layout.pp == 1 and e.layout.schedule == "1f1b" for e in result.ranked)


def test_plan_json_names_the_tiers_resolution_and_its_basis():
    cluster, train = Cluster.of(16, "h100"), TrainSpec(seq_len=2048, global_batch=32)
    tiers = plan(get_model("llama3-8b"), cluster, train, top=3).to_dict()["tiers"]
    value, basis = resolution(cluster.accelerator.name, train.impl)
    assert (tiers["resolution"], tiers["basis"]) == (value, basis) and basis


# ---------------------------------------------------------------------- what would fit
def test_the_baseline_names_the_leanest_layout_when_nothing_fits():
    """One GPU and a 70B model: one clear error naming the leanest layout tried and the
    GiB it needs."""
    with pytest.raises(ShardwiseError, match=r"nothing fits: the leanest \(.*\) needs [\d.]+ GiB"):
        choose_parallelism(get_model("llama3-70b"), Cluster.of(1, "h100"),
                           TrainSpec(seq_len=4096, global_batch=8))
