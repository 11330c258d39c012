"""Where `hf.save_hf` writes: a folder that already holds a checkpoint is replaced as a whole,
never mixed with the new one (an index beside a `model.safetensors` is a folder no reader
takes).

Into a folder without a checkpoint the files are written in place. Otherwise the new
checkpoint is written into a folder beside it (same parent: one file system), the target's
other files (tokenizer, README, …) are hard-linked into it, and the two folders are swapped
by renames; the old checkpoint is deleted only once the new one is complete. A folder that
cannot be swapped (a mount point, a parent this process cannot write) is refused before any
work, in one line (`check_save_target`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from shardwise.runtime.checkpoint.directory import _fsync_dir

__all__ = ["INDEX", "check_save_target", "discard", "held_checkpoint", "publish", "stage"]

INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # what `save_hf` and HF name shards


def held_checkpoint(directory: str | Path) -> list[str]:
    """The checkpoint files folder `directory` holds (its index and safetensors files),
    sorted; [] for none or for a path that is not a folder."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.name == INDEX or p.name.endswith(".safetensors"))


def _describe(names: list[str]) -> str:
    files = [n for n in names if n != INDEX]
    kinds = [INDEX] if INDEX in names else []
    if files == ["model.safetensors"] or len(files) == 1:
        kinds.append(files[0])
    elif files:
        kinds.append(f"{len(files)} safetensors files")
    return " and ".join(kinds)


def check_save_target(directory: str | Path, option: str = "--save-hf") -> None:
    """Refuse (`ShardwiseError`, one line) a target folder that holds a checkpoint this
    module cannot replace: a mount point, or one whose parent this process cannot write (the
    new checkpoint is written beside it, then swapped in)."""
    from shardwise.errors import ShardwiseError

    held = held_checkpoint(directory)
    if not held:
        return
    real = Path(os.path.realpath(directory))
    if os.path.ismount(real):
        why = "it is a mount point"
    elif not os.access(real.parent, os.W_OK | os.X_OK):
        why = f"its parent {real.parent} is not writable"
    else:
        return
    raise ShardwiseError(
        f"{option} {directory} already holds a checkpoint ({_describe(held)}), which is "
        f"replaced by writing the new one beside it and swapping the folders, but {why}; "
        "remove those files from it or choose another folder")


def stage(directory: str | Path) -> tuple[Path, bool]:
    """Rank 0, before any rank writes: (the folder to write the new checkpoint into, whether
    it must then be swapped in with `publish`). `directory` itself (created) when it holds no
    checkpoint; else a new folder beside it."""
    check_save_target(directory)
    real = Path(os.path.realpath(directory))
    if not held_checkpoint(real):
        real.mkdir(parents=True, exist_ok=True)
        return Path(directory), False
    staging = real.parent / f".{real.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    return staging, True


def _stale(directory: Path) -> set[str]:
    """The old checkpoint's files: config.json, the index and every file it names,
    model.safetensors and `model-NNNNN-of-NNNNN.safetensors` shards."""
    names = {"config.json", INDEX, "model.safetensors"}
    names |= {p.name for p in directory.iterdir() if _SHARD.fullmatch(p.name)}
    try:
        weight_map = json.loads((directory / INDEX).read_text(encoding="utf-8"))["weight_map"]
        names |= {f for f in weight_map.values() if isinstance(f, str) and Path(f).name == f}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no index, or one no reader takes: its shards match the pattern or stay
    return names


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def _carry(src: Path, dst: Path) -> None:
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(str(src), str(dst))


def publish(staging: Path, directory: str | Path) -> None:
    """Rank 0, once every file of the new checkpoint is in `staging`: carry the target's
    other files into it and swap the folders (two renames: a crash between them leaves both
    folders beside the target's name, the old one complete); the old checkpoint is deleted
    last."""
    real = Path(os.path.realpath(directory))
    stale = _stale(real)
    for entry in real.iterdir():
        if entry.name not in stale and not os.path.lexists(staging / entry.name):
            _carry(entry, staging / entry.name)
    shutil.copymode(real, staging)  # the folder keeps its permissions
    old = real.parent / f".{real.name}.old-{uuid.uuid4().hex}"
    os.rename(real, old)
    try:
        os.rename(staging, real)
    except OSError:
        os.rename(old, real)
        raise
    _fsync_dir(real.parent)
    shutil.rmtree(old, ignore_errors=True)


def discard(staging: Path) -> None:
    """Rank 0, after a failed save: remove the folder the new checkpoint was written into."""
    shutil.rmtree(staging, ignore_errors=True)
