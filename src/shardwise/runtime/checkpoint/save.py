"""`save_checkpoint`: write the state with DCP into a temporary directory, add `shardwise.json`
and the manifest, publish atomically; a failed save (disk full…) keeps the previous one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.errors import ShardwiseError
from shardwise.runtime import launch
from shardwise.runtime.checkpoint.directory import (
    _check_keep,
    _foreign,
    _leftovers,
    _publish,
    _remove,
)
from shardwise.runtime.checkpoint.manifest import (
    FORMAT,
    MARKER,
    METADATA,
    _write_durably,
    checkpoint_name,
    data_fingerprint,
    latest_checkpoint,
    write_manifest,
)
from shardwise.runtime.checkpoint.reshard import _adamw_zeros, _state_dict, _stepped
from shardwise.runtime.mixed_precision import MasterOptimizer
from shardwise.runtime.state import (
    TrainState,
    json_config,
)


def _errors(exc: BaseException) -> list[BaseException]:
    """`exc`, the per-rank exceptions of a DCP `CheckpointException`, and their causes."""
    out, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or e in out:
            continue
        out.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return out


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _size(path: Path | None) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path else 0


def _save_failure(exc: BaseException, final: Path) -> str:
    """One line for a save that failed with `exc`: "no space left on device …" for a full
    disk, else the system's reason. (torch's serializer reports a full disk as "unexpected
    pos", without the errno: a device with less free space than the previous checkpoint
    takes, or under 1 MiB, counts as full.)"""
    errors = _errors(exc)
    previous = latest_checkpoint(final.parent)
    kept = f"the previous checkpoint {previous} is kept" if previous else "no checkpoint kept"
    mount = _mount_point(final.parent)
    free = shutil.disk_usage(mount).free
    if (any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors)
            or free < max(_size(previous), 1 << 20)):
        return (f"no space left on device {mount} ({free / 2**20:.1f} MiB free) while saving "
                f"checkpoint {final}; {kept}; free space or use another --checkpoint-dir")
    os_errors = [e for e in errors if isinstance(e, OSError)]
    reason = (f"{os_errors[0].strerror} ({os_errors[0].filename})" if os_errors
              else f"{type(errors[-1]).__name__}: {str(errors[-1]).strip().splitlines()[0]}")
    return f"cannot save checkpoint {final}: {reason}; {kept}"


def _start_save(final: Path) -> tuple[str | None, str | None]:
    """Rank 0, before any rank writes: remove the leftovers of interrupted saves (this run
    holds the directory, so no save is in progress), refuse a `final` shardwise did not
    write, and create the save's temporary directory with `MARKER` in it. (its path, None)
    or (None, why not)."""
    problem = _foreign(final)
    if problem:
        return None, f"cannot save checkpoint {final}: {problem}"
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        for leftover in _leftovers(final.parent):
            _remove(leftover)
        tmp.mkdir()
        _write_durably(tmp / MARKER, "a checkpoint directory written by shardwise\n")
    except OSError as exc:
        return None, _save_failure(exc, final)
    return str(tmp), None


def save_checkpoint(state: TrainState, directory: str | Path, keep: int = 2) -> Path:
    """Save `state` as `directory/step-N` (N = `state.step`), atomically, with a checksum
    manifest; keep the newest `keep` checkpoints. Collective: every rank calls it. Returns the
    checkpoint's path. A failed save (disk full…) removes its files, keeps the previous
    checkpoint and raises `ShardwiseError` on every rank."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    _check_keep(keep)  # before any collective: every rank refuses alike
    final = Path(directory) / checkpoint_name(state.step)
    name, failure = launch.from_rank0(_start_save(final) if launch.rank() == 0 else (None, None))
    if failure is not None:  # after the clean-up: no rank writes before it
        raise ShardwiseError(failure)
    tmp = Path(name)
    stepped = _stepped(state)
    moments = [dict(state.optimizer.state.get(p) or _adamw_zeros(p))  # none before step 1
               for p in stepped]
    if isinstance(state.optimizer, MasterOptimizer):
        for moment, master in zip(moments, stepped):
            moment["master"] = master
    content = _state_dict(state, moments)
    if launch.rank() == 0:
        content["rng"] = torch.get_rng_state()
    try:
        # DCP's save is collective: a rank's failed write raises on every rank, after every
        # rank's files are written.
        dcp_save(content, storage_writer=FileSystemWriter(tmp),
                 no_dist=not dist.is_initialized())
        if launch.rank() == 0:
            meta = {"format": FORMAT, "step": state.step, "world_size": launch.world_size(),
                    "config": json_config(state.config),
                    "data_sha256": data_fingerprint(state.config.data)}
            _write_durably(tmp / METADATA, json.dumps(meta, indent=1) + "\n")
            write_manifest(tmp)
    except (OSError, CheckpointException) as exc:
        failure = _save_failure(exc, final)
    failure = launch.from_rank0(failure)  # rank 0 saw every failure (DCP's) and its own
    if launch.rank() == 0:
        try:
            if failure is None:
                _publish(tmp, final, keep)
            else:
                _remove(tmp)
        except (OSError, ShardwiseError) as exc:  # e.g. `final` appeared meanwhile
            failure = failure or f"cannot publish checkpoint {final}: {exc}"
    failure = launch.from_rank0(failure)  # published (or cleaned) before any rank goes on
    if failure is not None:
        raise ShardwiseError(failure)
    return final


