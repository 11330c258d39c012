"""The tool API through FastAPI's TestClient: every endpoint answers what the CLI's `--json`
prints for the same input (run through click on the real `cli`), figures from SPEC, and the
CLI's bad-input corpus (tests/test_cli.py) answered with 4xx and one line, never a 500."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardwise.cli import cli
from tests.web.cli_json import cli_json

HF = Path(__file__).parents[1] / "fixtures" / "hf"


def ok(client, path: str, body: dict | None = None):
    response = client.post(path, json=body or {}) if body is not None else client.get(path)
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------- API == CLI --json
@pytest.mark.parametrize(("cli_args", "path", "body"), [
    (["models"], "/api/models", None),
    (["memory", "llama3-70b", "--gpus", "64", "--tp", "8", "--zero", "1", "--sp",
      "--recompute", "selective", "--seq", "8192", "--no-flash", "--formula", "korthikanti"],
     "/api/memory", {"model": "llama3-70b", "gpus": 64, "tp": 8, "zero": 1, "sp": True,
                     "recompute": "selective", "seq": 8192, "flash": False,
                     "formula": "korthikanti"}),
    (["memory", "mixtral-8x7b", "--gpus", "64", "--ep", "8", "--pp", "4", "--zero", "3",
      "--schedule", "interleaved", "--chunks", "2", "--global-batch", "256", "--gpu", "h200"],
     "/api/memory", {"model": "mixtral-8x7b", "gpus": 64, "ep": 8, "pp": 4, "zero": 3,
                     "schedule": "interleaved", "chunks": 2, "global_batch": "256",
                     "gpu": "h200"}),
    (["memory", "llama3-8b", "--gpus", "8", "--zero", "2", "--impl", "hf-sdpa"],
     "/api/memory", {"model": "llama3-8b", "gpus": 8, "zero": 2, "impl": "hf-sdpa"}),
    (["comm", "--op", "all-reduce", "--size", "13.5GB", "--ranks", "8", "--link", "ndr"],
     "/api/comm", {"op": "all-reduce", "size": "13.5GB", "ranks": 8, "link": "ndr"}),
    (["comm", "--algorithm", "hierarchical", "--ranks", "64", "--nodes", "8"],
     "/api/comm", {"algorithm": "hierarchical", "ranks": 64, "nodes": 8}),
    (["schedule", "-p", "4", "-m", "8", "--schedule", "zb-h1"],
     "/api/schedule", {"stages": 4, "microbatches": 8, "schedule": "zb-h1"}),
    (["schedule", "-p", "4", "-m", "8", "--schedule", "interleaved", "-v", "2", "--tb", "2",
      "--p2p", "0.1"],
     "/api/schedule", {"stages": 4, "microbatches": 8, "schedule": "interleaved",
                       "chunks": 2, "t_b": 2, "p2p_latency": 0.1}),
    (["plan", "llama3-8b", "--gpus", "64", "--top", "3", "--tokens", "1T", "--price", "2",
      "--layout", "tp=2,pp=2,zero=1"],
     "/api/plan", {"model": "llama3-8b", "gpus": 64, "top": 3, "tokens": "1T", "price": 2,
                   "layout": "tp=2,pp=2,zero=1"}),
    (["plan", "mixtral-8x7b", "--gpus", "32", "--gpu", "a100", "--inter", "roce400",
      "--top", "2", "--seq", "4096", "--global-batch", "256", "--no-flash"],
     "/api/plan", {"model": "mixtral-8x7b", "gpus": 32, "gpu": "a100", "inter": "roce400",
                   "top": 2, "seq": 4096, "global_batch": "256", "flash": False}),
])
def test_api_equals_cli_json(client, cli_args, path, body):
    expected, got = cli_json(*cli_args), ok(client, path, body)
    if path == "/api/plan":  # wall-clock timings of the search differ run to run
        for payload in (expected, got):
            for key in ("seconds", "evaluation_seconds", "layouts_per_s"):
                payload["stats"].pop(key)
        # the web adds each export's file (the CLI's text under a header) or, for a framework
        # another stack runs, that stack to re-plan for
        for framework, emitted in got["emits"].items():
            if "download" in emitted:
                assert emitted.pop("download")["text"].endswith(
                    expected["emits"][framework]["config"])
                # and each launcher's job that the CLI writes (test_export.py: its text)
                jobs = expected["emits"][framework]["launchers"]
                assert set(emitted.pop("jobs")) == {name for name, job in jobs.items()
                                                    if isinstance(job, str)}
            else:
                assert emitted.pop("replan")["impl"] != expected["stack"]["name"]
    assert got == expected


def test_uploaded_config_equals_cli_reading_it_from_disk(client):
    path = HF / "mixtral-8x7b" / "config.json"
    config = json.loads(path.read_text())
    upload = {"name": "mixtral-8x7b", "config": config}
    row = ok(client, "/api/models", upload)
    assert round(row["active_params"] / 1e9, 1) == 12.9  # Mixtral's 12.9B active parameters
    expected = cli_json("memory", str(path), "--ep", "8", "--zero", "3")
    assert ok(client, "/api/memory", {"hf_config": upload, "ep": 8, "zero": 3}) == expected


# ------------------------------------------------------------------- published figures
def test_memory_spec_example(client):
    # SPEC §4: Llama-3-70B, TP 8 × DP 8, ZeRO-1, s=8192, selective recompute + SP.
    out = ok(client, "/api/memory", {"model": "llama3-70b", "gpus": 64, "tp": 8, "zero": 1,
                                     "sp": True, "recompute": "selective", "flash": False,
                                     "formula": "korthikanti"})
    stage = out["stages"][0]
    assert round((stage["weights"] + stage["grads"]) / 1e9, 1) == 35.3
    assert round(stage["optimizer"] / 1e9, 1) == 13.2
    assert out["fits"] is True


def test_schedule_closed_forms(client):
    out = ok(client, "/api/schedule", {"stages": 4, "microbatches": 8, "schedule": "gpipe"})
    assert out["makespan"] == 22 and out["bubble_fraction"] == pytest.approx(3 / 11)
    assert len(out["timeline"]) == out["actions"] == 64
    # every stage is busy 2·m time units of the makespan: the bubble is (p-1)/(m+p-1)
    busy = sum(e["end"] - e["start"] for e in out["timeline"])
    assert busy == 4 * 8 * 2


def test_comm_spec_figure(client):
    out = ok(client, "/api/comm", {"size": "4000B", "ranks": 4})
    assert out["bytes_sent_per_rank"] == 6000  # 2(n-1)/n · size


def test_plan_has_everything_the_page_shows(client):
    out = ok(client, "/api/plan", {"model": "llama3-8b", "gpus": 64, "top": 5})
    assert len(out["ranked"]) == 5 and out["ranked"][0]["rank"] == 1
    assert out["explanation"].startswith(out["recommended"]["short"])
    assert out["rejected"] and all(r["count"] > 0 for r in out["rejected"])
    # the layouts are for one stack (issue 33): its framework's configuration first, the
    # others say which stack they run
    assert out["stack"]["name"] == "megatron-te" and next(iter(out["emits"])) == "megatron"
    assert "--tensor-model-parallel-size" in out["emits"]["megatron"]["config"]
    for framework in ("torchtitan", "deepspeed"):
        assert "plan with --impl" in out["emits"][framework]["error"]
    assert "tp_overlap" in out["stack"]["assumed"]


def test_hardware_lists_presets(client):
    out = ok(client, "/api/hardware")
    assert out["accelerators"]["h100-sxm"] == 80 * 2**30 and "ndr" in out["links"]


def test_openapi_documents_every_tool(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/api/models", "/api/memory", "/api/comm", "/api/schedule", "/api/plan"):
        assert path in paths


# ------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("path", "body", "status", "fragment"), [
    ("/api/memory", {"model": "lama3-8b"}, 422, "llama3-8b"),
    ("/api/memory", {"tp": 3}, 400, "tp·pp·cp = 3 does not divide --gpus 8"),
    ("/api/memory", {"gpus": 64, "tp": 64}, 400, "tp=64 does not divide n_heads=32"),
    ("/api/memory", {"seq": "abc"}, 422, "valid integer"),
    ("/api/memory", {"gpu": "h1000"}, 400, "unknown accelerator 'h1000'"),
    ("/api/memory", {"model": "/nonexistent/config.json"}, 422, "Input should be"),
    ("/api/memory", {"model": "../../etc/passwd"}, 422, "Input should be"),
    ("/api/memory", {"bogus": 1}, 422, "Extra inputs are not permitted"),
    ("/api/memory", {"zero": 4}, 422, "less than or equal to 3"),
    ("/api/memory", {"gpus": 10**7}, 422, "less than or equal to 131072"),
    ("/api/memory", {"seq": 10**8}, 422, "less than or equal to 1048576"),
    ("/api/memory", {"global_batch": "lots"}, 400, "lots"),
    ("/api/memory", {"dtype": "fp13"}, 400, "dtype 'fp13' unknown"),
    ("/api/comm", {"size": "13.5GX"}, 400, "cannot read size '13.5GX'"),
    ("/api/comm", {"link": "nvlink9"}, 400, "unknown link 'nvlink9'"),
    ("/api/comm", {"algorithm": "hierarchical", "ranks": 8, "nodes": 3}, 400,
     "--nodes 3 must divide --ranks 8"),
    ("/api/schedule", {"stages": 4, "microbatches": 6, "schedule": "interleaved"}, 400,
     "m=6, p=4"),
    ("/api/schedule", {"schedule": "pipedream"}, 422, "Input should be"),
    ("/api/schedule", {"stages": 128, "microbatches": 1024}, 422, "too large to draw"),
    ("/api/schedule", {"t_f": 0}, 422, "greater than 0"),
    ("/api/plan", {"price": 2}, 400, "--price needs --tokens"),
    ("/api/plan", {"layout": "tp=3"}, 400, "does not divide"),
    ("/api/plan", {"layout": "banana"}, 400, "cannot read layout item 'banana'"),
    ("/api/plan", {"top": 1000}, 422, "less than or equal to 50"),
    ("/api/plan", {"image": "img; rm -rf ~"}, 422, "should match pattern"),
    ("/api/plan", {"model": "llama3-405b", "gpus": 8}, 400, "no layout"),
    ("/api/plan", {"gpus": 64, "gpus_per_node": 48}, 400, ""),
    ("/api/models", {"config": {"model_type": "llama"}}, 400, "lacks the field"),
    ("/api/models", {"config": {"model_type": "bert"}}, 400, "unsupported model_type 'bert'"),
    ("/api/models", {"config": [1, 2]}, 422, "valid dictionary"),
    ("/api/models", {"config": {"model_type": "gpt2", "n_embd": "wide", "n_layer": 2,
                                "n_head": 2, "vocab_size": 10, "n_positions": 8}}, 400,
     "config file 'uploaded'"),
])
def test_bad_input_is_4xx_with_one_line(client, path, body, status, fragment):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text[:300]
    detail = response.json()["detail"]
    if status == 400:
        assert isinstance(detail, str) and "\n" not in detail and "Traceback" not in detail
        assert fragment in detail
    else:
        assert fragment in " ".join(d["msg"] for d in detail)


def test_malformed_json_is_422(client):
    response = client.post("/api/memory", content=b"{oops",
                           headers={"content-type": "application/json"})
    assert response.status_code == 422


def test_upload_over_one_megabyte_is_413(client):
    big = {"config": {"model_type": "llama", "padding": "x" * 1_100_000}}
    response = client.post("/api/models", json=big)
    assert response.status_code == 413 and "1,000,000-byte limit" in response.json()["detail"]


def test_chunked_upload_without_a_length_is_411(client):
    """A body sent in chunks has no Content-Length for the 1 MB limit to read: refused before
    anything reads it, or a 2 MB upload would get past the limit."""
    padding = b"x" * 1_000_000

    def chunks():
        yield b'{"name": "big", "config": {"model_type": "llama", "padding": "'
        yield from (padding, padding)
        yield b'"}}'

    response = client.post("/api/models", content=chunks(),
                           headers={"content-type": "application/json"})
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers
    assert response.status_code == 411
    assert response.json()["detail"] == "send the request body with a Content-Length"


def test_plan_busy_and_time_limit(client, monkeypatch):
    from shardwise.web import tools

    slots = [tools._plan_slots.acquire(blocking=False) for _ in range(tools.PLAN_WORKERS)]
    try:
        response = client.post("/api/plan", json={})
        assert response.status_code == 503 and "busy" in response.json()["detail"]
    finally:
        for taken in slots:
            if taken:
                tools._plan_slots.release()
    done = threading.Event()
    slow = tools.plan_sync

    def slower(request):
        done.wait(5)
        return slow(request)

    monkeypatch.setattr(tools, "plan_sync", slower)
    monkeypatch.setattr(tools, "PLAN_TIMEOUT_S", 0.05)
    response = client.post("/api/plan", json={})
    done.set()
    assert response.status_code == 408 and "longer than" in response.json()["detail"]


def test_schedule_svg_is_the_cli_file(client, tmp_path):
    path = tmp_path / "zb.svg"
    CliRunner().invoke(cli, ["schedule", "-p", "4", "-m", "8", "--schedule", "zb-h1", "--svg",
                             str(path)], catch_exceptions=False)
    response = client.get("/api/schedule.svg",
                          params={"stages": 4, "microbatches": 8, "schedule": "zb-h1"})
    assert response.status_code == 200 and response.headers["content-type"] == "image/svg+xml"
    assert response.text == path.read_text()
    bad = client.get("/api/schedule.svg", params={"stages": 4, "microbatches": 6,
                                                   "schedule": "interleaved"})
    assert bad.status_code == 400 and "m=6, p=4" in bad.json()["detail"]


def test_plan_constraints_and_memory_fit_hints(client):
    out = ok(client, "/api/plan", {"model": "llama3-8b", "gpus": 16, "top": 3,
                                   "fix": "tp=2", "max": "pp=2", "all_variants": True})
    assert all(e["layout"]["tp"] == 2 and e["layout"]["pp"] <= 2 for e in out["ranked"])
    assert out["constraint"] == "fix tp=2; max pp=2" and out["all_variants"]
    assert out["rejected"][0]["reason"] == "outside the constraints (fix tp=2; max pp=2)"
    bad = client.post("/api/plan", json={"model": "llama3-8b", "fix": "tp=x"})
    assert bad.status_code == 400 and "must be an integer" in bad.json()["detail"]
    memory = ok(client, "/api/memory", {"model": "llama3-70b", "gpus": 64, "tp": 8, "zero": 1})
    assert memory["fit_hints"] == cli_json("memory", "llama3-70b", "--gpus", "64", "--tp",
                                           "8", "--zero", "1")["fit_hints"]
    assert memory["fit_hints"] and all(s["margin"] < 0 for s in memory["stages"])


def test_plan_for_another_stack_searches_and_exports_it(client):
    """The planner page's stack choice: torchtitan's search (no ZeRO-1, fp32 gradient
    reduce) and its export first."""
    out = ok(client, "/api/plan", {"model": "llama3-8b", "gpus": 16, "top": 3,
                                   "impl": "torchtitan"})
    assert out["stack"]["name"] == "torchtitan" and next(iter(out["emits"])) == "torchtitan"
    assert all(entry["layout"]["zero"] != 1 for entry in out["ranked"])
    assert "torchtitan.train" in out["emits"]["torchtitan"]["config"]
    assert out["train"]["grad_dtype"] == "fp32"
