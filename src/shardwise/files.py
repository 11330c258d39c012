"""Reading a user's file (a Hugging Face config or index, a calibration, training text) with
one-line errors, and writing an output the run produced without losing it.

Reading: only a regular file is read (a directory, FIFO, device or socket is refused before
it is opened, so `/dev/zero` is not read for ever and a FIFO does not block), and only up to a
size cap. JSON must be strict where it matters: nested at most `MAX_JSON_DEPTH` deep (Python's
parser recurses; a 100,000-deep file is one line, not a `RecursionError`) and every number
finite (`NaN`, `Infinity` and `1e400`, which Python reads as inf, are refused naming where
they stand, e.g. "links.nvlink4 must be a finite number, got inf"), and no object repeats a
key (Python's parser keeps the last silently; `{"peak_bf16": 1, "peak_bf16": 2}` is refused).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.validate import clean, nonfinite, walk

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "check_json", "parse_json", "read_bytes",
           "read_json", "regular_file", "save_output"]

MAX_JSON_BYTES = 64 * 2**20  # a config.json is a few kB, a calibration file ~100 kB
MAX_JSON_DEPTH = 32  # HF configs and calibration files nest ≤ 4 deep


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def regular_file(path: str | os.PathLike[str], what: str, max_bytes: float) -> Path:
    """`path` as a `Path` when it names a regular file of at most `max_bytes` (symlinks
    followed); else a `ShardwiseError` naming `what` and the path."""
    shown = str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ShardwiseError(f"{what} {shown!r} not found") from None
    except (OSError, ValueError) as exc:  # a symlink loop, a name too long, a NUL byte
        reason = _reason(exc) if isinstance(exc, OSError) else str(exc)
        raise ShardwiseError(f"{what} {shown!r} cannot be read ({reason})") from None
    if stat.S_ISDIR(info.st_mode):
        raise ShardwiseError(f"{what} {shown!r} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ShardwiseError(f"{what} {shown!r} is not a regular file (a FIFO, device or "
                             "socket); give a file")
    if info.st_size > max_bytes:
        raise ShardwiseError(f"{what} {shown!r} is {info.st_size:,} bytes; at most "
                             f"{max_bytes:,.0f} are read")
    return Path(path)


def read_bytes(path: str | os.PathLike[str], what: str, max_bytes: float) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (`regular_file`)."""
    regular_file(path, what, max_bytes)
    try:
        with open(path, "rb") as f:
            data = f.read(int(max_bytes) + 1)
    except OSError as exc:
        raise ShardwiseError(f"{what} {str(path)!r} cannot be read ({_reason(exc)})") from None
    if len(data) > max_bytes:  # grew since the check
        raise ShardwiseError(f"{what} {str(path)!r} is over {max_bytes:,.0f} bytes")
    return data


def check_json(data: Any, what: str) -> Any:
    """`data` (parsed JSON) when it nests at most `MAX_JSON_DEPTH` deep and every number in it
    is finite; else one line saying where (`key.key[3]`)."""
    if any(depth > MAX_JSON_DEPTH for _, _, depth in walk(data)):
        raise ShardwiseError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    bad = nonfinite(data)
    if bad is not None:
        raise ShardwiseError(f"{what}: {bad[0] or 'the value'} must be a finite number, "
                             f"got {bad[1]}")
    return data


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's `dict`, refusing a key given twice (`json.loads`' `object_pairs_hook`)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json(text: str | bytes, what: str) -> Any:
    """Parsed and checked (`check_json`) JSON text; malformed text and a key given twice in
    one object are one line."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise ShardwiseError(f"{what}: key {clean(str(exc))!r} is given twice in one object; "
                             "keep one") from None
    except RecursionError:
        raise ShardwiseError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardwiseError(f"{what} is not valid JSON: {exc}") from None
    return check_json(data, what)


def read_json(path: str | os.PathLike[str], what: str, max_bytes: float = MAX_JSON_BYTES
              ) -> Any:
    """The parsed JSON of the regular file `path` (`read_bytes`, `parse_json`); every problem
    is a `ShardwiseError` naming `what` ("config file", "calibration file") and the path."""
    return parse_json(read_bytes(path, what, max_bytes), f"{what} {str(path)!r}")


def save_output(path: str | os.PathLike[str], write: Callable[[Path], None], option: str
                ) -> None:
    """`write(path)`; when that fails (a full disk, a directory removed meanwhile) the same
    output goes to a new file in the temporary directory, and the one-line error says where,
    so what a long run produced is not lost."""
    target = Path(path)
    try:
        write(target)
        return
    except OSError as exc:
        problem = f"cannot write {option} {path} ({_reason(exc)})"
    fd, spare = tempfile.mkstemp(prefix="shardwise-", suffix=target.suffix)
    os.close(fd)
    try:
        write(Path(spare))
    except OSError as exc:
        Path(spare).unlink(missing_ok=True)
        raise ShardwiseError(f"{problem}; nor in {spare} ({_reason(exc)}): the output is "
                             "lost") from None
    raise ShardwiseError(f"{problem}; it was written to {spare} instead")
