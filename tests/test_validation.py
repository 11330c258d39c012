"""The validation against published runs and the band it gives every prediction (issue 30).

`data/validation.json` is written by benchmarks/validate_published.py from the published runs
in benchmarks/validation_runs.json; these tests check that it describes the model as it is
(recomputed, not remembered) and that the band follows its rules: the nearest group's
out-of-sample errors, widened for every relaxation and every feature no run measured.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from shardwise.arch import get_model
from shardwise.estimate.step import estimate_step
from shardwise.estimate.uncertainty import (
    MIN_RUNS,
    PER_FEATURE,
    QUANTILE,
    WIDEN,
    uncertainty,
    validation_data,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from tests.cli_helpers import shardwise_json

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _harness(name: str = "validate_published"):
    """A benchmark script of benchmarks/ as a module."""
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
                "gpt-neox")
    harness = _harness()
    _, sources, _ = harness.cases()
    used = [s for s in sources.values() if s["family"] not in harness.EXCLUDED_FAMILIES]
    for source in used:
        text = f"{source['id']} {source['citation']} {source.get('title', '')}".lower()
        assert not any(name in text for name in held_out), source["id"]


def _runs(group: str) -> list[float]:
    gen, stack, family = group.split(" · ")
    return [r["loso_error"] for r in validation_data()["runs"]
            if (r["generation"], r["stack"], r["family"]) == (gen, stack, family)]


def test_the_band_is_the_nearest_groups_out_of_sample_quantile():
    train = TrainSpec(seq_len=8192, global_batch=64, tp_overlap="bulk", dp_overlap=True)
    layout = Layout(dp=2, tp=8, pp=4, sp=True, zero=1, schedule="interleaved", chunks=4)
    sure = uncertainty("h100-sxm", "megatron-te", layout, train)
    errors = _runs(sure.group)
    assert sure.group == "hopper · megatron-te · tp+pp" and len(errors) >= MIN_RUNS
    import numpy as np

    assert sure.band == pytest.approx(float(np.quantile(np.abs(errors), QUANTILE)), abs=1e-4)
    assert sure.validated


def test_the_band_widens_outside_validated_ground():
    train = TrainSpec(seq_len=8192, global_batch=64, tp_overlap="bulk", dp_overlap=True)
    base = Layout(dp=2, tp=8, pp=4, sp=True, zero=1, schedule="interleaved", chunks=4)
    inside = uncertainty("h100-sxm", "megatron-te", base, train)
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
    assert ring.validated and gathered.unvalidated == ("allgather context parallelism",)
    assert gathered.band == pytest.approx(ring.band + PER_FEATURE)
    # a stack no published run measured: the group relaxes to all runs, widened
    deepspeed = uncertainty("h100-sxm", "megatron-deepspeed", Layout(dp=8, zero=1),
                            TrainSpec(seq_len=4096, global_batch=64, impl="megatron-deepspeed"))
    assert deepspeed.group == "all runs" and deepspeed.band > inside.band
    assert any("megatron-deepspeed" in f for f in deepspeed.unvalidated)
    errors = [r["loso_error"] for r in validation_data()["runs"]]
    import numpy as np

    expected = (float(np.quantile(np.abs(errors), QUANTILE)) * WIDEN ** 3
                + PER_FEATURE * len(deepspeed.unvalidated))
    assert deepspeed.band == pytest.approx(expected, abs=1e-4)


def test_every_prediction_carries_its_band_in_the_api_and_the_cli():
    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    est = estimate_step(model, cluster, Layout(dp=8, zero=1), TrainSpec(8192, 64))
    low, high = est.band
    assert low < est.total < high and est.uncertainty is not None
    out = shardwise_json("plan", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--top",
                         "3")
    for entry in out["ranked"]:
        sure = entry["estimate"]["uncertainty"]
        assert sure["band"] > 0 and sure["group"] and sure["runs"] >= 1
    assert "±" in out["explanation"]


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


@pytest.mark.parametrize(("n", "group", "band"), [
    # n = MIN_RUNS - 1: too few, relax one step to the generation and stack (2 + 3 runs):
    # |errors| sorted 0.02, 0.04, 0.5, 0.5, 0.5 → 0.9 quantile 0.5, widened once ×1.5
    (2, "hopper · megatron-te", 0.5 * 1.5),
    # n = MIN_RUNS: the group itself, 0.02 0.04 0.06 → position 0.9·2 = 1.8 → 0.056
    (3, "hopper · megatron-te · tp+pp", 0.04 + 0.8 * 0.02),
    # n = MIN_RUNS + 1: 0.02 … 0.08 → position 2.7 → 0.074
    (4, "hopper · megatron-te · tp+pp", 0.06 + 0.7 * 0.02),
])
def test_the_band_at_the_group_size_threshold(monkeypatch, n, group, band):
    """The group-size threshold (`MIN_RUNS` = 3) at n = 2, 3, 4 runs in the layout's own group,
    beside three runs of another family on the same stack and generation whose errors (0.5)
    would show if the band relaxed when it should not, or stayed when it should relax. Hand
    quantiles (linear interpolation, NumPy's default)."""
    import shardwise.estimate.uncertainty as unc

    assert MIN_RUNS == 3 and QUANTILE == 0.9 and WIDEN == 1.5
    real = validation_data()
    mine = [{"generation": "hopper", "stack": "megatron-te", "family": "tp+pp",
             "loso_error": e} for e in (0.02, -0.04, 0.06, 0.08)[:n]]
    other = [{"generation": "hopper", "stack": "megatron-te", "family": "dp",
              "loso_error": 0.5}] * 3
    monkeypatch.setattr(unc, "validation_data", lambda: real | {"runs": mine + other})
    train = TrainSpec(seq_len=8192, global_batch=64, tp_overlap="bulk", dp_overlap=True)
    layout = Layout(dp=2, tp=8, pp=4, sp=True, zero=1, schedule="interleaved", chunks=4)
    got = unc.uncertainty("h100-sxm", "megatron-te", layout, train)
    assert got.validated and got.group == group
    assert got.runs == (n if n >= MIN_RUNS else n + 3)
    assert got.band == pytest.approx(band, abs=1e-4)
