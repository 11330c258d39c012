"""`shardwise demo ddp` and `shardwise demo zero`: data parallelism on real ranks.

ddp: the bucketed, hook-driven reducer (`runtime.data_parallel`) with gradient accumulation vs
PyTorch's DistributedDataParallel and the single-process full-batch gradient; bytes vs SPEC §5.
zero: ZeRO-0..3 (`runtime.zero`) trained a few Adam steps vs PyTorch DDP and the full batch;
state per rank vs SPEC §2, bytes per step vs SPEC §5.

`ddp_rank`, `zero_rank` and `zero_rank_all_stages` run inside each rank and return plain
numbers (the tests run them in float64 with tight tolerances); `run_*_demo` launches them and
returns rows as `demos.common.check_row`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.demos.common import TOL, check_row, dtype_of, flat_grads, max_rel_diff, mse
from shardwise.estimate.comm import dp_step_comm_bytes
from shardwise.estimate.memory import StateBytes, zero_state_bytes
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.data_parallel import BucketedDataParallel, DDPConfig
from shardwise.runtime.launch import launch
from shardwise.runtime.mesh import Mesh
from shardwise.runtime.zero import ZeroConfig, ZeroDataParallel

__all__ = ["ddp_rank", "run_ddp_demo", "run_zero_demo", "zero_rank", "zero_rank_all_stages"]


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 8)).to(dtype)


def ddp_rank(dtype_name: str, micro_batches: int, bucket_cap_bytes: int,
             per_rank_batch: int = 4) -> dict[str, Any]:
    """Gradients of one accumulation step: bucketed / PyTorch DDP vs full batch."""
    dtype = dtype_of(dtype_name)
    r, n = dist.get_rank(), dist.get_world_size()
    Mesh.from_layout(Layout(dp=n))
    model = _mlp(dtype)
    gen = torch.Generator().manual_seed(1)
    batch = per_rank_batch * n
    x = torch.randn(batch, 16, generator=gen).to(dtype)
    y = torch.randn(batch, 8, generator=gen).to(dtype)
    xs, ys = x.chunk(n)[r], y.chunk(n)[r]  # this rank's shard of the global batch
    mx, my = xs.chunk(micro_batches), ys.chunk(micro_batches)

    full = copy.deepcopy(model)  # single-process reference on the whole batch
    mse(full, x, y).backward()
    g_full = flat_grads(full)

    bucketed = BucketedDataParallel(copy.deepcopy(model), "dp", DDPConfig(bucket_cap_bytes))
    with C.counting() as counter:
        for i, (a, b) in enumerate(zip(mx, my)):
            if i < micro_batches - 1:
                with bucketed.no_sync():
                    (mse(bucketed, a, b) / micro_batches).backward()
            else:
                (mse(bucketed, a, b) / micro_batches).backward()

    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    for i, (a, b) in enumerate(zip(mx, my)):
        if i < micro_batches - 1:
            with ddp.no_sync():
                (mse(ddp, a, b) / micro_batches).backward()
        else:
            (mse(ddp, a, b) / micro_batches).backward()

    g_bucketed = flat_grads(bucketed.module)
    g_ddp = flat_grads(ddp.module)
    n_params = sum(p.numel() for p in model.parameters())
    elt = torch.finfo(dtype).bits // 8
    return {
        "bucketed_vs_full": max_rel_diff(g_bucketed, g_full),
        "ddp_vs_full": max_rel_diff(g_ddp, g_full),
        "bucketed_vs_ddp": max_rel_diff(g_bucketed, g_ddp),
        "grads": g_bucketed,
        "buckets": len(bucketed.buckets),
        "bytes": counter.bytes(axis="dp"),
        "calls": counter.calls(axis="dp"),
        "predicted": dp_step_comm_bytes(n_params, n, 0, grad_bytes=elt),
    }


def run_ddp_demo(ranks: int = 2, dtype: str = "float32", micro_batches: int = 2,
                 bucket_cap_bytes: int = 1024, timeout_s: float = 120) -> list[dict[str, Any]]:
    """Bucketed (hook-overlapped, accumulating) DDP vs PyTorch DDP vs full batch."""
    res = launch(ddp_rank, ranks, dtype, micro_batches, bucket_cap_bytes,
                 timeout_s=timeout_s, backend="gloo")
    tol = f"≤ {TOL[dtype]:g}"
    agree = max(float((o["grads"] - res[0]["grads"]).abs().max()) for o in res)
    return [
        check_row(f"PyTorch DDP vs full batch ({dtype}, max rel. diff)",
                  max(o["ddp_vs_full"] for o in res), tol),
        check_row(f"bucketed hooks, {res[0]['buckets']} buckets, {micro_batches} micro-batches, vs "
                  "full batch", max(o["bucketed_vs_full"] for o in res), tol),
        check_row("bucketed vs PyTorch DDP", max(o["bucketed_vs_ddp"] for o in res), tol),
        check_row(f"rank agreement over {ranks} ranks (max abs diff)", agree, "≤ 0"),
        check_row("bytes sent per rank per step (measured vs dp_step_comm_bytes)", res[0]["bytes"],
                  res[0]["predicted"]),
    ]


# ------------------------------------------------------------------------------- ZeRO
def _zero_mlp(dtype: torch.dtype, n: int) -> nn.Module:
    """Three units of 16·w, w·w and w·8 parameters with w = 4N: every unit splits evenly over
    N ranks, so no padding blurs the comparison with SPEC §2."""
    torch.manual_seed(0)
    w = 4 * n
    return nn.Sequential(nn.Linear(16, w, bias=False), nn.Tanh(), nn.Linear(w, w, bias=False),
                         nn.Tanh(), nn.Linear(w, 8, bias=False)).to(dtype)


def zero_rank(stage: int, dtype_name: str = "float64", steps: int = 3,
              lr: float = 1e-2) -> dict[str, Any]:
    """Train `steps` Adam steps with ZeRO-`stage`, PyTorch DDP and full batch; compare."""
    dtype = dtype_of(dtype_name)
    r, n = dist.get_rank(), dist.get_world_size()
    Mesh.from_layout(Layout(dp=n, zero=stage))
    model = _zero_mlp(dtype, n)
    full = copy.deepcopy(model)
    opt_full = torch.optim.Adam(full.parameters(), lr=lr, foreach=False)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt_ddp = torch.optim.Adam(ddp.parameters(), lr=lr, foreach=False)
    zero = ZeroDataParallel(copy.deepcopy(model), ZeroConfig(stage=stage, lr=lr), "dp")
    per_step: list[float] = []
    state: dict[str, int] = {}
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4 * n, 16, generator=gen).to(dtype)
        y = torch.randn(4 * n, 8, generator=gen).to(dtype)
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]
        opt_full.zero_grad()
        mse(full, x, y).backward()
        opt_full.step()
        opt_ddp.zero_grad()
        mse(ddp, xs, ys).backward()
        opt_ddp.step()
        zero.events.clear()
        with C.counting() as counter:
            mse(zero, xs, ys).backward()
            state = zero.state_bytes()  # grads in their persistent form, moments exist
            zero.step()
        zero.zero_grad()
        per_step.append(counter.bytes(axis="dp"))
    params = zero.full_parameters()
    vs_ddp = max(max_rel_diff(params[k], v.detach()) for k, v in ddp.module.named_parameters())
    vs_full = max(max_rel_diff(params[k], v.detach()) for k, v in full.named_parameters())
    bitwise = all(torch.equal(params[k], v.detach()) for k, v in ddp.module.named_parameters())
    elt = torch.finfo(dtype).bits // 8
    p = zero.n_params
    return {"vs_ddp": vs_ddp, "vs_full": vs_full, "bit_identical_to_ddp": bitwise,
            "state": state, "n_params": p,
            # SPEC §2 with fp64 weights and grads, Adam's two moments, no master copy.
            "predicted_state": dict(zip(("weights", "grads", "optimizer"), zero_state_bytes(
                p, n, stage, StateBytes(elt, elt, 0, 2 * elt)))),
            "bytes_per_step": per_step,
            "predicted_bytes": dp_step_comm_bytes(p, n, stage, grad_bytes=elt,
                                                  weight_bytes=elt),
            "events": list(zero.events)}


def zero_rank_all_stages(dtype_name: str, steps: int) -> list[dict[str, Any]]:
    """`zero_rank` for stages 0, 1, 2 and 3 in turn."""
    return [zero_rank(stage, dtype_name, steps) for stage in range(4)]


def run_zero_demo(ranks: int = 2, dtype: str = "float64", steps: int = 3,
                  timeout_s: float = 120) -> list[dict[str, Any]]:
    """ZeRO-0..3: parameters after `steps` Adam steps vs DDP; state and traffic vs SPEC §2."""
    res = launch(zero_rank_all_stages, ranks, dtype, steps, timeout_s=timeout_s, backend="gloo")
    rows = []
    for stage in range(4):
        o = res[0][stage]
        rows.append(check_row(f"ZeRO-{stage}: params after {steps} Adam steps vs PyTorch DDP "
                              f"({dtype}, max rel. diff)",
                              max(r[stage]["vs_ddp"] for r in res), f"≤ {TOL[dtype]:g}"))
        measured = sum(o["state"].values())
        rows.append(check_row(f"ZeRO-{stage}: state bytes per rank (w + g + Adam moments)",
                              measured, sum(o["predicted_state"].values())))
        rows.append(check_row(f"ZeRO-{stage}: bytes sent per rank per step",
                              o["bytes_per_step"][-1], o["predicted_bytes"]))
    return rows
