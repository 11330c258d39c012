"""`shardwise mcp`: the planner as Model Context Protocol tools for coding agents (stdio).

Each tool's input and output schemas are the web API's pydantic models (`web.tools`), and each
call runs the function the matching `/api/*` endpoint runs, so an answer equals
`shardwise … --json` for the same inputs. Bad input is a tool error in one line (`isError`).
Served with the official `mcp` SDK's low-level server (`pip install "shardwise[mcp]"`); the
how-to is docs/howto/agents.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from pydantic import BaseModel, Field, ValidationError

from shardwise import __version__
from shardwise.emit.launchers import LAUNCHERS
from shardwise.errors import ShardwiseError, one_line
from shardwise.web import tools
from shardwise.web.app import _json_safe

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")


class ExportRequest(tools.PlanRequest):
    """`export`'s input: a plan request, the framework to launch its layout with, and the
    launcher whose job runs it on the planned nodes (`image`: the k8s job's container)."""

    framework: Literal[FRAMEWORKS] = Field(  # type: ignore[valid-type]
        "megatron", description="The framework whose configuration to write.")
    launcher: Literal[LAUNCHERS] | None = Field(  # type: ignore[valid-type]
        None, description="Also write the job that runs it on the planned nodes "
                          "(`plan --emit F --launcher L`; k8s needs `image`).")


class ExportResponse(tools._Out):
    """`export`'s answer: the framework's configuration of the planned layout (or why not)."""

    framework: str
    layout: str = Field(description="The exported layout, short form.")
    step_seconds: float = Field(description="Its predicted step time.")
    uncertainty: dict[str, Any] = Field(description="The step time's band and its basis.")
    config: str = Field(description="The launch configuration (a refusal is a tool error).")
    launcher: str | None = Field(None, description="The launcher asked for, if any.")
    script: str | None = Field(None, description="Its job (`plan … --launcher L`).")


class ModelsResponse(tools._Out):
    """`models`'s answer: the presets (`shardwise models --json`)."""

    models: list[tools.ModelRow]


class NoInput(tools._In):
    """A tool without arguments."""


WEB_ONLY = ("download", "jobs", "replan")  # the planner page's files and buttons


def _plan(request: tools.PlanRequest) -> dict[str, Any]:
    """`/api/plan`'s answer less what only the page uses (`WEB_ONLY`): `plan --json`'s."""
    payload = tools.plan_sync(request)
    for emitted in payload["emits"].values():
        for key in WEB_ONLY:
            emitted.pop(key, None)
    return payload


def _export(request: ExportRequest) -> dict[str, Any]:
    plan_request = tools.PlanRequest(**request.model_dump(exclude={"framework", "launcher"},
                                                          exclude_unset=True))
    payload = _plan(plan_request)
    emit = payload["emits"][request.framework]
    if emit.get("error"):
        raise ShardwiseError(emit["error"])
    job = emit["launchers"][request.launcher] if request.launcher else None
    if isinstance(job, dict):  # k8s without an image
        raise ShardwiseError(job["error"])
    chosen = payload.get("recommended") or payload["ranked"][0]
    return {**emit, "launcher": request.launcher, "script": job,
            "framework": request.framework, "layout": chosen["short"],
            "step_seconds": chosen["estimate"]["total"],
            "uncertainty": chosen["estimate"]["uncertainty"]}


@dataclass(frozen=True)
class Tool:
    """One MCP tool: its request and response models and the function that answers."""

    description: str
    request: type[BaseModel]
    response: type[BaseModel]
    answer: Callable[[Any], Any]


TOOLS: dict[str, Tool] = {
    "plan": Tool("Search every layout of a model on a cluster and rank them "
                 "(`shardwise plan --json`): step time with its band (± from published runs; "
                 "'unvalidated' marks what no run validates), memory, MFU, the exports.",
                 tools.PlanRequest, tools.PlanResponse, _plan),
    "memory": Tool("Per-GPU memory of one layout, stage by stage, in bytes "
                   "(`shardwise memory --json`).",
                   tools.MemoryRequest, tools.MemoryResponse, tools.memory),
    "schedule": Tool("Generate, validate and simulate a pipeline schedule "
                     "(`shardwise schedule --json`).",
                     tools.ScheduleRequest, tools.ScheduleResponse, tools.schedule),
    "comm": Tool("Bytes on the wire and alpha-beta time of one collective "
                 "(`shardwise comm --json`).",
                 tools.CommRequest, tools.CommResponse, tools.comm),
    "export": Tool("The planned layout as a Megatron-LM, torchtitan or DeepSpeed launch "
                   "configuration (`shardwise plan --emit FRAMEWORK`), with its band; with "
                   "`launcher` also the torchrun, Slurm, Kubeflow or SkyPilot job that runs it "
                   "(`--launcher`).",
                   ExportRequest, ExportResponse, _export),
    "models": Tool("The preset models and their parameter counts (`shardwise models --json`).",
                   NoInput, ModelsResponse, lambda _: {"models": tools.models()}),
}


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(mode="serialization")


def complaint(error: Exception) -> str:
    """The first complaint of a bad request, in one line (as the web API's 4xx says it)."""
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        given = f"={first['input']!r}" if not isinstance(first.get("input"), dict) else ""
        return one_line(f"{where}{given}: {first['msg']}" if where else first["msg"])
    return one_line(error)


async def list_tools(_: Any, __: Any) -> types.ListToolsResult:
    """`tools/list`: every tool with its request and response models' JSON schemas."""
    return types.ListToolsResult(tools=[
        types.Tool(name=name, description=tool.description, input_schema=_schema(tool.request),
                   output_schema=_schema(tool.response))
        for name, tool in TOOLS.items()])


async def call_tool(_: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    """`tools/call`: validate the arguments with the tool's request model, answer in a worker
    thread; bad input is a one-line tool error."""
    def error(text: str) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    is_error=True)

    tool = TOOLS.get(params.name)
    if tool is None:
        return error(f"no tool {params.name!r}; valid: {', '.join(TOOLS)}")
    try:
        request = tool.request.model_validate(params.arguments or {})
        answer = await anyio.to_thread.run_sync(tool.answer, request)
    except (ShardwiseError, ValidationError, ValueError) as exc:
        return error(complaint(exc))
    answer = json.loads(json.dumps(_json_safe(answer), default=str))
    return types.CallToolResult(content=[types.TextContent(type="text",
                                                           text=json.dumps(answer))],
                                structured_content=answer)


def server() -> Server[Any]:
    """The MCP server with shardwise's tools."""
    return Server("shardwise", version=__version__, on_list_tools=list_tools,
                  on_call_tool=call_tool,
                  instructions="Plan distributed training of Transformer LMs: call `plan` with "
                               "a model preset (see `models`) or a Hugging Face config, the "
                               "GPU count and type; each step time carries its band.")


def serve_stdio() -> None:
    """Serve the tools on stdin/stdout until the client closes them."""
    async def run() -> None:
        app = server()
        async with stdio_server() as (read, write):
            await app.run(read, write, app.create_initialization_options())

    anyio.run(run)


if __name__ == "__main__":
    serve_stdio()
