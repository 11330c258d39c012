"""Pipeline parallelism: run a schedule's action lists with real send/recv (SPEC §6, §8).

The executor runs any `StageModel`: something that can list a virtual stage's parameters, run a
virtual stage forward, and say the shape of the activation passed between stages. Two exist:
`PipelineModel` below (a small tanh-MLP LM, the executor's own reference) and the Transformer
stages of `runtime.parallelize`.

The model's layers are cut into `V = p·v` contiguous *virtual stages* with `partition_layers`
(uneven splits allowed); chunk `c` of pipeline rank `i` runs virtual stage
`schedules.virtual_stage(i, c, p, placement)`: `c·p + i` (Megatron-LM's interleaving,
"loop"), or `i` and `2p-1-i` (the V of ZBV and DualPipeV, "v"). The first virtual stage also
holds the embedding, the last the LM head and the loss. A batch of `m·b` sequences is cut into
`m` micro-batches of `b`.

Every rank runs *its own* action list from `shardwise.schedules` — the very lists the simulator
times — one action after the other:

    F(j, c)  receive the activation of micro-batch j from virtual stage vs-1 (unless vs = 0),
             run chunk c forward, keep what backward needs, send the output to vs+1 (or, on
             the last virtual stage, keep the loss L_j)
    B(j, c)  receive dL/d(output) from vs+1 (on the last virtual stage: the seed 1/m, so the
             step's loss is Σ_j L_j / m, the mean over the whole batch), back-propagate through
             chunk c, send dL/d(input) to vs-1. Without a W of (j, c) on the rank B is the
             whole backward and accumulates the weight gradients too.
    W(j, c)  (zero-bubble schedules) the weight gradients of chunk c for micro-batch j.

Schedules: GPipe (Huang et al. 2019) runs all forwards then all backwards and holds `m`
micro-batches; 1F1B (PipeDream-Flush, Narayanan et al. 2021) warms up with `p-1-i` forwards then
alternates, holding `min(p-i, m)`; interleaved 1F1B (Narayanan et al. 2021, §2.2) gives each rank
`v` chunks and shrinks the bubble to `(p-1)/(v·m+p-1)`; ZB-H1 (Qi et al. 2023) splits the
backward into B, the input gradient on the critical path, and W, the weight gradient, which
fills the drain bubble; ZBV (Qi et al. 2023, §6) and DualPipeV (DeepSeek-AI 2024) run two
chunks per rank in a V, DualPipeV with overlapped F&B pairs and both whole and split backwards.

B and W, honestly split: in a ZB-H1 run every weight-bearing op (embedding, each linear, the
head) records its input X and its output Y during F. B asks autograd for the gradients with
respect to the stage input *and each Y only*, so no weight-gradient product is computed (autograd
runs only the parts of the graph those inputs need); the graph is then freed and only (X, dY)
stay. W computes `dW = dYᵀ·X`, `db = Σ dY` (and an index-add for the embedding): the weight
gradient GEMMs of Qi et al.'s Figure 1. The Transformer stages (`parallel_transformer`) run
their forward under `defer_linears` instead: every linear becomes a `_DeferrableLinear`, B is
one autograd backward inside `deferring_weight_grads` (input gradients, and the weight
gradients of the norms, the router, the experts and the embedding, computed there), and each
linear hands its (X, dY) to W, which computes `dW = dYᵀ·X`. What a linear saves in the
forward is unchanged (X; the weight is state); between B and W the stage holds X and dY of
every linear of the micro-batch (X would otherwise be freed at B). A fully recomputed block
replays its forward under `defer_linears` too (`replay_contexts`); a ZeRO-3 unit, whose
gathered weights B frees, points its linears' weights at its open flat gradient
(`GradTarget`), to which W adds dW before the unit is reduce-scattered (`runtime.zero`).

Communication and why it cannot deadlock: a rank *receives* by waiting, right before the action
that needs the tensor, on an `irecv` it posted ahead (`RECV_AHEAD_BYTES`), and *sends*
with a non-blocking `isend` right after the action that produced it (the handles are waited at
the end of the step). Posting the receive early is what lets a send leave at once: gloo writes a
message only once the receiver has announced its buffer, and when that announcement comes while
the sender computes, the write waits for gloo's I/O thread to get a core — measured with two
ranks on two cores, a receive posted when needed took 0.10–1.7 ms (median) after a send whose
rank went on computing, one posted ahead 2–13 µs. Posting is not free either: in a training
step an `irecv` or `isend` call took 0.25 ms on average (35–60 µs median between idle ranks),
so a stage posts as many receives as fit in `RECV_AHEAD_BYTES` (all of a step's, for the tiny
models) before its first action rather than one per action — measured, interleaved pp2 on
`tiny` went from 53–57 to 45–48 ms per step; 1F1B within its noise. Waiting on a receive is the
same as a blocking `recv`, so the argument below is unchanged; the extra memory is the posted
message buffers (`RECV_AHEAD_BYTES`, or `RECV_AHEAD_MIN` messages where one is larger).
Only on gloo: NCCL puts a pair's sends and receives on one stream, where a receive posted ahead
would hold back the sends behind it, and its receives wait on the GPU, not on a host thread —
there a rank receives with a blocking `recv` when it needs the tensor. Each message carries a tag
naming (kind, micro-batch, virtual stage), so neighbours may order their traffic differently
(e.g. with v > 1 rank 0 sends activations *and* gradients to rank 1). A rank therefore only ever
waits for an action of another rank that does not itself wait on anything later — exactly the
simulator's dependency graph, which `validate_schedule` proves acyclic before the first message.
That proof covers one schedule, so the stages first all-gather a checksum of (schedule, layer
partition, batch shape) and all raise if they differ, rather than wait forever. The isends go to
torch.distributed directly (`collectives` offers blocking `send` only) and are counted under the
key `collectives.send` uses. gloo needs CPU tensors and has no reliable `batch_isend_irecv`;
neither is used.

Measured, against the analytic side:

* bytes: every send is recorded in the active `collectives` counter under ("pp", "send"); each
  stage boundary carries `s·b·h` activation bytes forward and as many gradient bytes back per
  micro-batch, `estimate.comm.pp_comm_bytes_per_microbatch` (`2·s·b·h·bytes`);
* memory: the executor keeps each in-flight micro-batch-chunk's autograd state in a dictionary
  from its F until its B (and the (X, dY) pairs of a split backward until its W); the peak size of
  these dictionaries, read while running, is what the simulator's `peak_in_flight` predicts
  (counted until B) and, for split schedules, its count until W;
* time: wall-clock start (once its input has arrived) and end of every action, a `Timeline`
  (`measured_timeline`) that `render_ascii` draws beside the simulated one.

Pipeline + data parallel: each dp replica runs its own pipeline on its share of the batch; the
gradients are averaged over the dp group once, after the last micro-batch
(`data_parallel.GradientReducer.reduce`: one all-reduce per bucket, SUM then divide), never per
micro-batch.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardwise.errors import ShardwiseError
from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.data_parallel import GradientReducer
from shardwise.schedules import (
    Action,
    Event,
    Placement,
    Timeline,
    num_stages,
    partition_layers,
    schedule_text,
    split_backwards,
    stage_of,
    validate_schedule,
    virtual_stage,
)

__all__ = [
    "GradTarget",
    "PipelineModel",
    "PipelineResult",
    "SavedOp",
    "StageModel",
    "VirtualStage",
    "accumulate_grad",
    "backward_input",
    "backward_weight",
    "defer_linears",
    "deferred_ops",
    "deferring_weight_grads",
    "measured_timeline",
    "replay_contexts",
    "run_pipeline",
    "virtual_stages",
]


# ------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class VirtualStage:
    """Virtual stage `index` of `count`: its layers, and whether it holds embedding / head."""

    index: int
    count: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def virtual_stages(n_layers: int, p: int, v: int = 1, *, first_stage_extra: float = 0.0,
                   last_stage_extra: float = 0.0, sizes: Sequence[int] = ()
                   ) -> list[VirtualStage]:
    """The `p·v` virtual stages, layers from `partition_layers` (contiguous, balanced) or
    contiguous runs of `sizes` layers (a layout's `stage_partition`)."""
    count = p * v
    if sizes:
        if len(sizes) != count or sum(sizes) != n_layers or min(sizes) < 1:
            raise ShardwiseError(f"stage sizes {list(sizes)} must be {count} counts ≥ 1 that "
                                 f"sum to n_layers={n_layers}")
        ends = list(accumulate(sizes))
        parts = [list(range(end - n, end)) for end, n in zip(ends, sizes)]
    else:
        parts = partition_layers(n_layers, count, first_stage_extra=first_stage_extra,
                                 last_stage_extra=last_stage_extra)
    return [VirtualStage(vs, count, tuple(layers)) for vs, layers in enumerate(parts)]


class GradTarget(Protocol):
    """Where W adds a weight gradient when the weight is no leaf parameter: a ZeRO-3 unit's
    gathered weights are dropped after B, so W adds dW into the unit's gradient instead
    (`runtime.zero`)."""

    def accumulate(self, grad: torch.Tensor) -> None: ...


@dataclass
class SavedOp:
    """What a weight-bearing op keeps for W: its weight (and bias), input X and output Y.
    The weight and bias may be `GradTarget`s standing for them (ZeRO-3)."""

    weight: Any  # torch.Tensor | GradTarget
    bias: Any  # torch.Tensor | GradTarget | None
    input: torch.Tensor  # linear: (..., k) activations; embedding: (b, s) token ids
    output: torch.Tensor | None  # (..., n); None once B has its dY (a deferred linear)
    embedding: bool = False


class StageModel(Protocol):
    """What `run_pipeline` needs of a model: its layer count and dtype, a virtual stage's
    parameters by name, the stage's forward, and the shape of an inter-stage message."""

    @property
    def n_layers(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def named_parameters(self, stage: VirtualStage | None = None) -> dict[str, torch.Tensor]:
        ...

    def forward_stage(self, stage: VirtualStage, inp: torch.Tensor,
                      targets: torch.Tensor | None = None,
                      saved: list[SavedOp] | None = None) -> torch.Tensor: ...

    def message_shape(self, batch: int, seq: int) -> tuple[int, ...]: ...


@dataclass
class PipelineModel:
    """A small LM the executor splits into stages, built identically from a seed on every rank.

        x_0 = E[tokens]                                   embedding E (V, h)
        x_k = x_{k-1} + tanh(x_{k-1} W1ᵀ + b1) W2ᵀ + b2   residual tanh-MLP block, W1 (f, h)
        L   = cross_entropy(x_n Hᵀ, targets)              head H (V, h), mean over tokens

    `forward` is the single-device model, the reference every pipeline run is compared with.
    """

    embed: torch.Tensor
    blocks: list[dict[str, torch.Tensor]]
    head: torch.Tensor

    @classmethod
    def build(cls, n_layers: int, hidden: int, ffn: int, vocab: int, seed: int = 0,
              dtype: torch.dtype = torch.float64) -> PipelineModel:
        if min(n_layers, hidden, ffn, vocab) < 1:
            raise ShardwiseError(f"model sizes must be ≥ 1, got n_layers={n_layers}, "
                                 f"hidden={hidden}, ffn={ffn}, vocab={vocab}")
        gen = torch.Generator().manual_seed(seed)

        def param(*shape: int, scale: float) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=dtype) * scale
            return t.requires_grad_()

        embed = param(vocab, hidden, scale=1.0)
        blocks = [{"w1": param(ffn, hidden, scale=hidden ** -0.5),
                   "b1": param(ffn, scale=0.1),
                   "w2": param(hidden, ffn, scale=ffn ** -0.5 / 2),
                   "b2": param(hidden, scale=0.1)} for _ in range(n_layers)]
        head = param(vocab, hidden, scale=hidden ** -0.5)
        return cls(embed, blocks, head)

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def hidden(self) -> int:
        return int(self.embed.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def message_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        """Activations (b, s, h) between stages."""
        return (batch, seq, self.hidden)

    def named_parameters(self, stage: VirtualStage | None = None) -> dict[str, torch.Tensor]:
        """Every parameter by name ("embed", "blocks.3.w1", "head"), or one virtual stage's."""
        layers = range(self.n_layers) if stage is None else stage.layers
        out: dict[str, torch.Tensor] = {}
        if stage is None or stage.first:
            out["embed"] = self.embed
        for k in layers:
            out.update({f"blocks.{k}.{name}": t for name, t in self.blocks[k].items()})
        if stage is None or stage.last:
            out["head"] = self.head
        return out

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The single-device model: mean cross-entropy over all `(b, s)` tokens."""
        whole = VirtualStage(0, 1, tuple(range(self.n_layers)))
        return self.forward_stage(whole, tokens, targets)

    def forward_stage(self, stage: VirtualStage, inp: torch.Tensor,
                      targets: torch.Tensor | None = None,
                      saved: list[SavedOp] | None = None) -> torch.Tensor:
        """Virtual stage `stage` on `inp` (token ids (b, s) on the first stage, else activations
        (b, s, h)); returns activations (b, s, h), or the loss on the last stage. With `saved`,
        every weight-bearing op appends its (weight, input, output) for a split backward."""
        if stage.first:
            x = F.embedding(inp, self.embed)  # (b, s) -> (b, s, h)
            if saved is not None:
                saved.append(SavedOp(self.embed, None, inp, x, embedding=True))
        else:
            x = inp
        for k in stage.layers:
            block = self.blocks[k]
            hidden = torch.tanh(_linear(x, block["w1"], block["b1"], saved))  # (b, s, f)
            x = x + _linear(hidden, block["w2"], block["b2"], saved)
        if not stage.last:
            return x
        if targets is None:
            raise ShardwiseError("the last stage needs the targets to compute the loss")
        logits = _linear(x, self.head, None, saved)  # (b, s, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            saved: list[SavedOp] | None) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    if saved is not None:
        saved.append(SavedOp(weight, bias, x, y))
    return y


def accumulate_grad(param: Any, grad: torch.Tensor) -> None:
    """`param.grad += grad`; a leaf parameter through autograd's own accumulation, so its
    post-accumulate-grad hooks (ZeRO-2's reduce-scatter once a unit's gradients are complete)
    fire after W as they fire after B; a `GradTarget` adds it where it stands for."""
    if not isinstance(param, torch.Tensor):
        param.accumulate(grad)
    elif param.is_leaf and param.requires_grad:
        torch.autograd.backward(param, grad)
    elif param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad.add_(grad)


def backward_input(out: torch.Tensor, inp: torch.Tensor | None, saved: list[SavedOp],
                   grad_out: torch.Tensor) -> tuple[torch.Tensor | None,
                                                    list[tuple[SavedOp, torch.Tensor]]]:
    """ZB-H1's B: the gradient of `out` with respect to the stage input `inp` (None on the
    first stage, whose input is token ids) and to the output Y of every op in `saved`, and
    nothing else — autograd runs only the ops on the paths from `out` back to those tensors, so
    no weight-gradient product is computed. Frees the graph; returns `dX` and the (op, dY)
    pairs `backward_weight` needs."""
    outputs = [op.output for op in saved if op.output is not None]
    wanted = ([] if inp is None else [inp]) + outputs
    grads = torch.autograd.grad(out, wanted, grad_out)
    for op, y in zip(saved, outputs):  # the graph is freed: keep plain tensors, no nodes
        op.input, op.output = op.input.detach(), y.detach()
    dys = grads[1:] if inp is not None else grads
    return (grads[0] if inp is not None else None), list(zip(saved, dys))


def backward_weight(pending: list[tuple[SavedOp, torch.Tensor]]) -> None:
    """ZB-H1's W: for each op, `dW += dYᵀ·X`, `db += Σ_rows dY`; for the embedding
    `dE[t] += dY` for every token t. Accumulates into `.grad`."""
    for op, dy in pending:
        weight = op.weight
        if op.embedding:
            grad = torch.zeros_like(weight)
            grad.index_add_(0, op.input.reshape(-1), dy.reshape(-1, weight.shape[1]))
            accumulate_grad(weight, grad)
            continue
        x2 = op.input.reshape(-1, op.input.shape[-1])  # (b, s, k) -> (b·s, k)
        dy2 = dy.reshape(-1, dy.shape[-1])  # (b, s, n) -> (b·s, n)
        accumulate_grad(weight, dy2.T @ x2)  # (n, k)
        if op.bias is not None:
            accumulate_grad(op.bias, dy2.sum(0))


class _DeferrableLinear(torch.autograd.Function):
    """`F.linear(x, w, b)` saving x and w, as `F.linear` does. Its backward returns dX (and
    db); dW = dYᵀ·X is computed there only outside `deferring_weight_grads` — inside, the op
    hands (X, dY) to the active collector and W computes dW later (`backward_weight`).
    `owner` holds the parameter when `w` is its detached alias: B then never reaches the
    parameter's gradient accumulator, whose hooks (ZeRO-2's) fire only when W accumulates."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                owner: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)  # weight and bias are state (ZeRO-3: markers)
        ctx.owner = owner[0] if owner else None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        param = weight if ctx.owner is None else ctx.owner
        dx = dy @ weight if ctx.needs_input_grad[0] else None  # (..., n) @ (n, k)
        if _COLLECTORS:  # ZB-H1's B: the weight gradient waits for W
            _COLLECTORS[-1].append((SavedOp(param, bias, x, None), dy))
            return dx, None, None, None
        dy2 = dy.reshape(-1, weight.shape[0])  # (..., n) -> (rows, n)
        dw = dy2.T @ x.reshape(-1, weight.shape[1]) if param.requires_grad else None
        db = dy2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        if ctx.owner is not None and dw is not None:  # not an input here: accumulate it
            accumulate_grad(ctx.owner, dw)
            dw = None
        return dx, dw, db, None


_COLLECTORS: list[list[tuple[SavedOp, torch.Tensor]]] = []  # the running B's (op, dY) pairs
_DEFERRING: list[defer_linears] = []  # the active `defer_linears` modes, innermost last


def deferred_ops() -> list[tuple[SavedOp, torch.Tensor]] | None:
    """The (op, dY) pairs the running ZB-H1 B has deferred so far (None outside B): a ZeRO-3
    unit's backward points its linears' weights at its own gradient (`runtime.zero`)."""
    return _COLLECTORS[-1] if _COLLECTORS else None


def replay_contexts() -> tuple[Any, Any]:
    """`torch.utils.checkpoint`'s `context_fn` for full recompute: the replay in backward
    runs under `defer_linears` when the forward did, so the replayed linears are the
    `_DeferrableLinear`s whose saved X the forward's graph expects, and B defers their dW."""
    return nullcontext(), defer_linears() if _DEFERRING else nullcontext()


class defer_linears(TorchFunctionMode):
    """While active, every `F.linear` that records a graph (nn.Linear, the column/row
    parallel linears) runs as a `_DeferrableLinear`, whose weight gradient a split backward
    defers to W. Linears inside another autograd function's forward (no graph recorded there,
    e.g. sequence parallelism's fused all-gather linears) and other weights (norms, router,
    experts, embedding) keep their gradients in B. A fully recomputed block replays its
    forward under it too (`replay_contexts`)."""

    def __enter__(self) -> defer_linears:
        _DEFERRING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _DEFERRING.remove(self)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, *rest = args
            bias = kwargs.get("bias", rest[0] if rest else None)
            if weight.is_leaf and weight.requires_grad:  # a parameter: W accumulates it
                return _DeferrableLinear.apply(x, weight.detach(), bias, (weight,))
            return _DeferrableLinear.apply(x, weight, bias)
        return func(*args, **kwargs)


@contextmanager
def deferring_weight_grads() -> Iterator[list[tuple[SavedOp, torch.Tensor]]]:
    """ZB-H1's B for a model run under `defer_linears`: a backward inside this context
    accumulates every gradient except the linears' dW, whose (op, dY) pairs it yields."""
    later: list[tuple[SavedOp, torch.Tensor]] = []
    _COLLECTORS.append(later)
    try:
        yield later
    finally:
        _COLLECTORS.pop()


# --------------------------------------------------------------------------------- executor
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
