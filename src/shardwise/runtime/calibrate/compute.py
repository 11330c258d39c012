"""One rank's compute side: GEMMs, memory-bound kernels, attention, the host's cost per aten op,
and the one-rank training steps (alone and kept in step with other ranks).
What each fits: docs/concepts/runtime.md#calibration.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardwise.arch import get_model
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime import launch

if TYPE_CHECKING:
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.train import TrainState
from shardwise.runtime.calibrate.plan import Plan, _seconds


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


