"""`/api/learn/*`: the explainers' data, computed by the emulations and the analytic models.

One endpoint per widget of the Learn section. Each calls the project's own functions — the
ZeRO state model (`estimate.memory`), the emulated ring all-reduce, tensor-parallel MLP and
ring attention (`emulate/`), the schedule generators and simulator (`schedules/`), the context
search (`estimate.context`) — and returns their numbers; the pages only scale and draw them.

Sizes are capped by the query validation (HTTP 422 with the field and the limit); a
`ShardwiseError` from the models becomes HTTP 400 with its one line (see `app.py`). The
emulations need torch: without it those endpoints answer 503 with one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel

from shardwise.arch import PRESETS
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import (
    training_memory_bytes,
    zero_memory_per_device,
    zero_stage_table,
    zero_state_bytes,
)
from shardwise.schedules.registry import SCHEDULES

router = APIRouter(tags=["learn"])

GB = 1e9  # budgets come in decimal GB (10^9 bytes); every response figure is in bytes
POWERS_OF_TWO_TO_1024 = [2**k for k in range(11)]


@contextmanager
def _torch() -> Iterator[None]:
    """Run an emulation; without torch answer 503 with one line instead of a traceback."""
    try:
        import torch
    except ImportError:
        raise HTTPException(503, "this explainer runs an emulation that needs torch: "
                                 "pip install 'shardwise[torch]'") from None
    # The tensors are tiny: intra-op threads only contend with each other (and the server).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ 1 + 3: memory, ZeRO
class StateParts(BaseModel):
    """Bytes per device of each persistent state class (SPEC §2, 16 B/param mixed-precision Adam)."""

    weights: float
    grads: float
    optimizer: float
    total: float
    partitioned: dict[str, bool]  # is this class divided over the N devices at this stage?


class StageRow(BaseModel):
    """One ZeRO stage: what it shards, bytes per device, bytes sent per step."""

    stage: int
    sharded: str
    bytes_per_device: float
    comm_bytes_per_step: float


class CurvePoint(BaseModel):
    """Bytes per device of stages 0–3 at one device count."""

    devices: int
    bytes_per_device: list[float]  # stages 0..3


class MemoryBudget(BaseModel):
    """The memory-budget and ZeRO explainers' data (SPEC §2)."""

    params: float
    devices: int
    stage: int
    unit: str
    per_device: StateParts
    baseline: StateParts  # one full replica: 16Ψ, what stage 0 keeps on every device
    stages: list[StageRow]  # SPEC §2's table for this Ψ and N
    curve: list[CurvePoint]  # per-device bytes against N = 1, 2, 4, …, 1024
    budget_bytes: float
    fewest_devices_that_fit: int | None  # smallest N ≤ 1024 at this stage within the budget


def _parts(weights: float, grads: float, optimizer: float,
           full: dict[str, float]) -> StateParts:
    values = {"weights": weights, "grads": grads, "optimizer": optimizer}
    return StateParts(**values, total=weights + grads + optimizer,
                      partitioned={k: v < full[k] for k, v in values.items()})


@router.get("/memory-budget", response_model=MemoryBudget)
def memory_budget(
    params: float = Query(7.5e9, ge=1e8, le=1e12, description="parameters Ψ (100M to 1T)"),
    devices: int = Query(64, ge=1, le=1024, description="data-parallel devices N"),
    stage: int = Query(0, ge=0, le=3, description="ZeRO stage"),
    budget_gb: float = Query(80, gt=0, le=1000, description="device memory, GB (10^9 bytes)"),
) -> MemoryBudget:
    """Per-device training state for Ψ parameters on N devices at a ZeRO stage (SPEC §2)."""
    full = training_memory_bytes(params)
    budget = budget_gb * GB
    fewest = next((n for n in range(1, 1025)
                   if zero_memory_per_device(params, n, stage) <= budget), None)
    return MemoryBudget(
        params=params, devices=devices, stage=stage, unit="bytes",
        per_device=_parts(*zero_state_bytes(params, devices, stage), full),
        baseline=_parts(full["weights"], full["grads"], full["optimizer"], full),
        stages=[StageRow(**vars(row)) for row in zero_stage_table(params, devices)],
        curve=[CurvePoint(devices=n, bytes_per_device=[
            zero_memory_per_device(params, n, s) for s in range(4)])
            for n in POWERS_OF_TWO_TO_1024],
        budget_bytes=budget, fewest_devices_that_fit=fewest,
    )


# ----------------------------------------------------------------------- 2: ring all-reduce
class RingSnapshot(BaseModel):
    """Every device's buffer after one step of the emulated ring all-reduce."""

    step: int  # 1 .. 2(N-1)
    phase: str
    sends: list[tuple[int, int]]  # (sender, chunk); each goes to sender + 1 mod N
    rows: list[list[float]]  # every device's buffer after the step, one value per chunk
    complete: list[list[bool]]  # the cell already holds its column's sum
    bytes_sent: list[int]  # per device, so far


class RingRun(BaseModel):
    """The emulated ring all-reduce, step by step."""

    devices: int
    element_bytes: int
    message_bytes: int  # M: one device's buffer
    expected_bytes_per_device: float  # 2(N-1)/N · M, SPEC §5
    initial: list[list[float]]
    column_sums: list[float]
    steps: list[RingSnapshot]


@router.get("/ring", response_model=RingRun)
def ring(devices: int = Query(4, ge=2, le=8, description="devices in the ring")) -> RingRun:
    """The emulated ring all-reduce, one snapshot per step (reduce-scatter, then all-gather).

    Device i starts with `[1, 2, …, N] · 10^i` (float64, exact), so every partial sum shows in
    its digits which devices have been added in."""
    with _torch():
        import torch

        from shardwise.emulate.collectives import ring_all_reduce_bytes, ring_all_reduce_steps

        rows = [torch.arange(1, devices + 1, dtype=torch.float64) * 10**i
                for i in range(devices)]
        sums = torch.stack(rows).sum(0)
        snapshots = ring_all_reduce_steps(rows)
        message = rows[0].numel() * rows[0].element_size()
        return RingRun(
            devices=devices, element_bytes=rows[0].element_size(), message_bytes=message,
            expected_bytes_per_device=ring_all_reduce_bytes(message, devices),
            initial=[r.tolist() for r in rows], column_sums=sums.tolist(),
            steps=[RingSnapshot(step=k + 1, phase=s.phase, sends=list(s.sends),
                                rows=[b.tolist() for b in s.buffers],
                                complete=[(b == sums).tolist() for b in s.buffers],
                                bytes_sent=list(s.sent))
                   for k, s in enumerate(snapshots)],
        )


# ------------------------------------------------------------------- 4: tensor-parallel MLP
class Tensor2D(BaseModel):
    """A named matrix, for display."""

    name: str
    shape: list[int]
    values: list[list[float]]


class TPStage(BaseModel):
    """One stage of the tensor-parallel MLP: its tensors and the collective, if any."""

    key: str
    title: str
    communication: str | None  # the collective at this stage, None for local work
    replicated: bool  # one tensor every device holds alike, or one per device
    tensors: list[Tensor2D]  # one (replicated) or one per device


class TPForward(BaseModel):
    """The tensor-parallel MLP's forward, stage by stage, against one device's."""

    devices: int
    tokens: int
    hidden: int
    ffn: int
    dtype: str
    weights: list[Tensor2D]  # A_i (column blocks) and B_i (row blocks) per device
    stages: list[TPStage]
    single_device: Tensor2D  # GELU(X·A)·B on one device
    max_abs_diff: float  # |Z (tensor parallel) − Z (one device)|, max over elements
    operators: dict[str, dict[str, str]]  # Megatron's f and g: forward / backward roles


def _t(name: str, x: object) -> Tensor2D:
    values = x.tolist()  # type: ignore[attr-defined]
    return Tensor2D(name=name, shape=[len(values), len(values[0])], values=values)


@router.get("/tp-mlp", response_model=TPForward)
def tp_mlp(devices: int = Query(2, ge=1, le=4, description="tensor-parallel devices"),
           seed: int = Query(0, ge=0, le=10**6, description="random inputs")) -> TPForward:
    """One forward pass of the Megatron MLP `GELU(X·A)·B` split over `devices`, stage by stage,
    from `emulate.tensor_parallel` (A column-, B row-sharded; f before, g after)."""
    with _torch():
        import torch
        import torch.nn.functional as F

        from shardwise.emulate.tensor_parallel import (
            column_shards,
            f_copy,
            g_sum,
            megatron_mlp,
            mlp,
            row_shards,
        )

        tokens, hidden, ffn = 3, 4, 8
        gen = torch.Generator().manual_seed(seed)
        X = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).round(decimals=2)
        A = torch.randn(hidden, ffn, generator=gen, dtype=torch.float64).round(decimals=2)
        B = torch.randn(ffn, hidden, generator=gen, dtype=torch.float64).round(decimals=2)
        A_i, B_i = column_shards(A, devices), row_shards(B, devices)
        xs = f_copy(X, devices)
        XA = [x @ a for x, a in zip(xs, A_i)]  # (tokens, ffn/N) per device
        Y = [F.gelu(t) for t in XA]
        partials = [y @ b for y, b in zip(Y, B_i)]  # (tokens, hidden) partial sums
        Z = g_sum(partials)
        Z_emulated = megatron_mlp(X, A_i, B_i)
        Z_single = mlp(X, A, B)
        if not torch.equal(Z, Z_emulated):
            raise ShardwiseError("the stage-by-stage pass disagrees with megatron_mlp")

        def per_device(name: str, ts: list[torch.Tensor]) -> list[Tensor2D]:
            return [_t(f"{name}{i + 1}", t) for i, t in enumerate(ts)]

        stages = [
            TPStage(key="x", title="X enters every device (f: identity forward)",
                    communication=None, replicated=True, tensors=[_t("X", X)]),
            TPStage(key="xa", title="column-parallel GEMM X·A_i", communication=None,
                    replicated=False, tensors=per_device("XA", XA)),
            TPStage(key="gelu", title="GeLU on each shard", communication=None,
                    replicated=False, tensors=per_device("Y", Y)),
            TPStage(key="yb", title="row-parallel GEMM Y_i·B_i (partial sums)",
                    communication=None, replicated=False, tensors=per_device("P", partials)),
            TPStage(key="g", title="all-reduce g: Z = Σ_i Y_i·B_i", communication="all-reduce",
                    replicated=True, tensors=[_t("Z", Z)]),
        ]
        return TPForward(
            devices=devices, tokens=tokens, hidden=hidden, ffn=ffn, dtype="float64",
            weights=per_device("A", A_i) + per_device("B", B_i), stages=stages,
            single_device=_t("Z (one device)", Z_single),
            max_abs_diff=float((Z_emulated - Z_single).abs().max()),
            operators={
                "f": {"where": "block input, where the replicated X enters",
                      "forward": "identity", "backward": "all-reduce of ∂L/∂X"},
                "g": {"where": "block output, after the row-parallel GEMM",
                      "forward": "all-reduce of the partial sums", "backward": "identity"},
            },
        )


# --------------------------------------------------------------------- 5: bubble vs M
class BubblePoint(BaseModel):
    """The bubble fraction at `m` micro-batches."""

    m: int
    bubble: float


class BubbleCurve(BaseModel):
    """The bubble against micro-batches for `p` stages (SPEC §6)."""

    p: int
    m: int
    v: int
    bubble: float  # (P-1)/(M+P-1) at the current M
    bubble_interleaved: float  # (P-1)/(v·M+P-1)
    m_4p: int
    bubble_at_4p: float
    curve: list[BubblePoint]  # v = 1, M = 1 .. max_m
    curve_interleaved: list[BubblePoint]  # v chunks per stage
    simulated: list[BubblePoint]  # 1F1B run through the simulator at sampled M
    simulated_t_b: float  # the backward time of those runs (t_f = 1)
    max_m: int


def _sample_m(max_m: int) -> list[int]:
    """About 16 micro-batch counts, log-spaced from 1 to max_m."""
    out, m = [], 1.0
    while m < max_m:
        out.append(round(m))
        m *= max_m ** (1 / 15)
    return sorted(set(out) | {max_m})


@router.get("/bubble", response_model=BubbleCurve)
def bubble(p: int = Query(4, ge=2, le=32, description="pipeline stages P"),
           m: int = Query(8, ge=1, le=256, description="micro-batches M"),
           v: int = Query(2, ge=1, le=8, description="chunks per stage (interleaved)"),
           t_b: float = Query(1.0, ge=1, le=3, description="backward time, forward = 1")
           ) -> BubbleCurve:
    """SPEC §6's closed form against M, and 1F1B simulated at sampled M as a cross-check."""
    from shardwise.schedules import bubble_fraction, make_schedule, simulate

    max_m = 256
    sims = [BubblePoint(m=k, bubble=simulate(make_schedule("1f1b", p, k), 1.0, t_b)
                        .bubble_fraction) for k in _sample_m(max_m) if p * k <= 2048]
    return BubbleCurve(
        p=p, m=m, v=v, bubble=bubble_fraction(p, m), bubble_interleaved=bubble_fraction(p, m, v),
        m_4p=4 * p, bubble_at_4p=bubble_fraction(p, 4 * p),
        curve=[BubblePoint(m=k, bubble=bubble_fraction(p, k)) for k in range(1, max_m + 1)],
        curve_interleaved=[BubblePoint(m=k, bubble=bubble_fraction(p, k, v))
                           for k in range(1, max_m + 1)],
        simulated=sims, simulated_t_b=t_b, max_m=max_m,
    )


# --------------------------------------------------------------------- 6: pipeline grid
class GridEvent(BaseModel):
    """One simulated action of the pipeline grid."""

    stage: int
    kind: str  # F, B or W
    micro_batch: int
    chunk: int
    start: float
    end: float
    pair: bool  # one of an overlapped F&B pair (DualPipeV)


class PipelineGrid(BaseModel):
    """A simulated schedule for the pipeline-grid explainer."""

    schedule: str
    p: int
    m: int
    v: int
    placement: str  # "loop" or "v" (ZBV, DualPipeV: chunk 1 runs back up the stages)
    t_f: float  # per stage and micro-batch, all chunks: a chunk's box is 1/v of it
    t_b: float  # the whole backward
    t_w: float | None  # its weight-gradient part, for schedules that split it
    events: list[GridEvent]
    makespan: float
    bubble_fraction: float  # simulated: 1 − busy / (P · makespan)
    closed_form_bubble: float | None  # the schedule's closed form (registry), as a fraction
    peak_in_flight: list[float]  # micro-batches (a chunk counts 1/v)


@router.get("/pipeline", response_model=PipelineGrid)
def pipeline(schedule: Literal[SCHEDULES] = "1f1b",  # type: ignore[valid-type]
             p: int = Query(4, ge=2, le=16, description="pipeline stages"),
             m: int = Query(8, ge=1, le=64, description="micro-batches"),
             v: int = Query(2, ge=2, le=4, description="chunks per stage, for the schedules "
                                                      "that take any v ≥ 2 (interleaved)"),
             backward: int = Query(1, ge=1, le=2, description="backward time / forward time"),
             ) -> PipelineGrid:
    """A schedule from the generators, timed by the simulator (SPEC §6): the same function and
    payload as `shardwise schedule --json` (`report.builders`). Per stage the forward costs 1
    and the whole backward `backward`; schedules that split it run B and W of half each."""
    from shardwise.report import builders
    from shardwise.schedules import get_schedule

    args = {"stages": p, "microbatches": m, "schedule": schedule,
            "chunks": v if get_schedule(schedule).chunks is None else None,
            "t_f": 1.0, "t_b": float(backward)}
    out = builders.schedule_payload(builders.simulate_schedule(**args), **args)
    return PipelineGrid(
        schedule=schedule, p=p, m=m, v=out["chunks"], placement=out["placement"],
        t_f=out["t_f"], t_b=out["t_b"], t_w=out["t_w"],
        events=[GridEvent(stage=e["stage"], kind=e["kind"], micro_batch=e["microbatch"],
                          chunk=e["chunk"], start=e["start"], end=e["end"], pair=e["pair"])
                for e in out["timeline"]],
        makespan=out["makespan"], bubble_fraction=out["bubble_fraction"],
        closed_form_bubble=out["bubble_closed_form"], peak_in_flight=out["peak_in_flight"],
    )


# ---------------------------------------------------------------------- 7: ring attention
class RingAttentionStep(BaseModel):
    """One ring-attention step: the K/V block each device holds and the causal pairs it absorbs."""

    step: int
    holds: list[int]  # the K/V block each device holds at this step
    pairs: list[int]  # causal (query, key) pairs it absorbs from it (0: skipped)


class RingAttentionRun(BaseModel):
    """The emulated ring attention's steps and per-device work."""

    devices: int
    tokens_per_device: int
    causal: bool
    layout: str
    positions: list[list[int]]  # token positions each device holds
    steps: list[RingAttentionStep]
    work: list[int]  # (query, key) pairs per device, counted by the emulated run
    blocks_computed: list[int]
    blocks_skipped: list[int]
    imbalance: float  # max / min work
    causal_block_work: list[int] | None  # emulate.ring_attention.causal_block_work (causal)
    max_abs_diff: float  # ring output vs torch's scaled_dot_product_attention
    bytes_sent_forward: list[int]


@router.get("/ring-attention", response_model=RingAttentionRun)
def ring_attention_run(
    devices: int = Query(8, ge=2, le=16, description="devices in the ring P"),
    tokens: int = Query(16, ge=2, le=64, description="tokens per device"),
    causal: bool = True,
    layout: Literal["contiguous", "striped", "zigzag"] = "contiguous",
) -> RingAttentionRun:
    """Ring attention emulated on random q, k, v (one head, d = 8, float64): the blocks each
    device absorbs at each step, its work, and the output against PyTorch's own attention."""
    with _torch():
        import torch
        import torch.nn.functional as F

        from shardwise.emulate.ring_attention import (
            RingStats,
            causal_block_work,
            layout_positions,
            plan_block,
            ring_attention,
        )

        if layout == "zigzag" and tokens % 2:
            raise ShardwiseError(f"zigzag gives each device two half blocks: tokens per device "
                                 f"must be even, got {tokens}")
        s = devices * tokens
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, s, 1, 8, generator=gen, dtype=torch.float64)
                   for _ in range(3))  # (b, s, h, d)
        stats = RingStats()
        out = ring_attention(q, k, v, devices, causal=causal, layout=layout, stats=stats)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal)
        positions = layout_positions(s, devices, layout)  # (P, tokens)
        steps = []
        for t in range(devices):  # the emulation's ring: at step t device p holds block p − t
            holds = [(p - t) % devices for p in range(devices)]
            plans = [plan_block(positions[p], positions[src], causal)
                     for p, src in enumerate(holds)]
            steps.append(RingAttentionStep(step=t, holds=holds,
                                           pairs=[pl.pairs if pl else 0 for pl in plans]))
        work = list(stats.pairs)
        return RingAttentionRun(
            devices=devices, tokens_per_device=tokens, causal=causal, layout=layout,
            positions=positions.tolist(), steps=steps, work=work,
            blocks_computed=list(stats.blocks_computed), blocks_skipped=list(stats.blocks_skipped),
            imbalance=max(work) / min(work),
            causal_block_work=causal_block_work(devices, tokens, layout) if causal else None,
            max_abs_diff=float((out - ref.transpose(1, 2)).abs().max()),
            bytes_sent_forward=list(stats.bytes_forward),
        )


# ------------------------------------------------------------------------ 8: context wall
class WallPoint(BaseModel):
    """The longest sequence that fits at one context-parallel degree."""

    cp: int
    max_seq_len: int


class ContextWall(BaseModel):
    """The context-wall explainer's data: the longest sequence per cp degree."""

    model: str
    models: list[str]
    budget_bytes: float
    cp: int
    tp: int
    zero: int
    recompute: str
    layout: str
    max_seq_len: int  # longest sequence that fits at this cp
    per_device_tokens: int  # max_seq_len / cp
    state_bytes: float  # weights + grads + optimizer on the busiest device at max_seq_len
    activation_bytes: float  # activations + logits + workspace there
    curve: list[WallPoint]  # cp = 1, 2, 4, …, 64


@router.get("/context-wall", response_model=ContextWall)
def context_wall(
    model: str = Query("llama3-8b", description="a preset model"),
    budget_gb: float = Query(80, ge=1, le=1000, description="per-device memory, GB (10^9 B)"),
    cp: int = Query(8, ge=1, le=64, description="context-parallel devices P"),
    tp: int = Query(8, ge=1, le=8, description="tensor-parallel degree (with SP)"),
    zero: int = Query(0, ge=0, le=3, description="ZeRO stage over the cp ranks"),
    recompute: Literal["none", "selective", "full"] = "selective",
) -> ContextWall:
    """The longest context that fits `budget_gb` per device with ring attention over `cp`
    devices (and Megatron TP `tp` with sequence parallelism), from the memory model."""
    from shardwise.estimate.context import longest_context, sequence_unit
    from shardwise.estimate.memory import largest_stage_memory
    from shardwise.layout import Layout, TrainSpec

    if model not in PRESETS:
        raise ShardwiseError(f"unknown model {model!r}; valid: {', '.join(PRESETS)}")
    spec, budget = PRESETS[model], budget_gb * GB

    def layout_for(c: int) -> Layout:
        return Layout(tp=tp, cp=c, sp=tp > 1, zero=zero, recompute=recompute).validate(spec)

    best = longest_context(spec, layout_for(cp), budget)
    # At the wall, or at the shortest sequence when nothing fits (the state alone is over).
    peak = largest_stage_memory(spec, layout_for(cp),
                               TrainSpec(seq_len=best or sequence_unit(layout_for(cp))))
    return ContextWall(
        model=model, models=list(PRESETS), budget_bytes=budget, cp=cp, tp=tp, zero=zero,
        recompute=recompute, layout=layout_for(cp).short(), max_seq_len=best,
        per_device_tokens=best // cp,
        state_bytes=peak.state, activation_bytes=peak.total - peak.state,
        curve=[WallPoint(cp=c, max_seq_len=longest_context(spec, layout_for(c), budget))
               for c in (1, 2, 4, 8, 16, 32, 64)],
    )


# -------------------------------------------------------------- 9: how often to checkpoint
class IntervalCurve(BaseModel):
    """The "how often to checkpoint" explainer's data (`estimate.goodput.interval_curve`):
    per useful second, the wall seconds lost to checkpoints, restarts and lost work against
    the interval between checkpoints."""

    gpus: int
    mtbf_gpu_hours: float
    job_mtbf_s: float  # M = H / N
    interruptions_per_day: float
    stall_s: float  # δ: what one checkpoint stalls training
    restart_s: float  # R
    interval_s: list[float]  # τ, log-spaced
    checkpoint: list[float]  # δ/τ
    restart: list[float]
    lost: list[float]
    total: list[float]
    best_interval_s: float  # the total's minimum on the grid
    best_total: float
    young_interval_s: float  # √(2δM)
    daly_interval_s: float  # Daly 2006
    daly_total: float
    goodput: float  # at Daly's interval: 1 / (1 + total)


@router.get("/checkpoint-interval", response_model=IntervalCurve)
def checkpoint_interval(
    gpus: int = Query(16384, ge=1, le=1_048_576, description="GPUs N in the job"),
    mtbf_gpu_hours: float = Query(50677, ge=100, le=1e7,
                                  description="GPU-hours between failures per GPU, H"),
    stall_s: float = Query(30, ge=0.1, le=3600, description="seconds one checkpoint stalls"),
    restart_min: float = Query(10, ge=0, le=240, description="minutes to restart, R"),
) -> IntervalCurve:
    """Lost time per useful second against the checkpoint interval, Young's and Daly's
    intervals (`estimate.goodput`: M = H/N, Daly's complete model)."""
    from shardwise.estimate.goodput import HOUR, interval_curve

    mtbf = mtbf_gpu_hours * HOUR / gpus
    curve = interval_curve(stall_s, mtbf, restart_min * 60)
    return IntervalCurve(gpus=gpus, mtbf_gpu_hours=mtbf_gpu_hours, job_mtbf_s=mtbf,
                         interruptions_per_day=86400 / mtbf, stall_s=stall_s,
                         restart_s=restart_min * 60, **curve,
                         goodput=1 / (1 + curve["daly_total"]))


# ------------------------------------------------------------------- 10: a run's timeline
from shardwise.web.learn_timeline import router as _timeline_router  # noqa: E402

router.include_router(_timeline_router)
