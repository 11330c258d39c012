"""`shardwise calibrate`: measure this machine and fit the step-time model's constants.

Measured, each on the ranks the runtime trains on (spawned with `launch.spawn`: one thread
per rank, `OMP_NUM_THREADS=1`, the same processes `shardwise train` starts):

    GEMM         `(M×K)·(K×N)` over a grid of shapes → P∞ and d½ of
                 `t = 2MKN / (P∞·Π d/(d+d½))` (`calibration.fit.fit_matmul`)
    memory       a copy (the machine's "HBM" bandwidth, 2 bytes moved per byte copied) and
                 the memory-bound kernels the model charges by bytes: RMSNorm (read + write),
                 a residual add (2 reads + 1 write), softmax (read + write) → `hbm_efficiency`
                 = kernels' fitted bandwidth ÷ the copy's
    attention    the runtime's attention core (`runtime.model.AttentionFunction`, forward +
                 backward) → `attention_efficiency` in the model's convention: causal
                 forward FLOPs `2·s²·d·heads` (the half of the square that is needed), backward
                 2.5× (`estimate.compute._attention_core`), at `P∞·η·d/(d+d½)`
    host ops     one of the runtime's own Transformer blocks at a tiny size (d = 16, s = 8:
                 its kernels take next to nothing), forward + backward, timed and its aten
                 ops counted with a `TorchDispatchMode`: seconds per aten op, the host's fixed
                 cost (Python, modules, autograd, dispatcher, launch) that the model charges
                 for each op the runtime dispatches (`estimate.compute.host_ops`; on a CPU
                 the tiny models are bound by it) — a probe, kept in the file for reference
    steps        training steps of the `tiny` model on one rank, through `runtime.train`
                 → `kernel_overhead`: the per-op cost at which the step model's one-rank
                 step matches them (`fit_scale`, everything else held). The probe block
                 alone came out low: in five calibrations on this machine the model with the
                 probe's figure was 4–25 % under the measured one-rank step, every time
                 (a step's ops also pay the training loop's hooks, the optimizer's Python
                 and the allocator at real sizes). Only one-rank steps are fitted: every
                 layout `check` compares is a prediction
    kept in step the same one-rank steps on a rank per core at once (`Mesh.alone`: each
                 rank its own model), the ranks meeting once a step in the loss's and
                 gradient norm's all-reduces over the world; `kernel_overhead` fitted again
                 on the time outside those calls, over the same fit on the steps alone timed
                 just before; the median of `FACTOR_ROUNDS` such pairs →
                 `synced_host_factor`, which the preset charges to layouts of more than one
                 rank (`calibration.machine`); `check` times the same pair again between a
                 layout's steps (`measure._Reference`)
    collectives  all-reduce, reduce-scatter, all-gather, all-to-all over groups of 2…N ranks
                 and a p2p exchange between two (one way = half), against message size,
                 through `runtime.collectives` (what training calls, waiting as it
                 waits: polling where a layout of the group's size would have a core per
                 rank, `collectives.ranks_running`), each call after
                 about a layer's forward of host work and without a barrier (as training
                 calls them: the ranks' wake-up and drift are part of the cost), the mean
                 call (a step pays the tail: on this machine 5–10 % of small gloo calls take
                 4–15 ms against a median of 0.4 ms, and the mean is 3–4× the median); with
                 more ranks than cores once more with all ranks busy in side-by-side groups
                 ("op/n@ranks"; with more ranks running than cores a call is charged the
                 CPU time it burns × ranks/cores, not its wall time: `_group_seconds`)
                 → one α-β link
                 `t = rounds·α + bytes/β` with SPEC §5's ring rounds and bytes on the wire
                 (`calibration.fit.fit_alpha_beta`), then at that β a fixed cost per call
                 for each collective and group size, `t = α_call + bytes/β`, the mean
                 over its messages under `PER_CALL_BELOW` (`fit_per_call`; the step model
                 charges it instead of the rounds' α: on gloo a small call costs about the
                 same with one ring round or two), and a fit per collective for reference;
                 a group of more ranks than cores is time-sliced, so its times are divided
                 by ranks/cores before the fit (the preset multiplies them back)

Not measured (the built-in value is kept, and the file says so): `dp_bucket_bytes`,
`overlap_contention`. The compute timings are the median of several repeats, the collectives
the mean of many calls: `shardwise check` compares the median step, and the pauses a shared
machine puts into a typical block are in a typical step too (the fastest block describes a
quieter machine than the steps run on); on a loaded machine the figures are still noisy.
`time_layout_calls` re-times one call of each collective on a layout's own groups, for
`shardwise check`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from shardwise.arch import get_model
from shardwise.calibration import Calibration, default_calibration, load_calibration
from shardwise.calibration.fit import (
    fit_alpha_beta,
    fit_matmul,
    fit_per_call,
    fit_scale,
    matmul_seconds,
    relative_residuals,
)
from shardwise.calibration.machine import THIS_MACHINE, MachineSpec, cluster_of, read_machine
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import ring_bytes_on_wire, ring_steps
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime import launch

if TYPE_CHECKING:
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.train import TrainState

__all__ = ["Plan", "calibrate", "host_cost_now", "one_rank_state", "one_rank_steps",
           "plot_calibration", "step_outside_world", "time_layout_calls"]

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
KiB, MiB = 1024, 1024**2
# The fixed cost per call is fitted on messages under this size, where it dominates: above,
# `t − bytes/β` carries the error of one β for every collective (p2p alone fits ~3.7 GB/s
# against the link's ~2.2; its 4 MiB point came out 0.4 ms *under* its bytes at the link's β).
PER_CALL_BELOW = MiB


@dataclass(frozen=True)
class Plan:
    """What to measure: `quick` is seconds, the default about two minutes on 2 cores."""

    backend: str = "gloo"
    ranks: int = 2
    quick: bool = False

    def validate(self) -> Plan:
        if self.backend not in ("gloo", "nccl"):
            raise ShardwiseError(f"backend must be gloo or nccl, got {self.backend!r}")
        if self.ranks < 2:
            raise ShardwiseError(f"--ranks must be ≥ 2 (collectives need two), got {self.ranks}")
        if self.backend == "nccl" and torch.cuda.device_count() < self.ranks:
            raise ShardwiseError(f"--backend nccl needs {self.ranks} GPUs, this machine has "
                                 f"{torch.cuda.device_count()}; use --backend gloo")
        return self

    @property
    def dims(self) -> tuple[int, ...]:
        return (32, 64, 128, 256) if self.quick else (16, 32, 64, 128, 256, 512)

    @property
    def sizes(self) -> tuple[int, ...]:
        return ((4 * KiB, 256 * KiB, 2 * MiB) if self.quick
                else (1 * KiB, 16 * KiB, 128 * KiB, 1 * MiB, 4 * MiB))

    def calls(self, size: int) -> int:
        """Calls timed per collective point: small calls many times (their cost has a long
        tail, so the mean needs many samples), large ones fewer."""
        if self.quick:
            return 16
        return 120 if size < MiB else 24

    @property
    def groups(self) -> tuple[int, ...]:
        if self.quick:
            return (2,)
        powers = [g for g in (2, 4, 8, 16, 32) if g < self.ranks]
        return (*powers, self.ranks)


# ------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], Any], device: torch.device, budget: float = 0.05,
             repeats: int = 5) -> float:
    """The median of `repeats` blocks, per call; each block runs enough calls to last about
    `budget / repeats` seconds (one warm-up call first). The median, not the fastest: the
    prediction is compared with the median step (module docstring)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(budget / repeats / once))
    blocks = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        blocks.append((time.perf_counter() - start) / calls)
    return statistics.median(blocks)


# ---------------------------------------------------------------- one rank: compute side
def _matmuls(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[list[float]]:
    dims = plan.dims
    shapes = {(d, d, d) for d in dims}
    shapes |= {(dims[-1], d, dims[-1]) for d in dims} | {(d, dims[-1], dims[-2]) for d in dims}
    points = []
    for m, k, n in sorted(shapes):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        points.append([m, k, n, _seconds(lambda a=a, b=b: a @ b, device)])
    return points


def _memory(plan: Plan, device: torch.device, dtype: torch.dtype
            ) -> tuple[list[list[float]], list[list[Any]]]:
    """(copy points [bytes moved, s], kernel points [kernel, bytes moved, s])."""
    from shardwise.runtime.model import RMSNorm

    elems = [2**e for e in ((16, 18, 20) if plan.quick else (14, 16, 18, 20, 22))]
    size = torch.tensor([], dtype=dtype).element_size()
    copy, kernels = [], []
    for n in elems:
        x = torch.randn(n // 64, 64, device=device, dtype=dtype)
        y = torch.empty_like(x)
        norm = RMSNorm(64, dtype=dtype).to(device)
        copy.append([2 * n * size, _seconds(lambda x=x, y=y: y.copy_(x), device)])
        with torch.no_grad():
            kernels.append(["rmsnorm", 2 * n * size, _seconds(lambda x=x, f=norm: f(x), device)])
        kernels.append(["add", 3 * n * size,
                        _seconds(lambda x=x, y=y: torch.add(x, y, out=y), device)])
        kernels.append(["softmax", 2 * n * size,
                        _seconds(lambda x=x: torch.softmax(x, dim=-1), device)])
    return copy, kernels


def _attention(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[list[float]]:
    """[s, d, heads, seconds of forward + backward] of the runtime's (flash) attention."""
    from shardwise.runtime.model import local_attention

    core = local_attention(causal=True, flash=True)
    shapes = ([(128, 16), (256, 32)] if plan.quick
              else [(128, 16), (256, 16), (256, 32), (512, 32)])
    heads, points = 4, []
    for s, d in shapes:
        q, k, v = (torch.randn(1, s, heads, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, s, heads, d, device=device, dtype=dtype)

        def run(q=q, k=k, v=v, grad=grad) -> None:
            core(q, k, v).backward(grad)

        points.append([s, d, heads, _seconds(run, device, budget=0.1)])
    return points


# The layer `_host_op_seconds` times: the runtime's own block at a size where its kernels are
# negligible next to the host's cost of dispatching them (d = 16, s = 8: every GEMM ≤ 4k FLOPs)
HOST_PROBE = {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "d_ff": 32, "seq": 8}


def _host_op_seconds(device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    """(seconds per aten op, aten ops per call) of one of the runtime's own Transformer
    blocks (`runtime.model.Block`: RMSNorm, attention with RoPE and GQA, SwiGLU, the
    residuals), forward and backward, at `HOST_PROBE`'s tiny size, its aten ops counted with
    a `TorchDispatchMode`. The ops of a training step pay the same Python, `nn.Module`,
    autograd-`Function` and dispatcher costs per op; a chain of bare ops (a 4×8 linear, a
    scale, an add) measured half of that on this machine (2.2 against 4.2 µs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.runtime.model import Transformer

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    probe = dict(HOST_PROBE)
    seq = probe.pop("seq")
    spec = replace(get_model("tiny"), name="host-probe", n_layers=1, max_seq=seq, **probe)
    model = Transformer(spec, dtype=dtype).to(device)
    x = torch.randn(1, seq, spec.d_model, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq, device=device)

    def layer() -> None:
        model.run_blocks(x, range(1), positions).sum().backward()

    layer()
    with Count():
        layer()
    return _seconds(layer, device, budget=0.6, repeats=12) / Count.ops, Count.ops


STEP_CONFIGS = ((64, 1), (128, 2))  # (seq_len, micro-batch) of the one-rank tiny steps
REFERENCE_STEP = STEP_CONFIGS[0]  # the one `shardwise check --calibration` re-times
STEPS = 16
# rounds of (alone, kept in step) for `synced_host_factor`: the median of their ratios (one
# pair swung 0.81–1.31 back to back on a loaded VM)
FACTOR_ROUNDS = 3


def one_rank_steps(dtype_name: str, configs: tuple[tuple[int, int], ...],
                   steps: int = STEPS, synced: bool = False) -> list[list[float]]:
    """[seq_len, micro_batch, median step after the first, seconds] of `tiny` on one rank
    (global batch 8 sequences), through `runtime.train` as `shardwise train` runs it — what
    `kernel_overhead` is fitted on (here and, timed beside a run, by `shardwise check`). The
    configurations take turns step by step, so that a slow spell of a shared machine falls
    on both alike (one measured after the other, a spell once put 46 % on one of them).

    `synced`: every rank of the process group trains its own one-rank model at once
    (`Mesh.alone`), the ranks meeting in the loss's and gradient norm's all-reduces over the
    world once a step; the seconds outside those calls."""
    from shardwise.runtime.mesh import Mesh

    states = [one_rank_state(dtype_name, seq, mbs, Mesh.alone() if synced else None)
              for seq, mbs in configs]
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(steps):
        for state, spent in zip(states, times, strict=True):
            spent.append(step_outside_world(state))
    return [[seq, mbs, statistics.median(spent[1:])]
            for (seq, mbs), spent in zip(configs, times, strict=True)]


def step_outside_world(state: TrainState) -> float:
    """One training step of `state`; its seconds outside the all-reduces over the world (the
    loss's and gradient norm's: where one-rank models on `Mesh.alone()` meet)."""
    from shardwise.runtime.train import train_step

    with C.clocking() as waited:
        seconds = train_step(state).seconds
    return seconds - waited["world"]


def one_rank_state(dtype_name: str, seq: int, mbs: int, mesh: Mesh | None = None
                   ) -> TrainState:
    """The training state of `tiny` on one rank, global batch 8 sequences of `seq` tokens in
    micro-batches of `mbs` (`one_rank_steps`; `mesh`: `Mesh.alone()` inside a larger group)."""
    from shardwise.runtime.train import TrainConfig, build

    return build(TrainConfig(get_model("tiny"), Layout(micro_batch=mbs), seq_len=seq,
                             global_batch=8, dtype=dtype_name, steps=STEPS), mesh)


def _step_plan(plan: Plan) -> tuple[tuple[tuple[int, int], ...], int]:
    """(configurations, steps) of the one-rank steps: one configuration, 3 steps `--quick`."""
    return (STEP_CONFIGS[:1], 3) if plan.quick else (STEP_CONFIGS, STEPS)


def _synced_ranks(plan: Plan, dtype_name: str) -> list[list[float]]:
    """`one_rank_steps(synced=True)` on every rank; each point's seconds the ranks' mean."""
    mine = one_rank_steps(dtype_name, *_step_plan(plan), synced=True)
    seconds = torch.tensor([p[2] for p in mine], dtype=torch.float64)
    dist.all_reduce(seconds)
    return [[seq, mbs, float(t) / dist.get_world_size()]
            for (seq, mbs, _), t in zip(mine, seconds, strict=True)]


def _compute_rank(plan: Plan) -> dict[str, Any]:
    device = launch.device()
    dtype_name, dtype = "fp32", torch.float32  # what the runtime trains in (or fp64)
    torch.manual_seed(0)
    copy, kernels = _memory(plan, device, dtype)
    one = torch.ones(1, device=device, dtype=dtype)
    op_seconds, op_count = _host_op_seconds(device, dtype)
    return {"device": str(device), "dtype": dtype_name,
            "launch": _seconds(lambda: torch.add(one, one, out=one), device),
            "host_ops": [op_seconds, op_count],
            "matmul": _matmuls(plan, device, dtype), "copy": copy, "kernels": kernels,
            "attention": _attention(plan, device, dtype),
            "steps": one_rank_steps(dtype_name, *_step_plan(plan))}


# ------------------------------------------------------------------- N ranks: collectives
def _collective_ranks(plan: Plan, busy: bool = False) -> list[list[Any]] | None:
    """[op, ranks, bytes (full tensor), seconds] on rank 0 (None elsewhere). `busy`: every
    rank takes part at once, in disjoint groups of consecutive ranks (as a layout with more
    ranks than one group runs its groups side by side), else only the first group of each
    size runs and the other ranks wait (each member has a core to itself when it fits)."""
    device = launch.device()
    me, world = dist.get_rank(), dist.get_world_size()
    points: list[list[Any]] = []
    sizes = [g for g in plan.groups if g < world] if busy else plan.groups
    for g in sizes:
        groups = [dist.new_group(list(range(k, k + g)), timeout=launch.group_timeout())
                  for k in range(0, world - g + 1, g)]
        mine = me // g if me // g < len(groups) and (busy or me < g) else None
        for op in COLLECTIVES:
            for size in plan.sizes:
                n = size // 4 // g * g  # fp32 elements, divisible by the group
                if mine is not None:
                    call = _collective_call(op, n, g, groups[mine], device)
                    seconds = _group_seconds(call, groups[mine], device, plan.calls(size),
                                             world if busy else g)  # ranks running at once
                    if me == 0:
                        points.append([op, g, 4 * n, seconds])
        dist.barrier()
    pairs = [dist.new_group([k, k + 1], timeout=launch.group_timeout())
             for k in range(0, world - 1, 2)]
    for size in plan.sizes:  # p2p within pairs (2k, 2k+1): an exchange, one way = half
        peer = me ^ 1
        if peer < world and (busy or me < 2):
            call = _exchange(torch.ones(size // 4, device=device), me % 2 == 0, peer)
            seconds = _group_seconds(call, pairs[me // 2], device, plan.calls(size),
                                     world if busy else 2) / 2
            if me == 0:
                points.append(["p2p", 2, 4 * (size // 4), seconds])
        dist.barrier()
    return points if me == 0 else None


def _collective_call(op: str, n: int, g: int, group: Any, device: torch.device
                     ) -> Callable[[], Any]:
    """One `op` on `n` fp32 elements (the full tensor) over `group` of `g` ranks."""
    full = torch.ones(n, device=device)
    part = torch.ones(n // g, device=device)
    out = torch.empty_like(full)
    calls: dict[str, Callable[[], Any]] = {
        "all-reduce": lambda: C.all_reduce(full, group),
        "reduce-scatter": lambda: C.reduce_scatter(part, full, group),
        "all-gather": lambda: C.all_gather(full, part, group),
        "all-to-all": lambda: C.all_to_all_single(out, full, group=group),
    }
    return calls[op]


def _exchange(buf: torch.Tensor, first: bool, peer: int) -> Callable[[], None]:
    """What a ring-attention hop and a pipeline's send/receive pair do with global rank
    `peer`: the `first` side sends then receives, the other receives then sends."""
    def call() -> None:
        if first:
            C.send(buf, peer)
            C.recv(buf, peer)
        else:
            C.recv(buf, peer)
            C.send(buf, peer)
    return call


def _host_work(device: torch.device) -> float:
    """About a layer's forward of host work (on this machine's tiny models what the runtime
    does between two collectives): 24 small GEMMs, each followed by an activation, on
    (64 × 64) tensors; returns the seconds it took."""
    start = time.perf_counter()
    work = torch.full((64, 64), 1 / 64, device=device)
    for _ in range(24):
        work = torch.tanh(work @ work)
    _sync(device)
    return time.perf_counter() - start


def _group_seconds(call: Callable[[], Any], group: Any, device: torch.device,
                   repeats: int, active: int) -> float:
    """The mean call as training makes them: each after some host work (`_host_work`, about
    a layer's forward) and with no barrier, so a rank's wake-up and the ranks' drift while
    they compute count as they do in a step (the wait grows with the work before a call:
    after 72 tiny ops a small all-reduce took 1.1 ms, after ten times as many 1.7 ms); the
    slowest member's mean (max all-reduce). The mean, not the median: a step pays every call,
    the slow tail too (module docstring).

    With more `active` ranks than cores (a CPU), the cores are time-sliced and a rank that
    waits in a call leaves its core to the others: what a call costs the step is then the CPU
    time it burns (`time.process_time`: the rank's threads, gloo's included), shared like
    compute — the group's mean × active/cores. Measured (8 ranks on 2 cores, side-by-side
    pairs, 24 small GEMMs then a small all-reduce, 100 rounds): the round took 14.5 ms and
    (work + call CPU seconds) × 8/2 = 14.4 ms; with groups of 4, 21.5 and 20.6 ms — while
    the call's wall time counts the waits in which other ranks ran."""
    wall = cpu = 0.0
    with C.ranks_running(active):  # they wait as a layout of `active` ranks does
        call()
        for _ in range(repeats):
            _host_work(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            _sync(device)
            wall += time.perf_counter() - start
            cpu += time.process_time() - start_cpu
    cores = len(os.sched_getaffinity(0))
    if device.type == "cpu" and active > cores:
        mean = torch.tensor([cpu / repeats * active / cores], dtype=torch.float64)
        dist.all_reduce(mean, group=group)
        return float(mean) / dist.get_world_size(group)
    mean = torch.tensor([wall / repeats], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
    return float(mean)


# ------------------------------------------------------- a layout's own groups, right now
# the collectives each axis of the runtime calls (the step model charges them per call; pp:
# the stages' per-step agreement all-gather too)
AXIS_CALLS = {"tp": ("all-reduce", "reduce-scatter", "all-gather"), "cp": ("p2p",),
              "cp_a2a": ("all-to-all",),  # Ulysses' (the whole cp group) or the hybrid's
              "pp": ("p2p", "all-gather"), "ep": ("all-to-all",), "dp": ("all-reduce",),
              "world": ("all-reduce",)}


def time_layout_calls(axis: Callable[[str], Any], calls: int,
                      dispatch_rows: tuple[int, int] | None = None) -> dict[str, float]:
    """The fixed cost of one call ("op/n", "p2p/2" one way) of every collective a layout's
    axes make, timed now on its own groups — every group of an axis at once, after the same
    host work as `calibrate`'s — as the slowest member's mean over `calls` calls. The host's
    collective costs drift on a shared machine (2× seen here within minutes): timed between
    the steps they describe (`measure.check_layout`), they leave the compute constants to the
    calibration file. `axis(name)` gives this rank's `AxisGroup`; every rank calls this
    together.

    The calls are small (256 fp32 elements), as `calibrate`'s per-call figures are — except
    the ep all-to-all, called as the MoE layer calls it (`expert_parallel_moe`): a
    `dispatch_rows` = (rows, h) message, the `T·k` rows one MoE call sends (`check` takes
    them from its checked steps), with explicit (even) splits. gloo's all-to-all cost steps up between 32 and 77 KB (measured
    here, 2 ranks, 7 rounds of 30 calls: 0.47–0.49 ms up to 8192 fp32 elements, 0.96–1.00 ms
    at 19,200), where the step model's `bytes/β` adds 10–20 µs, and an MoE layer's messages
    sit at that step (a micro-batch of `tiny-moe` dispatches 128 rows of 64: 32 KB, up to
    twice that received at the routing a run draws)."""
    device, world = launch.device(), dist.get_world_size()
    timed: dict[str, list[float]] = {}
    for name, ops in AXIS_CALLS.items():
        g = axis(name)
        if g.size < 2:
            continue
        for op in ops:
            if op == "p2p":  # pairs of neighbours (0, 1), (2, 3)…; an odd one out idles
                peer = g.rank ^ 1
                call = (_exchange(torch.ones(256, device=device), g.rank % 2 == 0,
                                  g.global_rank(peer)) if peer < g.size else lambda: None)
                key = "p2p/2"
                seconds = _group_seconds(call, g.group, device, calls, world) / 2
            else:
                key = f"{op}/{g.size}"
                call = (_dispatch(torch.ones(*dispatch_rows, device=device), g)[0]
                        if name == "ep" and dispatch_rows else
                        _collective_call(op, 256 // g.size * g.size, g.size, g.group, device))
                seconds = _group_seconds(call, g.group, device, calls, world)
            timed.setdefault(key, []).append(seconds)
    return {key: statistics.fmean(values) for key, values in timed.items()}


def _dispatch(x: torch.Tensor, g: Any) -> tuple[Callable[[], Any], torch.Tensor]:
    """An MoE dispatch over ep group `g` as the runtime calls it: this rank's rows x (N, h)
    split evenly over the ranks in order (the last takes the remainder), the splits given;
    (the call, the (N_recv, h) buffer it fills: from each rank in turn, the split for me)."""
    rows = x.shape[0]
    splits = [rows // g.size] * (g.size - 1) + [rows - rows // g.size * (g.size - 1)]
    out = x.new_empty(splits[g.rank] * g.size, *x.shape[1:])
    return (lambda: C.all_to_all_single(out, x, [splits[g.rank]] * g.size, splits, g)), out


# ---------------------------------------------------------------------------------- fits
def _wire_bytes(op: str, size: float, n: int) -> float:
    """Bytes one rank puts on the wire: a p2p message's own, a collective's by SPEC §5."""
    return size if op == "p2p" else ring_bytes_on_wire(op, size, n)


def _memory_bytes(device: str) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _clamped(value: float, notes: list[str], name: str) -> float:
    if value > 1:
        notes.append(f"{name} fitted {value:.3f} > 1 of the reference; stored as 1")
    return min(value, 1.0)


def fit_measurements(raw: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The calibration file (`calibration` format + `machine` + `measurements`) from the raw
    points: every constant fitted in the model's own form (module docstring)."""
    notes: list[str] = []
    mm = raw["matmul"]
    # the launch is timed apart; under load a tiny GEMM can come out faster than it
    launch_s = min(raw["launch"], 0.5 * min(p[3] for p in mm))
    gemm = fit_matmul(*zip(*mm, strict=True), launch=launch_s)
    copy = fit_alpha_beta([1] * len(raw["copy"]), *zip(*raw["copy"], strict=True))
    kern = fit_alpha_beta([1] * len(raw["kernels"]),
                          [p[1] for p in raw["kernels"]], [p[2] for p in raw["kernels"]])
    hbm = _clamped(kern.beta / copy.beta, notes, "hbm_efficiency")
    # attention: t = (3.5 · 2·s²·d·heads) / (P∞ · η · d/(d+d½)) → 1/η is a scale
    unit = [3.5 * 2 * s * s * d * h / (gemm.peak * d / (d + gemm.half_dim))
            for s, d, h, _ in raw["attention"]]
    attn = fit_scale([0.0] * len(unit), unit, [p[3] for p in raw["attention"]])
    attention = _clamped(1 / attn.scale, notes, "attention_efficiency")
    # collectives: one α-β link over every op and group size, and one per op for reference
    coll = raw["collectives"]

    cores = plan.ranks if plan.backend == "nccl" else len(os.sched_getaffinity(0))

    def rounds_bytes(points: list[list[Any]]) -> tuple[list[float], list[float], list[float]]:
        """Rounds, bytes on the wire and seconds of one rank with a core to itself: a group
        of n > cores ranks is time-sliced, its times ÷ n/cores (`calibration.machine`)."""
        r, b, t = [], [], []
        for op, n, size, seconds in points:
            r.append(1 if op == "p2p" else ring_steps(op, n))
            b.append(_wire_bytes(op, size, n))
            t.append(seconds / max(1.0, n / cores))
        return r, b, t

    link = fit_alpha_beta(*rounds_bytes(coll))
    per_op = {}
    for op in (*COLLECTIVES, "p2p"):  # for reference; noise may defeat a fit on few points
        try:
            per_op[op] = fit_alpha_beta(*rounds_bytes([p for p in coll if p[0] == op])).to_dict()
        except ShardwiseError as exc:
            per_op[op] = {"error": str(exc)}
    # a fixed cost per call for each collective and group size, at the link's β (the step
    # model charges it in place of the ring rounds' α: `estimate.step.group_collective_time`)
    # ("p2p/2": one message one way, half a ping-pong), on the messages where it dominates
    small = [p for p in coll if p[2] < PER_CALL_BELOW]
    _, wire, secs = rounds_bytes(small)
    per_call = fit_per_call([f"{op}/{n}" for op, n, *_ in small], wire, secs, link.beta)
    # and as measured with all `plan.ranks` ranks busy in side-by-side groups ("op/n@ranks",
    # not divided by the time-slicing: `calibration.machine.cluster_of` takes them as they
    # are for a layout of that many ranks)
    busy = [p for p in raw.get("collectives_busy") or [] if p[2] < PER_CALL_BELOW]
    if busy:
        wire = [_wire_bytes(op, size, n) for op, n, size, _ in busy]
        per_call |= fit_per_call([f"{op}/{n}@{plan.ranks}" for op, n, *_ in busy], wire,
                                 [p[3] for p in busy], link.beta)
    machine = MachineSpec(THIS_MACHINE, plan.backend, raw["dtype"], cores,
                          _memory_bytes(raw["device"]), gemm.peak, copy.beta, link.beta,
                          link.alpha,
                          per_call=tuple((k, f.scale) for k, f in per_call.items())).validate()
    per_group = {}
    for n in sorted({p[1] for p in coll}):  # α-β at each group size, for reference
        try:
            per_group[str(n)] = fit_alpha_beta(*rounds_bytes(
                [p for p in coll if p[1] == n])).to_dict()
        except ShardwiseError as exc:
            per_group[str(n)] = {"error": str(exc)}
    op_seconds, op_count = raw["host_ops"]
    probe = replace(default_calibration(), matmul_efficiency=1.0,
                    matmul_half_dim=gemm.half_dim, attention_efficiency=attention,
                    hbm_efficiency=hbm, kernel_overhead=op_seconds).validate()
    cal = replace(probe, kernel_overhead=_fit_host_cost(raw["steps"], machine, probe,
                                                        notes)).validate()
    steps = _step_residuals(raw["steps"], machine, cal)
    # the same steps with a rank on every core, kept in step, over the same steps alone just
    # before: the same fit on each, their ratio; the median over the rounds
    factors = [_fit_host_cost(synced, machine, probe, notes)
               / _fit_host_cost(alone, machine, probe, notes)
               for alone, synced in raw["synced_rounds"]]
    machine = replace(machine, synced_host_factor=statistics.median(factors)).validate()
    constants = {"matmul_efficiency": 1.0, "matmul_half_dim": gemm.half_dim,
                 "attention_efficiency": attention, "hbm_efficiency": hbm,
                 "kernel_overhead": cal.kernel_overhead}
    return {
        "_doc": [
            f"Written by `shardwise calibrate --backend {plan.backend} --ranks {plan.ranks}"
            f"{' --quick' if plan.quick else ''}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "machine: the 'this-machine' hardware preset (`--gpu this-machine --calibration "
            "FILE`): peak_flops is one rank's fitted GEMM asymptote P∞ (so matmul_efficiency "
            "= 1 by construction), memory_bandwidth one rank's copy bandwidth, link the α-β "
            "fitted over every collective (SPEC §5 ring rounds and bytes).",
            "Not measured, built-in values kept: dp_bucket_bytes, overlap_contention.",
            *notes,
        ],
        "default": constants,
        "machine": machine.to_dict(),
        "measurements": {
            "matmul": {"points [M, K, N, s]": mm, "launch_s": launch_s,  # the one fitted with
                       "launch_timed_s": raw["launch"],
                       "fit": gemm.to_dict()},
            "copy": {"points [bytes moved, s]": raw["copy"], "fit": copy.to_dict()},
            "memory_kernels": {"points [kernel, bytes moved, s]": raw["kernels"],
                               "fit": kern.to_dict()},
            "attention": {"points [s, d, heads, s fwd+bwd]": raw["attention"],
                          "fit (scale = 1/attention_efficiency)": attn.to_dict()},
            "host_ops": {"probe: seconds per aten op": op_seconds,
                         "aten ops of the probe block (forward + backward)": op_count,
                         "probe block": HOST_PROBE,
                         "fitted on the one-rank steps: seconds per aten op":
                             cal.kernel_overhead},
            "collectives": {"points [op, ranks, bytes, s]": coll, "fit": link.to_dict(),
                            f"points with all {plan.ranks} ranks busy [op, ranks, bytes, s]":
                                busy,
                            "per_op": per_op, "per_group_size": per_group,
                            "per_call (α_call of t = α_call + bytes/β)":
                                {k: f.to_dict() for k, f in per_call.items()}},
            "steps": steps,
            "synced_steps": {
                "rounds: points [seq, micro_batch, s] alone, then kept in step (s outside "
                "the all-reduces)": raw["synced_rounds"],
                "factor per round (fitted per-op cost kept in step ÷ alone)": factors},
        },
    }


def _predicted_steps(points: list[list[float]], machine: MachineSpec, cal: Calibration
                     ) -> list[float]:
    """The step model's one-rank `tiny` step (`estimate_step` on the "this machine" preset)
    for each [seq, micro_batch, s] point."""
    from shardwise.estimate.step import estimate_step
    from shardwise.layout import TrainSpec

    cluster, c = cluster_of(machine, cal, 1)
    return [estimate_step(get_model("tiny"), cluster, Layout(micro_batch=int(mbs)),
                          TrainSpec(seq_len=int(seq), global_batch=8, dtype="fp32"), c).total
            for seq, mbs, _ in points]


def _fit_host_cost(points: list[list[float]], machine: MachineSpec, probe: Calibration,
                   notes: list[str]) -> float:
    """`kernel_overhead` k at which the model's one-rank steps match the measured ones: one
    rank has no communication, so its predicted step is linear in k, `t = a + k·n` (a: the
    step at k = 0, n: its aten ops) — `fit_scale` (relative least squares). The probe's
    figure where the fit is degenerate (a note says so)."""
    k0 = probe.kernel_overhead
    base = _predicted_steps(points, machine, replace(probe, kernel_overhead=0.0))
    ops = [(t - a) / k0 for t, a in zip(_predicted_steps(points, machine, probe), base,
                                        strict=True)]
    k = fit_scale(base, ops, [p[2] for p in points]).scale
    if not k > 0:
        notes.append(f"kernel_overhead: the one-rank steps gave {k:.3g} s per op; the probe "
                     f"block's {k0:.3g} s kept")
        return k0
    return k


def host_cost_now(points: list[list[float]], path: str) -> float:
    """`kernel_overhead` refitted on one-rank steps timed later (`one_rank_steps`) than the
    calibration file `path`, everything else from the file: the host's cost per op as it is
    now (a shared machine's speed drifts 10–50 % within minutes here)."""
    notes: list[str] = []
    return _fit_host_cost(points, read_machine(path), load_calibration(THIS_MACHINE, path),
                          notes)


def _step_residuals(points: list[list[float]], machine: MachineSpec, cal: Calibration
                    ) -> dict[str, Any]:
    """The measured one-rank steps against the model's with the fitted constants (the
    residuals of the `kernel_overhead` fit)."""
    predicted = _predicted_steps(points, machine, cal)
    residuals = relative_residuals([p[2] for p in points], predicted)
    return {"points [seq, micro_batch, s]": points, "predicted_s": predicted,
            "residuals": residuals.tolist(),
            "rms": float(np.sqrt(np.mean(residuals ** 2))),
            "max_abs": float(np.max(np.abs(residuals)))}


# ------------------------------------------------------------------------------ the run
def calibrate(plan: Plan, progress: Callable[[str], None] = lambda msg: None
              ) -> dict[str, Any]:
    """Measure (one rank: compute; `plan.ranks` ranks: collectives) and fit; returns the
    calibration file's content."""
    plan.validate()
    progress("GEMMs, memory-bound kernels, attention, one-rank training steps")
    raw = launch.spawn(_compute_rank, 1, plan, timeout_s=600, backend=plan.backend)[0]
    ranks = plan.ranks if plan.backend == "nccl" else min(plan.ranks, len(os.sched_getaffinity(0)))
    rounds = 1 if plan.quick else FACTOR_ROUNDS
    progress(f"the one-rank steps alone, then on {ranks} ranks kept in step, × {rounds}")
    raw["synced_rounds"] = [
        [launch.spawn(one_rank_steps, 1, raw["dtype"], *_step_plan(plan), timeout_s=600,
                      backend=plan.backend)[0],
         launch.spawn(_synced_ranks, ranks, plan, raw["dtype"], timeout_s=600,
                      backend=plan.backend)[0]]
        for _ in range(rounds)]
    progress(f"collectives on {plan.ranks} ranks ({plan.backend})")
    raw["collectives"] = launch.spawn(_collective_ranks, plan.ranks, plan, timeout_s=600,
                                      backend=plan.backend)[0]
    if plan.ranks > len(os.sched_getaffinity(0)) and plan.backend == "gloo":
        progress(f"collectives with all {plan.ranks} ranks busy (more ranks than cores)")
        raw["collectives_busy"] = launch.spawn(_collective_ranks, plan.ranks, plan, True,
                                               timeout_s=600, backend=plan.backend)[0]
    progress("fitting")
    return fit_measurements(raw, plan)


def plot_calibration(data: dict[str, Any], path: str) -> None:
    """Measured points against the fitted curves: GEMM throughput, memory-bound kernels,
    collectives (matplotlib, `pip install 'shardwise[plot]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardwiseError("--plot needs matplotlib: pip install 'shardwise[plot]'") from None
    meas, machine = data["measurements"], data["machine"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    # GEMM: GFLOP/s against FLOPs
    mm = meas["matmul"]["points [M, K, N, s]"]
    fit = meas["matmul"]["fit"]
    flops = [2 * m * k * n for m, k, n, _ in mm]
    ax = axes[0]
    ax.scatter(flops, [f / t / 1e9 for f, (*_, t) in zip(flops, mm)], label="measured")
    launch = meas["matmul"]["launch_s"]
    fitted = [f / (launch + matmul_seconds(m, k, n, fit["peak_flops"], fit["half_dim"])) / 1e9
              for f, (m, k, n, _) in zip(flops, mm)]
    ax.scatter(flops, fitted, marker="x", label=f"fit P∞={fit['peak_flops'] / 1e9:.1f} "
                                                  f"GFLOP/s, d½={fit['half_dim']:.0f}")
    ax.set(xscale="log", xlabel="FLOPs of one GEMM (2MKN)", ylabel="GFLOP/s", title="GEMM")
    # memory-bound kernels: seconds against bytes moved
    ax = axes[1]
    for name, key in (("copy", "copy"), ("kernels", "memory_kernels")):
        pts = meas[key][next(k for k in meas[key] if k.startswith("points"))]
        f = meas[key]["fit"]
        xs = [p[-2] for p in pts]
        ax.scatter(xs, [p[-1] for p in pts], label=f"{name} measured")
        line = sorted(xs)
        ax.plot(line, [f["alpha"] + x / f["beta"] for x in line],
                label=f"{name} fit {f['beta'] / 1e9:.1f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="bytes moved", ylabel="s",
           title="memory-bound kernels")
    # collectives: seconds against size, fitted link
    ax = axes[2]
    link = machine["link"]
    for op, n, size, seconds in meas["collectives"]["points [op, ranks, bytes, s]"]:
        rounds = 1 if op == "p2p" else ring_steps(op, n)
        wire = _wire_bytes(op, size, n)
        sliced = max(1.0, n / machine["cores"])  # more ranks than cores: time-sliced
        model = sliced * (rounds * link["latency"] + wire / link["bandwidth"])
        ax.scatter(size, seconds, s=12, color=f"C{[*COLLECTIVES, 'p2p'].index(op)}")
        ax.scatter(size, model, s=12, marker="x", color=f"C{[*COLLECTIVES, 'p2p'].index(op)}")
    for i, op in enumerate((*COLLECTIVES, "p2p")):
        ax.scatter([], [], color=f"C{i}", label=op)
    ax.set(xscale="log", yscale="log", xlabel="message bytes (full tensor)", ylabel="s",
           title=f"collectives (o measured, x α-β: α={link['latency'] * 1e6:.0f} µs, "
                 f"β={link['bandwidth'] / 1e9:.2f} GB/s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    """[quantity, value, fit residual (rms / max, relative)] for the summary table."""
    meas, machine, const = data["measurements"], data["machine"], data["default"]

    def res(fit: dict[str, Any]) -> str:
        return f"{fit['rms']:.1%} / {fit['max_abs']:.1%}"

    link = machine["link"]
    rows = [
        ["GEMM asymptote P∞ (one rank)", f"{machine['peak_flops'] / 1e9:.2f} GFLOP/s "
                                         f"{machine['dtype']}", res(meas["matmul"]["fit"])],
        ["GEMM half dimension d½", f"{const['matmul_half_dim']:.1f}", ""],
        ["copy bandwidth (one rank)", f"{machine['memory_bandwidth'] / 1e9:.2f} GB/s",
         res(meas["copy"]["fit"])],
        ["hbm_efficiency (norm, add, softmax ÷ copy)", f"{const['hbm_efficiency']:.3f}",
         res(meas["memory_kernels"]["fit"])],
        ["attention_efficiency (causal convention)", f"{const['attention_efficiency']:.3f}",
         res(meas["attention"]["fit (scale = 1/attention_efficiency)"])],
        ["kernel_overhead (per aten op; fitted on the one-rank steps)",
         f"{const['kernel_overhead'] * 1e6:.2f} µs",
         f"probe block {meas['host_ops']['probe: seconds per aten op'] * 1e6:.2f} µs"],
        ["synced_host_factor (per-op cost of ranks kept in step ÷ alone)",
         f"{machine['synced_host_factor']:.3f}", ""],
        ["one-rank tiny step: model vs measured", ", ".join(
            f"{p * 1e3:.0f} vs {m[2] * 1e3:.0f} ms" for p, m in zip(
                meas["steps"]["predicted_s"], meas["steps"]["points [seq, micro_batch, s]"])),
         res(meas["steps"])],
        [f"link α ({machine['backend']})", f"{link['latency'] * 1e6:.1f} µs",
         res(meas["collectives"]["fit"])],
        [f"link β ({machine['backend']})", f"{link['bandwidth'] / 1e9:.3f} GB/s", ""],
    ]
    for n, fit in meas["collectives"]["per_group_size"].items():
        if "error" not in fit:
            rows.append([f"  {n} ranks: α, β", f"{fit['alpha'] * 1e6:.1f} µs, "
                                               f"{fit['beta'] / 1e9:.3f} GB/s", res(fit)])
    for op, fit in meas["collectives"]["per_op"].items():
        if "error" in fit:
            rows.append([f"  {op} alone", "no fit", fit["error"]])
            continue
        rows.append([f"  {op} alone: α, β", f"{fit['alpha'] * 1e6:.1f} µs, "
                                            f"{fit['beta'] / 1e9:.3f} GB/s", res(fit)])
    calls = meas["collectives"].get("per_call (α_call of t = α_call + bytes/β)", {})
    for key, fit in calls.items():  # what the step model charges per call (at the link's β)
        op, n = key.split("/")
        rows.append([f"  {op}, {n} ranks: per call", f"{fit['scale'] * 1e6:.1f} µs", res(fit)])
    rows.append(["cores, memory", f"{machine['cores']}, {machine['memory_bytes'] / 2**30:.1f} "
                                  "GiB", ""])
    return rows
