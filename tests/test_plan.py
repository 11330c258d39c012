"""The layout planner: the published 405B decision, agreement of the vectorised and scalar
models on every candidate, memory agreement with estimate/memory.py, ranking, rejected
regions, the §7 baseline, errors, and the validation set."""

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import (
    activation_bytes_per_layer,
    peak_stage_memory,
    training_memory_per_gpu,
)
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
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
    model = get_model("tiny")
    cluster, train, cand, terms = _small_search(model, 8, 64, 16)
    n = len(cand["tp"])
    assert n > 500
    for i in range(n):
        est = estimate_step(model, cluster, _layout_of(cand, i), train)
        for key in ("total", "compute", "tp_comm", "cp_comm_exposed", "pp_comm", "bubble",
                    "dp_comm_exposed", "optimizer", "mfu", "hfu"):
            assert terms[key][i] == pytest.approx(getattr(est, key), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("model, gpus, seq, batch, flash", [
    (get_model("llama3-8b"), 16, 4096, 64, True),
    (get_model("mixtral-8x7b"), 32, 4096, 64, True),
    (get_model("tiny-moe").with_(moe_every=2, n_layers=6), 8, 64, 16, True),
    (get_model("gpt3-1.3b"), 16, 2048, 64, False),
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


def test_memory_arrays_handle_gpipe_and_full_sharding():
    model = ModelSpec("m", 8, 512, 8, 4, 2048, 1000, dropout=True, norm="layernorm")
    train = TrainSpec(seq_len=256, global_batch=32, flash_attention=False)
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
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype)
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


# ------------------------------------------------------------------------------ validation
def _validation_module():
    path = ROOT / "benchmarks" / "validate_published.py"
    spec = importlib.util.spec_from_file_location("validate_published", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_narayanan_table1_median_error_within_three_percent():
    module = _validation_module()
    rows, median, worst = module.validate()
    assert len(rows) == 10
    assert median <= 0.03
    assert worst <= 0.05


def test_h100_dev_set_meets_the_acceptance_bar():
    # Issue 9: every cited H100 dev row (llm-foundry's published tokens/s per GPU) with the
    # built-in Hopper constants: median |error| ≤ 3 %, max ≤ 10 %
    module = _validation_module()
    rows, median, worst = module.validate_h100()
    assert len(rows) == 19
    assert median <= 0.03 and worst <= 0.10
    predicted, published = module.nemo_automodel_check()  # not fitted
    assert abs(predicted - published) / published <= 0.10


def test_h100_megatron_core_dev_set_meets_the_acceptance_bar():
    # Issue 9: NVIDIA's DGXC recipes (NeMo 24.09, DGX-H100 BF16): every published layout is
    # expressible and the predicted step times meet median |error| ≤ 3 %, max ≤ 10 %
    module = _validation_module()
    rows, median, worst = module.validate_dgxc()
    assert len(rows) == 27 and all(pred is not None for _, pred, _, _ in rows)
    assert median <= 0.03 and worst <= 0.10
    # the source's own MFU column is its FLOP formula over its step time: our reading of it
    for row, _, _, _ in rows:
        mfu = module.dgxc_flops(row) / (row.published_step * row.gpus * 989e12)
        assert mfu == pytest.approx(row.published_mfu, rel=0.01)


def test_llama3_405b_h100_heldout_mfu_within_ten_percent():
    # Issue 9 changed both sides of this comparison: MFU now counts full attention (the
    # papers' convention; +4 % at 8k tokens) and the 16,384-GPU row is compared with Table 4's
    # 400 TFLOP/s (41 %), not the 131k-token row's 38 %. Nothing is fitted to these held-out
    # rows (the Hopper constants come from the llm-foundry and NVIDIA DGXC dev rows), so the
    # bar is the acceptance maximum (10 %). It was a strict xfail until the Hopper
    # constants were fitted on Megatron-Core-era rows (DGXC) as well.
    module = _validation_module()
    for _, predicted, published in module.llama3_heldout():
        assert abs(predicted - published) / published <= 0.10
