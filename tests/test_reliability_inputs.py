"""Issue 47: strict input files, kernels only where they run, a memory budget per search, and
the Python API and web API validating like the CLI — each through the entry point a user
runs (the `shardwise` console script in a subprocess, the web API through TestClient, the
Python API). References: the datasheet-free physical ranges (`hardware.RANGES`), the
flash-attention repository's Hopper-only FlashAttention-3, the planner's own estimate for
the suggested constraint (re-run with the same budget)."""

from __future__ import annotations

import contextlib
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from tests.cli_helpers import assert_one_line_error, shardwise

GPU = {"name": "my-h100", "memory_bytes": 96 * 2**30, "hbm_bandwidth": 2.4e12,
       "peak_bf16": 8.0e14, "peak_fp8": 1.6e15, "intra": "my-nvlink", "inter": "ndr",
       "boost_clock_mhz": 1480, "calibrated_as": "h100",
       "links": [{"name": "my-nvlink", "bandwidth": 4.0e11, "latency": 3e-6}]}
MACHINE = {"name": "this-machine", "backend": "gloo", "dtype": "fp32", "cores": 2,
           "memory_bytes": 16e9, "peak_flops": 2e11, "memory_bandwidth": 2e10,
           "link": {"name": "gloo", "bandwidth": 1e9, "latency": 3e-4}}


def _memory(*args: str):
    return shardwise("memory", "llama3-8b", "--gpus", "8", *args, check=False)


def _plan(*args: str):
    return shardwise("plan", "llama3-8b", "--gpus", "8", "--top", "1", *args, check=False)


def _gpu_file(tmp_path, text: str | None = None, **fields):
    path = tmp_path / "gpu.json"
    path.write_text(text if text is not None else json.dumps(GPU | fields))
    return str(path)


def test_a_good_accelerator_file_still_reads(tmp_path):
    out = json.loads(_memory("--gpu", _gpu_file(tmp_path), "--json").stdout)
    assert out["accelerator"] == "my-h100" and out["memory_bytes"] == 96 * 2**30


@pytest.mark.parametrize(("fields", "fragments"), [
    # a link named like a preset would silently replace it while the header shows the preset
    ({"inter": "ndr", "links": [{"name": "ndr", "bandwidth": 1e9, "latency": 1e-6}]},
     ("named 'ndr' like a preset link",)),
    ({"links": [GPU["links"][0], GPU["links"][0]]}, ("'my-nvlink' is defined twice",)),
    ({"name": "h100"}, ("is a preset's",)),
    ({"peak_bf16": 1e-300}, ("peak_bf16 (FLOP/s)", "[1e+09, 1e+18]")),
    ({"links": [{"name": "my-nvlink", "bandwidth": 4e11, "latency": 1e300}]},
     ("links[0].latency (s)", "in [0, 1]")),
    ({"memory_bytes": 1e300}, ("memory_bytes (bytes)",)),
])
def test_accelerator_file_faults(tmp_path, fields, fragments):
    result = _memory("--gpu", _gpu_file(tmp_path, **fields))
    assert_one_line_error(result, *fragments)
    assert "Warning" not in result.stderr


def test_duplicate_json_key_is_refused(tmp_path):
    text = json.dumps(GPU)[:-1] + ', "peak_bf16": 1e15}'  # Python keeps the last silently
    assert json.loads(text)["peak_bf16"] == 1e15
    assert_one_line_error(_memory("--gpu", _gpu_file(tmp_path, text)),
                          "key 'peak_bf16' is given twice")


@pytest.mark.parametrize("name", ["gpu\x1b]0;pwned\x07", "a\nerror: forged", "x\x1b[31mred",
                                  "rtl\u202eevil"])
def test_control_characters_in_a_name_never_reach_the_terminal(tmp_path, name):
    result = _memory("--gpu", _gpu_file(tmp_path, name=name))
    assert_one_line_error(result, "without control characters")
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "\u202e" not in result.stderr


def test_clamp_absurd_options():
    assert_one_line_error(shardwise("plan", "llama3-8b", "--gpus", "8", "--clock-mhz", "1e-300",
                                    check=False), "--clock-mhz", "[10, 10000]")
    result = shardwise("plan", "llama3-8b", "--gpus", "8", "--checkpoint-bandwidth", "1e-300",
                       check=False)
    assert_one_line_error(result, "--checkpoint-bandwidth")
    assert "Warning" not in result.stderr


@pytest.mark.parametrize(("data", "fragments"), [
    ({"links": {"nvlnk4": 0.8}}, ("links: unknown nvlnk4", "nvlink4")),
    ({"link_latency": {"ndrr": 5e-6}}, ("link_latency: unknown ndrr",)),
    ({"accelerators": {"h100-sxn": {"kernel_overhead": 1e-5}}},
     ("accelerators: unknown h100-sxn", "h100-sxm")),
    ({"link_latency": {"ndr": 1e300}}, ("latency of ndr must be ≤ 1 s",)),
    ({"links": {"ndr": 1e-300}}, ("link efficiency of ndr must be ≥ 0.001",)),
    ({"default": {"kernel_overhead": 1e300}}, ("kernel_overhead must be ≤ 1 s",)),
])
def test_constants_file_with_an_unknown_name(tmp_path, data, fragments):
    path = tmp_path / "constants.json"
    path.write_text(json.dumps(data))
    assert_one_line_error(_plan("--calibration", str(path)), *fragments)


def test_constants_file_names_its_accelerator_files_links(tmp_path):
    path = tmp_path / "constants.json"
    path.write_text(json.dumps({"links": {"my-nvlink": 0.7, "nvlink4": 0.8},
                                "accelerators": {"my-h100": {"kernel_overhead": 1e-5}}}))
    gpu = _gpu_file(tmp_path, calibrated_as=None)
    assert _plan("--gpu", gpu, "--calibration", str(path)).returncode == 0


def test_calibration_machine_dtype_is_checked(tmp_path):
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"machine": MACHINE | {"dtype": "fp7"}}))
    assert_one_line_error(shardwise("memory", "tiny", "--gpus", "2", "--gpu", "this-machine",
                                    "--calibration", str(path), check=False),
                          "dtype must be one of", "fp7")


def test_fa3_only_on_hopper(client):
    assert_one_line_error(shardwise("plan", "llama3-8b", "--gpus", "8", "--gpu", "a100",
                                    "--attention", "fa3", check=False),
                          "fa3 (FlashAttention-3) runs on hopper", "a100-80gb (ampere)")
    assert_one_line_error(_memory("--gpu", "b200", "--attention", "fa3"), "blackwell")
    assert _memory("--gpu", "h100", "--attention", "fa3").returncode == 0
    response = client.post("/api/plan", json={"model": "llama3-8b", "gpus": 8, "gpu": "a100",
                                              "attention": "fa3"})
    assert response.status_code == 400 and "hopper" in response.json()["detail"]


def test_python_api_refuses_like_the_cli():
    from shardwise import get_model
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.layout import Layout, TrainSpec
    from shardwise.partition import stage_partition

    with pytest.raises(ShardwiseError, match="4 layers cannot fill pp=8"):
        stage_partition(4, 8, 1, ())
    assert sum(stage_partition(126, 16)) == 126  # Llama 3 405B's 7, 8 × 14, 7 still stands
    with pytest.raises(ShardwiseError, match="expert_load must be ≥ 1"):
        TrainSpec(expert_load=0.5).validate()
    with pytest.raises(ShardwiseError, match="schedule '2F0' unknown; valid: gpipe"):
        training_memory_per_gpu(get_model("llama3-8b"), Layout(pp=2, schedule="2F0"),
                                TrainSpec())


@pytest.fixture(scope="module")
def client():
    from shardwise.web.app import create_app

    return TestClient(create_app())


def test_web_numbers_are_not_booleans_and_fix_items_not_empty(client):
    bad = client.post("/api/memory", json={"model": "llama3-8b", "gpus": 8, "tp": True})
    assert bad.status_code == 422 and "tp must be a number" in json.dumps(bad.json())
    good = client.post("/api/memory", json={"model": "llama3-8b", "gpus": 8, "tp": 2,
                                            "sp": True})
    assert good.status_code == 200 and good.json()["layout"]["tp"] == 2
    response = client.post("/api/plan", json={"model": "llama3-8b", "gpus": 8,
                                              "fix": "tp=8,,pp=2"})
    assert response.status_code == 400 and response.json()["field"] == "fix"
    assert "an item is empty" in response.json()["detail"]


def test_cli_memory_budget_names_a_constraint_that_fits():
    """Llama 3 405B on 16,384 H100 (the search holds ~0.3 GB by the estimate) refused under
    250 MB; the constraint the refusal names then runs under the same budget."""
    args = ("plan", "llama3-405b", "--gpus", "16384", "--global-batch", "16M-tokens",
            "--top", "1", "--memory-budget", "250MB")
    result = shardwise(*args, check=False)
    assert_one_line_error(result, "over the 0.25 GB budget (--memory-budget)", "fits")
    hint = result.stderr.strip().split("; ")[-1].removesuffix(" fits").split()
    assert hint[0] in ("--fix", "--max"), hint
    assert shardwise(*args, *hint, "--json", check=False).returncode == 0
    assert_one_line_error(shardwise("plan", "--memory-budget", "1e-300", check=False),
                          "--memory-budget")


@pytest.mark.slow
def test_web_rss_stays_under_its_budget_under_concurrent_plans():
    """A real uvicorn server with a 0.7 GB budget, 3 concurrent Llama-3-405B / 16,384-GPU
    plans (2 workers, the third a 503): the server's peak RSS under the budget."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/bench_web_memory.py", "--requests", "3",
                          "--budget", "700MB", "--model", "llama3-405b", "--gpus", "16384",
                          "--global-batch", "16M-tokens", "--timeout", "200", "--json"],
                         capture_output=True, text=True, timeout=580)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["statuses"]) <= {"200", "503", "408"}, result
    assert result["statuses"].get("200", 0) >= 1, result
    assert result["base_rss"] < result["peak_rss"] <= 700e6, result


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.integers(-2**70, 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                 st.sampled_from(["ring", "hybrid", "1f1b", "zbv", "selective", "nvlink4"]))
_LAYOUT = ("dp", "tp", "pp", "cp", "ep", "cp_kind", "ulysses", "zero", "zero_group", "sp",
           "schedule", "chunks", "recompute", "micro_batch", "partition", "etp")
_TRAIN = ("seq_len", "global_batch", "dtype", "grad_dtype", "optimizer", "flash_attention",
          "expert_load", "experts_active", "fp8", "offload", "offload_fraction", "impl")
_GPU_KEYS = ("name", "memory_bytes", "hbm_bandwidth", "peak_bf16", "peak_fp8", "intra", "inter",
             "host", "calibrated_as", "boost_clock_mhz", "links")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(_LAYOUT), value=_ANY, train_field=st.sampled_from(_TRAIN),
       train_value=_ANY, gpu_key=st.sampled_from(_GPU_KEYS), gpu_value=_ANY)
def test_public_functions_give_a_result_or_shardwise_error(field, value, train_field,
                                                          train_value, gpu_key, gpu_value):
    """Any value of one Layout, TrainSpec or accelerator-file field through the memory and
    step estimates and the accelerator reader: a result or `ShardwiseError`, no other
    exception (found here before the fix: a None or text `etp`/`ulysses` was a TypeError, a
    null required accelerator field a TypeError)."""
    from shardwise import get_model
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.estimate.step import estimate_step
    from shardwise.hardware import Cluster, accelerator_from_dict
    from shardwise.layout import Layout, TrainSpec

    model = get_model("tiny-moe")
    for call in (lambda: training_memory_per_gpu(model, Layout(**{field: value}),
                                                 TrainSpec(**{train_field: train_value})),
                 lambda: estimate_step(model, Cluster.of(8, "h100"), Layout(**{field: value}),
                                       TrainSpec(**{train_field: train_value})),
                 lambda: accelerator_from_dict(GPU | {gpu_key: gpu_value}, "gpu.json")):
        with contextlib.suppress(ShardwiseError):
            call()
