"""`shardwise …` commands.

Every command takes `--json`. Bad input — an unknown model, a malformed number, a layout that
cannot run — prints one line on stderr and exits with code 2, never a traceback.

One module per command group, registered on the click group `cli` (`group`) by importing it:
`analytic` (models, memory, comm, schedule), `planner` (plan), `runs` (train, check),
`machine` (demo, calibrate), `serve` (ui, mcp); the shared options and helpers live in `common`.
Importing this package never imports torch: the runtime is imported inside the commands.
"""

from __future__ import annotations

from shardwise.cli import analytic, machine, planner, runs, serve  # noqa: F401 (registers)
from shardwise.cli.group import cli, main
from shardwise.cli.machine import DEMOS

__all__ = ["DEMOS", "cli", "main"]

if __name__ == "__main__":
    main()
