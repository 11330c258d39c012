"""Where the benchmarks put what they measure: `write_result(name, markdown)` writes
`docs/generated/<name>.md`, which the Accuracy pages include (pymdownx.snippets), stamped
with the commit, the date, the machine and the command that produced it. A figure in the docs
that a benchmark measures comes from here, never typed by hand: rerun the benchmark to
refresh it.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "docs" / "generated"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]],
                   align: str = "") -> str:
    """A markdown table; `align` holds one letter per column, `l` or `r` (default: the first
    column left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *[[str(cell) for cell in row] for row in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None
    return kib / 2**20


def _loop_seconds() -> float:
    """The best of three runs of `for i in range(10**7): total += i`: the same code on every
    run, so two stamps' figures say how fast each machine ran Python (virtual machines on
    one kind of host differ by 2× and more)."""
    best = float("inf")
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(10**7):
            total += i
        best = min(best, time.perf_counter() - start)
    return best


def stamp() -> str:
    """One line: when, at which commit (`+changes` when a tracked file other than the results
    differs from it), on what machine, under what load, by which command."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/generated"):
        commit += "+changes"
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    memory = _memory_gib()
    machine = f"{platform.machine()}, {cores} cores" + (f", {memory:.0f} GiB" if memory else "")
    versions = f"Python {platform.python_version()}"
    if "torch" in sys.modules:
        versions += f", torch {sys.modules['torch'].__version__}"
    busy = " — the machine was busy, so times are indicative" if load >= cores / 2 else ""
    busy += f"; a pure-Python loop of 10⁷ additions took {_loop_seconds():.2f} s (its speed)"
    script = Path(sys.argv[0]).resolve()
    where = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script.name
    command = " ".join(["python", str(where), *sys.argv[1:]])
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Measured {when} at commit `{commit}` on {machine} ({versions}); load average "
            f"{load:.1f}{busy}. Command: `{command}`.")


def write_result(name: str, markdown: str) -> Path:
    """Write `markdown` (the benchmark's tables and notes) to `docs/generated/<name>.md`
    under a stamp line, and return the path."""
    if not re.fullmatch(r"[a-z0-9_-]+", name):
        raise ValueError(f"result name {name!r}: use lower-case letters, digits, '_' and '-'")
    GENERATED.mkdir(parents=True, exist_ok=True)
    path = GENERATED / f"{name}.md"
    path.write_text(f"*{stamp()}*\n\n{markdown.strip()}\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return path
