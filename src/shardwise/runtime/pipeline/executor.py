"""`run_pipeline`: execute a schedule's action lists on this rank with real send/recv (receives
posted ahead, tagged per message), check the ranks agree on the schedule, and record the
measured timeline. Design: docs/concepts/runtime.md#pipeline-parallelism.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.data_parallel import GradientReducer
from shardwise.runtime.pipeline.deferral import (
    SavedOp,
    backward_input,
    backward_weight,
    deferring_weight_grads,
)
from shardwise.runtime.pipeline.stages import StageModel, VirtualStage, virtual_stages
from shardwise.schedules import (
    Action,
    Event,
    Placement,
    Timeline,
    num_stages,
    schedule_text,
    split_backwards,
    stage_of,
    validate_schedule,
    virtual_stage,
)


@dataclass
class PipelineResult:
    """One rank's view of one pipeline step.

    `loss` (the batch mean, `Σ_j L_j / m`) is set on the last pipeline stage only. `grads` holds
    this rank's parameters' gradients after the step (after the dp all-reduce if any). `events`
    are the measured actions in seconds since the step's start barrier. `peak_alive` counts
    micro-batch-chunks from F until B (the simulator's convention), `peak_alive_until_w` until
    their W has run (equal without W). `sent` is the bytes this rank sent, per direction.
    """

    stage: int
    num_stages: int
    chunks: int
    microbatches: int
    loss: float | None
    grads: dict[str, torch.Tensor]
    events: list[Event]
    peak_alive: int
    peak_alive_until_w: int
    sent: dict[str, int] = field(default_factory=dict)
    messages: int = 0
    dp_syncs: int = 0
    clock_origin: float = 0.0  # time.perf_counter() at the step's start on this rank


# receives a stage keeps posted before it needs them (each an s·b·h message buffer): as many
# as fit in RECV_AHEAD_BYTES, at least RECV_AHEAD_MIN (module docstring)
RECV_AHEAD_BYTES = 64 * 2**20
RECV_AHEAD_MIN = 4


class _Executor:
    """The state of one rank during one step: stashes, mailbox for same-rank messages, handles,
    and the receives posted ahead."""

    def __init__(self, model: StageModel, stages: list[VirtualStage], pp: Any, m: int,
                 placement: Placement, shape: tuple[int, ...], device: torch.device,
                 actions: Sequence[Action]):
        self.model, self.stages, self.pp, self.m = model, stages, pp, m
        self.p, self.placement = pp.size, placement
        # the (micro-batch, virtual stage) pairs whose backward this rank splits into B and W
        self.split = {(j, self.vs(c)) for j, c in split_backwards(actions)}
        # this rank's receives from another rank, in the order its actions consume them
        gloo = self.p > 1 and dist.get_backend(pp.group) == "gloo"
        self.receives = deque(
            (tag, src) for a in (actions if gloo else ())
            for tag, src in [self._input_of(a.kind, a.micro_batch, self.vs(a.chunk))]
            if src is not None and self.rank_of(src) != pp.rank)
        self.posted: dict[int, tuple[Any, torch.Tensor]] = {}
        self.shape, self.device = shape, device  # of every message, e.g. (b, s, h)
        message = math.prod(shape) * model.dtype.itemsize
        self.ahead = max(RECV_AHEAD_MIN, RECV_AHEAD_BYTES // message)
        self.stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor,
                                                 list[SavedOp]]] = {}
        self.pending_w: dict[tuple[int, int], list[tuple[SavedOp, torch.Tensor]]] = {}
        self.mailbox: dict[int, torch.Tensor] = {}
        self.handles: list[tuple[Any, torch.Tensor]] = []
        self.losses: dict[int, torch.Tensor] = {}
        self.sent = {"forward": 0, "backward": 0}
        self.messages = 0
        self.peak = self.peak_w = 0
        self.started = 0.0  # perf_counter() when the current action's compute began
        self._post_ahead()

    def vs(self, chunk: int) -> int:
        """The virtual stage this rank's `chunk` runs."""
        return virtual_stage(self.pp.rank, chunk, self.p, self.placement)

    def rank_of(self, vs: int) -> int:
        """The pipeline rank running virtual stage `vs`."""
        return stage_of(vs, self.p, self.placement)

    # -- messages --------------------------------------------------------------------------
    def _tag(self, kind: str, j: int, vs: int) -> int:
        """A tag unique within the step: the message produced by `kind` of `j` at `vs`."""
        return (j * len(self.stages) + vs) * 2 + (kind == "B")

    def _input_of(self, kind: str, j: int, vs: int) -> tuple[int, int | None]:
        """The tag and source virtual stage of the message action `kind` of `j` at `vs` waits
        for (source None: it needs none)."""
        if kind == "F" and vs > 0:
            return self._tag("F", j, vs - 1), vs - 1
        if kind == "B" and vs < len(self.stages) - 1:
            return self._tag("B", j, vs + 1), vs + 1
        return -1, None

    def _post_ahead(self) -> None:
        while self.receives and len(self.posted) < self.ahead:
            tag, src_vs = self.receives.popleft()
            buf = torch.empty(self.shape, dtype=self.model.dtype, device=self.device)
            src = self.pp.global_rank(self.rank_of(src_vs))
            self.posted[tag] = (dist.irecv(buf, src=src, group=self.pp.group, tag=tag), buf)

    def send(self, message: tuple[torch.Tensor, int, int, str] | None) -> None:
        """Send what an action produced, `(tensor, to virtual stage, tag, direction)`."""
        if message is None:
            return
        tensor, to_vs, tag, direction = message
        dst = self.pp.global_rank(self.rank_of(to_vs))
        payload = tensor.detach().contiguous()
        if dst == dist.get_rank():
            self.mailbox[tag] = payload  # the neighbouring virtual stage is on this rank
            return
        nbytes = payload.numel() * payload.element_size()
        C.note_send(self.pp, nbytes)
        self.sent[direction] += nbytes
        self.messages += 1
        self.handles.append((dist.isend(payload, dst=dst, group=self.pp.group, tag=tag), payload))

    def receive(self, kind: str, j: int, vs: int) -> torch.Tensor | None:
        """The message action `kind` of `j` at `vs` waits for (`_input_of`; None: none)."""
        tag, from_vs = self._input_of(kind, j, vs)
        if from_vs is None:
            return None
        if tag in self.mailbox:
            return self.mailbox.pop(tag)
        if tag in self.posted:  # gloo: posted ahead, and consumed in order
            work, buf = self.posted.pop(tag)
            with C.blocked_in(self.pp.name):
                work.wait()
            self._post_ahead()
            return buf
        src = self.pp.global_rank(self.rank_of(from_vs))
        buf = torch.empty(self.shape, dtype=self.model.dtype, device=self.device)
        with C.blocked_in(self.pp.name):
            dist.recv(buf, src=src, group=self.pp.group, tag=tag)
        return buf

    # -- actions ---------------------------------------------------------------------------
    def run(self, action: Action, message: torch.Tensor | None, tokens: torch.Tensor,
            targets: torch.Tensor) -> tuple[torch.Tensor, int, int, str] | None:
        """Run `action` on its received `message`; return what it sends (`send`), if any."""
        j, vs = action.micro_batch, self.vs(action.chunk)
        self.started = time.perf_counter()
        if action.kind == "F":
            return self.forward(j, vs, message, tokens, targets)
        if action.kind == "B":
            return self.backward(j, vs, message)
        backward_weight(self.pending_w.pop((j, vs)))
        return None

    def forward(self, j: int, vs: int, received: torch.Tensor | None, tokens: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, int, int, str] | None:
        stage = self.stages[vs]
        x = None if stage.first else received.requires_grad_()  # type: ignore[union-attr]
        saved: list[SavedOp] = []
        out = self.model.forward_stage(stage, tokens if stage.first else x,
                                       targets if stage.last else None,
                                       saved if (j, vs) in self.split else None)
        self.stash[(j, vs)] = (x, out, saved)
        if stage.last:
            self.losses[j] = out.detach()
            return None
        return out, vs + 1, self._tag("F", j, vs), "forward"

    def backward(self, j: int, vs: int, received: torch.Tensor | None
                 ) -> tuple[torch.Tensor, int, int, str] | None:
        stage = self.stages[vs]
        x, out, saved = self.stash.pop((j, vs))
        grad_out = (torch.full_like(out, 1.0 / self.m)  # loss = Σ_j L_j / m
                    if stage.last else received)
        split = (j, vs) in self.split
        if split and saved:  # the model recorded its weight-bearing ops
            dx, self.pending_w[(j, vs)] = backward_input(out, x, saved, grad_out)
        else:  # input and weight gradients at once — but the linears' dW under a split
            # backward, when the stage ran under `defer_linears` (the Transformer stages)
            with deferring_weight_grads() if split else nullcontext() as later:
                torch.autograd.backward(out, grad_out)
            dx = x.grad if x is not None else None
            if split:
                self.pending_w[(j, vs)] = later
        if dx is None:
            return None
        return dx, vs - 1, self._tag("B", j, vs), "backward"

    def account(self) -> None:
        self.peak = max(self.peak, len(self.stash))
        self.peak_w = max(self.peak_w, len(self.stash) + len(self.pending_w))
        self.handles = [h for h in self.handles if not _completed(h[0])]


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # pragma: no cover - backends without is_completed
        return False


def _groups(actions: Sequence[Action]) -> Iterator[list[Action]]:
    """The actions one at a time, an overlapped pair (`Action.with_next`) as one group."""
    index = 0
    while index < len(actions):
        size = 2 if actions[index].with_next else 1
        yield list(actions[index:index + size])
        index += size


def run_pipeline(model: StageModel, schedule: Mapping[int, Sequence[Action]],
                 tokens: torch.Tensor, targets: torch.Tensor, pp: C.GroupLike = "pp",
                 dp: C.GroupLike | None = None, *, placement: Placement = "loop",
                 first_stage_extra: float = 0.0, last_stage_extra: float = 0.0,
                 sizes: Sequence[int] = ()) -> PipelineResult:
    """Run one training step's forward and backward of `model` under `schedule` on this rank.

    `pp` is the pipeline group (an `AxisGroup`, an axis name on the current mesh, …); this rank
    runs `schedule[pp.rank]`, its chunks on the virtual stages `placement` gives them (the
    schedule's registry entry says which: "loop", or "v" for ZBV and DualPipeV). `tokens` and
    `targets` (m·b, s) are this data-parallel replica's batch, the same on every stage (the
    first virtual stage reads the tokens, the last the targets); `m` and the chunks `v` come
    from the schedule. With `dp`, the gradients are averaged over that group by one all-reduce
    after the last micro-batch. Parameter gradients are zeroed first and left in `.grad` (and
    returned).

    An overlapped pair (DualPipe's F&B, `Action.with_next`) waits for both its inputs, runs
    the forward then the backward, and then sends both outputs, as torch.distributed.pipelining
    runs `OVERLAP_F_B` (2.13, `_PipelineScheduleRuntime`; the overlap of one's communication
    with the other's compute, DualPipe's point, needs a per-layer interleaving neither does).

    Raises `ShardwiseError`, before any message is sent, for a schedule that is incomplete or
    would deadlock, and on every stage when the stages disagree on the schedule, the model
    sizes or the batch shape (checked with one small all-gather, not counted): mismatched
    action lists are the one way a pipeline could hang.
    """
    actions = [a for stage_actions in schedule.values() for a in stage_actions]
    if not actions:
        raise ShardwiseError("the schedule has no actions")
    m = 1 + max(a.micro_batch for a in actions)
    v = 1 + max(a.chunk for a in actions)
    p = num_stages(schedule)
    # complete and deadlock-free: the executor cannot hang
    validate_schedule(schedule, p, m, v, placement)
    if tokens.shape != targets.shape or tokens.dim() != 2:
        raise ShardwiseError(f"tokens and targets must both be (batch, seq), got "
                             f"{tuple(tokens.shape)} and {tuple(targets.shape)}")
    if tokens.shape[0] % m:
        raise ShardwiseError(f"batch of {tokens.shape[0]} sequences does not split into "
                             f"m={m} equal micro-batches")
    stages = virtual_stages(model.n_layers, p, v, first_stage_extra=first_stage_extra,
                            last_stage_extra=last_stage_extra, sizes=sizes)
    group = C.resolve(pp)
    if group.size != p:
        raise ShardwiseError(f"schedule has {p} stages but the pipeline group has "
                             f"{group.size} ranks")
    b = tokens.shape[0] // m
    shape = model.message_shape(b, tokens.shape[1])
    _check_agreement(group, f"{schedule_text(schedule)}|{placement}|"
                            f"{[s.layers for s in stages]}|{shape}|{model.dtype}|"
                            f"{tuple(tokens.shape)}")
    me = group.rank
    mine = [stages[virtual_stage(me, c, p, placement)] for c in range(v)]
    params = {name: t for stage in mine for name, t in model.named_parameters(stage).items()}
    for t in params.values():  # (an fp32 main_grad where t accumulates in fp32)
        mp.set_grad(t, torch.zeros_like(t, dtype=mp.grad_dtype(t)))
    token_mbs, target_mbs = tokens.split(b), targets.split(b)  # m × (b, s)
    ex = _Executor(model, stages, group, m, placement, shape, tokens.device, schedule[me])

    t0 = time.perf_counter()  # just after the agreement all-gather: every stage starts now
    events: list[Event] = []
    for group_actions in _groups(schedule[me]):
        # an action starts once its input has arrived (a pair once both have): waiting for
        # it is idle time (bubble)
        received = [ex.receive(a.kind, a.micro_batch, ex.vs(a.chunk)) for a in group_actions]
        outputs = []
        for action, message in zip(group_actions, received):
            j = action.micro_batch
            outputs.append(ex.run(action, message, token_mbs[j], target_mbs[j]))
            events.append(Event(me, action, ex.started - t0, time.perf_counter() - t0))
            ex.account()
        for output in outputs:  # a pair sends when both are done
            ex.send(output)
    with C.blocked_in(group.name):
        for work, _ in ex.handles:
            work.wait()
    ex.handles.clear()

    syncs = 0
    if dp is not None and C.resolve(dp).size > 1:
        # once, after the last micro-batch (the bucketed reducer, without backward hooks)
        GradientReducer(list(params.values()), dp, hooks=False).reduce()
        syncs = 1
    loss = float(sum(ex.losses.values()) / m) if ex.losses else None
    # (ZeRO-2 has already reduce-scattered and freed them: no gradient left to report)
    grads = {name: g.detach().clone() for name, t in params.items()
             if (g := mp.grad(t)) is not None}
    return PipelineResult(me, p, v, m, loss, grads, events, ex.peak, ex.peak_w, dict(ex.sent),
                          ex.messages, syncs, t0)


def _check_agreement(group: Any, plan: str) -> None:
    """All-gather a checksum of what this stage is about to run; raise on every stage if any
    stage differs (instead of hanging in a receive that never completes)."""
    if group.size == 1:
        return
    mine = torch.tensor([zlib.crc32(plan.encode())], dtype=torch.int64)
    every = torch.empty(group.size, dtype=torch.int64)
    C.all_gather(every, mine, group, counter=C.CommCounter())  # a check, not pipeline traffic
    differ = [i for i, value in enumerate(every.tolist()) if value != mine.item()]
    if differ:
        raise ShardwiseError(f"pipeline stage {group.rank} and stages {differ} disagree on the "
                             "schedule, the model's partition or the batch shape")


# ---------------------------------------------------------------------------- measurements
def measured_timeline(results: Sequence[PipelineResult], same_clock: bool = True) -> Timeline:
    """The measured `Timeline` of one pipeline (one result per stage, any order), shifted so the
    first action starts at 0; bubble `1 - busy/(p·makespan)`; peak = the measured peaks in
    micro-batches (a chunk counts `1/v`, as `simulate`'s).

    `same_clock`: the ranks shared one host, whose monotonic clock (`time.perf_counter`) is the
    same in every process, so each stage's events are placed by its own clock origin — exact.
    Otherwise (several nodes) each stage's events count from its own start of the step, which
    the agreement all-gather aligns to within a network latency."""
    by_stage = sorted(results, key=lambda r: r.stage)
    if [r.stage for r in by_stage] != list(range(len(by_stage))):
        raise ShardwiseError("measured_timeline needs exactly one result per pipeline stage")
    shift = {r.stage: r.clock_origin if same_clock else 0.0 for r in by_stage}
    events = [Event(e.stage, e.action, e.start + shift[r.stage], e.end + shift[r.stage])
              for r in by_stage for e in r.events]
    if not events:
        raise ShardwiseError("no measured events")
    origin = min(e.start for e in events)
    shifted = tuple(Event(e.stage, e.action, e.start - origin, e.end - origin) for e in events)
    makespan = max(e.end for e in shifted)
    busy = sum(e.end - e.start for e in shifted)
    p = len(by_stage)
    return Timeline(p, shifted, makespan, 1 - busy / (p * makespan) if makespan > 0 else 0.0,
                    tuple(r.peak_alive / r.chunks for r in by_stage))
