"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save on one layout, resume on
any other, bit-identically on the same one.

Content. Layout-independent: every tensor is a tensor of the single-device `Transformer`,
keyed by its parameter name, so a checkpoint saved on dp4 loads on dp2×tp2, pp2, ZeRO-3 or
one rank:

    model.{name}               the parameter (the single-device shape)
    optim.{name}.exp_avg       AdamW's first moment (same shape)
    optim.{name}.exp_avg_sq    AdamW's second moment (same shape)
    optim.{name}.step          AdamW's step count for the parameter (0-d)
    rng                        the torch CPU generator (`torch.get_rng_state()`)
    shardwise.json             {"format", "step", "world_size", "config": the TrainConfig with
                               its model and layout}; `step` is also the data position
                               (`data.Batches`: step k reads global batch k)

What a rank writes. Each rank holds, of each parameter of its pipeline stage(s), a contiguous
range of its local (tp / ep) shard flattened, at some offset of a flat tensor the optimizer
steps on (`_Span`): the whole shard at offset 0 without ZeRO; under ZeRO the part of the
parameter inside this rank's row of its unit's flat buffer (`runtime.zero`), which need not
start or end on a row. A range of a row-major tensor is a few rectangular blocks (a partial
first row, whole rows, a partial last row, recursively: at most 2·ndim − 1), each a plain view
of the flat tensor; shifted by the shard's place in the full tensor (tp rank × the local size
along the tp dim, ep rank × E/e experts along dim 0) each is one chunk of the full tensor
(`_Blocks`, a tensor that tells DCP its chunks through DCP's checkpointable protocol, as
DTensor does for its one regular shard). DCP writes each distinct chunk once (replicas over
dp, cp and tp write the same chunk; it keeps one) and, on load, reads into every local block
whatever saved chunks overlap it. So ZeRO's flat shards are saved and loaded in place, never
gathered to full parameters, and no DeviceMesh or extra process group is needed: DCP plans
over the default group. A tied embedding's copy on the last pipeline stage (`head.weight`)
is stored under `embedding.weight`, whose value it equals.

Atomicity. `save_checkpoint` writes into `dir/step-000012.tmp-<uuid>` (a directory rank 0
creates, with the marker `.shardwise-checkpoint` in it first, and broadcasts): DCP's files,
then `shardwise.json`. Once every rank's files are written rank 0 renames it to
`dir/step-000012` — one atomic rename — then rewrites the `latest` file atomically (a
temporary file, fsync, `os.replace`) and prunes. So a directory named `step-N` is always
complete; a crash at any point leaves the previous checkpoint intact, and `latest_checkpoint`
(the complete `step-N` with the largest N, which the `latest` file names unless a crash fell
between the rename and its update) never sees a partial one. Every rank waits in
`save_checkpoint` until the checkpoint is published (or the failure known).

Ownership. shardwise touches only directories it wrote (`MARKER`): pruning keeps the newest
`keep` marked checkpoints up to the one just saved and removes the older ones and the
leftovers of interrupted saves (`step-N.tmp-…` holding the marker; a victim is renamed to
`.tmp-…` and its marker deleted last); a checkpoint whose `shardwise.json` names another step
than its directory is never pruned nor trusted; a `step-N` shardwise did not write is never
replaced (`check_start` refuses such a run before it starts). A person's `*.tmp-*` files stay.

Integrity. After every rank wrote and before the publish, rank 0 writes `manifest.json`: the
size and SHA-256 of every other file of the checkpoint. `damage(path)` re-checks them and says
what is wrong: a listed file missing, truncated or changed; a file the manifest does not list;
a file DCP's `.metadata` names that the manifest does not cover; a malformed `shardwise.json`
or one whose step is not the directory's. A resume takes the newest intact checkpoint
(`resume_point`, naming each damaged newer one) and stops with one line when none is intact;
a checkpoint DCP then fails to load is damage too (`load_checkpoint` falls back to the next
older one and says so). `shardwise.json` also records the SHA-256 of the training text, so a
resume refuses a `--data` file whose text changed. A save that runs out of disk space says so
("no space left on device …"), removes its temporary directory and keeps the previous
checkpoint. `DirectoryLock` (taken by the launcher around a run) keeps a second run out of the
same directory; a lock whose holder process is dead is taken over.

Resume. `load_checkpoint(state, directory)` fills a freshly `build`-ed state in place, on any
layout: weights, AdamW moments and step counts, the step (data position), the RNG. The model,
dtype and data settings must match the checkpoint's; so must the optimizer schedule of the
steps already taken (`state.schedule_changes`: learning rate, warm-up, min_lr, the steps the
cosine spans, weight decay, clipping, betas, ε) unless `TrainConfig.override` names each
change (`--override lr,steps`); the layout is the new run's. The RNG: model initialisation
seeds the torch generator identically on every rank and no step draws from it, so rank 0's
state is saved and restored on every rank (CUDA generators are not saved).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import re
import shutil
import socket
import stat
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.errors import ShardwiseError
from shardwise.files import parse_json, regular_file
from shardwise.runtime import launch
from shardwise.runtime.mixed_precision import MasterOptimizer
from shardwise.runtime.state import (
    TrainConfig,
    TrainState,
    json_config,
    schedule_changes,
)

if TYPE_CHECKING:
    from shardwise.runtime.parallel_transformer import ParallelTransformer

__all__ = ["FORMAT", "LATEST", "MANIFEST", "MARKER", "METADATA", "DirectoryLock",
           "check_start", "checkpoint_name", "complete_checkpoints", "damage",
           "data_fingerprint", "latest_checkpoint", "load_checkpoint", "prune", "read_metadata",
           "read_parameters", "resume_point", "save_checkpoint", "write_manifest"]

FORMAT = 1
METADATA = "shardwise.json"  # our metadata, next to DCP's `.metadata`
LATEST = "latest"  # a file naming the newest checkpoint directory
MANIFEST = "manifest.json"  # size and SHA-256 of every other file of the checkpoint
MARKER = ".shardwise-checkpoint"  # in every directory shardwise writes: only those it touches
DCP_METADATA = ".metadata"  # DCP's index of the tensors and the files that hold them
LOCK = ".lock"  # in the checkpoint directory while a run uses it: "pid host"
_STEP_DIR = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"step-\d+\.tmp-.+")  # an unpublished save or a victim being deleted
_OUR_TMP = re.compile(r"step-\d+\.tmp-[0-9a-f]{32}")  # a name `save_checkpoint` or `_remove` picks
_POINTER_TMP = re.compile(rf"{LATEST}\.tmp-[0-9a-f]{{32}}")  # `latest` being replaced
_MAX_JSON = 64 * 2**20  # shardwise.json and the manifest: a few kB
_MOMENTS = ("exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------- the directory (no processes)
def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint after `step` optimizer steps: `step-NNNNNN`."""
    return f"step-{step:06d}"


def _ours(path: Path) -> bool:
    """A directory shardwise wrote (it holds `MARKER`, written before anything else)."""
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first: directories shardwise wrote
    (`MARKER`) named `step-N`, holding `shardwise.json` (`.tmp-…` directories are unfinished
    or being deleted)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and _ours(p) and (p / METADATA).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in `directory`, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


# What shardwise.json must hold (key → type); config: the TrainConfig's keys this module reads.
_META_TYPES: dict[str, type | tuple[type, ...]] = {"format": int, "step": int, "world_size": int,
                                                   "config": dict}
_CONFIG_TYPES: dict[str, type | tuple[type, ...]] = {
    "model": dict, "dtype": str, "seq_len": int, "global_batch": int, "seed": int,
    "data": (str, type(None))}


def _metadata_problem(meta: Any) -> str | None:
    """What is wrong with a parsed `shardwise.json`, or None."""
    if not isinstance(meta, dict):
        return f"{METADATA} holds a {type(meta).__name__}, not an object"
    for where, obj, types in (("", meta, _META_TYPES), ("config.", meta.get("config"),
                                                          _CONFIG_TYPES)):
        for key, kind in types.items():
            if key not in obj:
                return f"{METADATA} has no {where}{key!r}"
            value = obj[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return (f"{METADATA}: {where}{key} is {value!r}, not "
                        f"{'an integer' if kind is int else 'of type ' + str(kind)}")
    if meta["format"] != FORMAT:
        return (f"{METADATA} is of format {meta['format']}; this version of shardwise reads "
                f"format {FORMAT}")
    if meta["step"] < 0 or meta["world_size"] < 1:
        return f"{METADATA}: step {meta['step']} or world_size {meta['world_size']} is invalid"
    return None


def _read_json(path: Path) -> Any:
    """A JSON file of the checkpoint (strict: `files.parse_json`), or one line on why not."""
    try:
        text = regular_file(path, path.name, _MAX_JSON).read_bytes()
    except OSError as exc:
        raise ShardwiseError(f"{path.name} cannot be read ({exc.strerror})") from None
    return parse_json(text, path.name)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """A checkpoint's `shardwise.json`: format, step, world_size, config (checked: a missing
    or malformed file raises `ShardwiseError` naming the path and the problem)."""
    try:
        meta = _read_json(Path(path) / METADATA)
    except ShardwiseError as exc:
        raise ShardwiseError(f"checkpoint {path}: {exc}") from None
    problem = _metadata_problem(meta)
    if problem:
        raise ShardwiseError(f"checkpoint {path}: {problem}")
    return dict(meta)


# ------------------------------------------------------------------------------ integrity
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(path: str | Path) -> None:
    """Record the size and SHA-256 of every file under checkpoint `path` in `MANIFEST`
    (written last, durably; call it once every rank's files are written)."""
    root = Path(path)
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}
    _write_durably(root / MANIFEST, json.dumps({"algorithm": "sha256", "files": files},
                                               indent=1) + "\n")


def _manifest(root: Path) -> dict[str, tuple[int, str]]:
    """The manifest's files: relative name → (bytes, SHA-256)."""
    files = _read_json(root / MANIFEST)["files"]
    out = {}
    for name, entry in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"it names {name!r}, outside the checkpoint")
        out[str(name)] = (int(entry["bytes"]), str(entry["sha256"]))
    return out


def _dcp_files(root: Path) -> set[str]:
    """The files DCP's `.metadata` says hold the checkpoint's tensors."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(root).read_metadata()
    return {info.relative_path for info in metadata.storage_data.values()}


def damage(path: str | Path) -> str | None:
    """What is wrong with checkpoint `path`, or None if intact. Checked: the directory is
    one shardwise wrote (`MARKER`); every file is listed in `MANIFEST` and every listed file
    has its size and SHA-256 (missing, truncated, changed); every file DCP's `.metadata`
    names is listed; `shardwise.json` is well-formed and its step is the directory's."""
    root = Path(path)
    if not (root / MANIFEST).exists():
        return f"its checksum manifest {MANIFEST} is missing"
    try:
        listed = _manifest(root)
    except (ShardwiseError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its checksum manifest {MANIFEST} is unreadable or malformed ({exc})"
    for required, what in ((METADATA, "shardwise's metadata"), (MARKER, "shardwise's marker"),
                           (DCP_METADATA, "DCP's metadata")):
        if required not in listed:
            return f"its manifest does not cover {required} ({what}): not a checkpoint " \
                   "shardwise wrote, or damaged"
    for name, (size, digest) in listed.items():
        file = root / name
        if not file.is_file():
            return f"{name} is missing"
        try:
            actual = file.stat().st_size
            if actual != size:
                return f"{name} is {actual} bytes, {size} when saved (truncated or overwritten)"
            if _sha256(file) != digest:
                return f"{name} fails its SHA-256 checksum (bytes changed since the save)"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
    unlisted = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if not p.is_dir() and p.name != MANIFEST
                      and p.relative_to(root).as_posix() not in listed)
    if unlisted:
        return f"{unlisted[0]} is not in its manifest (added or renamed since the save)"
    try:
        unverified = sorted(_dcp_files(root) - listed.keys())
    except Exception as exc:  # DCP unpickles: anything can be raised
        return f"DCP's {DCP_METADATA} cannot be read ({type(exc).__name__}: {exc})"[:300]
    if unverified:
        return f"DCP's {DCP_METADATA} names {unverified[0]}, which its manifest does not cover"
    try:
        meta = read_metadata(root)
    except ShardwiseError as exc:
        return str(exc).removeprefix(f"checkpoint {path}: ")
    m = _STEP_DIR.fullmatch(root.name)
    if m and int(m.group(1)) != meta["step"]:
        return (f"{METADATA} says step {meta['step']} but the directory is {root.name} "
                "(renamed or copied: its step cannot be trusted)")
    return None


def _candidates(directory: Path) -> list[Path]:
    """Published checkpoint directories, newest first: `step-N` holding `shardwise.json`, a
    manifest or `MARKER` (a directory with none of them is not one of ours; it is never read,
    replaced or removed)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()
             and any((p / f).exists() for f in (METADATA, MANIFEST, MARKER))]
    return [p for _, p in sorted(found, reverse=True)]


def resume_point(directory: str | Path, skip: tuple[Path, ...] = ()
                 ) -> tuple[Path | None, list[str]]:
    """(the newest intact checkpoint in `directory` not in `skip`, or None when there is
    none at all; one line per newer damaged checkpoint skipped). Raises `ShardwiseError` when
    checkpoints exist but none is intact."""
    skipped = []
    for path in _candidates(Path(directory)):
        if path in skip:
            continue
        problem = damage(path)
        if problem is None:
            return path, skipped
        skipped.append(f"checkpoint {path} is damaged: {problem}")
    if skipped:
        raise ShardwiseError(f"no intact checkpoint to resume from: {'; '.join(skipped)}")
    return None, []


@functools.lru_cache(maxsize=8)
def _fingerprint(path: str | None, stamp: tuple[int, int]) -> str:
    if path is None:
        from shardwise.runtime.data import builtin_corpus

        return hashlib.sha256(builtin_corpus().encode("utf-8")).hexdigest()
    return _sha256(Path(path))


def data_fingerprint(path: str | None) -> str | None:
    """SHA-256 of the training text (the file's bytes; the built-in corpus when None), or
    None when the file cannot be read."""
    if path is None:
        return _fingerprint(None, (0, 0))
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device: never read for a fingerprint
        return None
    return _fingerprint(str(path), (st.st_mtime_ns, st.st_size))


# --------------------------------------------------------------------------------- the lock
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class DirectoryLock:
    """`with DirectoryLock(directory):` — this process alone runs into `directory`.

    The lock is a file `.lock` holding "pid host", created atomically (a hard link of a
    complete temporary file, which fails if the lock exists). A lock held by a live process
    (or by one on another host, which cannot be checked) is refused with one line; one whose
    holder on this host is dead (a killed launcher) is taken over."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK
        self.held = False

    def __enter__(self) -> DirectoryLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = f"{os.getpid()} {socket.gethostname()}\n"
        tmp = self.path.with_name(f"{LOCK}.tmp-{uuid.uuid4().hex}")
        tmp.write_text(me, encoding="utf-8")
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    self._refuse_or_clear()
                    continue
                self.held = True
                return self
            raise ShardwiseError(f"could not lock {self.path.parent} (another run keeps "
                                 "taking it)")
        finally:
            tmp.unlink(missing_ok=True)

    def _refuse_or_clear(self) -> None:
        try:
            pid_text, _, host = self.path.read_text(encoding="utf-8").strip().partition(" ")
            pid = int(pid_text)
        except FileNotFoundError:
            return  # released meanwhile
        except (OSError, ValueError):
            pid, host = -1, ""
        if host == socket.gethostname() and pid > 0 and not _alive(pid):
            self.path.unlink(missing_ok=True)  # stale: its run was killed
            return
        holder = f"pid {pid} on {host}" if pid > 0 else "an unreadable lock"
        raise ShardwiseError(
            f"{self.path.parent} is in use by another run ({holder}); wait for it or use "
            f"another --checkpoint-dir (if no such run is alive, delete {self.path})")

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _write_durably(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a directory shardwise wrote (a checkpoint or a leftover) or a `latest.tmp-…`
    file: a directory is first renamed to `.tmp-…`, so a crash mid-delete never leaves a
    partial directory under a checkpoint's name, and its `MARKER` goes last, so a leftover
    with anything in it is still recognisably ours."""
    if path.is_dir():
        if not path.name.partition(".tmp-")[1]:
            path = path.rename(path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}"))
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            elif child.name != MARKER:
                child.unlink(missing_ok=True)
        (path / MARKER).unlink(missing_ok=True)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


def _check_keep(keep: int) -> None:
    if not isinstance(keep, int) or keep < 1:
        raise ShardwiseError(f"keep must be ≥ 1 checkpoint, got {keep!r}")


def _leftovers(root: Path) -> list[Path]:
    """What interrupted saves and deletions left: `step-N.tmp-…` directories shardwise wrote
    (`MARKER`; or empty, under a name it picks) and `latest.tmp-…` files; nothing else
    matching `*.tmp-*`."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if (p.is_dir() and not p.is_symlink()
                      and ((_LEFTOVER.fullmatch(p.name) and _ours(p))
                           or (_OUR_TMP.fullmatch(p.name) and not any(p.iterdir()))))
                  or (_POINTER_TMP.fullmatch(p.name) and p.is_file()))


def _trusted_step(path: Path) -> int | None:
    """The step of checkpoint `path` when its `shardwise.json` names the directory's step."""
    try:
        step = read_metadata(path)["step"]
    except ShardwiseError:
        return None
    return step if path.name == checkpoint_name(step) else None


def prune(directory: str | Path, keep: int, newest: Path | None = None) -> list[Path]:
    """Keep the newest `keep` complete checkpoints shardwise wrote up to `newest` (the one
    just published, always kept); remove the older ones and the leftovers (`_leftovers`).
    Never removed: a directory without `MARKER`, one whose `shardwise.json` does not name its
    own step (damage, left for a person to look at), one newer than `newest`. Call it only
    while no save is in progress. Returns what was removed."""
    _check_keep(keep)
    root = Path(directory)
    ceiling = _trusted_step(newest) if newest is not None else None
    trusted = [p for p in complete_checkpoints(root)
               if (step := _trusted_step(p)) is not None and (ceiling is None or step <= ceiling)]
    victims = trusted[:-keep] + _leftovers(root)
    for path in victims:
        _remove(path)
    return victims


def _foreign(final: Path) -> str | None:
    """Why `final` cannot be written: something there that shardwise did not write."""
    if os.path.lexists(final) and not _ours(final):
        return (f"{final} exists and was not written by shardwise (no {MARKER}); move it away "
                "or use another --checkpoint-dir")
    return None


def _publish(tmp: Path, final: Path, keep: int) -> None:
    """Rank 0, once every rank has written `tmp`: make it the checkpoint `final` (one atomic
    rename), point `latest` at it (atomically), prune."""
    problem = _foreign(final)
    if problem:
        raise ShardwiseError(problem)
    if final.exists():  # the same step saved again: the new one replaces it
        _remove(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    pointer = final.parent / f"{LATEST}.tmp-{uuid.uuid4().hex}"
    _write_durably(pointer, final.name + "\n")
    os.replace(pointer, final.parent / LATEST)
    _fsync_dir(final.parent)
    prune(final.parent, keep, newest=final)


def check_start(config: TrainConfig, report: Callable[[str], None] | None = None
                ) -> Path | None:
    """Where a run of `config` starts: the checkpoint it resumes from, or None (from step 0).

    Refused with one sentence each: a fresh run into a directory that already holds
    checkpoints (it would mix two runs), a checkpoint of another model or dtype or of other
    data settings (sequence length, global batch, seed, data path or its text), one whose
    optimizer schedule this run changes for steps already taken (unless `config.override`
    names the change), one already at `config.steps`, a directory whose checkpoints are all
    damaged, a directory shardwise did not write where this run would save a checkpoint. A
    damaged newest checkpoint is skipped for the newest intact one; `report(line)` (if given)
    hears of each skipped one. Resuming from a directory with no checkpoint yet starts from
    step 0 (the first launch of a job that is relaunched as it is after each failure)."""
    if not config.checkpoint_dir:
        return None
    root = Path(config.checkpoint_dir)
    if not config.resume:
        found = _candidates(root)
        if found:
            raise ShardwiseError(
                f"{config.checkpoint_dir} already holds checkpoints (newest: {found[0].name}); "
                "resume from them (--resume) or choose an empty directory")
        _check_saves(config, root, 0)
        return None
    path, skipped = resume_point(root)
    for line in skipped:
        if report is not None:
            report(f"{line}; resuming from the older {path.name if path else None}")
    if path is None:
        _check_saves(config, root, 0)
        return None
    meta = read_metadata(path)
    if meta["step"] >= config.steps:
        raise ShardwiseError(f"{path} is already at step {meta['step']} of steps="
                             f"{config.steps}; train for more steps to continue")
    _check_compatible(path, meta, config)
    _check_saves(config, root, meta["step"])
    return path


def _check_saves(config: TrainConfig, root: Path, start: int) -> None:
    """No checkpoint this run will save (after step `start`) would replace a directory
    shardwise did not write."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        m = _STEP_DIR.fullmatch(entry.name)
        if m is None:
            continue
        step = int(m.group(1))
        every = config.checkpoint_every
        if start < step <= config.steps and (step == config.steps or (every and
                                                                      step % every == 0)):
            problem = _foreign(entry)
            if problem:
                raise ShardwiseError(f"this run would save checkpoint {entry.name}, but "
                                     f"{problem}")


def _check_compatible(path: Path, meta: dict[str, Any], config: TrainConfig) -> None:
    """The checkpoint at `path` holds this run's model in its dtype and data settings (the
    layout may differ), and this run takes the steps before it with the same optimizer
    schedule, unless `config.override` names what changes."""
    saved = meta["config"]
    if saved["model"] != json_config(config)["model"]:  # tuples → lists
        raise ShardwiseError(f"{path} holds model {saved['model'].get('name')!r}, not "
                             f"{config.model.name!r} (or with other dimensions); it cannot "
                             "resume this run")
    if saved["dtype"] != config.dtype:
        raise ShardwiseError(f"{path} was trained in {saved['dtype']}, this run in "
                             f"{config.dtype}; use dtype {saved['dtype']}")
    # The data position is the step number: another batch, length, seed or text would
    # silently change which tokens the remaining steps read.
    for key, option in (("seq_len", "--seq"), ("global_batch", "--global-batch"),
                        ("seed", "--seed"), ("data", "--data")):
        if saved[key] != getattr(config, key):
            raise ShardwiseError(f"{path} was trained with {key}={saved[key]!r}, this run has "
                                 f"{getattr(config, key)!r}; resume with {option} "
                                 f"{saved[key]}")
    saved_text = meta.get("data_sha256")
    if saved_text is not None and saved_text != data_fingerprint(config.data):
        what = f"the text of --data {config.data}" if config.data else "the built-in corpus"
        raise ShardwiseError(f"{path} was trained on other text: {what} changed since the "
                             "checkpoint (SHA-256 differs); resume on the original text or "
                             "start a new run in an empty directory")
    changed = [k for k in schedule_changes(saved, config, meta["step"])
               if k not in config.override]
    if changed:
        was = ", ".join(f"{k}={saved.get(k)!r} → {json_config(config)[k]!r}" for k in changed)
        raise ShardwiseError(f"{path} took its {meta['step']} step(s) with another optimizer "
                             f"schedule ({was}); resume with the same settings, or say the "
                             f"change is meant with --override {','.join(changed)}")


# ------------------------------------------------------------------------ the rank's share
def _blocks(shape: tuple[int, ...], start: int, stop: int
            ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, stop) of a row-major tensor of `shape` as rectangular blocks
    (offsets, sizes), in memory order; each is contiguous in the flat tensor."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])  # elements per row (row = index along dim 0)
    rest = (0,) * (len(shape) - 1)
    out = []
    row, within = divmod(start, inner)
    if within:  # a partial first row
        end = min(stop, (row + 1) * inner)
        out += [((row, *o), (1, *z)) for o, z in _blocks(shape[1:], within, end - row * inner)]
        row, start = row + 1, end
    whole = (stop - start) // inner
    if start < stop and whole:  # whole rows
        out.append(((row, *rest), (whole, *shape[1:])))
        row, start = row + whole, start + whole * inner
    if start < stop:  # a partial last row
        out += [((row, *o), (1, *z)) for o, z in _blocks(shape[1:], 0, stop - start)]
    return out


@dataclass(frozen=True)
class _Span:
    """Elements [first, first + numel) of parameter `key`'s local shard (shape `local`, at
    `base` in the full tensor of shape `full`) are elements [at, at + numel) of the flat
    tensor number `tensor` (a parameter, a ZeRO shard, or their AdamW moments)."""

    key: str
    full: tuple[int, ...]
    local: tuple[int, ...]
    base: tuple[int, ...]
    tensor: int
    at: int
    first: int
    numel: int

    def blocks(self, tensor: torch.Tensor) -> _Blocks:
        """This span of `tensor` as chunks of the full tensor (views: writes land in place)."""
        flat = tensor.detach().view(-1)
        chunks, cursor = [], self.at
        for offsets, sizes in _blocks(self.local, self.first, self.first + self.numel):
            n = math.prod(sizes)
            chunks.append((tuple(b + o for b, o in zip(self.base, offsets)),
                           flat[cursor:cursor + n].view(sizes)))
            cursor += n
        return _Blocks(self.full, chunks)


class _Blocks(torch.Tensor):
    """A full tensor of `shape` of which this rank holds `chunks` — (global offsets, local
    view) — for DCP: it implements DCP's checkpointable protocol (`__create_write_items__`,
    `__create_chunk_list__`, `__get_tensor_shard__`), which DTensor implements for one regular
    shard. A metadata-only wrapper: no tensor operation runs on it."""

    _chunks: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], torch.Tensor]]
                ) -> _Blocks:
        first = chunks[0][1]
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=first.dtype,
                                                  device=first.device)
        out._chunks = chunks
        return out

    def _chunk_metadata(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in self._chunks]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                              size=self.size()))
                for chunk, (_, t) in zip(self._chunk_metadata(), self._chunks)]

    def __create_chunk_list__(self) -> list[Any]:
        return self._chunk_metadata()

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, t in self._chunks:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"no local chunk of {index.fqn} at {tuple(index.offset)}")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        raise RuntimeError(f"_Blocks is checkpoint metadata, not a tensor to compute with "
                           f"({func})")


def _place(model: ParallelTransformer, name: str, local: tuple[int, ...]
           ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(checkpoint key, full shape, offsets of this rank's shard) of parameter `name`."""
    shard = model.shards[name]
    full, base = list(local), [0] * len(local)
    for dim, group in ((shard.tp_dim, "tp"), (0 if shard.expert else None, "ep")):
        if dim is not None:  # an even split (parallelize._keep): shard r starts at r·size
            axis = model.axis(group)
            copies = shard.tp_replicas if group == "tp" else 1  # replicated kv heads: once
            base[dim] = axis.rank // copies * local[dim]
            full[dim] = local[dim] * axis.size // copies
    key = "embedding.weight" if shard.tied_copy else name  # equal to the embedding it copies
    return key, tuple(full), tuple(base)


def _whole(model: ParallelTransformer) -> list[_Span]:
    """One span per module parameter (`model.model.named_parameters()` order): the whole
    local shard."""
    spans = []
    for i, (name, p) in enumerate(model.model.named_parameters()):
        key, full, base = _place(model, name, tuple(p.shape))
        spans.append(_Span(key, full, tuple(p.shape), base, i, 0, 0, p.numel()))
    return spans


def _flat(model: ParallelTransformer) -> list[_Span]:
    """Spans of the ZeRO shards (`zero.shards` order): each parameter's part of this rank's
    row of its unit's flat buffer (stage 0: the whole buffer)."""
    zero = model.zero
    assert zero is not None
    spans = []
    for i, unit in enumerate(zero.units):
        lo, hi = (0, unit.padded) if zero.config.stage == 0 else (unit.lo, unit.hi)
        for s in unit.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                key, full, base = _place(model, s.qualname, tuple(s.shape))
                spans.append(_Span(key, full, tuple(s.shape), base, i, a - lo, a - s.offset,
                                   b - a))
    return spans


def _layout(model: ParallelTransformer) -> tuple[list[torch.Tensor], list[_Span], list[_Span]]:
    """(the tensors holding the weights, the weights' spans over them, the spans of the
    optimizer's tensors `model.parameters()`). Without ZeRO both are the module parameters;
    ZeRO 0–2 keep full weights in the module (views of the flat buffers) and step on flat
    shards; ZeRO-3 keeps only the shards."""
    if model.zero is None:
        spans = _whole(model)
        return [p for _, p in model.model.named_parameters()], spans, spans
    if model.zero.config.stage < 3:
        return [p for _, p in model.model.named_parameters()], _whole(model), _flat(model)
    spans = _flat(model)
    return list(model.zero.shards), spans, spans


def _state_dict(state: TrainState, moments: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The DCP state dict over this rank's tensors: the live weights, and `moments[i]` (the
    exp_avg, exp_avg_sq and step of the optimizer's tensor i, and under mixed precision its
    fp32 master) for the optimizer state."""
    weights, weight_spans, state_spans = _layout(state.model)
    out: dict[str, Any] = {f"model.{s.key}": s.blocks(weights[s.tensor]) for s in weight_spans}
    for s in state_spans:
        for moment in _MOMENTS + (("master",) if "master" in moments[s.tensor] else ()):
            out[f"optim.{s.key}.{moment}"] = s.blocks(moments[s.tensor][moment])
        # One count per parameter, as AdamW keeps it (a ZeRO shard's parameters share theirs;
        # a shard of padding alone keeps 0, which moves nothing: its values stay 0).
        out[f"optim.{s.key}.step"] = moments[s.tensor]["step"]
    return out


def _stepped(state: TrainState) -> list[torch.Tensor]:
    """The tensors AdamW steps, in `model.parameters()` order: those parameters, or under
    mixed precision their fp32 masters (`MasterOptimizer.masters`, one per parameter or ZeRO
    shard, same shapes), whose moments and values the checkpoint keeps."""
    if isinstance(state.optimizer, MasterOptimizer):
        return state.optimizer.masters
    return list(state.model.parameters())


def _adamw_zeros(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `p` before its first step (what `torch.optim.AdamW` creates lazily;
    stepping from it is stepping from no state)."""
    return {"step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


# ------------------------------------------------------------------------- save and load
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


def load_checkpoint(state: TrainState, directory: str | Path,
                    report: Callable[[str], None] | None = None) -> bool:
    """Load the newest intact checkpoint in `directory` (or the checkpoint `directory`
    itself) into `state`, a freshly `build`-ed state on any layout, in place. Collective.
    Returns False (and leaves `state` as built) when there is no checkpoint. A checkpoint
    that passes `damage` but that DCP then fails to load is damage like any other: the next
    older intact one is loaded instead (`report(line)`, on rank 0, hears of it); raises
    `ShardwiseError` on every rank when none loads or the checkpoint does not fit."""
    failed: list[Path] = []
    while True:
        found: tuple[str | None, str | None] = (None, None)  # (path, error)
        if launch.rank() == 0:  # rank 0 verifies; every rank reads the same checkpoint
            found = _choose(Path(directory), state.config, tuple(failed))
        path, error = launch.from_rank0(found)
        if error is not None:
            raise ShardwiseError(error)
        if path is None:
            return False
        problem = launch.first_problem(_load(state, Path(path)))
        if problem is None:
            return True
        failed.append(Path(path))
        if report is not None and launch.rank() == 0:
            report(f"checkpoint {path} cannot be loaded ({problem}); trying an older one")


def _choose(given: Path, config: TrainConfig, failed: tuple[Path, ...]
            ) -> tuple[str | None, str | None]:
    """Rank 0: (the checkpoint to load, None), (None, None) for none, or (None, why not)."""
    try:
        if (given / METADATA).is_file() or (given / MANIFEST).is_file():  # one checkpoint
            problem = "DCP could not load it" if given in failed else damage(given)
            if problem:
                raise ShardwiseError(f"checkpoint {given} is damaged: {problem}")
            path: Path | None = given
        else:
            path, _ = resume_point(given, skip=failed)
            if path is None and failed:
                raise ShardwiseError(f"no checkpoint in {given} loads: "
                                     f"{', '.join(map(str, failed))} failed")
        if path is not None:
            _check_compatible(path, read_metadata(path), config)
        return (None if path is None else str(path)), None
    except ShardwiseError as exc:
        return None, str(exc)


def _load(state: TrainState, path: Path) -> str | None:
    """Load checkpoint `path` into `state` (this rank's share); None, or why it failed."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    meta = read_metadata(path)
    stepped = _stepped(state)
    mixed = isinstance(state.optimizer, MasterOptimizer)
    moments = [_adamw_zeros(p) | ({"master": torch.empty_like(p)} if mixed else {})
               for p in stepped]  # loaded into
    content = _state_dict(state, moments)
    content["rng"] = torch.get_rng_state()
    try:
        dcp_load(content, storage_reader=FileSystemReader(path),
                 no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as exc:  # I/O, unpickling; DCP's is a BaseException
        first = _errors(exc)[-1]
        text = str(first).strip().splitlines()
        return f"{type(first).__name__}: {text[0] if text else ''}"[:300]
    if mixed:  # the fp32 masters; the bf16 weights came with `model.*` (their rounding)
        with torch.no_grad():
            for moment, master in zip(moments, stepped):
                master.copy_(moment.pop("master"))
    adamw = state.optimizer.optimizer if mixed else state.optimizer
    adamw.load_state_dict({"state": dict(enumerate(moments)),
                           "param_groups": adamw.state_dict()["param_groups"]})
    torch.set_rng_state(content["rng"])
    state.rng = content["rng"]
    state.step = int(meta["step"])
    return None


def read_parameters(path: str | Path) -> dict[str, torch.Tensor]:
    """The single-device parameters of checkpoint `path`, in this process (no process group
    needed): what a single-device `Transformer` would load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    reader = FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    out = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in saved.items()
           if key.startswith("model.")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(out, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): t for key, t in out.items()}

