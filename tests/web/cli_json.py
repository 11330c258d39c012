"""The real `shardwise` command's `--json` output, run in-process through click."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner

from shardwise.cli import cli


def cli_json(*args: str) -> Any:
    result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)
