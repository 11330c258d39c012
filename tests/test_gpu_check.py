"""benchmarks/gpu_check.py, the prepared GPU run (docs/howto/gpu-check.md), exercised on the CPU
as CI can: `--dry-run` runs every step at tiny sizes (gloo, no CUDA), so the script cannot rot
before a GPU is lent. Its figures are held to references the script does not produce: every
`train` run and kernel against fp64 (tolerances from the dtype's unit roundoff), the saved
bytes against the activation profiles and `shardwise check`'s own targets, and the calibration
file it writes is read back by `load_calibration`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

# the steps a dry run skips (their reasons are in the JSON); every other one must run
DRY_SKIPS = {"multi-gpu.calibrate", "multi-gpu.check-tp2", "multi-gpu.check-pp2"}


def _steps(data: dict) -> dict[str, dict]:
    return {f"{section}.{name}": entry for section, s in data["sections"].items()
            for name, entry in s["steps"].items()}


@pytest.mark.slow
def test_dry_run_measures_every_step_and_meets_every_tolerance(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["dry_run"] and data["finished"]
    steps = _steps(data)
    assert {s.section + "." + s.name for s in gpu_check.STEPS} == set(steps)
    for section in data["sections"].values():
        assert section["status"] in ("measured", "skipped")
    skipped = {key for key, e in steps.items() if e["status"] == "skipped"}
    assert skipped == DRY_SKIPS, {key: steps[key].get("reason") for key in skipped ^ DRY_SKIPS}
    assert all(e["status"] == "measured" for key, e in steps.items() if key not in DRY_SKIPS)
    assert all(steps[key]["reason"] for key in DRY_SKIPS)
    checks = [c for e in steps.values() for c in e.get("checks", [])]
    assert [c for c in checks if c["ok"] is False] == []
    # the references are there: each train run and each runtime kernel against fp64 in both
    # dtypes, transformers' layers against their profiles, check's rows, the file read back
    names = {c["what"] for c in checks if c["ok"] is True}
    for model, dtype in gpu_check.DRY.train_runs:
        assert f"train {model} {dtype}: loss, worst step vs fp64" in names
    for kernel in ("kernel attention core, flash path", "kernel attention core, materialised",
                   "module MoE layer (tiny-deepseek)", "module MLA (flash path, tiny-deepseek)"):
        for dtype in ("fp32", "bf16"):
            assert f"{kernel} {dtype}: worst of output and gradients" in names
    assert {"transformers sdpa: layer 1 saved vs hf-sdpa",
            "transformers eager: layer 1 saved vs hf-eager",
            "check dp2: comm dp all-reduce",
            "calibration file loads (load_calibration)"} <= names
    from shardwise.calibration import load_calibration

    cal = load_calibration("h200", tmp_path / "calibration-h200.json")
    written = json.loads((tmp_path / "calibration-h200.json").read_text())
    assert cal.matmul_half_dim == written["accelerators"]["h200"]["matmul_half_dim"]
    assert (tmp_path / "summary.md").read_text().startswith("# gpu_check (dry run)")


def hangs_after_a_point(ctx, path):
    """A step that records a point and a check, then hangs (an NCCL call that never ends)."""
    note = gpu_check.Notebook(path)
    note("first", 1.0)
    note.check("a figure", 0.5, 1.0)
    time.sleep(120)


@pytest.mark.slow
def test_a_hung_step_is_killed_and_keeps_what_it_measured(tmp_path):
    ctx = gpu_check.Context(True, gpu_check.DRY, "h200", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(gpu_check.StepFailed) as failed:
        gpu_check.on_ranks(hangs_after_a_point)(ctx, 2, {})
    assert "timed out" in str(failed.value)
    assert time.monotonic() - start < 40  # killed at its timeout (+ launch's start grace)
    assert failed.value.items == {"first": 1.0}
    assert [c["ok"] for c in failed.value.checks] == [True]


def test_a_spent_budget_still_writes_every_step_skipped(tmp_path):
    data = gpu_check.run(tmp_path, True, 1.0, None, ())
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk["finished"] == data["finished"]
    steps = _steps(on_disk)
    assert len(steps) == len(gpu_check.STEPS)
    assert all(e["status"] == "skipped" and "global budget spent" in e["reason"]
               for e in steps.values())
    assert all(s["status"] == "skipped" for s in on_disk["sections"].values())


@pytest.mark.parametrize("args", [["/proc/no-such-folder"], ["--accelerator", "h999", "OUT"],
                                  ["--budget", "-5", "OUT"]])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args):
    args = [str(tmp_path) if a == "OUT" else a for a in args]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("gpu_check: ")


def test_gpu_only_figures_are_checked_and_summarised():
    """The branches only a GPU reaches (the allocator's figures) on recorded numbers, and a
    summary with a failed check and a figure without a value."""
    spec = gpu_check.get_model("tiny")
    gib = 2**30
    items = {"tiny: rows": [], "tiny: memory_stats": {"allocated_bytes.all.peak": 2 * gib,
                                                      "reserved_bytes.all.peak": 3 * gib}}
    checks = {c["what"]: c for c in gpu_check.memory_checks(items, spec, 64, 8)}
    assert checks["tiny: peak reserved / peak allocated − 1"]["value"] == pytest.approx(0.5)
    assert checks["tiny: peak reserved vs the modelled peak"]["ok"] is None  # reported
    layer = gpu_check._layer_model(gpu_check.Context(True, gpu_check.DRY, "h200", "."))
    hf = {"sdpa": {"saved_per_layer": [1, 2], "allocated_by_forward": gib,
                   "peak_above_weights": 2 * gib}}
    names = [c["what"] for c in gpu_check.hf_checks(hf, layer, 128)]
    assert names == ["transformers sdpa: layer 1 saved vs hf-sdpa",
                     "transformers sdpa: allocated by the forward vs modelled",
                     "transformers sdpa: forward + backward peak above the weights vs modelled"]
    data = {"dry_run": False, "started": "now", "budget_s": 450, "wall_s": 1,
            "environment": {"devices": [{"name": "NVIDIA H200"}]},
            "sections": {"memory": {"steps": {"tiny": {
                "status": "failed", "timeout_s": 60, "error": "RankFailure: boom",
                "checks": [gpu_check.check_item("a failed figure", 2.0, 1.0),
                           gpu_check.check_item("reserved, unknown", None, None)]}}}}}
    text = gpu_check.summary_markdown(data)
    assert "| tiny | a failed figure | 2 | 1 |" in text and "RankFailure: boom" in text


@pytest.mark.parametrize(("name", "memory", "preset"), [
    ("NVIDIA H200", 141, "h200"), ("NVIDIA H100 80GB HBM3", 80, "h100-sxm"),
    ("NVIDIA GH200 480GB", 96, "gh200"), ("NVIDIA A100-SXM4-40GB", 40, "a100-40gb"),
    ("NVIDIA GeForce RTX 4090", 24, None)])
def test_device_names_map_to_hardware_presets(name, memory, preset):
    from shardwise.hardware import ACCELERATORS

    label = gpu_check.accelerator_label(name, memory * 2**30)
    assert label == preset and (label is None or label in ACCELERATORS)


def test_stand_in_rates_put_the_best_cpu_gemm_and_copy_at_the_presets_efficiencies():
    """A loaded CPU (0.8 TFLOP/s best bf16 GEMM: 0.0008 of an H200, under the file's 0.001
    floor) still fits and loads in the dry run; the ratios between points are kept."""
    from gpu_check.calibration import stand_in_rates

    from shardwise.calibration import default_calibration
    from shardwise.hardware import get_accelerator

    acc, cal = get_accelerator("h200"), default_calibration("h200")
    results = {"gemm": {"a": {"tflops": 0.8, "m": 256}, "b": {"tflops": 0.2, "m": 64}},
               "attention": {"fa2": [{"tflops": 0.1, "pass": "fwd"}]},
               "hbm": {"copy 1": {"kernel": "copy", "gbps": 20.0}, "copy 2": {"gbps": 5.0}}}
    out = stand_in_rates(results, "h200")
    top = acc.peak_bf16 * cal.matmul_efficiency / 1e12
    assert out["gemm"]["a"]["tflops"] == pytest.approx(top)
    assert out["gemm"]["b"]["tflops"] == pytest.approx(top / 4)
    assert out["attention"]["fa2"][0]["tflops"] == pytest.approx(top / 8)
    assert out["gemm"]["b"]["m"] == 64
    assert out["hbm"]["copy 1"]["gbps"] == pytest.approx(
        acc.hbm_bandwidth * cal.hbm_efficiency / 1e9)
    assert out["hbm"]["copy 2"]["gbps"] == pytest.approx(out["hbm"]["copy 1"]["gbps"] / 4)
