"""`/api/models`, `/api/hardware`, `/api/memory`, `/api/comm`, `/api/schedule` (and its SVG),
`/api/plan`.

Each endpoint validates its request with a pydantic model (422 on a wrong type or a value
outside the caps below), then calls the builder `shardwise <command> --json` calls
(`shardwise.report.builders`), so a response equals the CLI's JSON for the same input. Bad
input the builders reject (an unknown GPU, a layout that cannot run) is a 400 with the CLI's
one-line message. A model is a preset name or an uploaded Hugging Face `config.json` (the
parsed object in `hf_config`; never a path on the server).

Caps keep one request from hogging the server: GPUs, sequence length, pipeline grid size, top-k,
request size (1 MB); `/api/plan` runs in a worker thread, at most `PLAN_WORKERS` at once, and
answers 503 when they are busy and 408 when a search outlasts `PLAN_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import threading
import typing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from shardwise.arch import DEFAULT_MODEL, PRESETS, ModelSpec, from_hf_dict, get_model
from shardwise.budget import web_request_budget
from shardwise.emit import framework_stack
from shardwise.errors import ShardwiseError
from shardwise.hardware import ACCELERATOR_ALIASES, ACCELERATORS, LINKS
from shardwise.layout import CP_KINDS, RECOMPUTE, SCHEDULES
from shardwise.report import builders
from shardwise.stacks import ATTENTION_KERNELS, DEFAULT_STACK, STACKS, TP_OVERLAPS
from shardwise.validate import layout_items
from shardwise.web import export

router = APIRouter(tags=["tools"])

MAX_GPUS = 131_072
MAX_SEQ = 1_048_576
MAX_TOP = 50
MAX_SCHEDULE_ACTIONS = 20_000  # p·m·v·(2 or 3) actions simulated and drawn
MAX_UPLOAD_BYTES = 1_000_000
PLAN_TIMEOUT_S = 30.0
PLAN_WORKERS = 2
_plan_slots = threading.BoundedSemaphore(PLAN_WORKERS)
# bytes one search may hold: PLAN_WORKERS of them stay under `budget.WEB_BUDGET` (1.5 GB)
PLAN_REQUEST_BYTES = web_request_budget(PLAN_WORKERS)

ModelName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


class _Out(BaseModel):
    """Responses pass every key of the builder's payload through, declared or not."""

    model_config = ConfigDict(extra="allow")


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits a bool (bool, bool | None, Any)."""
    if annotation is bool or annotation is Any:
        return True
    return any(_takes_bool(a) for a in typing.get_args(annotation))


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        """JSON true/false is refused where a number is wanted (pydantic's lax mode reads
        `{"tp": true}` as tp=1); a form's text "8" still reads as 8."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and not _takes_bool(
                        field.annotation):
                    raise ValueError(f"{name} must be a number or text, not {str(value).lower()}")
        return data


# ------------------------------------------------------------------------------------ models
class ModelRow(_Out):
    """One model: its shape and parameter counts (`/api/models`)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int
    top_k: int
    total_params: int = Field(description="All parameters.")
    active_params: int = Field(description="Parameters one token passes through (MoE).")


class ConfigUpload(_In):
    """A Hugging Face config.json uploaded as JSON, with a name for it."""

    name: str = Field("uploaded", max_length=80, pattern=r"^[\w.+-]+$",
                      description="Name shown for the model.")
    config: dict[str, Any] = Field(description="The parsed Hugging Face config.json.")


class ModelChoice(_In):
    """A preset name, or an uploaded config (which wins)."""

    model: ModelName = Field(  # type: ignore[valid-type]
        DEFAULT_MODEL, description="A preset (see GET /api/models).")
    hf_config: ConfigUpload | None = Field(
        None, description="An uploaded config.json; replaces `model` when given.")

    def spec(self) -> ModelSpec:
        if self.hf_config is not None:
            return from_hf_dict(self.hf_config.config, self.hf_config.name)
        return get_model(self.model)


@router.get("/models", response_model=list[ModelRow])
def models() -> Any:
    """The presets with their parameter counts (`shardwise models --json`)."""
    return builders.models_payload()


@router.post("/models", response_model=ModelRow)
def upload_model(upload: ConfigUpload) -> Any:
    """Read an uploaded Hugging Face config.json (≤ 1 MB) in memory, as the CLI reads one on
    disk: its shape and parameter counts, or 400 with what is wrong."""
    return builders.model_row(from_hf_dict(upload.config, upload.name))


class Hardware(_Out):
    """The accelerator and link presets (`/api/hardware`)."""

    accelerators: dict[str, float] = Field(description="Name → HBM bytes.")
    aliases: dict[str, str]
    links: dict[str, float] = Field(description="Name → bytes/s per direction per GPU.")
    stacks: dict[str, str] = Field(description="Training stack (`--impl`) → its title and "
                                               "version (`shardwise.stacks`).")


@router.get("/hardware", response_model=Hardware)
def hardware() -> Any:
    """The accelerator and link presets (the names --gpu, --intra, --inter, --link take)."""
    return {"accelerators": {a.name: a.memory_bytes for a in ACCELERATORS.values()},
            "aliases": ACCELERATOR_ALIASES,
            "links": {link.name: link.bandwidth for link in LINKS.values()},
            "stacks": {s.name: f"{s.title} ({s.version})" for s in STACKS.values()}}


# ------------------------------------------------------------------------------------ memory
FUSED_KERNELS = tuple(k for k in ATTENTION_KERNELS if k != "math")
STACK_CHOICES = ("compile", "tp_overlap", "dp_overlap", "attention")
"""The stack's time choices besides `impl` (`TrainSpec`; `shardwise plan --compile …`)."""
TRAIN_KW = (*STACK_CHOICES, "recompute_share")
"""What `TrainFields.stack_kw` hands to `TrainSpec` (the CLI's `pop_stack_kw`)."""


class LayoutFields(_In):
    """A layout's fields, as `Layout` takes them."""

    tp: int = Field(1, ge=1, le=MAX_GPUS, description="Tensor-parallel degree.")
    pp: int = Field(1, ge=1, le=MAX_GPUS, description="Pipeline stages.")
    dp: int | None = Field(None, ge=1, le=MAX_GPUS,
                           description="Data-parallel degree [default: gpus / (tp·pp·cp)].")
    cp: int = Field(1, ge=1, le=MAX_GPUS, description="Context-parallel degree.")
    ep: int = Field(1, ge=1, le=MAX_GPUS, description="Expert-parallel degree.")
    etp: int = Field(0, ge=0, le=MAX_GPUS,
                     description="Expert tensor-parallel degree (0: tp, Megatron's default).")
    cp_kind: Literal[CP_KINDS] = "ring"  # type: ignore[valid-type]
    ulysses: int = Field(0, ge=0, le=MAX_GPUS, description="Hybrid cp: ranks of each "
                                                           "all-to-all group.")
    zero: int = Field(0, ge=0, le=3, description="ZeRO stage.")
    zero_group: int = Field(0, ge=0, le=MAX_GPUS, description="Hybrid shard group (0: all dp).")
    sp: bool = Field(False, description="Sequence parallelism (with tp > 1).")
    schedule: Literal[SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    chunks: int = Field(1, ge=1, le=256, description="Virtual chunks per stage.")
    recompute: Literal[RECOMPUTE] = "none"  # type: ignore[valid-type]
    micro_batch: int = Field(1, ge=1, le=4096, description="Micro-batch size (sequences).")
    partition: list[int] = Field(default_factory=list, max_length=1024,
                                 description="Layers per pipeline stage, first to last "
                                             "([]: even, or balanced when pp ∤ layers).")


class TrainFields(_In):
    """The cluster and what is trained, as `TrainSpec` and `Cluster.of` take them."""

    gpus: int = Field(8, ge=1, le=MAX_GPUS)
    gpu: str = Field("h100", max_length=40, description="Accelerator preset.")
    gpus_per_node: int = Field(8, ge=1, le=1024)
    seq: int = Field(8192, ge=1, le=MAX_SEQ, description="Sequence length.")
    flash: bool = Field(True, description="FlashAttention.")
    dtype: str = Field("bf16", max_length=20)
    grad_dtype: str | None = Field(None, max_length=20)
    optimizer: str = Field("adam", max_length=40)
    headroom: float = Field(0.85, gt=0, le=1, description="Usable fraction of GPU memory.")
    impl: str = Field(DEFAULT_STACK, max_length=40,
                      description="Training stack, name or name@version (`--impl`): "
                                  + ", ".join(STACKS) + ".")
    compile: bool | None = Field(None, description="torch.compile [default: the stack's].")
    tp_overlap: Literal[TP_OVERLAPS] | None = Field(  # type: ignore[valid-type]
        None, description="TP communication overlap [default: the stack's].")
    dp_overlap: bool | None = Field(None, description="DP/ZeRO overlap [default: the stack's].")
    attention: Literal[FUSED_KERNELS] | None = Field(  # type: ignore[valid-type]
        None, description="Fused attention kernel [default: the stack's].")
    recompute_share: float = Field(1.0, gt=0, le=1, description="With recompute full: the "
                                   "share of the layers recomputed (`--recompute-share`).")

    @field_validator(*STACK_CHOICES, mode="before")
    @classmethod
    def _unset(cls, value: Any) -> Any:
        """A form's empty choice is the stack's default."""
        return None if value == "" else value

    def stack_kw(self) -> dict[str, Any]:
        """The stack's choices and the recompute share as `TrainSpec` takes them (the CLI's
        `pop_stack_kw`)."""
        return {k: getattr(self, k) for k in TRAIN_KW}


class MemoryRequest(ModelChoice, TrainFields, LayoutFields):
    """`/api/memory`'s input: model, cluster, layout, training options (`shardwise memory`'s
    options)."""

    global_batch: str | None = Field(None, max_length=40,
                                     description="Sequences (1024) or tokens (16M-tokens).")
    formula: Literal["generalised", "korthikanti"] = "generalised"


class StageMemory(_Out):
    """Bytes per GPU of one pipeline stage, by part."""

    stage: int
    layers: int
    in_flight: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    workspace: float
    total: float


class MemoryResponse(_Out):
    """`/api/memory`'s answer: `shardwise memory --json`."""

    model: str
    layout: dict[str, Any]
    layout_short: str
    train: dict[str, Any]
    accelerator: str
    gpus: int
    formula: str
    headroom: float
    memory_bytes: float
    budget_bytes: float = Field(description="memory_bytes × headroom.")
    fits: bool
    largest_stage: int
    stages: list[StageMemory] = Field(description="Bytes per GPU of each pipeline stage.")


@router.post("/memory", response_model=MemoryResponse)
def memory(request: MemoryRequest) -> Any:
    """Per-GPU memory stage by stage (`shardwise memory --json`); bytes."""
    fields = request.model_dump(exclude={"model", "hf_config", *TRAIN_KW})
    return builders.memory_payload(request.spec(), stack_kw=request.stack_kw(), **fields)


# -------------------------------------------------------------------------------------- comm
class CommRequest(_In):
    """`/api/comm`'s input (`shardwise comm`'s options)."""

    op: Literal["all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                "broadcast"] = "all-reduce"
    size: str = Field("1GB", max_length=40, description="Tensor size, e.g. 13.5GB.")
    ranks: int = Field(8, ge=1, le=MAX_GPUS)
    link: str = Field("nvlink4", max_length=40)
    algorithm: Literal["ring", "tree", "hierarchical"] = "ring"
    nodes: int = Field(1, ge=1, le=MAX_GPUS, description="Nodes (hierarchical).")
    inter: str = Field("ndr", max_length=40, description="Inter-node link (hierarchical).")


class CommResponse(_Out):
    """`/api/comm`'s answer: `shardwise comm --json`."""

    op: str
    size_bytes: float
    ranks: int
    link: str
    algorithm: str
    rounds: int
    bytes_sent_per_rank: float
    seconds: float
    bus_bandwidth: float | None = Field(description="Bytes/s (NCCL's bus bandwidth).")


@router.post("/comm", response_model=CommResponse)
def comm(request: CommRequest) -> Any:
    """Bytes on the wire and α-β time of one collective (`shardwise comm --json`)."""
    return builders.comm_payload(**request.model_dump())


# ---------------------------------------------------------------------------------- schedule
class ScheduleRequest(_In):
    """`/api/schedule`'s input (`shardwise schedule`'s options)."""

    stages: int = Field(4, ge=1, le=128, description="Pipeline stages p.")
    microbatches: int = Field(8, ge=1, le=1024, description="Micro-batches m.")
    schedule: Literal[SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    chunks: int | None = Field(None, ge=1, le=64,
                               description="Chunks per stage v [default: the schedule's: 2 for "
                                           "interleaved, zbv and dualpipev, else 1].")
    t_f: float = Field(1.0, gt=0, le=1e6, description="Forward time of one micro-batch on one "
                                                      "stage (all its chunks).")
    t_b: float = Field(1.0, gt=0, le=1e6, description="Whole backward time of one micro-batch "
                                                      "on one stage (input and weight grads).")
    t_w: float | None = Field(None, gt=0, le=1e6,
                              description="The weight-gradient part of t_b, for schedules that "
                                          "split the backward [default: t_b/2].")
    p2p_latency: float = Field(0.0, ge=0, le=1e6, description="Latency between stages.")

    @model_validator(mode="after")
    def _grid_cap(self) -> ScheduleRequest:
        actions = 3 * self.stages * self.microbatches * (self.chunks or 2)
        if actions > MAX_SCHEDULE_ACTIONS:
            raise ValueError(f"p·m·v = {actions // 3:,} is too large to draw here; "
                             f"keep it ≤ {MAX_SCHEDULE_ACTIONS // 3:,}")
        return self


class ScheduleEvent(_Out):
    """One action of the simulated timeline: stage, kind, micro-batch, chunk, start and end."""

    stage: int
    kind: Literal["F", "B", "W"]
    microbatch: int
    chunk: int
    start: float
    end: float
    pair: bool = Field(description="One of an overlapped F&B pair (DualPipeV).")


class ScheduleResponse(_Out):
    """`/api/schedule`'s answer: `shardwise schedule --json`."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    placement: Literal["loop", "v"]
    t_f: float
    t_b: float
    t_w: float | None = Field(description="The weight-gradient part of t_b used; none when the "
                                          "schedule does not split the backward.")
    p2p_latency: float
    actions: int
    makespan: float
    bubble_fraction: float
    bubble_closed_form: float | None = Field(description="The registry's closed-form bubble "
                                                         "over bubble plus work (no p2p "
                                                         "latency); none where there is none.")
    peak_in_flight: list[float] = Field(description="Peak micro-batches in flight per stage "
                                                    "(a chunk counts 1/v).")
    text: str
    timeline: list[ScheduleEvent]


@router.post("/schedule", response_model=ScheduleResponse)
def schedule(request: ScheduleRequest) -> Any:
    """Generate, validate and simulate a pipeline schedule (`shardwise schedule --json`)."""
    timeline = builders.simulate_schedule(**request.model_dump())
    return builders.schedule_payload(timeline, **request.model_dump())


@router.get("/schedule.svg", response_class=Response,
            responses={200: {"content": {"image/svg+xml": {}}}})
def schedule_svg(request: Annotated[ScheduleRequest, Query()]) -> Response:
    """The schedule's Gantt chart as SVG, the file `shardwise schedule --svg` writes."""
    timeline = builders.simulate_schedule(**request.model_dump())
    svg = builders.schedule_svg(timeline, builders.schedule_payload(timeline,
                                                                    **request.model_dump()))
    return Response(svg, media_type="image/svg+xml",
                    headers={"Content-Disposition": f'inline; filename="{request.schedule}.svg"'})


# ---------------------------------------------------------------------------------------- plan
class PlanRequest(ModelChoice, TrainFields):
    """`/api/plan`'s input (`shardwise plan`'s options)."""

    gpus: int = Field(64, ge=1, le=MAX_GPUS)
    intra: str | None = Field(None, max_length=40, description="Intra-node link preset.")
    inter: str | None = Field(None, max_length=40, description="Inter-node link preset.")
    global_batch: str = Field("4M-tokens", max_length=40,
                              description="Sequences (1024) or tokens (16M-tokens).")
    tokens: str | None = Field(None, max_length=40, description="Training budget (15T).")
    price: float | None = Field(None, ge=0, le=1e6, description="Price per GPU-hour.")
    top: int = Field(10, ge=1, le=MAX_TOP, description="Layouts to show.")
    layout: str | None = Field(None, max_length=300,
                               description="Evaluate this layout too, e.g. tp=8,pp=2,zero=1.")
    fix: str | None = Field(None, max_length=300,
                            description="Search only layouts with these fields, e.g. "
                                        "tp=8,pp=4 (`shardwise plan --fix`).")
    max: str | None = Field(None, max_length=300,
                            description="Search only layouts with at most these counts, e.g. "
                                        "tp=8,pp=8 (`shardwise plan --max`).")
    all_variants: bool = Field(False, description="One row per layout, not per family of "
                                                  "second-order variants.")
    rank_by: Literal["step", "goodput"] = Field(
        "step", description="Rank by step time or by step ÷ goodput (`--rank-by`).")
    choose: Literal["simplest", "fastest"] = Field(
        "simplest", description="Recommend the simplest layout of the first tier or the "
                                "fastest (`--choose`).")
    mtbf_gpu_hours: float | None = Field(
        None, gt=0, le=1e12, description="GPU-hours between job-interrupting failures per GPU "
                                         "[default: Llama 3's fleet figure].")
    checkpoint_bandwidth: str | None = Field(
        None, max_length=40, description="Each node's write bandwidth to storage, e.g. 2GB/s.")
    restart_minutes: float | None = Field(
        None, ge=0, le=1e6, description="Failure to training again: detect, reschedule, "
                                        "reload.")
    async_checkpoint: bool = Field(False, description="Only the device→host copy stalls "
                                                      "training.")
    link: str | None = Field(None, max_length=4000,
                             description="The page's share link, written into each download's "
                                         "header; no effect on the plan.")
    image: str | None = Field(None, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$",
                              description="Container image of the k8s launcher's job "
                                          "(`--image`); no effect on the plan.")


class PlanEntryOut(_Out):
    """One ranked layout of a plan."""

    rank: int | None
    variants: int = Field(0, description="Other fitting layouts this row folds (they differ "
                                         "only in ZeRO group size or stage partition).")
    layout: dict[str, Any]
    short: str
    estimate: dict[str, Any] = Field(description="Seconds per step component and rates.")
    memory: dict[str, Any] = Field(description="Bytes of the largest stage, by part.")
    budget_bytes: float
    fits: bool
    goodput: dict[str, Any] | None = Field(
        None, description="What failures, checkpoints and restarts leave (estimate.goodput).")
    tier: int | None = Field(None, description="1: the rows the model cannot tell from the "
                                               "fastest (`tiers`); None off the ranking.")


class PlanResponse(_Out):
    """`/api/plan`'s answer: `shardwise plan --json`."""

    model: str
    cluster: dict[str, Any]
    train: dict[str, Any]
    stack: dict[str, Any] = Field(description="The training stack and its resolved settings "
                                              "(`assumed`: the stack's defaults).")
    headroom: float
    budget_bytes: float
    ranked: list[PlanEntryOut]
    baseline: PlanEntryOut | None
    baseline_note: str
    given: PlanEntryOut | None
    given_note: str
    rejected: list[dict[str, Any]]
    alternatives: list[dict[str, Any]]
    tiers: dict[str, Any] = Field(description="The tiers' resolution (relative), rule and "
                                               "the rows in the first tier (`count`).")
    choose: Literal["simplest", "fastest"]
    recommended: PlanEntryOut = Field(description="The row the figures, the explanation and "
                                                  "the exports use.")
    constraint: str = Field(description="The --fix / --max the search kept to ('' if none).")
    stats: dict[str, Any]
    calibration: dict[str, Any]
    explanation: str
    training: dict[str, float] | None
    goodput: dict[str, Any] | None = Field(
        description="The winner's goodput; with a token budget its expected interruptions, "
                    "days, GPU-hours and cost.")
    rank_by: str
    reliability: dict[str, Any] = Field(description="The goodput inputs the plan used.")
    emits: dict[str, dict[str, Any]] = Field(
        description="Megatron-LM / torchtitan / DeepSpeed configuration of the chosen layout; "
                    "the stack's own framework first (the others say which --impl they need).")


def plan_sync(request: PlanRequest) -> dict[str, Any]:
    """The search and its payload, as `shardwise plan --json` computes them."""
    options = request.model_dump(exclude={"model", "hf_config", "layout", "fix", "max",
                                          "link", "image", *TRAIN_KW})
    options["stack_kw"] = request.stack_kw()
    result = builders.run_plan(request.spec(), layout_text=request.layout, fix_text=request.fix,
                               max_text=request.max, memory_budget=PLAN_REQUEST_BYTES,
                               **options)
    payload = builders.plan_payload(result, tokens=request.tokens, price=request.price,
                                    image=request.image)
    return with_downloads(payload, request)


class FieldError(ShardwiseError):
    """Bad input of one form field: the 400 names it (`field`) besides the one-line message."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def plan_checked(request: PlanRequest) -> dict[str, Any]:
    """`plan_sync`, with an error that only the compared layout causes (the search without it
    runs) named as the `layout` field's."""
    for name in ("layout", "fix", "max"):  # `tp=8,,pp=2`: 400 naming the field, as the CLI
        try:
            layout_items(getattr(request, name), name)
        except ShardwiseError as exc:
            raise FieldError(str(exc), name) from None
    try:
        return plan_sync(request)
    except ShardwiseError as exc:
        if not request.layout:
            raise
        try:
            plan_sync(request.model_copy(update={"layout": None}))
        except ShardwiseError:
            raise exc from None
        raise FieldError(str(exc), "layout") from None


def with_downloads(payload: dict[str, Any], request: PlanRequest) -> dict[str, Any]:
    """Each export of `payload` with its file to download (`web.export.download`) and each
    launcher's job (`jobs`: launcher → file, `web.export.download_job`), or, for a framework
    another stack exports, that stack's name (`replan`: the planner's "re-plan for this
    stack")."""
    fields = request.model_dump(exclude={"link"})
    for framework, emitted in payload["emits"].items():
        if emitted.get("error"):
            stack = framework_stack(framework)
            if stack.name != request.impl.split("@")[0]:
                emitted["replan"] = {"impl": stack.name, "title": stack.title}
        else:
            command = export.plan_command(fields, framework)
            emitted["download"] = export.download(framework, emitted["config"], command,
                                                  request.link)
            emitted["jobs"] = {
                launcher: export.download_job(framework, launcher, job, command, request.link,
                                              request.image)
                for launcher, job in emitted["launchers"].items() if isinstance(job, str)}
    return payload


@router.post("/plan", response_model=PlanResponse,
             responses={408: {"description": "The search outlasted the time limit."},
                        503: {"description": "Every planner worker is busy."}})
async def plan(request: PlanRequest) -> Any:
    """Search every layout and explain the best (`shardwise plan --json`)."""
    if not _plan_slots.acquire(blocking=False):
        raise HTTPException(503, f"the planner is busy with {PLAN_WORKERS} searches; "
                                 "try again in a moment")

    def work() -> dict[str, Any]:
        try:
            return plan_checked(request)
        finally:
            _plan_slots.release()

    try:
        return await asyncio.wait_for(run_in_threadpool(work), PLAN_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise HTTPException(408, f"the search took longer than {PLAN_TIMEOUT_S:.0f} s; "
                                 "try fewer GPUs or fix some axes with a layout") from None


class LimitBody:
    """ASGI middleware: a request body over `max_bytes` (by its Content-Length) gets 413 with
    a one-line message before anything reads it; a body without a length gets 411."""

    def __init__(self, app: Any, max_bytes: int = MAX_UPLOAD_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            status, message = 0, ""
            if length is None and headers.get(b"transfer-encoding"):
                status, message = 411, "send the request body with a Content-Length"
            elif length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                status, message = 413, (f"the request body is over the {self.max_bytes:,}-byte "
                                        "limit (a config.json is a few kB)")
            if status:
                from starlette.responses import JSONResponse

                await JSONResponse({"detail": message}, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
