"""The validation against published runs and the band it gives every prediction (issue 30).

`data/validation.json` is written by benchmarks/validate_published.py from the published runs
in benchmarks/validation_runs.json; these tests check that it describes the model as it is
(recomputed, not remembered) and that the band follows its rules: the nearest group's
out-of-sample errors, widened for every relaxation and every feature no run measured.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from shardwise.arch import get_model
from shardwise.estimate.step import estimate_step
from shardwise.estimate.uncertainty import (
    MIN_RUNS,
    PER_FEATURE,
    WIDEN,
    band_of,
    group_names,
    uncertainty,
    validation_data,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from tests.cli_helpers import shardwise, shardwise_json
from tests.scripts import load_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _harness(name: str = "validate_published"):
    """A benchmark script of benchmarks/ as a module."""
    return load_script(f"benchmarks/{name}.py")


def test_the_recorded_errors_are_the_models_errors_now():
    """Every expressible published run is in validation.json, and its in-sample error is what
    the built-in constants predict today (a model change without a rerun of the harness
    fails here)."""
    harness = _harness()
    rows, _, _ = harness.cases()
    recorded = {run["id"]: run for run in validation_data()["runs"]}
    assert {c.row["id"] for c in rows} == set(recorded)
    params = harness.builtin_params(rows)
    by_family = defaultdict(list)
    for case in rows:
        by_family[case.row["family"]].append(
            (harness.error(case, params), recorded[case.row["id"]]["error"]))
    for family, pairs in by_family.items():
        now = statistics.median(abs(a) for a, _ in pairs)
        then = statistics.median(abs(b) for _, b in pairs)
        assert now == pytest.approx(then, abs=0.005), family


def test_no_held_out_source_is_in_the_validation_set():
    held_out = ("megatron-lm readme", "herd of models", "dubey", "korthikanti",
                "reducing activation recomputation", "bloom", "torchtitan paper",
                "one-stop pytorch native", "nemotron-4", "megatron-turing", "mt-nlg",
                "gpt-neox",
                # issue 43's: the DeepSeek-V2/V3 reports, the Megatron-Core MoE model zoo, the
                # DeepSeek-V3-on-GB200 guide
                "2405.04434", "2412.19437", "deepseek-v2 technical", "deepseek-v3 technical",
                "moe-modelzoo", "moe model zoo", "gb200-optimization")
    harness = _harness()
    _, sources, _ = harness.cases()
    used = [s for s in sources.values() if s["family"] not in harness.EXCLUDED_FAMILIES]
    for source in used:
        text = " ".join(str(source.get(k, "")) for k in ("id", "citation", "title", "url",
                                                          "path")).lower()
        assert not any(name in text for name in held_out), source["id"]


def _runs(group: str) -> list[float]:
    gen, stack, family = group.split(" · ")
    return [r["loso_error"] for r in validation_data()["runs"]
            if (r["generation"], r["stack"], r["family"]) == (gen, stack, family)]


def _conformal(errors: list[float], coverage: float) -> float:
    """The split-conformal quantile by hand: the ⌈(n+1)·c⌉-th smallest |error|."""
    ranked = sorted(abs(e) for e in errors)
    return ranked[math.ceil((len(ranked) + 1) * coverage - 1e-9) - 1]


def _factor(group: str, coverage: float) -> float:
    return validation_data().get("band_factors", {}).get(f"{coverage:g}", {}).get(group, 1.0)


def test_the_band_is_the_nearest_groups_conformal_quantile():
    train = TrainSpec(seq_len=8192, global_batch=64, tp_overlap="bulk", dp_overlap=True)
    layout = Layout(dp=2, tp=8, pp=4, sp=True, zero=1, schedule="interleaved", chunks=4)
    sure = uncertainty("h100-sxm", "megatron-te", layout, train)
    errors = _runs(sure.group)
    assert sure.group == "hopper · megatron-te · tp+pp" and len(errors) >= 19
    assert sure.band == pytest.approx(_conformal(errors, 0.8) * _factor(sure.group, 0.8),
                                      abs=1e-4)
    assert sure.band_95 == pytest.approx(_conformal(errors, 0.95)
                                         * _factor(sure.group, 0.95), abs=1e-4)
    assert sure.band_95 > sure.band and sure.validated and sure.on_ground
    assert sure.coverage == 0.8 and "51 leave-one-source-out errors" in sure.basis


def _run(group: tuple[str, str, str], error: float) -> dict:
    gen, stack, fam = group
    return {"generation": gen, "stack": stack, "family": fam, "loso_error": error}


@pytest.mark.parametrize("coverage", [0.8, 0.95])
def test_the_band_at_each_threshold_of_the_group_size(coverage):
    """A group of n = min−1, min and min+1 runs (min: `MIN_RUNS`, or the 19 runs a 95 %
    conformal quantile needs): below min its parent group gives the band, widened by `WIDEN`;
    from min on, its own — the ⌈(n+1)·c⌉-th smallest of its |errors| (every error distinct,
    the parent's distinct from the group's)."""
    least = max(MIN_RUNS, 19 if coverage == 0.95 else 4)
    mine = ("hopper", "megatron-te", "tp+pp")
    parent = [_run(("hopper", "megatron-te", "tp"), 0.01 * (k + 1)) for k in range(40)]
    names = group_names(*mine)
    for n in (least - 1, least, least + 1):
        own = [_run(mine, -0.3 - 0.02 * k) for k in range(n)]  # all wider than the parent's
        width, group, runs, step = band_of(parent + own, names, coverage)
        if n < least:
            assert (group, runs, step) == ("hopper · megatron-te", 40 + n, 1)
            everything = [r["loso_error"] for r in parent + own]
            assert width == pytest.approx(_conformal(everything, coverage) * WIDEN)
        else:
            assert (group, runs, step) == (names[0], n, 0)
            k = math.ceil((n + 1) * coverage - 1e-9)
            assert width == pytest.approx(0.3 + 0.02 * (k - 1))
    # no level with enough runs: no band at all, never the whole set's
    few = [_run(mine, 0.1 * (k + 1)) for k in range(least - 1)]
    assert band_of(few, names, coverage) == (None, names[0], 0, -1)


def test_the_band_widens_outside_validated_ground():
    train = TrainSpec(seq_len=8192, global_batch=64, tp_overlap="bulk", dp_overlap=True)
    base = Layout(dp=2, tp=8, pp=4, sp=True, zero=1, schedule="interleaved", chunks=4)
    # context parallelism at 1k tokens: shorter than any validation run with CP
    short = TrainSpec(seq_len=1024, global_batch=64, tp_overlap="bulk", dp_overlap=True)
    cp = uncertainty("h100-sxm", "megatron-te", base.with_(cp=2, dp=1), short)
    assert any("context parallelism" in f for f in cp.unvalidated)
    assert cp.band >= PER_FEATURE
    # at a validated length, a kind of context parallelism no run measured (they ran ring)
    kinds = validation_data()["ground"]["stacks"]["megatron-te"]["cp_kinds"]
    assert kinds == ["ring"]
    ring = uncertainty("h100-sxm", "megatron-te", base.with_(cp=2, dp=1), train)
    gathered = uncertainty("h100-sxm", "megatron-te",
                           base.with_(cp=2, dp=1, cp_kind="allgather"), train)
    assert ring.on_ground and gathered.unvalidated == ("allgather context parallelism",)
    assert gathered.band == pytest.approx(ring.band + PER_FEATURE)
    assert "+ 5% × 1 unvalidated" in gathered.basis


def test_a_stack_without_published_runs_is_not_validated_not_widened():
    """Megatron-DeepSpeed has no published run in the set: no band (never the whole set's
    quantile widened into a meaningless ±79 %), `validated` false in the JSON, "not
    validated" in the CLI's table in place of ±N %."""
    deepspeed = uncertainty("h100-sxm", "megatron-deepspeed", Layout(dp=8, zero=1),
                            TrainSpec(seq_len=4096, global_batch=64, impl="megatron-deepspeed"))
    assert deepspeed.band is None and not deepspeed.validated
    assert any("megatron-deepspeed" in f for f in deepspeed.unvalidated)
    args = ("plan", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--top", "3",
            "--impl", "megatron-deepspeed")
    out = shardwise_json(*args)
    for entry in out["ranked"]:
        sure = entry["estimate"]["uncertainty"]
        assert sure["validated"] is False and sure["band"] is None and sure["low"] is None
    text = shardwise(*args).stdout
    rows = [line for line in text.split("Recommended:")[0].splitlines() if line.startswith("│")]
    assert any("not validated" in line for line in rows)
    assert rows and not any("±" in line for line in rows)


def test_every_prediction_carries_its_band_in_the_api_and_the_cli():
    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    est = estimate_step(model, cluster, Layout(dp=8, zero=1), TrainSpec(8192, 64))
    low, high = est.band
    assert low < est.total < high and est.uncertainty is not None
    out = shardwise_json("plan", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--top",
                         "3")
    for entry in out["ranked"]:
        sure = entry["estimate"]["uncertainty"]
        total = entry["estimate"]["total"]
        assert sure["band"] > 0 and sure["group"] and sure["runs"] >= MIN_RUNS
        assert sure["low"] < total < sure["high"] and sure["high_95"] > sure["high"]
        assert sure["docs"] == "docs/accuracy/bands.md"
    assert "±" in out["explanation"] and "docs/accuracy/bands.md" in out["explanation"]


def test_torchao_memory_table_is_within_ten_percent():
    """benchmarks/validate_fp8.py's torchao memory rows run (the stack settings it passes are
    valid for torchtitan) and land within 10 % of torchao's README table (47.65 / 47.79 GB)."""
    rows = _harness("validate_fp8").torchao_memory()
    for name, published, predicted in rows[:2]:
        assert float(predicted) == pytest.approx(float(published), rel=0.10), name


def test_an_attention_kernel_without_a_benchmark_on_the_accelerator_is_said():
    from shardwise.calibration import default_calibration

    layout = Layout(dp=8, zero=3)
    train = TrainSpec(seq_len=4096, global_batch=64, impl="pytorch-fsdp", attention="triton")
    assert "triton" in default_calibration("h100-sxm").attention_kernels
    assert "triton" not in default_calibration("b200").attention_kernels
    hopper = uncertainty("h100-sxm", "pytorch-fsdp", layout, train)
    blackwell = uncertainty("b200", "pytorch-fsdp", layout, train)
    assert not any("triton" in f for f in hopper.unvalidated)
    borrowed = [f for f in blackwell.unvalidated if f.startswith("triton attention")]
    assert borrowed and "no kernel benchmark on b200" in borrowed[0]


def test_the_recorded_band_factors_are_the_calibration_now():
    """validation.json's factors are what benchmarks/band_coverage.py computes from its runs
    (a change of the band rule without a rerun fails here)."""
    _harness()
    import band_coverage

    data = validation_data()
    assert band_coverage.calibrate(data["runs"]) == data["band_factors"]


def test_a_group_factor_by_hand():
    """hopper · megatron-te · tp+cp holds two source families of six runs each: each family's
    runs get the band of the other's six (the conformal 80 % quantile of six is the 6th, their
    largest |error|); the factor is the 11th smallest of the twelve |error| ÷ band scores
    (⌈13·0.8⌉), at least 1 — and the band it widens then covers 11 of the 12 out of sample."""
    runs = [r for r in validation_data()["runs"]
            if (r["generation"], r["stack"], r["family"]) == ("hopper", "megatron-te", "tp+cp")]
    families = {r["family_of_sources"] for r in runs}
    assert len(runs) == 12 and len(families) == 2
    largest = {f: max(abs(r["loso_error"]) for r in runs if r["family_of_sources"] == f)
               for f in families}
    scores = sorted(abs(r["loso_error"]) / next(v for f, v in largest.items()
                                                if f != r["family_of_sources"]) for r in runs)
    factor = max(1.0, scores[10])
    recorded = validation_data()["band_factors"]["0.8"]["hopper · megatron-te · tp+cp"]
    assert recorded == pytest.approx(factor, abs=1e-3) and factor > 1
    assert sum(s <= recorded + 1e-9 for s in scores) >= 0.8 * len(scores)


def test_moe_and_fp8_rows_only_validate():
    """The end-to-end fit scores only dense bf16/fp16 rows: a MoE row (bf16 or FP8) and a dense
    FP8 row of the same generation are never predicted while the constants are searched."""
    harness = _harness()
    rows, _, _ = harness.cases()
    hopper = [c for c in rows if c.cluster.accelerator.name == "h100-sxm"]
    dense = next(c for c in hopper if not c.model.is_moe and c.train.fp8 is None)
    moe = next(c for c in hopper if c.model.is_moe and c.train.fp8 is None and c.layout.ep > 1)
    moe_fp8 = next(c for c in hopper if c.model.is_moe and c.train.fp8 is not None)
    dense_fp8 = next(c for c in hopper if not c.model.is_moe and c.train.fp8 is not None)
    scored = []
    real = harness.error
    harness.error = lambda case, params: scored.append(case.row["id"]) or real(case, params)
    try:
        fitted = harness.fit([moe, dense_fp8, dense, moe_fp8], steps=(0.08,), rounds=1)
    finally:
        harness.error = real
    assert set(scored) == {dense.row["id"]} and set(fitted) == {"hopper"}


def test_expert_parallel_layouts_take_their_band_from_moe_runs():
    """validation.json holds MoE runs in groups with an EP axis, and an EP-heavy layout's band
    is drawn from such a group: every run in it is a MoE run."""
    harness = _harness()
    rows, _, _ = harness.cases()
    moe_ids = {c.row["id"] for c in rows if c.model.is_moe}
    runs = validation_data()["runs"]
    ep_groups = {(r["generation"], r["stack"], r["family"]) for r in runs
                 if "ep" in r["family"].split("+")}
    assert ep_groups and all(r["id"] in moe_ids for r in runs
                             if (r["generation"], r["stack"], r["family"]) in ep_groups)
    train = TrainSpec(seq_len=8192, global_batch=1024, tp_overlap="bulk", dp_overlap=True)
    layout = Layout(dp=16, tp=4, pp=8, cp=2, ep=8, sp=True, zero=1, schedule="interleaved",
                    chunks=8)
    sure = uncertainty("h100-sxm", "megatron-te", layout, train)
    assert sure.group == "hopper · megatron-te · tp+pp+cp+ep"
    assert len(_runs(sure.group)) >= MIN_RUNS
