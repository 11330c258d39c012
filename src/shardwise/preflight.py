"""Checks before any rank starts: every output path can be written, the sequence fits the
model, and the run fits in this machine's memory. Each failure is one `ShardwiseError` line
(exit code 2 from the CLI), so a bad path or an impossible run is refused in a second instead
of being discovered after the training (or after the machine ran out of memory). Torch-free:
`train`/`check` call `check_run` with the run's settings before importing the runtime.

Paths are checked by doing what the run will do — creating the file (removed again if it did
not exist) or the directory and a temporary file in it — so a missing parent, a file where a
directory should be, a read-only directory or a path under /proc are all caught the way the
operating system sees them.

Memory: the run's bytes per rank come from shardwise's own model (`estimate.memory`, SPEC
§4: weights, gradients, AdamW state, activations in flight, logits) in the run's dtype, for
every local rank, plus `RANK_OVERHEAD` per rank process (interpreter + torch); the sum must fit
in the memory available now (`MemAvailable`, /proc/meminfo).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.units import gib

__all__ = ["RANK_OVERHEAD", "available_memory", "check_run", "run_memory", "writable_dir",
           "writable_file"]

# Resident memory of one rank before it allocates a tensor: python + torch 2.13 (CPU) +
# shardwise.runtime imported, 229 MB maximum RSS measured with `/usr/bin/time -f %M python -c
# "import torch, torch.distributed; import shardwise.runtime.train"`; rounded up.
RANK_OVERHEAD = 256 * 2**20


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def writable_file(path: str | os.PathLike[str] | None, option: str) -> None:
    """`path` can be created or overwritten as a file (refused in one line otherwise): a new
    file or an existing regular one (or /dev/null), never a directory, FIFO or device, which
    would block or swallow the output."""
    if path is None:
        return
    target = Path(path)
    try:
        info = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # the parent's checks say why
        info = None
    except (OSError, ValueError) as exc:  # a symlink loop, a name too long, a NUL byte
        reason = _reason(exc) if isinstance(exc, OSError) else str(exc)
        raise ShardwiseError(f"{option} {path}: cannot write there ({reason})") from None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise ShardwiseError(f"{option} {path}: is a directory; give a file name")
    if info is not None and not stat.S_ISREG(info.st_mode) and str(target) != os.devnull:
        raise ShardwiseError(f"{option} {path}: is not a regular file (a FIFO, device or "
                             "socket); give a file name")
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ShardwiseError(f"{option} {path}: the directory {parent} {what}")
    existed = info is not None
    try:
        with target.open("a"):
            pass
    except OSError as exc:
        raise ShardwiseError(f"{option} {path}: cannot write there ({_reason(exc)})") from None
    if not existed:
        target.unlink(missing_ok=True)


def writable_dir(path: str | os.PathLike[str] | None, option: str) -> None:
    """`path` is (or can be made) a directory this process can write files in; created."""
    if path is None:
        return
    target = Path(path)
    try:
        if target.exists() and not target.is_dir():
            raise ShardwiseError(f"{option} {path}: is a file, not a directory")
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except ShardwiseError:
        raise
    except (OSError, ValueError) as exc:
        reason = _reason(exc) if isinstance(exc, OSError) else str(exc)
        raise ShardwiseError(f"{option} {path}: cannot write there ({reason})") from None


def available_memory() -> int | None:
    """Bytes of memory available to new processes now (Linux `MemAvailable`), or the physical
    memory elsewhere, or None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def run_memory(model: Any, layout: Any, seq_len: int, global_batch: int, dtype: str,
               flash: bool = True) -> float:
    """Bytes all ranks of the run hold together by `estimate.memory` (each pipeline stage's
    per-rank total × the dp·tp·cp ranks of the stage), without `RANK_OVERHEAD`."""
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.layout import TrainSpec

    train = TrainSpec(seq_len=seq_len, global_batch=global_batch, dtype=dtype,
                      flash_attention=flash, impl="shardwise")  # the runtime's own stack
    stages = training_memory_per_gpu(model, layout, train)
    return sum(stage.total for stage in stages) * layout.dp * layout.tp * layout.cp


def check_run(model: Any, layout: Any, seq_len: int, global_batch: int, dtype: str,
              flash: bool = True, *, files: dict[str, Any] | None = None,
              directories: dict[str, Any] | None = None, local: bool = True) -> None:
    """Refuse, in one line, a run that cannot finish: an output path that cannot be written
    (`files`/`directories`: option → path), `seq_len` beyond the model's `max_seq`, or (for
    ranks started on this machine, `local`) more memory than this machine has available."""
    for option, path in (files or {}).items():
        writable_file(path, option)
    for option, path in (directories or {}).items():
        writable_dir(path, option)
    if seq_len > model.max_seq:
        raise ShardwiseError(f"--seq {seq_len} exceeds {model.name}'s maximum sequence length "
                             f"{model.max_seq}; use --seq ≤ {model.max_seq}")
    for problem in model.seq_problems(seq_len):
        raise ShardwiseError(problem)
    available = available_memory()
    if not local or available is None:
        return
    try:
        need = run_memory(model, layout, seq_len, global_batch, dtype, flash)
    except ShardwiseError:
        return  # a layout the estimate does not cover: the run's own checks speak
    ranks = layout.world_size
    total = need + ranks * RANK_OVERHEAD
    if total > available:
        raise ShardwiseError(
            f"this run needs about {gib(total)} of memory ({ranks} rank(s): {gib(need)} of "
            f"weights, gradients, AdamW state and activations by shardwise's memory model in "
            f"{dtype}, + {gib(RANK_OVERHEAD)} per process) but this machine has {gib(available)} "
            "available; use a smaller --model, --seq or --global-batch, or more ranks on "
            "more machines (torchrun)")
