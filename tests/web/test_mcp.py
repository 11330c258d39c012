"""`shardwise mcp` driven by the official MCP SDK's own client over stdio: the tools listed
with the web API's schemas, a plan equal to `shardwise plan --json`, refusals as one-line tool
errors. The server runs as a subprocess, exactly as an agent starts it."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest

from tests.web.cli_json import cli_json

if os.environ.get("CI"):
    import mcp  # noqa: F401  (under CI a missing SDK is an error, not a skip)
mcp_client = pytest.importorskip("mcp")
from mcp.client.stdio import StdioServerParameters  # noqa: E402

from shardwise.web import tools  # noqa: E402

pytestmark = pytest.mark.slow  # a server subprocess


def drive(calls: list[tuple[str, dict[str, Any]]]) -> tuple[list[Any], list[Any]]:
    """Start `shardwise mcp`, list its tools, make `calls`; (tools, results)."""
    server = StdioServerParameters(command=sys.executable, args=["-m", "shardwise", "mcp"],
                                   env=dict(os.environ))

    async def session() -> tuple[list[Any], list[Any]]:
        async with mcp_client.Client(server, read_timeout_seconds=300) as client:
            listed = (await client.list_tools()).tools
            return listed, [await client.call_tool(name, args) for name, args in calls]

    # in a thread of its own: an earlier test (Playwright's sync API) may leave an event loop
    # running in this one, and anyio.run refuses to start inside it
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, session).result()


def without_timings(payload: dict[str, Any]) -> dict[str, Any]:
    for key in ("seconds", "evaluation_seconds", "layouts_per_s"):
        payload["stats"].pop(key)
    return payload


def test_mcp_tools_answer_as_the_cli_and_refuse_in_one_line():
    plan_args = {"model": "mixtral-8x7b", "gpus": 32, "gpu": "a100", "top": 2, "seq": 4096,
                 "global_batch": "256"}
    export_args = {**plan_args, "framework": "megatron"}
    listed, (plan, refused, unknown, export, bad_type, slurm, k8s, no_image) = drive([
        ("plan", plan_args),
        ("plan", {"model": "llama3-8b", "gpus": 64, "layout": "tp=8,pp=3"}),
        ("memory", {"model": "no-such-model"}),
        ("export", export_args),
        ("comm", {"ranks": "many"}),
        ("export", {**export_args, "launcher": "slurm"}),
        ("export", {**export_args, "launcher": "k8s", "image": "registry.example.com/t:1"}),
        ("export", {**export_args, "launcher": "k8s"}),
    ])
    schemas = {tool.name: tool for tool in listed}
    assert set(schemas) == {"plan", "memory", "schedule", "comm", "export", "models"}
    # one definition for both: the web API's pydantic models are the tools' schemas
    assert schemas["plan"].input_schema == tools.PlanRequest.model_json_schema(
        mode="serialization")
    assert schemas["memory"].output_schema == tools.MemoryResponse.model_json_schema(
        mode="serialization")

    assert not plan.is_error
    expected = cli_json("plan", "mixtral-8x7b", "--gpus", "32", "--gpu", "a100", "--top", "2",
                        "--seq", "4096", "--global-batch", "256")
    assert without_timings(plan.structured_content) == without_timings(expected)
    assert json.loads(plan.content[0].text)["ranked"] == expected["ranked"]
    # the band travels with every step time
    assert all("band" in row["estimate"]["uncertainty"] for row in expected["ranked"])

    assert not export.is_error
    assert export.structured_content["config"] == expected["emits"]["megatron"]["config"]
    chosen = expected.get("recommended") or expected["ranked"][0]
    assert export.structured_content["layout"] == chosen["short"]
    assert export.structured_content["uncertainty"] == chosen["estimate"]["uncertainty"]

    # with a launcher, the job the CLI writes for the same plan (`plan --json`'s launchers;
    # `plan --emit megatron --launcher k8s --image` prints the same job)
    assert slurm.structured_content["script"] == expected["emits"]["megatron"]["launchers"][
        "slurm"]
    assert slurm.structured_content["launcher"] == "slurm"
    assert export.structured_content["script"] is None
    k8s_job = cli_json("plan", "mixtral-8x7b", "--gpus", "32", "--gpu", "a100", "--top", "2",
                       "--seq", "4096", "--global-batch", "256", "--emit", "megatron",
                       "--launcher", "k8s", "--image", "registry.example.com/t:1")["script"]
    assert k8s.structured_content["script"] == k8s_job and "kind: \"PyTorchJob\"" in k8s_job

    for result, fragment in ((refused, "does not divide"), (unknown, "no-such-model"),
                             (bad_type, "ranks"), (no_image, "needs --image")):
        assert result.is_error
        (text,) = [block.text for block in result.content]
        assert fragment in text and "\n" not in text and "Traceback" not in text
