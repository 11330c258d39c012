"""Multi-GPU steps: NCCL collectives against the ring model, and `shardwise` run as a user runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from gpu_check.config import Context
from gpu_check.notebook import Notebook, _sync, check_item

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def collectives_rank(ctx: Context, path: str) -> None:
    """Each collective over the world against message size through `runtime.collectives`
    (what training calls): the slowest rank's mean call, every rank making the same calls."""
    import torch.distributed as dist

    world = dist.get_world_size()
    note = Notebook(path) if dist.get_rank() == 0 else None
    for op in COLLECTIVES:
        for size in ctx.sizes.collective_sizes:
            n = size // 4 // world * world  # fp32 elements, divisible by the ranks
            seconds = _collective_seconds(op, n, 20 if size < 2**24 else 5)
            if note is not None:
                note(f"{op} {4 * n}", {"op": op, "ranks": world, "bytes": 4 * n,
                                       "seconds": seconds})


def _collective_seconds(op: str, n: int, calls: int) -> float:
    """The mean of `calls` back-to-back calls of `op` on `n` fp32 elements over the world,
    after one untimed call and a barrier; the slowest rank's."""
    import torch
    import torch.distributed as dist

    from shardwise.runtime import collectives as C
    from shardwise.runtime import launch

    device, world = launch.device(), dist.get_world_size()
    full = torch.ones(n, device=device)
    part = torch.ones(n // world, device=device)
    out = torch.empty_like(full)
    call = {"all-reduce": lambda: C.all_reduce(full),
            "reduce-scatter": lambda: C.reduce_scatter(part, full),
            "all-gather": lambda: C.all_gather(full, part),
            "all-to-all": lambda: C.all_to_all_single(out, full)}[op]
    call()
    C.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    _sync(device)
    mean = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64,
                        device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean)


def collective_checks(items: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """Bus bandwidth (nccl-tests' convention) against the step model's ring on the preset's
    calibrated intra-node link (reported)."""
    from shardwise.calibration import default_calibration
    from shardwise.estimate.comm import bus_bandwidth, collective_time
    from shardwise.hardware import get_accelerator, get_link

    link = default_calibration(label).link(get_link(get_accelerator(label).intra))
    checks = []
    for p in items.values():
        predicted = collective_time(p["op"], p["bytes"], p["ranks"], link)
        measured = bus_bandwidth(p["op"], p["bytes"], p["ranks"], p["seconds"])
        checks.append(check_item(
            f"{p['op']} {p['ranks']} ranks {p['bytes']} B: busbw / model − 1",
            measured / bus_bandwidth(p["op"], p["bytes"], p["ranks"], predicted) - 1, None,
            f"measured {measured / 1e9:.2f} GB/s; model {link.name} ring"))
    return checks


def _cli(args: list[str], timeout: float) -> dict[str, Any]:
    """`python -m shardwise ARGS --json` (what a user runs) within `timeout`: its JSON."""
    done = subprocess.run([sys.executable, "-m", "shardwise", *args, "--json"],
                          capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode not in (0, 1):  # 1: `check` with rows that miss their target
        raise RuntimeError(f"shardwise {' '.join(args)}: exit {done.returncode}: "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


