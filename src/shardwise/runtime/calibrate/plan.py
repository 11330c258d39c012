"""What `shardwise calibrate` measures (`Plan`: backend, ranks, grids) and its timer (`_seconds`:
the median of blocks of calls, synchronised on the device).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.errors import ShardwiseError

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


