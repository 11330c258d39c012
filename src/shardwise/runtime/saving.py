"""When a run saves and what each save cost: the training loop's checkpoint hook, the bytes a
checkpoint holds, this machine's disk bandwidth.

`Checkpoints` saves (`checkpoint.save_checkpoint`) after every `every` steps and after the last,
times each save and writes its bytes and seconds into the step's record (`StepRecord.
checkpoint_bytes`, `checkpoint_seconds`). With `every="auto"` it saves after the first step to
measure the write, then picks the interval by Daly's formula (`estimate.goodput.daly_interval`)
from the mean measured write time `δ` and the job's MTBF `M = H / ranks`, in whole steps of the
median step time so far, and picks it again after every save (`StepRecord.checkpoint_every`).
Rank 0's measurements decide, broadcast to every rank, so all save at the same steps.

Design notes: docs/concepts/runtime.md#runtime-saving.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardwise.estimate.goodput import DEFAULT_MTBF_GPU_HOURS, HOUR, daly_interval
from shardwise.runtime import collectives as C
from shardwise.runtime import launch
from shardwise.runtime.checkpoint import save_checkpoint

if TYPE_CHECKING:
    from shardwise.runtime.state import StepRecord, TrainState

__all__ = ["AUTO", "Checkpoints", "checkpoint_payload", "disk_bandwidth", "measure_checkpoint"]

AUTO = "auto"  # `TrainConfig.checkpoint_every`: the interval from the measured write time
_STATE = (".master", ".exp_avg", ".exp_avg_sq")  # optimizer keys that are per-parameter state
DISK_TEST_BYTES = 16 * 2**20


def checkpoint_payload(path: str | Path) -> dict[str, float]:
    """{"state", "other", "total"}: bytes of the tensors checkpoint `path` holds (DCP's
    `.metadata`: each chunk's elements × element size, each chunk once). `state` counts the
    parameters (`model.*`) and their optimizer state (`optim.*.master`, `.exp_avg`,
    `.exp_avg_sq`); `other` the rest (AdamW step counters, the RNG)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {"state": 0.0, "other": 0.0}
    for key, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        size = torch.empty((), dtype=meta.properties.dtype).element_size()
        nbytes = float(sum(math.prod(chunk.sizes) for chunk in meta.chunks) * size)
        kind = ("state" if key.startswith("model.")
                or (key.startswith("optim.") and key.endswith(_STATE)) else "other")
        out[kind] += nbytes
    return out | {"total": out["state"] + out["other"]}


def disk_bandwidth(directory: str | Path, nbytes: int = DISK_TEST_BYTES) -> float:
    """Bytes/s this machine writes into `directory`: `nbytes` written in 4 MiB blocks, then
    fsync'ed, timed from open to the end of the fsync (the file is removed)."""
    block = bytes(4 * 2**20)
    probe = Path(directory) / f".disk-test-{os.getpid()}"
    started = time.perf_counter()
    try:
        with probe.open("wb") as f:
            for _ in range(max(1, nbytes // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(1, nbytes // len(block)) * len(block) / (time.perf_counter() - started)
    finally:
        probe.unlink(missing_ok=True)


@dataclass
class Checkpoints:
    """The training loop's checkpoint hook (docs/concepts/runtime.md#runtime-saving): save into `directory` after
    every `every` steps (0: only after the last; "auto": Daly's interval from the measured
    write time and `mtbf_gpu_hours` per GPU), keeping the newest `keep`."""

    directory: str
    every: int | str = 0
    keep: int = 2
    mtbf_gpu_hours: float = DEFAULT_MTBF_GPU_HOURS
    next_due: int = 1  # "auto": the step after which the next save comes
    writes: list[float] | None = None  # "auto": rank 0's measured seconds per save

    def __call__(self, state: TrainState, record: StepRecord) -> None:
        last = state.step == state.config.steps
        if self.every == AUTO:
            due = last or state.step >= self.next_due
        else:
            due = last or bool(self.every and state.step % int(self.every) == 0)
        if not due:
            return
        started = time.perf_counter()
        path = save_checkpoint(state, self.directory, self.keep)
        seconds = time.perf_counter() - started
        saved = {"checkpoint_seconds": seconds}
        if launch.rank() == 0:
            saved["checkpoint_bytes"] = checkpoint_payload(path)["total"]
        if self.every == AUTO and not last:
            saved["checkpoint_every"] = self._next(state, seconds)
        state.records[-1] = replace(record, **saved)

    def _next(self, state: TrainState, seconds: float) -> int:
        """Steps to the next save: Daly's interval for rank 0's mean write time and median
        step time so far, in whole steps (at least one)."""
        self.writes = [*(self.writes or []), seconds]
        step = statistics.median(r.seconds for r in state.records)
        measured = torch.tensor([statistics.fmean(self.writes), step], dtype=torch.float64,
                                device=launch.device())
        C.broadcast(measured, src=0, counter=C.CommCounter())  # rank 0's figures decide
        write, step = measured.tolist()
        mtbf = self.mtbf_gpu_hours * HOUR / launch.world_size()
        every = max(1, round(float(daly_interval(write, mtbf)) / step))
        self.next_due = state.step + every
        return every


def measure_checkpoint(state: TrainState, directory: str | None = None) -> dict[str, float]:
    """Every rank: save `state` once into a new temporary directory (under `directory`, else
    the system's) and remove it. On rank 0 (empty elsewhere): `checkpoint_payload`'s bytes,
    `disk_bytes` (its files' sizes: DCP's torch.save framing, `.metadata` and the manifest
    included), `busiest_rank_bytes` (the most one rank's DCP file holds), the save's
    `seconds`, and `bandwidth`, this disk's bytes/s measured just before by writing
    `disk_test_bytes` (`disk_bandwidth`)."""
    from torch.distributed.checkpoint import FileSystemReader

    path, bandwidth = None, 0.0
    if launch.rank() == 0:
        path = tempfile.mkdtemp(prefix="shardwise-check-", dir=directory)
        bandwidth = disk_bandwidth(path)
    shared = [path]
    if launch.world_size() > 1:
        torch.distributed.broadcast_object_list(shared, src=0)
    root = str(shared[0])
    try:
        started = time.perf_counter()
        saved = save_checkpoint(state, root, keep=1)
        seconds = time.perf_counter() - started
        if launch.rank() != 0:
            return {}
        written: dict[str, int] = {}
        for info in FileSystemReader(str(saved)).read_metadata().storage_data.values():
            written[info.relative_path] = written.get(info.relative_path, 0) + info.length
        disk = sum(p.stat().st_size for p in Path(saved).rglob("*") if p.is_file())
        return checkpoint_payload(saved) | {
            "disk_bytes": float(disk), "busiest_rank_bytes": float(max(written.values())),
            "seconds": seconds, "bandwidth": bandwidth, "disk_test_bytes": DISK_TEST_BYTES}
    finally:
        C.barrier()  # every rank is done with the directory
        if int(os.environ.get("LOCAL_RANK", launch.rank())) == 0:
            shutil.rmtree(root, ignore_errors=True)
