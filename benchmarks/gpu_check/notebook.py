"""`Notebook`: what a step's ranks write as they measure (a JSON line per point or check, so
a crash or a hang loses nothing measured before it); checks; timing helpers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Notebook:
    """What a step measured so far: one JSON line per item, appended as it is measured, in a
    file the orchestrator reads whether the step finished, raised, died or timed out."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, key: str, value: Any) -> Any:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "value": _plain(value)}) + "\n")
        return value

    def check(self, what: str, value: float | None, tolerance: float | None,
              note: str = "") -> None:
        """A figure against its tolerance (None: reported, no target)."""
        self("check", check_item(what, value, tolerance, note))

    @staticmethod
    def read(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(items by key, checks) of a notebook; a torn last line is dropped."""
        items: dict[str, Any] = {}
        checks: list[dict[str, Any]] = []
        if not Path(path).is_file():
            return items, checks
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry["key"] == "check":
                checks.append(entry["value"])
            else:
                items[entry["key"]] = entry["value"]
        return items, checks


def check_item(what: str, value: float | None, tolerance: float | None,
               note: str = "") -> dict[str, Any]:
    """{what, value, tolerance, ok, note}: ok is None without a tolerance or a value."""
    ok = None if tolerance is None or value is None else bool(value <= tolerance)
    return {"what": what, "value": value, "tolerance": tolerance, "ok": ok, "note": note}


def _plain(value: Any) -> Any:
    """JSON-ready: NumPy and torch scalars to floats, tuples to lists, non-finite to str."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _error_text(exc: BaseException) -> str:
    """The first line of an exception and its last frames (a rank's traceback included)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = text.splitlines()
    return "\n".join(lines[:1] + lines[-12:]) if len(lines) > 13 else text


def _seconds(fn: Callable[[], Any], device: Any, budget: float) -> float:
    """Seconds per call: `runtime.calibrate`'s timer (median of blocks, synchronised on a
    GPU), the one `shardwise calibrate` uses."""
    from shardwise.runtime import calibrate

    return calibrate._seconds(fn, device, budget=budget, repeats=3)


def _sync(device: Any) -> None:
    """Wait for the device's queued work (`runtime.calibrate`'s)."""
    from shardwise.runtime import calibrate

    calibrate._sync(device)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _rel(x: Any, ref: Any) -> float:
    """‖x − ref‖ / ‖ref‖ in fp64 on the CPU."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm())


def _row_checks(prefix: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`shardwise check`'s rows (`CheckRow.as_dict`) as checks with the rows' own targets
    (exact: float rounding, 1 %; "-": reported)."""
    checks = []
    for row in rows:
        target = {"exact": 1e-12, "1%": 0.01}.get(row["target"])
        error = None if row["error"] is None else abs(row["error"])
        checks.append(check_item(f"{prefix}: {row['item']} {row['what']}", error, target,
                                 f"predicted {row['predicted']}, measured {row['measured']}; "
                                 f"{row['note']}"))
    return checks


