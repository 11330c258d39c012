"""Every `shardwise demo` as a user runs it: the real entry point (`python -m shardwise`), a
fresh process, the CLI's own start method. The reference is each demo's own check against one
device (its `ok` column) and the CLI's exit code."""

import json

import pytest

from shardwise.cli import DEMOS
from tests.cli_helpers import shardwise

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(DEMOS))
def test_demo_passes_through_the_cli(name):
    result = shardwise("demo", name, "--ranks", "2", "--json", check=False)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    rows = [row for value in payload.values() if isinstance(value, list)
            for row in value if isinstance(row, dict) and "ok" in row]
    assert rows, payload
    assert all(row["ok"] is True for row in rows), [r for r in rows if not r["ok"]]


def test_moe_demo_does_not_depend_on_the_start_method(monkeypatch):
    """Ranks that do not fork from one parent share no RNG state: every draw the ranks must
    agree on is seeded (`spawn` once gave max_diff 63–249 here)."""
    monkeypatch.setenv("SHARDWISE_START_METHOD", "spawn")
    payload = json.loads(shardwise("demo", "moe", "--ranks", "2", "--json").stdout)
    assert all(row["ok"] is True for row in payload["rows"]), payload
