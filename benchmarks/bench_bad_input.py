"""How long the CLI takes to answer a bad or extreme value: every option of
tests/test_bad_input.py's property test with values that push each check hardest (huge,
negative, non-finite, junk), in this process, the slowest answer per command.

Run: `.venv/bin/python benchmarks/bench_bad_input.py` (a few seconds). Target: every answer,
a result or one line with exit code 2, within 20 s on a loaded 2-core machine (it was a time
bound inside the unit test; speed targets live here).
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/

from tests.test_bad_input import OPTIONS

from shardwise.cli import main

VALUES = ["0", "-1", "1e400", "nan", "inf", "1" + "0" * 40, "-" + "9" * 40, "x", "",
          "1e30-tokens", "2.5"]
TARGET_S = 20.0


def answer_seconds(args: list[str]) -> float:
    start = time.perf_counter()
    with (contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()),
          contextlib.suppress(SystemExit)):
        main(args)
    return time.perf_counter() - start


def run() -> dict[str, tuple[float, str]]:
    """{command: (slowest answer in s, its arguments)}."""
    slowest: dict[str, tuple[float, str]] = {}
    for command, option, fixed in OPTIONS:
        for value in VALUES:
            args = [command, *fixed, option, value, "--json"]
            seconds = answer_seconds(args)
            if seconds > slowest.get(command, (0.0, ""))[0]:
                slowest[command] = (seconds, " ".join(args))
    return slowest


if __name__ == "__main__":
    worst = run()
    for command, (seconds, args) in sorted(worst.items()):
        print(f"{command:<9} {seconds:7.3f} s  shardwise {args}")
    over = [c for c, (s, _) in worst.items() if s > TARGET_S]
    print(f"target: every answer within {TARGET_S:g} s: {'missed by ' + ', '.join(over) if over else 'met'}")
    sys.exit(1 if over else 0)
