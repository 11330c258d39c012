"""N ranks' collectives: each collective timed over group sizes and message sizes, and a
layout's own groups timed right now (`time_layout_calls`, used after each measured step).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime import collectives as C
from shardwise.runtime import launch
from shardwise.runtime.calibrate.plan import COLLECTIVES, Plan, _sync


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


