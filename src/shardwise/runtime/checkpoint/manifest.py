"""A checkpoint's files: names, `shardwise.json`, the checksum manifest and its verification.

`write_manifest` records the size and SHA-256 of every file; `damage` re-checks them (and
DCP's `.metadata`, the marker, the step) and says what is wrong; `resume_point` picks the
newest intact checkpoint. Design: docs/concepts/runtime.md#checkpoints.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.files import parse_json, regular_file

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


def _write_durably(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


