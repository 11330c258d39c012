"""The checkpoint directory: the run lock, removal of what shardwise wrote, pruning, publishing.

shardwise touches only directories holding `MARKER`; a save is published by one atomic
rename and `latest` is replaced atomically. Design: docs/concepts/runtime.md#checkpoints.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from pathlib import Path

from shardwise.errors import ShardwiseError
from shardwise.runtime.checkpoint.manifest import (
    _LEFTOVER,
    _OUR_TMP,
    _POINTER_TMP,
    LATEST,
    LOCK,
    MARKER,
    _ours,
    _write_durably,
    checkpoint_name,
    complete_checkpoints,
    read_metadata,
)


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


